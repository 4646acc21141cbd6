#pragma once

// The checkpoint layout shared by gwt's optimizers (internal): the format name, named counters,
// and per group its options and its parameters' shapes and state by position. Loading reads and
// checks everything before anything changes, so a checkpoint that does not fit is an error that
// leaves the optimizer as it was.

#include <c10/util/irange.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common.h"

namespace gwt {
namespace optim_detail {

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
/// if it does not fit) and moves it to the parameter's device and dtypes. Returns the counters.
template <typename Options, typename State, typename Prepare>
std::map<std::string, int64_t> load_checkpoint(torch::optim::Optimizer& optimizer,
                                               torch::serialize::InputArchive& archive,
                                               const std::string& format,
                                               const std::vector<std::string>& counters,
                                               const char* who, Prepare&& prepare) {
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
  for (const auto& name : counters)
    loaded_counters[name] = read_value(archive, name, what, who).toInt();

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
      torch::serialize::InputArchive state_archive;
      if (!group_archive.try_read(param_key(j), state_archive)) continue;
      auto state = std::make_unique<State>();
      state->serialize(state_archive);
      prepare(*state, param, options);
      loaded_state.emplace_back(param.unsafeGetTensorImpl(), std::move(state));
    }
    loaded_options.push_back(options);
  }

  // Everything checked: commit.
  for (const auto i : c10::irange(groups.size()))
    groups[i].set_options(std::make_unique<Options>(loaded_options[i]));
  optimizer.state().clear();
  for (auto& [key, state] : loaded_state) optimizer.state()[key] = std::move(state);
  return loaded_counters;
}

}  // namespace optim_detail
}  // namespace gwt
