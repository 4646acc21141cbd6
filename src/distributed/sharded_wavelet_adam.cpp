// gwt::distributed::ShardedWaveletAdam: WaveletAdam with each parameter's state on one rank.
//
// The update itself is a gwt::WaveletAdam's, made by a local WaveletAdam over the parameters this
// rank owns; this file decides who owns what, keeps every rank's decisions the same (the skip of a
// non-finite step, the options of each group) and brings the updated parameters to every rank.

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <numeric>
#include <sstream>
#include <unordered_set>

#include "comm.h"
#include "gwt/distributed.h"
#include "gwt/wavelet.h"

namespace gwt {
namespace distributed {

namespace {

constexpr const char* k_who = "gwt::distributed::ShardedWaveletAdam";
constexpr const char* k_format = "gwt.ShardedWaveletAdam.v1";

const WaveletAdamOptions& wavelet_options(const torch::optim::OptimizerParamGroup& group) {
  return static_cast<const WaveletAdamOptions&>(group.options());
}

// Bytes of state a parameter will hold under `o` (the two moments), as WaveletAdam allocates it:
// the approximation band's shape for wavelet parameters, the parameter's for the others.
int64_t estimated_state_bytes(const at::Tensor& p, const WaveletAdamOptions& o, bool wavelet) {
  const int64_t elem = o.state_dtype() == "bfloat16" ? 2 : p.scalar_type() == at::kDouble ? 8 : 4;
  int64_t n = p.numel();
  if (wavelet && p.numel() > 0) {
    const Wavelet w(o.wavelet());
    const BoundaryMode mode = boundary_mode_from_string(o.boundary());
    auto shrink = [&](int64_t dim) {
      n = n / p.size(dim) * approx_len(p.size(dim), w, o.level(), mode);
    };
    if (o.transform() == "2d") {
      shrink(p.dim() - 2), shrink(p.dim() - 1);
    } else {
      shrink(o.dim() < 0 ? o.dim() + p.dim() : o.dim());
    }
  }
  return 2 * n * elem;
}

// A digest of every group's options, for the ranks to check that they agree (a scheduler or an
// option changed on one rank only would make the shards step with different rules).
int64_t options_digest(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a
  auto bytes = [&h](const void* data, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      h ^= static_cast<const unsigned char*>(data)[i];
      h *= 1099511628211ULL;
    }
  };
  auto num = [&bytes](auto v) { bytes(&v, sizeof v); };
  auto text = [&bytes, &num](const std::string& v) { num(v.size()), bytes(v.data(), v.size()); };
  for (const auto& group : groups) {
    const WaveletAdamOptions& o = wavelet_options(group);
    num(o.lr()), num(std::get<0>(o.betas())), num(std::get<1>(o.betas())), num(o.eps());
    num(o.weight_decay()), text(o.wavelet()), num(o.level()), text(o.boundary()), num(o.scale());
    num(o.norm_growth_limit()), num(o.correct_bias()), num(o.dim()), num(o.fused());
    text(o.state_dtype()), text(o.transform()), num(o.threshold()), text(o.threshold_mode());
    num(o.min_size()), text(o.nonfinite());
  }
  return static_cast<int64_t>(h >> 2);
}

// A parameter's state between two ranks (save_full, load_full): a header of int64 values (whether
// there is state, its step and skip counts, the moments' dtype and sizes, whether the limiter norm
// is there and its dtype), then the tensors themselves, sent from where they are: no rank but the
// one that writes or reads the file holds more than its own state.
constexpr int64_t k_header = 6;  // has state, step, skipped, moment dtype, has norm, norm dtype

void send_state(const c10::intrusive_ptr<c10d::Backend>& pg, const WaveletAdamParamState* state,
                const at::Tensor& param, int64_t dst, int tag, const std::string& what) {
  const auto dev = detail::comm_device(*pg, param);
  at::Tensor header = at::zeros({k_header + param.dim()}, at::kLong);
  int64_t* h = header.data_ptr<int64_t>();
  if (state != nullptr) {
    TORCH_INTERNAL_ASSERT(state->exp_avg().dim() == param.dim());
    h[0] = 1, h[1] = state->step(), h[2] = state->skipped();
    h[3] = static_cast<int64_t>(state->exp_avg().scalar_type());
    h[4] = state->norm().defined() ? 1 : 0;
    h[5] = state->norm().defined() ? static_cast<int64_t>(state->norm().scalar_type()) : 0;
    for (const auto d : c10::irange(param.dim())) h[k_header + d] = state->exp_avg().size(d);
  }
  header = header.to(dev);
  detail::send(pg, header, dst, tag, what);
  if (state == nullptr) return;
  for (const at::Tensor* t : {&state->exp_avg(), &state->exp_avg_sq(), &state->norm()}) {
    if (!t->defined()) continue;
    at::Tensor on = t->to(dev).contiguous();  // no copy for a contiguous tensor already there
    detail::send(pg, on, dst, tag, what);
  }
}

std::unique_ptr<WaveletAdamParamState> recv_state(const c10::intrusive_ptr<c10d::Backend>& pg,
                                                  const at::Tensor& param, int64_t src, int tag,
                                                  const std::string& what) {
  const auto dev = detail::comm_device(*pg, param);
  at::Tensor header = at::empty({k_header + param.dim()}, at::TensorOptions(at::kLong).device(dev));
  detail::recv(pg, header, src, tag, what);
  header = header.cpu();
  const int64_t* h = header.data_ptr<int64_t>();
  if (h[0] == 0) return nullptr;
  auto dtype = [&](int64_t code) {
    TORCH_CHECK(code >= 0 && code < static_cast<int64_t>(at::ScalarType::NumOptions), k_who,
                "::", what, ": rank ", src, " sent a state with an unknown dtype (", code, ")");
    return static_cast<at::ScalarType>(code);
  };
  const std::vector<int64_t> sizes(h + k_header, h + k_header + param.dim());
  auto take = [&](std::vector<int64_t> shape, at::ScalarType type) {
    at::Tensor t = at::empty(shape, at::TensorOptions(type).device(dev));
    detail::recv(pg, t, src, tag, what);
    return t.to(param.device());
  };
  auto state = std::make_unique<WaveletAdamParamState>();
  state->step(h[1]);
  state->skipped(h[2]);
  state->exp_avg(take(sizes, dtype(h[3])));
  state->exp_avg_sq(take(sizes, dtype(h[3])));
  if (h[4] != 0) state->norm(take({}, dtype(h[5])));
  return state;
}

std::string archive_bytes(torch::serialize::OutputArchive& archive) {
  std::string bytes;
  archive.save_to([&bytes](const void* data, size_t size) -> size_t {
    bytes.append(static_cast<const char*>(data), size);
    return size;
  });
  return bytes;
}

}  // namespace

ShardedWaveletAdam::ShardedWaveletAdam(c10::intrusive_ptr<c10d::Backend> pg,
                                       std::vector<torch::optim::OptimizerParamGroup> groups,
                                       WaveletAdamOptions defaults)
    : Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                std::make_unique<WaveletAdamOptions>(defaults)),
      pg_(std::move(pg)) {
  TORCH_CHECK(pg_, k_who, ": the process group is null");
  // A WaveletAdam over every group checks everything (options, duplicates, dtypes) with
  // WaveletAdam's own messages, and says which parameters take the wavelet path. An error on one
  // rank is agreed on, so that no rank waits for it in the next collective.
  std::vector<int64_t> bytes;
  int64_t digest = 0;
  const std::string error = detail::capture([&] {
    WaveletAdam all(groups, defaults);
    for (const auto i : c10::irange(all.param_groups().size())) {
      torch::optim::Optimizer::add_param_group(all.param_groups()[i]);
      param_groups_.back().set_options(all.param_groups()[i].options().clone());
    }
    for (const auto& group : param_groups_)
      for (const auto& p : group.params()) {
        params_.push_back(p);
        bytes.push_back(estimated_state_bytes(p, wavelet_options(group), all.is_wavelet_param(p)));
      }
    digest = detail::shape_digest(params_, false);
  });
  const detail::Agreed agreed = detail::agree(
      pg_, {detail::failure_flag(*pg_, error)},
      {static_cast<int64_t>(params_.size()), digest, static_cast<int64_t>(param_groups_.size()),
       error.empty() ? options_digest(param_groups_) : 0},
      "ShardedWaveletAdam");
  detail::throw_if_failed(*pg_, agreed.max[0], error, "ShardedWaveletAdam");
  if (!agreed.same)
    detail::fail_differ(*pg_, "ShardedWaveletAdam",
                        "the parameters, their groups or the groups' options");
  // Greedy by state size, the largest first: each to the rank holding the least so far (the
  // lowest such rank on a tie). The same on every rank, since it depends only on the shapes.
  std::vector<size_t> order(params_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return bytes[a] > bytes[b]; });
  std::vector<int64_t> load(pg_->getSize(), 0);
  owner_.assign(params_.size(), 0);
  for (const size_t i : order) {
    const auto r = std::min_element(load.begin(), load.end()) - load.begin();
    owner_[i] = r;
    load[r] += bytes[i];
  }
  build_local();
  // Every rank starts from rank 0's values, as DDP does.
  distributed::broadcast_parameters(pg_, params_, 0);
}

ShardedWaveletAdam::ShardedWaveletAdam(c10::intrusive_ptr<c10d::Backend> pg,
                                       std::vector<at::Tensor> params, WaveletAdamOptions defaults)
    : ShardedWaveletAdam(std::move(pg), {torch::optim::OptimizerParamGroup(std::move(params))},
                         std::move(defaults)) {}

ShardedWaveletAdam::~ShardedWaveletAdam() = default;

void ShardedWaveletAdam::build_local() {
  std::vector<torch::optim::OptimizerParamGroup> local;
  local_group_.clear();
  size_t i = 0;
  for (const auto g : c10::irange(param_groups_.size())) {
    std::vector<at::Tensor> mine;
    for (const auto& p : param_groups_[g].params()) {
      if (owner_[i++] == pg_->getRank()) mine.push_back(p);
    }
    if (mine.empty()) continue;
    local.emplace_back(std::move(mine), param_groups_[g].options().clone());
    local_group_.push_back(static_cast<int64_t>(g));
  }
  local_ = local.empty()
               ? nullptr
               : std::make_unique<WaveletAdam>(std::move(local), wavelet_options(param_groups_[0]));
}

void ShardedWaveletAdam::sync_local_options() {
  if (!local_) return;
  for (const auto j : c10::irange(local_group_.size()))
    local_->param_groups()[j].set_options(param_groups_[local_group_[j]].options().clone());
}

int64_t ShardedWaveletAdam::owner(const at::Tensor& param) const {
  for (const auto i : c10::irange(params_.size()))
    if (params_[i].unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) return owner_[i];
  TORCH_CHECK(false, k_who, "::owner: the tensor of shape ", param.sizes(),
              " is not one of this optimizer's parameters");
}

int64_t ShardedWaveletAdam::state_bytes() const {
  return local_ ? local_->state_bytes() : 0;
}

at::Tensor ShardedWaveletAdam::step(LossClosure closure) {
  const char* what = "ShardedWaveletAdam::step";
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  last_step_bytes_sent_ = 0;
  // Every decision is made together, and every error a caller can cause is agreed on before any
  // rank writes a parameter or a moment: an error on one rank leaves every rank as it was.
  // 1. The options (the same on every rank) and whether the gradients still need averaging.
  std::string error = detail::capture([&] {
    for (const auto& group : param_groups_) validate_options(wavelet_options(group));
  });
  // Which gradients are defined is compared too: the averaging below may be skipped, and the
  // owners' broadcasts must have the same sizes everywhere.
  const bool averaged = detail::gradients_already_averaged(params_);
  detail::Agreed agreed = detail::agree(
      pg_, {detail::failure_flag(*pg_, error), averaged ? 0 : 1},
      {options_digest(param_groups_), detail::shape_digest(params_, /*with_grads=*/true)}, what);
  detail::throw_if_failed(*pg_, agreed.max[0], error, what);
  if (!agreed.same)
    detail::fail_differ(*pg_, what, "the groups' options or the gradients that are defined");
  if (agreed.max[1] != 0) {
    all_reduce_gradients(pg_, params_);
    last_step_bytes_sent_ += last_grad_sync_stats().bytes_sent;
  }
  // 2. The local optimizer's checks (which write nothing), and the whole-step skip: a non-finite
  // averaged gradient in a "skip_step" group skips the step everywhere. The averaged gradients
  // are the same on every rank, so each rank looks at those it owns, as WaveletAdam::step does:
  // in the dtype the update reads them in (a float64 gradient of a float32 parameter can be
  // finite and overflow float32). Parameters of "skip_param" groups are decided by their owner's
  // local step, as on one process.
  sync_local_options();
  bool nonfinite = false;
  error = detail::capture([&] {
    if (!local_) return;
    local_->check_step();
    std::vector<at::Tensor> finite;
    for (const auto& group : local_->param_groups()) {
      if (wavelet_options(group).nonfinite() != "skip_step") continue;
      for (const auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        const bool narrower = p.scalar_type() != at::kDouble;
        const at::Tensor g =
            narrower && p.grad().scalar_type() == at::kDouble ? p.grad().to(at::kFloat) : p.grad();
        finite.push_back(at::isfinite(g).all());
      }
    }
    nonfinite = !finite.empty() && !at::stack(finite).all().item<bool>();
  });
  agreed = detail::agree(pg_, {detail::failure_flag(*pg_, error), nonfinite ? 1 : 0}, {}, what);
  detail::throw_if_failed(*pg_, agreed.max[0], error, what);
  if (agreed.max[1] != 0) {
    ++skipped_steps_;
    return loss;
  }
  // 3. The owners step. Only what no check foresees can fail here (memory running out): the
  // owners' values are broadcast even then, so that the ranks' copies stay the same, and every
  // rank raises.
  const int64_t skipped_before = local_ ? local_->skipped_steps() : 0;
  error = detail::capture([&] {
    if (local_) local_->step();
  });
  const bool skipped_any = local_ && local_->skipped_steps() != skipped_before;
  agreed = detail::agree(pg_, {detail::failure_flag(*pg_, error), skipped_any ? 1 : 0}, {}, what);
  if (agreed.max[1] != 0) ++skipped_steps_;
  broadcast_parameters();
  detail::throw_if_failed(*pg_, agreed.max[0], error, what,
                          " (the step was applied in part: every rank holds its owners' values)");
  return loss;
}

void ShardedWaveletAdam::broadcast_parameters() {
  // One broadcast per owner and dtype run: the owner's updated values to every rank.
  for (const auto r : c10::irange(pg_->getSize())) {
    std::vector<at::Tensor> owned;
    for (const auto i : c10::irange(params_.size()))
      if (owner_[i] == static_cast<int64_t>(r) && params_[i].grad().defined())
        owned.push_back(params_[i]);
    for (const auto& [begin, end] : detail::buckets(owned, int64_t{64} << 20)) {
      std::vector<at::Tensor> flat;
      for (size_t i = begin; i < end; ++i) flat.push_back(owned[i].detach().reshape({-1}));
      at::Tensor bucket = at::cat(flat).to(detail::comm_device(*pg_, owned[begin]));
      if (static_cast<int64_t>(r) == pg_->getRank())
        last_step_bytes_sent_ += static_cast<int64_t>(bucket.nbytes());
      detail::broadcast(pg_, bucket, static_cast<int64_t>(r), "ShardedWaveletAdam::step");
      if (static_cast<int64_t>(r) == pg_->getRank()) continue;
      int64_t offset = 0;
      for (size_t i = begin; i < end; ++i) {
        const int64_t n = owned[i].numel();
        owned[i].detach().copy_(bucket.narrow(0, offset, n).view(owned[i].sizes()));
        offset += n;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Checkpoints
// ------------------------------------------------------------------------------------------------

void ShardedWaveletAdam::save(torch::serialize::OutputArchive& archive) const {
  archive.write("format", c10::IValue(std::string(k_format)));
  archive.write("rank", c10::IValue(pg_->getRank()));
  archive.write("world_size", c10::IValue(pg_->getSize()));
  archive.write("owners", at::tensor(owner_, at::kLong));
  archive.write("skipped_steps", c10::IValue(skipped_steps_));
  archive.write("has_local", c10::IValue(local_ != nullptr));
  // Every group's options, owned or not (the local checkpoint has only the owned groups'), so that
  // a loaded shard restores them all.
  for (const auto g : c10::irange(param_groups_.size())) {
    torch::serialize::OutputArchive options;
    wavelet_options(param_groups_[g]).serialize(options);
    archive.write("options_" + std::to_string(g), options);
  }
  if (local_) {
    torch::serialize::OutputArchive local;
    local_->save(local);
    archive.write("local", local);
  }
}

void ShardedWaveletAdam::load(torch::serialize::InputArchive& archive) {
  c10::IValue format, rank, world, skipped, has_local;
  TORCH_CHECK(
      archive.try_read("format", format) && format.isString() && format.toStringRef() == k_format,
      k_who, "::load: this is not a ShardedWaveletAdam shard (no '", k_format,
      "' format entry); a single-process WaveletAdam checkpoint loads with load_full");
  TORCH_CHECK(archive.try_read("rank", rank) && archive.try_read("world_size", world) &&
                  archive.try_read("skipped_steps", skipped) &&
                  archive.try_read("has_local", has_local) && rank.isInt() && world.isInt() &&
                  skipped.isInt() && has_local.isBool(),
              k_who, "::load: the shard is damaged (rank, world_size or counters missing)");
  TORCH_CHECK(world.toInt() == pg_->getSize(), k_who, "::load: the shard was saved by a run of ",
              world.toInt(), " ranks and this run has ", pg_->getSize(), "; load it with ",
              world.toInt(),
              " ranks, or change the world size through "
              "save_full / load_full");
  TORCH_CHECK(rank.toInt() == pg_->getRank(), k_who, "::load: the shard is rank ", rank.toInt(),
              "'s and this is rank ", pg_->getRank(), " (each rank loads path.rank-N, its own)");
  at::Tensor owners;
  TORCH_CHECK(archive.try_read("owners", owners) && owners.dim() == 1 &&
                  owners.scalar_type() == at::kLong &&
                  owners.numel() == static_cast<int64_t>(owner_.size()),
              k_who, "::load: the shard was saved for ", owners.defined() ? owners.numel() : -1,
              " parameters; this optimizer has ", owner_.size());
  const std::vector<int64_t> saved(owners.data_ptr<int64_t>(),
                                   owners.data_ptr<int64_t>() + owners.numel());
  TORCH_CHECK(saved == owner_, k_who,
              "::load: the shard assigns the parameters to other ranks "
              "than this optimizer does (were parameters or groups changed?)");
  TORCH_CHECK(has_local.toBool() == (local_ != nullptr), k_who,
              "::load: the shard holds state for ", has_local.toBool() ? "some" : "no",
              " parameters, but this rank owns ", local_ ? "some" : "none");
  // Every group's options (shards written before they were saved have the owned groups' only).
  std::vector<std::unique_ptr<WaveletAdamOptions>> options(param_groups_.size());
  for (const auto g : c10::irange(param_groups_.size())) {
    torch::serialize::InputArchive one;
    if (!archive.try_read("options_" + std::to_string(g), one)) continue;
    options[g] = std::make_unique<WaveletAdamOptions>();
    options[g]->serialize(one);
    validate_options(*options[g]);
  }
  if (local_) {
    torch::serialize::InputArchive local;
    TORCH_CHECK(archive.try_read("local", local), k_who, "::load: the shard has no local state");
    local_->load(local);  // checks everything before it changes anything
    for (const auto j : c10::irange(local_group_.size()))
      param_groups_[local_group_[j]].set_options(local_->param_groups()[j].options().clone());
  }
  for (const auto g : c10::irange(param_groups_.size()))
    if (options[g]) param_groups_[g].set_options(std::move(options[g]));
  sync_local_options();
  skipped_steps_ = skipped.toInt();
}

namespace {
std::string shard_path(const std::string& path, int64_t rank) {
  return path + ".rank-" + std::to_string(rank);
}
}  // namespace

void ShardedWaveletAdam::save_shard(const std::string& path) const {
  torch::serialize::OutputArchive archive;
  save(archive);
  archive.save_to(shard_path(path, pg_->getRank()));
}

void ShardedWaveletAdam::load_shard(const std::string& path) {
  const std::string error = detail::capture([&] {
    const std::string file = shard_path(path, pg_->getRank());
    TORCH_CHECK(std::ifstream(file).good(), k_who, "::load_shard: rank ", pg_->getRank(),
                " has no ", file, " (a run of ", pg_->getSize(), " ranks reads ", path,
                ".rank-0 to .rank-", pg_->getSize() - 1,
                "; was the checkpoint saved with another world size?)");
    torch::serialize::InputArchive archive;
    archive.load_from(file);
    load(archive);  // checks everything before it changes anything
  });
  // Every rank learns whether every rank loaded: a rank whose shard failed keeps its state, and
  // the others must not go on training from a checkpoint that is not whole.
  const int64_t failed =
      detail::agree(pg_, {detail::failure_flag(*pg_, error)}, {}, "ShardedWaveletAdam::load_shard")
          .max[0];
  detail::throw_if_failed(*pg_, failed, error, "ShardedWaveletAdam::load_shard",
                          error.empty() ? " (this rank loaded its own shard: load the checkpoint "
                                          "again on every rank once every shard loads)"
                                        : "");
}

void ShardedWaveletAdam::save_full(const std::string& path) const {
  // Rank 0 receives each parameter's state from its owner, one parameter at a time, and writes the
  // checkpoint; the other ranks send what they own from where it is (ZeRO's consolidation to one
  // rank: no rank but 0 holds more than its own state).
  const char* what = "ShardedWaveletAdam::save_full";
  const int64_t rank = pg_->getRank();
  // The owned states are read directly below: CUDA shards' step counts and norms first come up
  // from the device (WaveletAdam keeps them there between steps).
  if (local_) local_->sync_device_steps();
  auto owned_state = [&](size_t i) -> const WaveletAdamParamState* {
    if (!local_) return nullptr;
    auto it = local_->state().find(params_[i].unsafeGetTensorImpl());
    return it == local_->state().end()
               ? nullptr
               : static_cast<const WaveletAdamParamState*>(it->second.get());
  };
  // Rank 0 first makes the optimizer it will write, and every rank knows whether it could, before
  // any transfer starts (a sender would otherwise wait for a receiver that gave up).
  std::unique_ptr<WaveletAdam> full;
  std::string error;
  if (rank == 0) {
    error = detail::capture([&] {
      std::vector<torch::optim::OptimizerParamGroup> groups;
      for (const auto& g : param_groups_) groups.emplace_back(g.params(), g.options().clone());
      full = std::make_unique<WaveletAdam>(std::move(groups), wavelet_options(param_groups_[0]));
      full->skipped_steps_ = skipped_steps_;
    });
  }
  int64_t failed = detail::agree(pg_, {detail::failure_flag(*pg_, error)}, {}, what).max[0];
  detail::throw_if_failed(*pg_, failed, error, what);
  error = detail::capture([&] {
    if (rank != 0) {
      for (const auto i : c10::irange(params_.size()))
        if (owner_[i] == rank)
          send_state(pg_, owned_state(i), params_[i], 0, static_cast<int>(i), what);
      return;
    }
    for (const auto i : c10::irange(params_.size())) {
      std::unique_ptr<WaveletAdamParamState> state;
      if (owner_[i] != 0) {
        state = recv_state(pg_, params_[i], owner_[i], static_cast<int>(i), what);
      } else if (const auto* mine = owned_state(i)) {
        state = std::make_unique<WaveletAdamParamState>(*mine);  // shares the tensors
      }
      if (state) full->state()[params_[i].unsafeGetTensorImpl()] = std::move(state);
    }
    try {
      torch::save(*full, path);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, k_who, "::save_full: rank 0 could not write ", path, ": ", e.what());
    }
  });
  failed = detail::agree(pg_, {detail::failure_flag(*pg_, error)}, {}, what).max[0];
  detail::throw_if_failed(*pg_, failed, error, what);
}

void ShardedWaveletAdam::load_full(const std::string& path) {
  // Rank 0 reads and checks the whole checkpoint (a single-process WaveletAdam's, or one
  // save_full wrote), sends every rank the groups' options and the skip count, and then each
  // owner the state of its parameters, one at a time. Nothing changes anywhere unless every
  // rank got all of its part.
  const char* what = "ShardedWaveletAdam::load_full";
  const int64_t rank = pg_->getRank();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const auto& g : param_groups_) groups.emplace_back(g.params(), g.options().clone());
  std::unique_ptr<WaveletAdam> full;
  std::string header;  // rank 0: the options and the skip count, serialized
  std::string error;
  if (rank == 0) {
    error = detail::capture([&] {
      TORCH_CHECK(std::ifstream(path).good(), "cannot open ", path);
      full = std::make_unique<WaveletAdam>(groups, wavelet_options(param_groups_[0]));
      torch::serialize::InputArchive archive;
      archive.load_from(path);
      full->load(archive);  // checks everything
      torch::serialize::OutputArchive out;
      out.write("skipped_steps", c10::IValue(full->skipped_steps()));
      for (const auto g : c10::irange(param_groups_.size())) {
        torch::serialize::OutputArchive options;
        full->group_options(g).serialize(options);
        out.write("options_" + std::to_string(g), options);
      }
      header = archive_bytes(out);
    });
  }
  at::Tensor size =
      at::full({1}, error.empty() ? static_cast<int64_t>(header.size()) : -1, at::kLong)
          .to(detail::comm_device(*pg_));
  detail::broadcast(pg_, size, 0, what);
  const int64_t n = size.cpu().item<int64_t>();
  TORCH_CHECK(n >= 0, k_who, "::load_full: rank 0 could not load ", path,
              error.empty() ? std::string(" (see rank 0's message)") : ": " + error);
  at::Tensor buffer = at::zeros({n}, at::kByte);
  if (rank == 0) std::memcpy(buffer.data_ptr(), header.data(), header.size());
  buffer = buffer.to(detail::comm_device(*pg_));
  detail::broadcast(pg_, buffer, 0, what);
  buffer = buffer.cpu();

  std::vector<std::unique_ptr<WaveletAdamOptions>> options(param_groups_.size());
  int64_t skipped = 0;
  std::vector<std::unique_ptr<WaveletAdamParamState>> states(params_.size());
  error = detail::capture([&] {
    torch::serialize::InputArchive in;
    in.load_from(reinterpret_cast<const char*>(buffer.data_ptr<uint8_t>()), static_cast<size_t>(n));
    c10::IValue value;
    TORCH_CHECK(in.try_read("skipped_steps", value) && value.isInt(), "no skip count");
    skipped = value.toInt();
    for (const auto g : c10::irange(param_groups_.size())) {
      torch::serialize::InputArchive one;
      TORCH_CHECK(in.try_read("options_" + std::to_string(g), one), "no options for group ", g);
      options[g] = std::make_unique<WaveletAdamOptions>();
      options[g]->serialize(one);
      validate_options(*options[g]);
    }
    for (const auto i : c10::irange(params_.size())) {
      const int tag = static_cast<int>(i);
      if (rank == 0) {
        auto it = full->state().find(params_[i].unsafeGetTensorImpl());
        auto* state = it == full->state().end()
                          ? nullptr
                          : static_cast<WaveletAdamParamState*>(it->second.get());
        if (owner_[i] != 0) {
          send_state(pg_, state, params_[i], owner_[i], tag, what);
        } else if (state != nullptr) {
          states[i] = std::make_unique<WaveletAdamParamState>(*state);
        }
      } else if (owner_[i] == rank) {
        states[i] = recv_state(pg_, params_[i], 0, tag, what);
      }
    }
  });
  const int64_t failed = detail::agree(pg_, {detail::failure_flag(*pg_, error)}, {}, what).max[0];
  detail::throw_if_failed(
      *pg_, failed, error.empty() ? error : std::string(k_who) + "::load_full: " + error, what);
  full.reset();
  for (const auto g : c10::irange(param_groups_.size()))
    param_groups_[g].set_options(std::move(options[g]));
  build_local();  // fresh, empty state; options from the checkpoint
  for (const auto i : c10::irange(params_.size()))
    if (states[i]) local_->state()[params_[i].unsafeGetTensorImpl()] = std::move(states[i]);
  skipped_steps_ = skipped;
}

}  // namespace distributed
}  // namespace gwt
