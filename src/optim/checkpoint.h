#pragma once

// The checkpoint layout shared by gwt's optimizers (internal): the format name, named counters,
// and per group its options and, by position, its parameters' fingerprints (shape and dtype; the
// group index and position are the keys they are stored under) and state. Loading reads and
// checks everything before anything changes, so a checkpoint that does not fit is an error that
// leaves the optimizer as it was.

#include <c10/util/irange.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common.h"

namespace gwt {
namespace optim_detail {

/// Each parameter's param_where(), by its TensorImpl, for a loader's messages.
inline std::unordered_map<const void*, std::string> param_positions(
    const torch::optim::Optimizer& optimizer) {
  std::unordered_map<const void*, std::string> out;
  for (const auto i : c10::irange(optimizer.param_groups().size()))
    for (const auto j : c10::irange(optimizer.param_groups()[i].params().size())) {
      const at::Tensor& param = optimizer.param_groups()[i].params()[j];
      out[param.unsafeGetTensorImpl()] = param_where(i, j, param);
    }
  return out;
}

inline std::string group_key(size_t i) {
  return "group_" + std::to_string(i);
}
inline std::string param_key(size_t j) {
  return "param_" + std::to_string(j);
}

template <typename Options, typename State>
void save_checkpoint(const torch::optim::Optimizer& optimizer,
                     torch::serialize::OutputArchive& archive, const std::string& format,
                     const std::map<std::string, int64_t>& counters) {
  archive.write("format", c10::IValue(format));
  archive.write("num_groups", c10::IValue(static_cast<int64_t>(optimizer.param_groups().size())));
  for (const auto& [name, value] : counters) archive.write(name, c10::IValue(value));
  for (const auto i : c10::irange(optimizer.param_groups().size())) {
    const auto& group = optimizer.param_groups()[i];
    torch::serialize::OutputArchive group_archive(archive.compilation_unit());
    torch::serialize::OutputArchive options_archive(archive.compilation_unit());
    static_cast<const Options&>(group.options()).serialize(options_archive);
    group_archive.write("options", options_archive);
    group_archive.write("num_params", c10::IValue(static_cast<int64_t>(group.params().size())));
    for (const auto j : c10::irange(group.params().size())) {
      const at::Tensor& param = group.params()[j];
      group_archive.write(param_key(j) + "_shape", c10::IValue(param.sizes().vec()));
      group_archive.write(param_key(j) + "_dtype",
                          c10::IValue(std::string(c10::toString(param.scalar_type()))));
      auto it = optimizer.state().find(param.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      torch::serialize::OutputArchive state_archive(archive.compilation_unit());
      static_cast<const State&>(*it->second).serialize(state_archive);
      group_archive.write(param_key(j), state_archive);
    }
    archive.write(group_key(i), group_archive);
  }
}

/// Reads a checkpoint written by save_checkpoint into `optimizer` after checking all of it.
/// `prepare(state, param, options)` checks one parameter's state against its options (throwing
/// if it does not fit) and moves it to the parameter's device and dtypes. `fits(param, options,
/// next_step)` checks, for every parameter (with state or without), that the loaded options can
/// drive its next step (the checks step() makes before it changes anything). Returns the counters.
template <typename Options, typename State, typename Prepare, typename Fits>
std::map<std::string, int64_t> load_checkpoint(torch::optim::Optimizer& optimizer,
                                               torch::serialize::InputArchive& archive,
                                               const std::string& format,
                                               const std::vector<std::string>& counters,
                                               const char* who, Prepare&& prepare, Fits&& fits) {
  const char* what = "checkpoint";
  c10::IValue value;
  TORCH_CHECK(
      archive.try_read("format", value) && value.isString() && value.toStringRef() == format, who,
      "::load: not a ", format, " checkpoint (was it saved by another optimizer?)");
  auto& groups = optimizer.param_groups();
  const int64_t num_groups = read_value(archive, "num_groups", what, who).toInt();
  TORCH_CHECK(num_groups == static_cast<int64_t>(groups.size()), who, "::load: the checkpoint has ",
              num_groups, " parameter groups but this optimizer has ", groups.size());
  std::map<std::string, int64_t> loaded_counters;
  for (const auto& name : counters) {
    const int64_t count = read_value(archive, name, what, who).toInt();
    TORCH_CHECK(count >= 0, who, "::load: the checkpoint's ", name, " is negative (", count,
                "); it counts events");
    loaded_counters[name] = count;
  }
  // Saved dtypes against this optimizer's, checked once all are read (see below).
  struct DtypeFingerprint {
    size_t group, position;
    std::string saved;
    at::ScalarType here;
  };
  std::vector<DtypeFingerprint> dtypes;
  std::set<at::ScalarType> dtypes_here;

  std::vector<Options> loaded_options;
  std::vector<std::pair<void*, std::unique_ptr<State>>> loaded_state;
  for (const auto i : c10::irange(groups.size())) {
    const auto& group = groups[i];
    torch::serialize::InputArchive group_archive, options_archive;
    TORCH_CHECK(archive.try_read(group_key(i), group_archive), who, "::load: group ", i,
                " is missing from the checkpoint");
    TORCH_CHECK(group_archive.try_read("options", options_archive), who, "::load: group ", i,
                " has no options in the checkpoint");
    Options options;
    options.serialize(options_archive);
    validate_options(options);
    const int64_t num_params = read_value(group_archive, "num_params", what, who).toInt();
    TORCH_CHECK(num_params == static_cast<int64_t>(group.params().size()), who, "::load: group ", i,
                " has ", num_params, " parameters in the checkpoint but ", group.params().size(),
                " here");
    for (const auto j : c10::irange(group.params().size())) {
      const at::Tensor& param = group.params()[j];
      const auto saved_shape =
          read_value(group_archive, param_key(j) + "_shape", what, who).toIntVector();
      TORCH_CHECK(saved_shape == param.sizes().vec(), who, "::load: parameter ", j, " of group ", i,
                  " had shape ", c10::IntArrayRef(saved_shape), " when saved but has shape ",
                  param.sizes(), " here");
      dtypes_here.insert(param.scalar_type());
      c10::IValue saved_dtype;  // absent from checkpoints written before the fingerprints
      if (group_archive.try_read(param_key(j) + "_dtype", saved_dtype)) {
        TORCH_CHECK(saved_dtype.isString(), who, "::load: parameter ", j, " of group ", i,
                    " has a malformed dtype entry in the checkpoint");
        dtypes.push_back({i, j, saved_dtype.toStringRef(), param.scalar_type()});
      }
      torch::serialize::InputArchive state_archive;
      if (!group_archive.try_read(param_key(j), state_archive)) {
        fits(param, options, int64_t{1});
        continue;
      }
      auto state = std::make_unique<State>();
      state->serialize(state_archive);
      prepare(*state, param, options);
      fits(param, options, state->step() + 1);
      loaded_state.emplace_back(param.unsafeGetTensorImpl(), std::move(state));
    }
    loaded_options.push_back(options);
  }

  // A parameter of another dtype than when saved means the parameters were reordered, unless the
  // whole model was converted to one dtype (Module::to) between save and load, as docs/options.md
  // suggests for moving to another dtype. Parameters of equal shape and dtype that swapped places
  // cannot be told apart (docs/options.md, "Errors change nothing").
  if (dtypes_here.size() > 1) {
    for (const auto& d : dtypes)
      TORCH_CHECK(d.saved == c10::toString(d.here), who, "::load: parameter ", d.position,
                  " of group ", d.group, " was ", d.saved, " when saved but is ", d.here,
                  " here (were the parameters reordered?); a checkpoint loads into the same "
                  "parameters in the same order, or into a model converted as a whole to one "
                  "dtype");
  }

  // Everything checked: commit.
  for (const auto i : c10::irange(groups.size()))
    groups[i].set_options(std::make_unique<Options>(loaded_options[i]));
  optimizer.state().clear();
  for (auto& [key, state] : loaded_state) optimizer.state()[key] = std::move(state);
  return loaded_counters;
}

// ----------------------------------------------------------------------------------------------
// Parameter digests: which parameter a checkpoint's state belongs to, beyond shape and position.
// save_param_digests() writes, per group, a digest of each parameter's dtype, shape and bytes;
// check_param_digests() (call it before load_checkpoint) rejects a checkpoint whose parameters were
// reordered or moved between groups since the save. Detection needs the model's weights as they
// were saved (loaded before the optimizer); when values changed, nothing can be told and the load
// goes on. Checkpoints without digests load unchecked.
// ----------------------------------------------------------------------------------------------

inline std::string digests_key(size_t group) {
  return group_key(group) + "_digests";
}

/// 64-bit digest of a tensor's dtype, shape and bytes (dtype and shape only for tensors without
/// data, e.g. on the meta device). Exact: equal digests for equal bytes on any machine; tensors on
/// other devices are read in chunks through the host.
inline int64_t param_digest(const at::Tensor& param) {
  uint64_t h = 0x9E3779B97F4A7C15ull;
  auto mix = [&h](uint64_t word) {
    word *= 0x87C37B91114253D5ull;
    word = (word << 31) | (word >> 33);
    h ^= word * 0x4CF5AD432745937Full;
    h = ((h << 27) | (h >> 37)) * 5 + 0x52DCE729ull;
  };
  mix(static_cast<uint64_t>(param.scalar_type()));
  mix(static_cast<uint64_t>(param.dim()));
  for (const int64_t size : param.sizes()) mix(static_cast<uint64_t>(size));
  if (!param.has_storage() || param.device().is_meta() || param.numel() == 0)
    return static_cast<int64_t>(h);
  const at::Tensor flat = param.detach().contiguous().view({-1});
  auto mix_bytes = [&](const at::Tensor& chunk) {  // a contiguous CPU tensor
    const auto* bytes = static_cast<const unsigned char*>(chunk.data_ptr());
    const size_t n = chunk.nbytes();
    size_t k = 0;
    for (; k + 8 <= n; k += 8) {
      uint64_t word;
      std::memcpy(&word, bytes + k, 8);
      mix(word);
    }
    uint64_t tail = 0;
    std::memcpy(&tail, bytes + k, n - k);
    mix(tail ^ (static_cast<uint64_t>(n - k) << 56));
  };
  if (flat.device().is_cpu()) {
    mix_bytes(flat);
  } else {
    constexpr int64_t chunk = int64_t{1} << 22;  // elements per host copy
    for (int64_t off = 0; off < flat.numel(); off += chunk)
      mix_bytes(flat.narrow(0, off, std::min(chunk, flat.numel() - off)).cpu());
  }
  return static_cast<int64_t>(h);
}

inline void save_param_digests(const torch::optim::Optimizer& optimizer,
                               torch::serialize::OutputArchive& archive) {
  for (const auto i : c10::irange(optimizer.param_groups().size())) {
    std::vector<int64_t> digests;
    for (const auto& param : optimizer.param_groups()[i].params())
      digests.push_back(param_digest(param));
    archive.write(digests_key(i), c10::IValue(digests));
  }
}

/// Throws, before anything changes, if some parameter now holds the bytes another position (in
/// any group) held when saved while that position's parameter no longer does: the parameters were
/// reordered or moved between groups. Groups without digests, or whose parameter count differs
/// (load_checkpoint reports that), are skipped.
inline void check_param_digests(const torch::optim::Optimizer& optimizer,
                                torch::serialize::InputArchive& archive, const char* who) {
  const auto& groups = optimizer.param_groups();
  std::vector<std::vector<int64_t>> saved(groups.size()), now(groups.size());
  std::map<int64_t, std::vector<std::pair<size_t, size_t>>> saved_at;
  for (const auto i : c10::irange(groups.size())) {
    c10::IValue value;
    if (!archive.try_read(digests_key(i), value) || !value.isIntList()) continue;
    auto digests = value.toIntVector();
    if (digests.size() != groups[i].params().size()) continue;
    saved[i] = std::move(digests);
    for (const auto j : c10::irange(saved[i].size())) {
      now[i].push_back(param_digest(groups[i].params()[j]));
      saved_at[saved[i][j]].emplace_back(i, j);
    }
  }
  for (const auto i : c10::irange(groups.size()))
    for (const auto j : c10::irange(saved[i].size())) {
      if (now[i][j] == saved[i][j]) continue;
      const auto it = saved_at.find(now[i][j]);
      if (it == saved_at.end()) continue;
      for (const auto& [k, l] : it->second)
        TORCH_CHECK(now[k][l] == saved[k][l], who, "::load: parameter ", j, " of group ", i,
                    " holds the values that parameter ", l, " of group ", k,
                    " had when the checkpoint was saved, and neither holds its own saved values: "
                    "the parameters were reordered (or moved between groups) since the save. Build "
                    "the optimizer with its groups and parameters in the order they were saved in");
    }
}

}  // namespace optim_detail
}  // namespace gwt
