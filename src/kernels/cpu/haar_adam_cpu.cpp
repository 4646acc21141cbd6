// CPU entry of the fused Haar WaveletAdam passes and of the dense loop: checks the arguments and
// picks the AVX2 build of the body when the CPU has it (x86-64), the baseline build otherwise.

#define GWT_KERNEL_NS baseline
#include "kernels/cpu/dense_adam_cpu_impl.h"
#include "kernels/cpu/haar_adam_cpu_impl.h"
#include "kernels/shared/multi_tensor.h"

namespace gwt {
namespace kernels {

#if defined(GWT_HAVE_AVX2_KERNELS)
namespace avx2 {
double haar_adam_norm_sq_entry(const HaarAdamArgs& args);
void haar_adam_update_entry(const HaarAdamArgs& args, double lim);
bool all_finite_entry(const void* data, int64_t n, ScalarKind kind);
void dense_adam_update_entry(const DenseAdamArgs& args);
}  // namespace avx2
namespace {
const bool k_has_avx2 = avx2_kernels_enabled();  // CPU support, unless GWT_NO_AVX2
}  // namespace
#define GWT_DISPATCH(baseline_call, avx2_call) \
  if (k_has_avx2) return avx2_call;            \
  return baseline_call
#else
#define GWT_DISPATCH(baseline_call, avx2_call) return baseline_call
#endif

namespace {
void check(const HaarAdamArgs& args) {
  TORCH_INTERNAL_ASSERT(args.level >= 1 && args.level <= 30 && args.n >= 1 && args.rows >= 0);
  TORCH_INTERNAL_ASSERT(args.approx_len == (args.n + (int64_t{1} << args.level) - 1) >> args.level);
  TORCH_INTERNAL_ASSERT(!args.two_d || (args.height >= 1 && args.rows % args.height == 0));
  TORCH_INTERNAL_ASSERT(!args.grad_f32 || args.param_kind == ScalarKind::f16 ||
                        args.param_kind == ScalarKind::bf16);
}
}  // namespace

bool all_finite_cpu(const void* data, int64_t n, ScalarKind kind) {
  GWT_DISPATCH(baseline::all_finite(data, n, kind), avx2::all_finite_entry(data, n, kind));
}

double haar_adam_norm_sq_cpu(const HaarAdamArgs& args) {
  check(args);
  GWT_DISPATCH(baseline::haar_adam_norm_sq(args), avx2::haar_adam_norm_sq_entry(args));
}

void haar_adam_update_cpu(const HaarAdamArgs& args, double lim) {
  check(args);
  GWT_DISPATCH(baseline::haar_adam_update(args, lim), avx2::haar_adam_update_entry(args, lim));
}

void dense_adam_update_cpu(const DenseAdamArgs& args) {
  TORCH_INTERNAL_ASSERT(args.n >= 0);
  GWT_DISPATCH(baseline::dense_adam_update(args), avx2::dense_adam_update_entry(args));
}

#undef GWT_DISPATCH

#ifndef GWT_WITH_CUDA
bool built_with_cuda() {
  return false;
}
bool cuda_kernels_run_on(int) {
  return false;
}
namespace mt {
void multi_tensor_step_cuda(const std::vector<Group>&, const StepLayout&, unsigned char*,
                            StepFlags*) {
  TORCH_CHECK(false, "gwt was built without CUDA kernels (configure with -DGWT_CUDA=ON)");
}
}  // namespace mt
void haar_adam_norm_sq_cuda(const HaarAdamArgs&, void*) {
  TORCH_CHECK(false, "gwt was built without CUDA kernels (configure with -DGWT_CUDA=ON)");
}
void haar_adam_update_cuda(const HaarAdamArgs&, const void*) {
  TORCH_CHECK(false, "gwt was built without CUDA kernels (configure with -DGWT_CUDA=ON)");
}
void wavelet_adam_norm_sq_cuda(const WaveletAdamArgs&, void*) {
  TORCH_CHECK(false, "gwt was built without CUDA kernels (configure with -DGWT_CUDA=ON)");
}
void wavelet_adam_update_cuda(const WaveletAdamArgs&, const void*) {
  TORCH_CHECK(false, "gwt was built without CUDA kernels (configure with -DGWT_CUDA=ON)");
}
int64_t wavelet_adam_cuda_max_scratch_bytes() {
  return 0;
}
#endif

}  // namespace kernels
}  // namespace gwt
