// The general fused body compiled for AVX2 and FMA (avx2_target.h); called only after the CPU
// reported both.

#include "kernels/avx2/avx2_target.h"

GWT_AVX2_BEGIN

#define GWT_KERNEL_NS avx2
#include "kernels/cpu/wavelet_adam_cpu_impl.h"

namespace gwt {
namespace kernels {
namespace avx2 {
double wavelet_adam_norm_sq_entry(const WaveletAdamArgs& args) {
  return wavelet_adam_norm_sq(args);
}
void wavelet_adam_update_entry(const WaveletAdamArgs& args, double lim) {
  wavelet_adam_update(args, lim);
}
}  // namespace avx2
}  // namespace kernels
}  // namespace gwt

GWT_AVX2_END
