// Delta adapters over whole models: DeltaLinear layers put in place of a model's Linear layers and
// merged back, forwards that take any of the three linear layers, and the optimizer groups of a
// model's adapter parameters.

#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "delta_linear_detail.h"
#include "gwt/nn/delta_linear.h"
#include "gwt/nn/low_rank_linear.h"

namespace gwt {
namespace nn {

namespace detail {

bool runs_own_list(const torch::nn::Module& module) {
  return dynamic_cast<const torch::nn::SequentialImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::ModuleListImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::ModuleDictImpl*>(&module) != nullptr;
}

void refuse_layer_in_container(const char* who, const std::string& layer,
                               const torch::nn::Module& container, const char* instead) {
  // "torch::nn::SequentialImpl": the holder's name reads better.
  std::string type = container.name();
  if (type.size() > 4 && type.compare(type.size() - 4, 4, "Impl") == 0)
    type.resize(type.size() - 4);
  TORCH_CHECK(false, who, ": layer '", layer, "' is inside a ", type,
              ", which runs its own list of modules that replace_module cannot change (the layer "
              "would be replaced in name only, and left out of the forward); ",
              instead, "; nothing was changed");
}

}  // namespace detail

// ----------------------------------------------------------------------------------------------
// Whole models
// ----------------------------------------------------------------------------------------------

namespace {

int64_t merge_adapters(torch::nn::Module& parent) {
  int64_t merged = 0;
  for (const auto& item : parent.named_children()) {
    if (auto adapter = std::dynamic_pointer_cast<DeltaLinearImpl>(item.value())) {
      parent.replace_module(item.key(), adapter->merge().ptr());
      ++merged;
    } else {
      merged += merge_adapters(*item.value());
    }
  }
  return merged;
}

}  // namespace

std::vector<std::pair<std::string, DeltaLinear>> add_delta_adapters(
    torch::nn::Module& module, const DeltaLinearOptions& options, const NameFilter& filter) {
  constexpr const char* who = "gwt::nn::add_delta_adapters";
  TORCH_CHECK(options.rank() >= 0 && options.reflections() >= 0, who,
              ": rank and reflections must be >= 0, got ", options.rank(), " and ",
              options.reflections());
  // Every layer is checked as its DeltaLinear constructor will check it before any is replaced, so
  // that a layer that cannot take the options leaves the model as it was; the filter is asked once
  // per layer.
  struct Target {
    std::string name;
    torch::nn::Module* parent;
    std::string child;
    std::shared_ptr<torch::nn::LinearImpl> linear;
    DeltaLinearOptions options;
  };
  std::vector<Target> targets;
  const auto modules = module.named_modules("", /*include_self=*/false);
  for (const auto& item : modules) {
    auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(item.value());
    if (!linear || (filter && !filter(item.key()))) continue;
    const auto dot = item.key().rfind('.');
    torch::nn::Module* parent =
        dot == std::string::npos ? &module : modules[item.key().substr(0, dot)].get();
    if (detail::runs_own_list(*parent))
      detail::refuse_layer_in_container(
          who, item.key(), *parent,
          "build the container from DeltaLinear layers instead, or leave the layer out with the "
          "filter");
    const auto& w = linear->weight;
    TORCH_CHECK(w.defined() && w.dim() == 2 && options.rank() <= std::min(w.size(0), w.size(1)) &&
                    options.reflections() <= w.size(1),
                who, ": layer '", item.key(), "' of weight ",
                w.defined() ? w.sizes() : c10::IntArrayRef{}, " cannot take rank ", options.rank(),
                " and ", options.reflections(),
                " reflections (rank <= min(in, out), reflections <= in); nothing was replaced");
    DeltaLinearOptions o = options;
    o.in_features(w.size(1)).out_features(w.size(0));
    detail::check_base(std::string(who) + ": layer '" + item.key() + "'", w, linear->bias, o);
    targets.push_back({item.key(), parent,
                       dot == std::string::npos ? item.key() : item.key().substr(dot + 1), linear,
                       o});
  }
  std::vector<std::pair<std::string, DeltaLinear>> out;
  for (const auto& t : targets) {
    DeltaLinear adapter(torch::nn::Linear(t.linear), t.options);
    t.parent->replace_module(t.child, adapter.ptr());
    out.emplace_back(t.name, adapter);
  }
  return out;
}

int64_t merge_delta_adapters(torch::nn::Module& module) {
  // Checked before anything is merged: a container that runs its own list would keep running the
  // adapter.
  const auto modules = module.named_modules("", /*include_self=*/false);
  for (const auto& item : modules) {
    if (!std::dynamic_pointer_cast<DeltaLinearImpl>(item.value())) continue;
    const auto dot = item.key().rfind('.');
    const torch::nn::Module& parent =
        dot == std::string::npos ? module : *modules[item.key().substr(0, dot)];
    if (detail::runs_own_list(parent))
      detail::refuse_layer_in_container(
          "gwt::nn::merge_delta_adapters", item.key(), parent,
          "build the container again from each adapter's merge() (DeltaLinear::merge)");
  }
  return merge_adapters(module);
}

at::Tensor linear_forward(torch::nn::Module& layer, const at::Tensor& x) {
  if (auto* l = dynamic_cast<torch::nn::LinearImpl*>(&layer)) return l->forward(x);
  if (auto* d = dynamic_cast<DeltaLinearImpl*>(&layer)) return d->forward(x);
  if (auto* r = dynamic_cast<LowRankLinearImpl*>(&layer)) return r->forward(x);
  TORCH_CHECK(false, "gwt::nn::linear_forward: a ", layer.name(),
              " is not a torch::nn::Linear, gwt::nn::DeltaLinear or gwt::nn::LowRankLinear");
}

at::Tensor child_forward(torch::nn::Module& parent, const std::string& name, const at::Tensor& x) {
  const auto children = parent.named_children();
  TORCH_CHECK(children.contains(name), "gwt::nn::child_forward: ", parent.name(), " has no child '",
              name, "'");
  return linear_forward(*children[name], x);
}

std::vector<torch::optim::OptimizerParamGroup> delta_param_groups(
    const torch::nn::Module& module, double lr,
    const std::function<std::unique_ptr<torch::optim::OptimizerOptions>(double lr)>& make_options,
    const DeltaLrMultipliers& multipliers) {
  TORCH_CHECK(make_options != nullptr, "gwt::nn::delta_param_groups needs make_options");
  // The adapter parameters of DeltaLinear submodules, by identity: a parameter of another module
  // that happens to be named U, V, core or reflections is a base parameter.
  enum class Part { low_rank, reflections, core };
  std::unordered_map<const void*, Part> parts;
  auto note = [&](const torch::nn::Module& m) {
    const auto* a = dynamic_cast<const DeltaLinearImpl*>(&m);
    if (a == nullptr) return;
    for (const at::Tensor* t : {&a->U, &a->V})
      if (t->defined()) parts[t->unsafeGetTensorImpl()] = Part::low_rank;
    if (a->reflections.defined()) parts[a->reflections.unsafeGetTensorImpl()] = Part::reflections;
    if (a->core.defined()) parts[a->core.unsafeGetTensorImpl()] = Part::core;
  };
  note(module);
  for (const auto& m : module.modules(/*include_self=*/false)) note(*m);
  std::vector<at::Tensor> base, low_rank, refl, core;
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    if (!p.requires_grad()) continue;
    const auto it = parts.find(p.unsafeGetTensorImpl());
    if (it == parts.end())
      base.push_back(p);
    else if (it->second == Part::low_rank)
      low_rank.push_back(p);
    else if (it->second == Part::reflections)
      refl.push_back(p);
    else
      core.push_back(p);
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const auto& [params, mult] :
       {std::make_pair(&base, multipliers.base), std::make_pair(&low_rank, multipliers.low_rank),
        std::make_pair(&refl, multipliers.reflections), std::make_pair(&core, multipliers.core)}) {
    if (params->empty()) continue;
    groups.emplace_back(*params, make_options(lr * mult));
  }
  return groups;
}

}  // namespace nn
}  // namespace gwt
