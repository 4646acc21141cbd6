#pragma once

// Internal to the optimizers (not installed): the step of CUDA parameters through the
// multi-tensor kernels (src/kernels/shared/multi_tensor.h), with their step counts, skip counts and
// limiter norms in device memory, so that a step never waits for the device and can be captured
// in a CUDA graph. gwt::WaveletAdam and gwt::FoamAdam describe each parameter's step as a
// DeviceItem; this owns what lives on the device between steps.
//
// The device is authoritative for every parameter it holds counts of; the host's state of those
// parameters (DeviceSlots) and the optimizer's skipped_steps() catch up in sync() (one copy to the
// host), which the optimizer runs when they are asked for (save, skipped_steps) and before a step
// that takes another path.

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "kernels/kernels.h"
#include "kernels/shared/multi_tensor.h"

namespace gwt {
namespace optim_detail {

/// Where one parameter's host state lives, for the counts the device keeps: read when the
/// parameter is new to the device, written by sync(). Pointers into the optimizer's state.
struct DeviceSlots {
  int64_t* step = nullptr;
  int64_t* skipped = nullptr;
  /// The limiter's saved norm (WaveletAdam with norm_growth_limit > 0), moved to the device in the
  /// math type on first use (-1: none yet); nullptr: no limiter.
  at::Tensor* norm = nullptr;
  /// Thresholded details kept and in all at the last step (WaveletAdam, general rows with a
  /// threshold); nullptr: none.
  int64_t* kept_details = nullptr;
  int64_t* total_details = nullptr;
};

/// A parameter of a multi-tensor step, checked by the optimizer: contiguous parameter, gradient of
/// its dtype and moments, all on one device (CUDA, or the CPU when emulated).
struct DeviceItem {
  at::Tensor param;
  at::Tensor exp_avg, exp_avg_sq;
  DeviceSlots slots;
  /// The tensor's kind, geometry and option values (kernels::mt::TensorMeta); the pointers and
  /// first_chunk / chunks are filled here.
  kernels::mt::TensorMeta meta;
  kernels::WaveletAdamArgs general;  ///< Kind::general: the per-tensor kernel's arguments
};

class DeviceSteps {
 public:
  /// `who` names the optimizer in errors.
  explicit DeviceSteps(std::string who);
  ~DeviceSteps();
  /// One step of `items` (at least one): Planner::launches() kernels and, when the tensors or
  /// options changed since the last step, one copy of the metadata; nothing waits for the device.
  void step(const std::vector<DeviceItem>& items);
  /// Copies the device's counts and norms into the host states (slots_of finds a parameter's
  /// slots by its TensorImpl; nothing: a parameter without state), adds the device's skipped
  /// steps to `skipped_steps` and clears them there. One synchronisation; nothing when no
  /// parameter has device counts.
  void sync(const std::function<bool(const void*, DeviceSlots&)>& slots_of, int64_t& skipped_steps);
  /// Drops every device count (after sync(), or when a load replaces the state).
  void clear();
  bool empty() const;

 private:
  struct Impl;
  std::string who_;
  std::unique_ptr<Impl> impl_;
};

/// Whether the multi-tensor kernels run on `device`: a CUDA device gwt's kernels were built for,
/// or the CPU while emulate_device_steps_on_cpu is on.
bool device_steps_run_on(const c10::Device& device);

/// Tests only: CPU parameters take the multi-tensor step too, through the host emulation of its
/// kernels (src/kernels/shared/multi_tensor_emulate.h), so that what the optimizers keep on the
/// device (counts, norms, skips, their sync, checkpoints) is tested on machines without a GPU.
/// Read at each step; off by default.
void emulate_device_steps_on_cpu(bool on);
bool device_steps_emulated();

}  // namespace optim_detail
}  // namespace gwt
