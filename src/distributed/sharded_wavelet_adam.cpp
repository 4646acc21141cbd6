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
  // WaveletAdam's own messages, and says which parameters take the wavelet path.
  WaveletAdam all(groups, defaults);
  for (const auto i : c10::irange(all.param_groups().size())) {
    torch::optim::Optimizer::add_param_group(all.param_groups()[i]);
    param_groups_.back().set_options(all.param_groups()[i].options().clone());
  }
  std::vector<int64_t> bytes;
  for (const auto& group : param_groups_)
    for (const auto& p : group.params()) {
      params_.push_back(p);
      bytes.push_back(estimated_state_bytes(p, wavelet_options(group), all.is_wavelet_param(p)));
    }
  detail::check_same(pg_,
                     {static_cast<int64_t>(params_.size()), detail::shape_digest(params_, false),
                      static_cast<int64_t>(param_groups_.size())},
                     "ShardedWaveletAdam", "the parameters");
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
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  for (const auto& group : param_groups_) validate_options(wavelet_options(group));
  last_step_bytes_sent_ = 0;
  // Average the gradients unless all_reduce_gradients just did it on every rank.
  const bool averaged = detail::gradients_already_averaged(params_);
  if (detail::any(pg_, !averaged, "ShardedWaveletAdam::step")) {
    all_reduce_gradients(pg_, params_);
    last_step_bytes_sent_ += last_grad_sync_stats().bytes_sent;
  }
  // The averaged gradients are the same on every rank; the decision is made together anyway, so
  // that no rank can step while another skips.
  bool finite = true;
  for (const auto& p : params_)
    if (p.grad().defined()) finite = finite && at::isfinite(p.grad()).all().item<bool>();
  if (detail::any(pg_, !finite, "ShardedWaveletAdam::step")) {
    ++skipped_steps_;
    return loss;
  }
  sync_local_options();
  // An error here (a bad gradient shape, options that do not fit the dtype) is the same on every
  // rank for the parameters it owns; it is reported on every rank before any parameter moves.
  std::string error;
  if (local_) {
    try {
      local_->step();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
  }
  TORCH_CHECK(!detail::any(pg_, !error.empty(), "ShardedWaveletAdam::step"), k_who,
              "::step failed on ", error.empty() ? "another rank" : "this rank", ": ",
              error.empty() ? "see that rank's message" : error);
  broadcast_parameters();
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
      at::Tensor bucket = at::cat(flat).to(detail::comm_device(*pg_));
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
  if (local_) {
    torch::serialize::InputArchive local;
    TORCH_CHECK(archive.try_read("local", local), k_who, "::load: the shard has no local state");
    local_->load(local);  // checks everything before it changes anything
    for (const auto j : c10::irange(local_group_.size()))
      param_groups_[local_group_[j]].set_options(local_->param_groups()[j].options().clone());
  }
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
  const std::string file = shard_path(path, pg_->getRank());
  TORCH_CHECK(std::ifstream(file).good(), k_who, "::load_shard: rank ", pg_->getRank(), " has no ",
              file, " (a run of ", pg_->getSize(), " ranks reads ", path, ".rank-0 to .rank-",
              pg_->getSize() - 1, "; was the checkpoint saved with another world size?)");
  torch::serialize::InputArchive archive;
  archive.load_from(file);
  load(archive);
}

void ShardedWaveletAdam::save_full(const std::string& path) const {
  // Each rank's owned states, serialized; gathered as bytes (padded to the longest).
  torch::serialize::OutputArchive mine;
  std::vector<int64_t> have;
  if (local_) {
    for (const auto i : c10::irange(params_.size())) {
      auto it = local_->state().find(params_[i].unsafeGetTensorImpl());
      if (owner_[i] != pg_->getRank() || it == local_->state().end()) continue;
      torch::serialize::OutputArchive one;
      static_cast<const WaveletAdamParamState&>(*it->second).serialize(one);
      mine.write("p" + std::to_string(i), one);
      have.push_back(static_cast<int64_t>(i));
    }
  }
  mine.write("have", at::tensor(have, at::kLong));
  const std::string bytes = archive_bytes(mine);
  at::Tensor size = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
  at::Tensor size_on = size.to(detail::comm_device(*pg_));
  detail::allreduce(pg_, size_on, c10d::ReduceOp::MAX, "ShardedWaveletAdam::save_full");
  const int64_t longest = size_on.cpu().item<int64_t>();
  at::Tensor buffer = at::zeros({longest + 8}, at::kByte);
  std::memcpy(buffer.data_ptr(), bytes.data(), bytes.size());
  const auto n = static_cast<int64_t>(bytes.size());
  std::memcpy(buffer.data_ptr<uint8_t>() + longest, &n, 8);
  const std::vector<at::Tensor> all =
      detail::allgather(pg_, buffer.to(detail::comm_device(*pg_)), "ShardedWaveletAdam::save_full");

  std::string error;
  if (pg_->getRank() == 0) {
    try {
      std::vector<torch::optim::OptimizerParamGroup> groups;
      for (const auto& g : param_groups_) groups.emplace_back(g.params(), g.options().clone());
      WaveletAdam full(std::move(groups), wavelet_options(param_groups_[0]));
      full.skipped_steps_ = skipped_steps_;
      for (const auto& t : all) {
        const at::Tensor b = t.cpu();
        int64_t len = 0;
        std::memcpy(&len, b.data_ptr<uint8_t>() + longest, 8);
        torch::serialize::InputArchive in;
        in.load_from(reinterpret_cast<const char*>(b.data_ptr<uint8_t>()),
                     static_cast<size_t>(len));
        at::Tensor indices;
        in.read("have", indices);
        for (const auto k : c10::irange(indices.numel())) {
          const int64_t i = indices[k].item<int64_t>();
          torch::serialize::InputArchive one;
          in.read("p" + std::to_string(i), one);
          auto state = std::make_unique<WaveletAdamParamState>();
          state->serialize(one);
          full.state()[params_[i].unsafeGetTensorImpl()] = std::move(state);
        }
      }
      torch::save(full, path);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  TORCH_CHECK(!detail::any(pg_, !error.empty(), "ShardedWaveletAdam::save_full"), k_who,
              "::save_full: rank 0 could not write ", path,
              error.empty() ? std::string(" (see rank 0's message)") : ": " + error);
}

void ShardedWaveletAdam::load_full(const std::string& path) {
  // Rank 0 reads the file; every rank gets its bytes (a size of -1: rank 0 could not read it).
  std::string bytes, error;
  if (pg_->getRank() == 0) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    } else {
      error = "cannot open " + path;
    }
  }
  at::Tensor size =
      at::full({1}, error.empty() ? static_cast<int64_t>(bytes.size()) : -1, at::kLong)
          .to(detail::comm_device(*pg_));
  detail::broadcast(pg_, size, 0, "ShardedWaveletAdam::load_full");
  const int64_t n = size.cpu().item<int64_t>();
  TORCH_CHECK(n >= 0, k_who, "::load_full: rank 0 ",
              error.empty() ? std::string("could not read ") + path : error);
  at::Tensor buffer = at::zeros({n}, at::kByte);
  if (pg_->getRank() == 0) std::memcpy(buffer.data_ptr(), bytes.data(), bytes.size());
  buffer = buffer.to(detail::comm_device(*pg_));
  detail::broadcast(pg_, buffer, 0, "ShardedWaveletAdam::load_full");
  buffer = buffer.cpu();

  // Every rank loads the whole checkpoint into a WaveletAdam over every parameter (the same
  // checks, the same outcome everywhere), then keeps the state of what it owns.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const auto& g : param_groups_) groups.emplace_back(g.params(), g.options().clone());
  WaveletAdam full(std::move(groups), wavelet_options(param_groups_[0]));
  torch::serialize::InputArchive archive;
  archive.load_from(reinterpret_cast<const char*>(buffer.data_ptr<uint8_t>()),
                    static_cast<size_t>(n));
  full.load(archive);
  for (const auto g : c10::irange(param_groups_.size()))
    param_groups_[g].set_options(full.param_groups()[g].options().clone());
  build_local();  // fresh, empty state; options from the checkpoint
  if (local_) {
    for (const auto i : c10::irange(params_.size())) {
      if (owner_[i] != pg_->getRank()) continue;
      auto it = full.state().find(params_[i].unsafeGetTensorImpl());
      if (it != full.state().end())
        local_->state()[params_[i].unsafeGetTensorImpl()] = std::move(it->second);
    }
  }
  skipped_steps_ = full.skipped_steps();
}

}  // namespace distributed
}  // namespace gwt
