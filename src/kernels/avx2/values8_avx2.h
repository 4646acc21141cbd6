#pragma once

// 8 consecutive values of float, c10::BFloat16 or c10::Half as floats in an AVX2 register, and
// back: the typed loads and stores of the AVX2 kernels (haar_simd_avx2.h, wavelet_rows8_avx2.h).
// bfloat16 goes through bf16_avx2.h, float16 through f16_avx2.h: widened exactly, rounded as
// c10::BFloat16(float) and c10::Half(float) round, bit for bit. Only for the AVX2 builds
// (avx2_target.h).

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>

#include "kernels/avx2/bf16_avx2.h"
#include "kernels/avx2/f16_avx2.h"

namespace gwt {
namespace kernels {
namespace values8 {
namespace {  // internal linkage: compiled for one instruction set only

inline __m256 load8(const float* x) {
  return _mm256_loadu_ps(x);
}
inline __m256 load8(const c10::BFloat16* x) {
  return bf16::load8(reinterpret_cast<const uint16_t*>(x));
}
inline __m256 load8(const c10::Half* x) {
  return f16::load8(reinterpret_cast<const uint16_t*>(x));
}
inline void store8(float* x, __m256 v) {
  _mm256_storeu_ps(x, v);
}
inline void store8(c10::BFloat16* x, __m256 v) {
  bf16::store8(reinterpret_cast<uint16_t*>(x), v);
}
inline void store8(c10::Half* x, __m256 v) {
  f16::store8(reinterpret_cast<uint16_t*>(x), v);
}

}  // namespace
}  // namespace values8
}  // namespace kernels
}  // namespace gwt
