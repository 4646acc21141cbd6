// The fused FoamAdam body compiled for AVX2 and FMA (avx2_target.h); called only after the CPU
// reported both.

#include "kernels/avx2/avx2_target.h"

GWT_AVX2_BEGIN

#define GWT_KERNEL_NS avx2
#include "kernels/cpu/foam_adam_cpu_impl.h"

namespace gwt {
namespace kernels {
namespace avx2 {
void foam_adam_update_entry(const FoamAdamArgs& args) {
  foam_adam_update(args);
}
}  // namespace avx2
}  // namespace kernels
}  // namespace gwt

GWT_AVX2_END
