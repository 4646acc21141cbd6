#pragma once

// bfloat16 <-> float for 8 values in an AVX2 register, bit-identical to c10::BFloat16's own
// conversions. Only for AVX2 code: the kernels' AVX2 builds (between avx2_target.h's
// GWT_AVX2_BEGIN and GWT_AVX2_END), and tests/bf16_avx2_probe.cpp (compiled with -mavx2), which
// checks them against c10 for every bfloat16 and a wide sample of floats. Raw bits in and out, no c10 type: the probe includes nothing it shares with other
// translation units.

#include <immintrin.h>

#include <cstdint>

namespace gwt {
namespace kernels {
namespace bf16 {
namespace {  // internal linkage: compiled for one instruction set only

/// 8 bfloat16 values (their bits at x) widened to floats: exact, a bfloat16's bits are the top
/// half of its float's.
inline __m256 load8(const uint16_t* x) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

/// 8 floats rounded to bfloat16 (bits stored at x) as c10::BFloat16(float) rounds them
/// (torch/headeronly/util/BFloat16.h, round_to_nearest_even): to nearest, ties to even, by
/// adding 0x7FFF plus the kept part's lowest bit to the float's bits; every NaN becomes 0x7FC0.
inline void store8(uint16_t* x, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lowest_kept = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lowest_kept, _mm256_set1_epi32(0x7FFF));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // Every lane is in [0, 0xFFFF] now (a sum past 32 bits only comes from a NaN's bits, replaced
  // above), so packing with unsigned saturation changes nothing.
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), packed);
}

}  // namespace
}  // namespace bf16
}  // namespace kernels
}  // namespace gwt
