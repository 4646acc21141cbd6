// The fused Haar body and the dense loop compiled for AVX2 and FMA (avx2_target.h); called only
// after the CPU reported both.

#include "kernels/avx2/avx2_target.h"

GWT_AVX2_BEGIN

#define GWT_KERNEL_NS avx2
#include "kernels/cpu/dense_adam_cpu_impl.h"
#include "kernels/cpu/haar_adam_cpu_impl.h"

namespace gwt {
namespace kernels {
namespace avx2 {
double haar_adam_norm_sq_entry(const HaarAdamArgs& args) {
  return haar_adam_norm_sq(args);
}
void haar_adam_update_entry(const HaarAdamArgs& args, double lim) {
  haar_adam_update(args, lim);
}
bool all_finite_entry(const void* data, int64_t n, ScalarKind kind) {
  return all_finite(data, n, kind);
}
void dense_adam_update_entry(const DenseAdamArgs& args) {
  dense_adam_update(args);
}
}  // namespace avx2
}  // namespace kernels
}  // namespace gwt

GWT_AVX2_END
