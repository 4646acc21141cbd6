#pragma once

// Internal to gwt::WaveletAdam (not installed): a parameter's step as WaveletAdam::step plans it
// (wavelet_adam.cpp), and the rules that compute it: which one takes it (path_for,
// wavelet_adam_plan.cpp), the readable ATen reference (wavelet_adam_reference.cpp) and the fused
// CPU and CUDA kernels (wavelet_adam_fused.cpp).

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "gwt/optim/wavelet_adam.h"
#include "gwt/wavelet.h"
#include "kernels/kernels.h"
#include "wavelet_adam_detail.h"

namespace gwt {
namespace wavelet_adam_detail {

// Which implementation computes a parameter's step.
enum class Path { reference, haar, general };

struct Work {
  at::Tensor param;
  const WaveletAdamOptions* options;
  Plan plan;
  Path path = Path::reference;
  at::Tensor grad;  // fused: contiguous, in the param's dtype or (low precision) float32
  const Wavelet* wavelet = nullptr;                    // general kernel: the filters
  WaveletAdamParamState* state = nullptr;              // existing state, or fresh_state
  std::unique_ptr<WaveletAdamParamState> fresh_state;  // committed only if the step is taken
  at::Tensor norm_sq;        // fused on a device: result of the norm pass (0-dim, on the device)
  double norm_sq_host = 0;   // fused on the CPU: result of the norm pass
  bool per_param = false;    // nonfinite("skip_param")
  int64_t carry_floats = 0;  // HaarAdamArgs::carry's room (0: none)
  float* carry = nullptr;    // Haar on the CPU: HaarAdamArgs::carry, or none
};

// wavelet_adam_plan.cpp

/// The path of `param`'s step under `o` and its plan.
Path path_for(const at::Tensor& param, const WaveletAdamOptions& o, const Plan& plan);

// wavelet_adam_reference.cpp

/// One parameter's step by the ATen reference (WaveletAdamOptions::fused(false), and every
/// parameter no kernel takes).
void reference_update(const Work& work, WaveletAdamParamState& state, double step_size);

// wavelet_adam_fused.cpp

/// Gives the "skip_param" Haar CPU tensors of `work` their HaarAdamArgs::carry, in `room`.
void assign_carry(std::vector<Work>& work, std::vector<float>& room);
/// The general kernels' arguments for `work`'s step (step_size 0: its norm pass).
kernels::WaveletAdamArgs general_args(const Work& work, double step_size);
/// The norm pass of a fused path: sets work.grad, and work.norm_sq or work.norm_sq_host.
void fused_norm_pass(Work& work);
/// The update pass of a fused path, after fused_norm_pass.
void fused_update(const Work& work, WaveletAdamParamState& state, double step_size);
/// Whether the dense rule of `work` can run in the fused CPU loop (dense_update).
bool dense_fusable(const Work& work, const WaveletAdamParamState& state);
void dense_update(const Work& work, WaveletAdamParamState& state, double step_size);

}  // namespace wavelet_adam_detail
}  // namespace gwt
