// CPU entry of the fused FoamAdam pass: checks the arguments and picks the AVX2 build of the body
// when the CPU has it (x86-64), the baseline build otherwise.

#define GWT_KERNEL_NS baseline
#include "kernels/cpu/foam_adam_cpu_impl.h"

namespace gwt {
namespace kernels {

#if defined(GWT_HAVE_AVX2_KERNELS)
namespace avx2 {
void foam_adam_update_entry(const FoamAdamArgs& args);
}  // namespace avx2
#endif

void foam_adam_update_cpu(const FoamAdamArgs& args) {
  TORCH_INTERNAL_ASSERT(args.level >= 1 && args.level <= 30 && args.n >= 1 && args.rows >= 0);
  TORCH_INTERNAL_ASSERT(args.approx_len == (args.n + (int64_t{1} << args.level) - 1) >> args.level);
  TORCH_INTERNAL_ASSERT(!args.grad_f32 || args.param_kind == ScalarKind::f16 ||
                        args.param_kind == ScalarKind::bf16);
#if defined(GWT_HAVE_AVX2_KERNELS)
  if (avx2_kernels_enabled()) return avx2::foam_adam_update_entry(args);
#endif
  baseline::foam_adam_update(args);
}

}  // namespace kernels
}  // namespace gwt
