// The kernels' AVX2 bfloat16 and float16 conversions (src/kernels/avx2/bf16_avx2.h, f16_avx2.h) behind
// plain functions, for KernelSimd.BFloat16ConversionsAreC10s and
// KernelSimd.HalfConversionsAreC10s in test_fused_simd.cpp. Compiled with -mavx2 (x86-64 only,
// tests/CMakeLists.txt) and called only where the CPU has AVX2. It includes nothing but the
// intrinsics and those headers, so no inline function it shares with the other translation units
// (the standard library's, c10's, GoogleTest's) can get an AVX2 copy here.

#include <cstddef>
#include <cstdint>

#include "kernels/avx2/bf16_avx2.h"
#include "kernels/avx2/f16_avx2.h"

namespace gwt_test {

// n: a multiple of 8.
void bf16_round_avx2(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i + 8 <= n; i += 8)
    gwt::kernels::bf16::store8(out + i, _mm256_loadu_ps(in + i));
}

void bf16_widen_avx2(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, gwt::kernels::bf16::load8(in + i));
}

void f16_round_avx2(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i + 8 <= n; i += 8)
    gwt::kernels::f16::store8(out + i, _mm256_loadu_ps(in + i));
}

void f16_widen_avx2(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, gwt::kernels::f16::load8(in + i));
}

}  // namespace gwt_test
