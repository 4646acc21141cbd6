#pragma once

/// \file
/// Data parallelism on PyTorch's c10d (docs/algorithm.md#data-parallelism): a process group from
/// torchrun's variables, gradient averaging (optionally in the wavelet domain, with error
/// feedback), and gwt::distributed::ShardedWaveletAdam, WaveletAdam with its state sharded across
/// ranks (ZeRO-1).
///
/// Built into libgwt when CMake finds Gloo's headers (Debian: libgloo-dev; the symbols come from
/// LibTorch's libtorch_cpu.so); the gwt target then carries the compile definition
/// GWT_HAVE_DISTRIBUTED to everything that links it. The header
/// itself needs only LibTorch's c10d headers. It depends on the optimizers' public API only.
///
/// Every call here is collective: each rank of the group must make it, in the same order, with
/// parameters of the same shapes (a mismatch is detected where it is cheap, and is an error on
/// every rank, never a hang: every wait has the group's timeout).

#include <gwt/optim/wavelet_adam.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace gwt {
namespace distributed {

/// Creates this process's group from torchrun's variables: RANK, WORLD_SIZE, MASTER_ADDR and
/// MASTER_PORT (rank 0 runs the TCPStore, unless torchrun's agent does:
/// TORCHELASTIC_USE_AGENT_STORE), or a FileStore at GWT_STORE_FILE when that is set (then
/// MASTER_ADDR/MASTER_PORT are not needed). backend: "gloo", "nccl" or "auto" (nccl when CUDA is
/// available and gwt was built with NCCL, else gloo). Gloo binds to MASTER_ADDR (127.0.0.1 when
/// unset). `timeout` bounds the rendezvous and every later collective; the environment variable
/// GWT_DIST_TIMEOUT_S overrides it.
c10::intrusive_ptr<c10d::Backend> init_from_env(
    const std::string& backend = "auto",
    std::chrono::milliseconds timeout = std::chrono::minutes(5));

/// How all_reduce_gradients averages. The first three members are in the order of the issue's
/// designated initialiser GradSyncOptions{.compression = "wavelet", .level = 2, .error_feedback =
/// true}.
struct GradSyncOptions {
  /// "none": every gradient all-reduced in full. "wavelet": eligible gradients (at least two
  /// dimensions and at least 2^level elements along the last one, as for WaveletAdam) are
  /// transformed (Haar along the last dimension, `level` levels); the approximation band (2^-level
  /// of the coefficients) is all-reduced exactly, and the detail bands go as one sign bit per
  /// coefficient and one scale per row (their mean magnitude), gathered from every rank and
  /// averaged. At level 2: 0.27x the bytes of the full all-reduce. The gradient becomes the
  /// reconstruction from the averaged bands. Other gradients are all-reduced in full.
  std::string compression = "none";
  int64_t level = 2;
  /// With "wavelet": keep what the sign sketch of the details missed on this rank and add it to
  /// the next call's details of the same parameter (1-bit SGD's and PowerSGD's error feedback), so
  /// that the details arrive late but in full.
  bool error_feedback = true;
  /// Gradients are flattened into buckets of at most this many MiB per collective.
  double bucket_mb = 25;
};

/// What the last all_reduce_gradients call of this process sent.
struct GradSyncStats {
  int64_t bytes_sent = 0;  ///< payload this rank all-reduced (bytes)
  int64_t bytes_full = 0;  ///< what the uncompressed all-reduce would have sent
  int64_t tensors = 0;     ///< gradients averaged
  int64_t compressed_tensors = 0;
  int64_t collectives = 0;  ///< all-reduce calls (buckets)
};

/// Averages every defined .grad() of `params` over the ranks of `pg`, in place. Every rank must
/// pass parameters of the same shapes with gradients defined for the same ones (checked: an error
/// on every rank otherwise). A NaN or infinity on one rank reaches every rank, so WaveletAdam skips
/// that step everywhere.
void all_reduce_gradients(const c10::intrusive_ptr<c10d::Backend>& pg,
                          const std::vector<at::Tensor>& params, GradSyncOptions options = {});

GradSyncStats last_grad_sync_stats();

/// Copies rank `root`'s parameter values to every rank (e.g. once after building the model, as
/// DDP does), in place.
void broadcast_parameters(const c10::intrusive_ptr<c10d::Backend>& pg,
                          const std::vector<at::Tensor>& params, int64_t root = 0);

/// Drops the error-feedback residuals of every parameter (e.g. after loading a checkpoint).
void reset_error_feedback();

/// ZeRO-1 WaveletAdam: each parameter's optimizer state lives on one rank (assigned greedily by
/// state size, the same on every rank); after step() every rank holds identical parameters (each
/// owner broadcasts what it updated). The update of every parameter is exactly the one a
/// single-process WaveletAdam makes from the same averaged gradient.
///
/// step() averages the gradients itself unless all_reduce_gradients already did since they last
/// changed (tracked by the gradients' identities and version counters, in any parameter order; the
/// decision is made collectively). A non-finite averaged gradient skips the step on every rank in
/// a "skip_step" group, and only its parameter in a "skip_param" group, as on one process. Every
/// error a caller can cause (a gradient of the wrong shape on one rank, options that differ
/// between the ranks, ...) is agreed on before any rank writes: every rank raises, and every
/// rank's parameters and state are as they were.
class ShardedWaveletAdam : public torch::optim::Optimizer {
 public:
  ShardedWaveletAdam(c10::intrusive_ptr<c10d::Backend> pg,
                     std::vector<torch::optim::OptimizerParamGroup> groups,
                     WaveletAdamOptions defaults = {});
  ShardedWaveletAdam(c10::intrusive_ptr<c10d::Backend> pg, std::vector<at::Tensor> params,
                     WaveletAdamOptions defaults = {});
  ~ShardedWaveletAdam() override;

  at::Tensor step(LossClosure closure = nullptr) override;

  /// This rank's shard (format "gwt.ShardedWaveletAdam.v1": rank, world size, every group's
  /// options, the local WaveletAdam's checkpoint). Loading checks rank and world size. These two
  /// are this rank's alone (torch::save / torch::load call them); load_shard is collective.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  /// torch::save/torch::load of this rank's shard to `path` + ".rank-" + rank. load_shard is
  /// collective: when any rank's shard fails to load, every rank raises (that rank keeps its
  /// state; the others say that they loaded theirs).
  void save_shard(const std::string& path) const;
  void load_shard(const std::string& path);
  /// Collective: rank 0 receives every parameter's state from its owner, one parameter at a time,
  /// and writes a checkpoint that a single-process gwt::WaveletAdam over the same parameter groups
  /// loads with torch::load (with this run's skipped_steps()). Only rank 0 holds more than its own
  /// shard; the others send their state from where it lives (one tensor at a time through the
  /// host when Gloo meets CUDA state).
  void save_full(const std::string& path) const;
  /// Collective: rank 0 reads and checks a single-process WaveletAdam checkpoint (or one
  /// save_full wrote) and sends each rank the groups' options and the state of the parameters it
  /// owns, one parameter at a time: only rank 0 holds the whole checkpoint. Nothing changes on any
  /// rank unless every rank received its part.
  void load_full(const std::string& path);

  /// Bytes of optimizer state on this rank.
  int64_t state_bytes() const;
  /// The rank that holds `param`'s state.
  int64_t owner(const at::Tensor& param) const;
  /// Steps skipped for a non-finite gradient (the same on every rank).
  int64_t skipped_steps() const { return skipped_steps_; }
  /// Bytes this rank sent in the last step: gradients all-reduced (when step() averaged them) and
  /// parameters it broadcast as their owner.
  int64_t last_step_bytes_sent() const { return last_step_bytes_sent_; }
  const c10::intrusive_ptr<c10d::Backend>& process_group() const { return pg_; }

 private:
  void build_local();
  void sync_local_options();
  void broadcast_parameters();

  c10::intrusive_ptr<c10d::Backend> pg_;
  std::vector<at::Tensor> params_;      // every parameter, in group order
  std::vector<int64_t> owner_;          // owner_[i]: rank of params_[i]
  std::vector<int64_t> local_group_;    // for each group of the local optimizer, the outer group
  std::unique_ptr<WaveletAdam> local_;  // the parameters this rank owns (null when none)
  int64_t skipped_steps_ = 0;
  int64_t last_step_bytes_sent_ = 0;
};

}  // namespace distributed
}  // namespace gwt
