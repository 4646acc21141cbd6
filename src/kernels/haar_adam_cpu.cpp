// CPU entry of the fused Haar WaveletAdam step: checks the arguments and picks the AVX2 build of
// the body when the CPU has it (x86-64), the baseline build otherwise.

#define GWT_KERNEL_NS baseline
#include "haar_adam_cpu_impl.h"

namespace gwt {
namespace kernels {

#if defined(GWT_HAVE_AVX2_KERNELS)
namespace avx2 {
void haar_adam_step_entry(const HaarAdamArgs& args);
bool all_finite_entry(const void* data, int64_t n, ScalarKind kind);
}  // namespace avx2
static const bool k_has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif

bool all_finite_cpu(const void* data, int64_t n, ScalarKind kind) {
#if defined(GWT_HAVE_AVX2_KERNELS)
  if (k_has_avx2) return avx2::all_finite_entry(data, n, kind);
#endif
  return baseline::all_finite(data, n, kind);
}

void haar_adam_step_cpu(const HaarAdamArgs& args) {
  TORCH_INTERNAL_ASSERT(args.level >= 1 && args.level <= 30 && args.n >= 1 && args.rows >= 0);
  TORCH_INTERNAL_ASSERT(args.approx_len == (args.n + (int64_t{1} << args.level) - 1) >> args.level);
  TORCH_INTERNAL_ASSERT(args.norm_growth_limit == 0 || args.saved_norm != nullptr);
  if (args.rows == 0) return;
#if defined(GWT_HAVE_AVX2_KERNELS)
  if (k_has_avx2) {
    avx2::haar_adam_step_entry(args);
    return;
  }
#endif
  baseline::haar_adam_step(args);
}

#ifndef GWT_WITH_CUDA
bool built_with_cuda() { return false; }
void haar_adam_step_cuda(const HaarAdamArgs&) {
  TORCH_CHECK(false, "gwt was built without CUDA kernels (configure with -DGWT_CUDA=ON)");
}
#endif

}  // namespace kernels
}  // namespace gwt
