#pragma once

// float16 <-> float for 8 values in an AVX2 register, bit-identical to c10::Half's own conversions
// as the library's translation units compile them (without F16C, c10 converts in software:
// torch/headeronly/util/Half.h, fp16_ieee_to_fp32_value and fp16_ieee_from_fp32_value). The work is
// done by F16C's two instructions, written as inline assembly: compiling with -mf16c would also
// give c10::Half's inline conversions an F16C copy that the linker may keep for every caller (see
// dispatch.h), and the assembler takes the instructions whatever the compiler's flags. Callers run
// them only where the CPU has F16C (avx2_kernels_enabled() checks it). Both conversions round to
// nearest, ties to even, as c10 does in the default rounding mode (which nothing in torch or gwt
// changes; DAZ and FTZ change neither); they differ from c10 in one place, a NaN, which F16C
// narrows with its payload truncated and c10 to 0x7E00 with its sign: store8 hands F16C c10's NaN
// instead.
// Only for AVX2 code: the kernels' AVX2 builds (avx2_target.h), and tests/bf16_avx2_probe.cpp
// (compiled with -mavx2), which checks them against c10 for every float16 and a wide sample of
// floats. Raw bits in and out, no c10 type, as bf16_avx2.h.

#include <immintrin.h>

#include <cstdint>

namespace gwt {
namespace kernels {
namespace f16 {
namespace {  // internal linkage: compiled for one instruction set only

/// 8 float16 values (their bits at x) widened to floats, exactly (vcvtph2ps).
inline __m256 load8(const uint16_t* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  __m256 out;
  asm("vcvtph2ps {%1, %0|%0, %1}" : "=x"(out) : "x"(h));  // AT&T | Intel syntax
  return out;
}

/// 8 floats rounded to float16 (bits stored at x) as c10::Half(float) rounds them: to nearest,
/// ties to even (vcvtps2ph with rounding control 0), overflow to infinity, subnormal results
/// rounded as well; every NaN becomes 0x7E00 with its sign, as c10's software conversion makes it
/// (a float NaN with only the quiet bit set narrows to exactly that).
inline void store8(uint16_t* x, __m256 v) {
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  const __m256 sign = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN)));
  const __m256 quiet_nan = _mm256_or_ps(sign, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)));
  const __m256 w = _mm256_blendv_ps(v, quiet_nan, nan);
  __m128i h;
  asm("vcvtps2ph {$0, %1, %0|%0, %1, 0}" : "=x"(h) : "x"(w));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), h);
}

}  // namespace
}  // namespace f16
}  // namespace kernels
}  // namespace gwt
