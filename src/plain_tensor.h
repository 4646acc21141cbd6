#pragma once

// Tensors gwt's kernels can address (internal: not installed). The kernels read and write through
// data_ptr(): a tensor without storage of its own (a wrapper tensor subclass such as FSDP2's
// DTensor parameters, a functorch wrapper), a meta tensor or one on a device gwt has no kernels for
// would be read out of bounds, or written nowhere. Every entry point that takes tensors calls this
// first, so such a tensor is an error that names it, before anything changes.

#include <ATen/ATen.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/util/Exception.h>

namespace gwt {
namespace detail {

/// Whether `t` is a tensor subclass that handles its own dispatch (Python `__torch_dispatch__`:
/// DTensor, FSDP2's sharded parameters, fake and functional tensors) or a functorch wrapper.
inline bool is_tensor_subclass(const at::Tensor& t) {
  const c10::DispatchKeySet keys = t.key_set();
  return keys.has(c10::DispatchKey::Python) || keys.has(c10::DispatchKey::PythonTLSSnapshot) ||
         keys.has(c10::DispatchKey::Functionalize) ||
         keys.has_any(c10::DispatchKeySet(
             {c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper}));
}

/// Throws a c10::Error unless `t` (described by `what`, e.g. "a parameter") is a dense tensor with
/// storage of its own, on the CPU or a CUDA device, and not a tensor subclass. `who` names the
/// caller ("gwt::WaveletAdam").
inline void check_plain_tensor(const char* who, const char* what, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), who, ": ", what, " is an undefined tensor");
  TORCH_CHECK(!is_tensor_subclass(t), who, ": ", what, " of shape ", t.sizes(),
              " is a tensor subclass (such as a DTensor from FSDP2's fully_shard or "
              "torch.distributed.tensor); gwt's kernels step plain tensors only: use "
              "gwt::distributed::ShardedWaveletAdam or DDP for data parallelism, or pass the "
              "local tensors (DTensor.to_local())");
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), who, ": ", what, " of shape ", t.sizes(),
              " is on ", t.device(),
              " (gwt runs on cpu and cuda tensors); materialize it first (a meta tensor: "
              "to_empty(device) and initialise it)");
  // Sparse and other layouts have no storage of their own either; the callers' layout checks name
  // them.
  TORCH_CHECK(t.layout() != at::kStrided || t.has_storage(), who, ": ", what, " of shape ",
              t.sizes(),
              " has no storage of its own (a wrapper or nested tensor); pass a dense tensor");
}

}  // namespace detail
}  // namespace gwt
