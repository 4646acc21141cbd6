// CPU entry of the general fused WaveletAdam passes: picks the AVX2 build of the body when the CPU
// has it (x86-64), the baseline build otherwise.

#define GWT_KERNEL_NS baseline
#include "kernels/cpu/wavelet_adam_cpu_impl.h"

namespace gwt {
namespace kernels {

#if defined(GWT_HAVE_AVX2_KERNELS)
namespace avx2 {
double wavelet_adam_norm_sq_entry(const WaveletAdamArgs& args);
void wavelet_adam_update_entry(const WaveletAdamArgs& args, double lim);
}  // namespace avx2
namespace {
const bool k_general_avx2 = avx2_kernels_enabled();  // CPU support, unless GWT_NO_AVX2
}  // namespace
#endif

int64_t wavelet_workspace_len(int64_t n, int64_t filter_length, int64_t level,
                              BoundaryMode boundary) {
  int64_t total = 0, len = n;
  for (int64_t l = 0; l < level; ++l) {
    len = dwt_coeff_len(len, filter_length, boundary);
    total += len;  // D_l
  }
  return total + len;  // + A_L
}

int64_t wavelet_row_scratch_bytes(int64_t n, int64_t filter_length, int64_t level,
                                  BoundaryMode boundary, bool math_f64) {
  const int64_t first = dwt_coeff_len(n, filter_length, boundary);
  int64_t approx = first;
  for (int64_t l = 1; l < level; ++l) approx = dwt_coeff_len(approx, filter_length, boundary);
  // As row::make_row_plan and cuda/wavelet_adam.cu: the coefficients, two buffers of
  // lengths[1] + F, then approx_len denominators.
  const int64_t coefficients = wavelet_workspace_len(n, filter_length, level, boundary);
  return (coefficients + 2 * (first + filter_length) + approx) * (math_f64 ? 8 : 4);
}

double wavelet_adam_norm_sq_cpu(const WaveletAdamArgs& args) {
  if (args.rows == 0) return 0.0;
#if defined(GWT_HAVE_AVX2_KERNELS)
  if (k_general_avx2) return avx2::wavelet_adam_norm_sq_entry(args);
#endif
  return baseline::wavelet_adam_norm_sq(args);
}

void wavelet_adam_update_cpu(const WaveletAdamArgs& args, double lim) {
  if (args.rows == 0) return;
#if defined(GWT_HAVE_AVX2_KERNELS)
  if (k_general_avx2) return avx2::wavelet_adam_update_entry(args, lim);
#endif
  baseline::wavelet_adam_update(args, lim);
}

}  // namespace kernels
}  // namespace gwt
