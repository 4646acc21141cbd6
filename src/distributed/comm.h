#pragma once

// Collectives as gwt::distributed uses them (internal: not installed). Every wait is bounded by
// the group's timeout, and any failure of a peer (it died, timed out, or sent a mismatch) becomes
// a c10::Error that names this rank, the world size and what was being done.

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace gwt {
namespace distributed {
namespace detail {

/// Where a group's collectives take their tensors: CUDA for NCCL, the CPU otherwise.
at::Device comm_device(const c10d::Backend& pg);

/// Waits for `work`, turning a failure into a c10::Error that says what failed.
void wait(const c10::intrusive_ptr<c10d::Work>& work, const c10d::Backend& pg,
          const std::string& what);

/// In-place collectives on one tensor, waited for.
void allreduce(const c10::intrusive_ptr<c10d::Backend>& pg, at::Tensor& t, c10d::ReduceOp op,
               const std::string& what);
void broadcast(const c10::intrusive_ptr<c10d::Backend>& pg, at::Tensor& t, int64_t root,
               const std::string& what);
/// Every rank's `t` (same shape on each), in rank order.
std::vector<at::Tensor> allgather(const c10::intrusive_ptr<c10d::Backend>& pg, const at::Tensor& t,
                                  const std::string& what);

/// The largest of every rank's flag (a collective): true when any rank passed true.
bool any(const c10::intrusive_ptr<c10d::Backend>& pg, bool flag, const std::string& what);

/// Checks that every rank passed the same values (a collective, part of the call `op`): an error
/// on every rank otherwise, saying that `differs` differ.
void check_same(const c10::intrusive_ptr<c10d::Backend>& pg, const std::vector<int64_t>& values,
                const std::string& op, const std::string& differs);

/// A 62-bit digest of shapes and dtypes (and whether each gradient is defined), for check_same.
int64_t shape_digest(const std::vector<at::Tensor>& tensors, bool with_grads);

/// Copies `tensors` into one flat buffer per run of equal dtype and device, at most `max_bytes`
/// each (one tensor larger than that is a buffer of its own); returns the index ranges.
std::vector<std::pair<size_t, size_t>> buckets(const std::vector<at::Tensor>& tensors,
                                               int64_t max_bytes);

/// Whether the gradients of `params` are exactly the ones the last all_reduce_gradients call of
/// this process wrote, unchanged since (same tensors, same version counters).
bool gradients_already_averaged(const std::vector<at::Tensor>& params);

}  // namespace detail
}  // namespace distributed
}  // namespace gwt
