#pragma once

// Collectives as gwt::distributed uses them (internal: not installed). Every wait is bounded by
// the group's timeout, and any failure of a peer (it died, timed out, or sent a mismatch) becomes
// a c10::Error that names this rank, the world size and what was being done.

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace gwt {
namespace distributed {
namespace detail {

/// Where a group's collectives take their tensors: the CPU for Gloo; for NCCL the CUDA device of
/// `like` when it is a CUDA tensor (the parameters' device), else the device init_from_env chose
/// for this rank (cuda_device_for_rank).
at::Device comm_device(const c10d::Backend& pg, const at::Tensor& like = {});

/// The CUDA device of this process in a group of one process per GPU: LOCAL_RANK (set by torchrun)
/// when set, else the rank modulo `device_count`. An error when there is no device or LOCAL_RANK
/// names none.
int64_t cuda_device_for_rank(int64_t rank, int64_t device_count);
/// Records the device init_from_env chose for its NCCL group (comm_device's fallback).
void remember_nccl_device(int64_t index);

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

/// What every rank decided, from one collective: the largest of each rank's `flags`, and whether
/// every rank passed the same `same` values.
struct Agreed {
  std::vector<int64_t> max;
  bool same = true;
};
Agreed agree(const c10::intrusive_ptr<c10d::Backend>& pg, const std::vector<int64_t>& flags,
             const std::vector<int64_t>& same, const std::string& what);

/// The largest of every rank's flag (a collective): true when any rank passed true.
bool any(const c10::intrusive_ptr<c10d::Backend>& pg, bool flag, const std::string& what);

/// Checks that every rank passed the same values (a collective, part of the call `op`): an error
/// on every rank otherwise, saying that `differs` differ.
void check_same(const c10::intrusive_ptr<c10d::Backend>& pg, const std::vector<int64_t>& values,
                const std::string& op, const std::string& differs);
/// The message a failed check_same gives on every rank.
[[noreturn]] void fail_differ(const c10d::Backend& pg, const std::string& op,
                              const std::string& differs);

/// Runs `f` and returns what it threw ("" when it returned): a failure on one rank is kept for a
/// collective agreement instead of being thrown while the other ranks wait in the next
/// collective. Every exception is caught (std::bad_alloc too), so no peer is left waiting.
std::string capture(const std::function<void()>& f);

/// A flag for agree(): 0 when `error` is empty, else this rank + 1 (so the largest names the last
/// failing rank).
int64_t failure_flag(const c10d::Backend& pg, const std::string& error);

/// After agree(): throws on every rank when a rank failed (`flag` is the agreed failure_flag):
/// this rank's own message where it failed, else one that names the failing rank; `suffix` is
/// added to either.
void throw_if_failed(const c10d::Backend& pg, int64_t flag, const std::string& error,
                     const std::string& what, const std::string& suffix = "");

/// Point-to-point transfers, waited for within the group's timeout (`tag` pairs them).
void send(const c10::intrusive_ptr<c10d::Backend>& pg, at::Tensor& t, int64_t dst, int tag,
          const std::string& what);
void recv(const c10::intrusive_ptr<c10d::Backend>& pg, at::Tensor& t, int64_t src, int tag,
          const std::string& what);

/// A 62-bit digest of shapes and dtypes (and whether each gradient is defined), for check_same.
int64_t shape_digest(const std::vector<at::Tensor>& tensors, bool with_grads);

/// Copies `tensors` into one flat buffer per run of equal dtype and device, at most `max_bytes`
/// each (one tensor larger than that is a buffer of its own); returns the index ranges.
std::vector<std::pair<size_t, size_t>> buckets(const std::vector<at::Tensor>& tensors,
                                               int64_t max_bytes);

/// Whether every defined gradient of `params` is one the last all_reduce_gradients call of this
/// process wrote, unchanged since (same tensor, same version counter), in whatever order the
/// parameters come; false when none is defined.
bool gradients_already_averaged(const std::vector<at::Tensor>& params);

}  // namespace detail
}  // namespace distributed
}  // namespace gwt
