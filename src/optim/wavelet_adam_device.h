#pragma once

// Internal to gwt::WaveletAdam (not installed): the step of CUDA parameters through the
// multi-tensor kernels (src/kernels/shared/multi_tensor.h), with their step counts, skip counts and
// limiter norms in device memory, so that a step never waits for the device and can be captured
// in a CUDA graph.
//
// The device is authoritative for every parameter it holds counts of; the host's
// WaveletAdamParamState::step() and skipped() of those parameters, and the optimizer's
// skipped_steps(), catch up in sync() (one copy to the host), which the optimizer runs when they
// are asked for (save, skipped_steps) and before a step that takes another path.

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "kernels/kernels.h"
#include "gwt/optim/wavelet_adam.h"

namespace gwt {
namespace wavelet_adam_detail {

/// A parameter of a multi-tensor step, checked by the optimizer: contiguous parameter, gradient of
/// its dtype and moments, all on one CUDA device.
struct DeviceItem {
  enum class Rule { haar, dense, general };
  at::Tensor param;
  const WaveletAdamOptions* options = nullptr;
  WaveletAdamParamState* state = nullptr;
  Rule rule = Rule::dense;
  bool two_d = false;  ///< Haar: transform "2d"
  kernels::WaveletAdamArgs
      general;  ///< general: the per-tensor kernel's arguments (filters, sizes)
};

class DeviceSteps {
 public:
  DeviceSteps();
  ~DeviceSteps();
  /// One step of `items` (at least one): Planner::launches() kernels and, when the tensors or
  /// options changed since the last step, one copy of the metadata; nothing waits for the device.
  void step(const std::vector<DeviceItem>& items);
  /// Copies the device's counts and norms into the host states (state_of finds a parameter's
  /// state by its TensorImpl), adds the device's skipped steps to `skipped_steps` and clears them
  /// there. One synchronisation; nothing when no parameter has device counts.
  void sync(const std::function<WaveletAdamParamState*(const void*)>& state_of,
            int64_t& skipped_steps);
  /// Drops every device count (after sync(), or when a load replaces the state).
  void clear();
  bool empty() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Tests only: CPU parameters take the multi-tensor step too, through the host emulation of its
/// kernels (src/kernels/shared/multi_tensor_emulate.h), so that what the optimizer keeps on the device
/// (counts, norms, skips, their sync, checkpoints) is tested on machines without a GPU. Read at
/// each step; off by default.
void emulate_device_steps_on_cpu(bool on);
bool device_steps_emulated();

}  // namespace wavelet_adam_detail
}  // namespace gwt
