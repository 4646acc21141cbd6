// Saving and loading delta adapters alone, and the training diagnostics of gwt::nn::DeltaLinear.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/util/irange.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/serialize.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <mutex>
#include <sstream>
#include <unordered_set>

#include "delta_linear_detail.h"
#include "gwt/nn/delta_linear.h"

namespace gwt {
namespace nn {

/// What load_delta_adapters sets that no public setter does: the saved scale.
struct DeltaLinearAccess {
  static void set_loaded(DeltaLinearImpl& layer, double scaling) { layer.set_scaling(scaling); }
};

namespace {

constexpr const char* k_format = "gwt.DeltaAdapters.v1";
constexpr const char* k_who = "gwt::nn::load_delta_adapters";

std::vector<std::pair<std::string, std::shared_ptr<DeltaLinearImpl>>> adapters_of(
    const torch::nn::Module& module) {
  std::vector<std::pair<std::string, std::shared_ptr<DeltaLinearImpl>>> out;
  for (const auto& item : module.named_modules("", /*include_self=*/false))
    if (auto a = std::dynamic_pointer_cast<DeltaLinearImpl>(item.value()))
      out.emplace_back(item.key(), a);
  return out;
}

c10::IValue read(torch::serialize::InputArchive& archive, const std::string& key,
                 const std::string& where) {
  c10::IValue v;
  TORCH_CHECK(archive.try_read(key, v), k_who, ": ", where, " has no '", key,
              "' entry; not written by gwt::nn::save_delta_adapters");
  return v;
}

int64_t read_int(torch::serialize::InputArchive& a, const std::string& key,
                 const std::string& where) {
  const auto v = read(a, key, where);
  TORCH_CHECK(v.isInt(), k_who, ": ", where, "'s '", key, "' is not an integer");
  return v.toInt();
}

double read_double(torch::serialize::InputArchive& a, const std::string& key,
                   const std::string& where) {
  const auto v = read(a, key, where);
  TORCH_CHECK(v.isDouble(), k_who, ": ", where, "'s '", key, "' is not a number");
  return v.toDouble();
}

bool read_bool(torch::serialize::InputArchive& a, const std::string& key,
               const std::string& where) {
  const auto v = read(a, key, where);
  TORCH_CHECK(v.isBool(), k_who, ": ", where, "'s '", key, "' is not a bool");
  return v.toBool();
}

// A saved tensor of the given shape, floating point and finite.
at::Tensor read_tensor(torch::serialize::InputArchive& a, const std::string& key,
                       const std::string& where, c10::IntArrayRef shape) {
  at::Tensor t;
  TORCH_CHECK(a.try_read(key, t), k_who, ": ", where, " has no tensor '", key, "'");
  TORCH_CHECK(t.sizes() == shape, k_who, ": ", where, "'s ", key, " has shape ", t.sizes(),
              " but its options need ", shape);
  TORCH_CHECK(t.is_floating_point(), k_who, ": ", where, "'s ", key, " is ", t.scalar_type(),
              " (floating point expected)");
  TORCH_CHECK(t.numel() == 0 || at::isfinite(t).all().item<bool>(), k_who, ": ", where, "'s ", key,
              " is not finite; the file is corrupt");
  return t;
}

}  // namespace

void save_delta_adapters(const torch::nn::Module& module,
                         torch::serialize::OutputArchive& archive) {
  const auto adapters = adapters_of(module);
  archive.write("format", c10::IValue(std::string(k_format)));
  archive.write("count", c10::IValue(static_cast<int64_t>(adapters.size())));
  for (const auto i : c10::irange(adapters.size())) {
    const auto& [name, a] = adapters[i];
    const auto& o = a->options();
    torch::serialize::OutputArchive entry;
    entry.write("name", c10::IValue(name));
    entry.write("in_features", c10::IValue(o.in_features()));
    entry.write("out_features", c10::IValue(o.out_features()));
    entry.write("rank", c10::IValue(o.rank()));
    entry.write("reflections", c10::IValue(o.reflections()));
    entry.write("orthogonal_core", c10::IValue(o.orthogonal_core()));
    entry.write("alpha", c10::IValue(o.alpha()));
    entry.write("gram_schmidt", c10::IValue(o.gram_schmidt()));
    entry.write("train_base", c10::IValue(o.train_base()));
    entry.write("scaling", c10::IValue(a->scaling()));
    // U and V of a rank-0 layer have no columns: nothing to write.
    for (const auto& [key, t] :
         {std::make_pair("U", &a->U), std::make_pair("V", &a->V),
          std::make_pair("reflection_vectors", &a->reflections), std::make_pair("core", &a->core)})
      if (t->defined() && t->numel() > 0) entry.write(key, t->detach());
    // A trained base belongs with the adapters trained on it.
    if (o.train_base()) {
      entry.write("base_weight", a->weight.detach());
      if (a->bias.defined()) entry.write("base_bias", a->bias.detach());
    }
    archive.write("adapter_" + std::to_string(i), entry);
  }
}

void save_delta_adapters(const torch::nn::Module& module, const std::string& path) {
  torch::serialize::OutputArchive archive;
  save_delta_adapters(module, archive);
  archive.save_to(path);
}

namespace {

// Building a replacement draws its start values (overwritten by the saved ones) from the default
// generator of its base's device; each such generator's state is put back, so that a load never
// shifts the caller's random stream, on the CPU or on a GPU.
class KeepGeneratorStates {
 public:
  KeepGeneratorStates() = default;
  KeepGeneratorStates(const KeepGeneratorStates&) = delete;
  KeepGeneratorStates& operator=(const KeepGeneratorStates&) = delete;
  // Records the state of `device`'s default generator, once, before its first draw.
  void keep(const at::Device& device) {
    for (const auto& k : kept_)
      if (k.device == device) return;
    at::Generator g = device.is_cpu() ? at::detail::getDefaultCPUGenerator()
                                      : at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(g.mutex());
    kept_.push_back({device, g, g.get_state()});
  }
  ~KeepGeneratorStates() {
    for (auto& k : kept_) {
      std::lock_guard<std::mutex> lock(k.generator.mutex());
      k.generator.set_state(k.state);
    }
  }

 private:
  struct Kept {
    at::Device device;
    at::Generator generator;
    at::Tensor state;
  };
  std::vector<Kept> kept_;
};

bool same_options(const DeltaLinearOptions& a, const DeltaLinearOptions& b) {
  return a.in_features() == b.in_features() && a.out_features() == b.out_features() &&
         a.rank() == b.rank() && a.reflections() == b.reflections() &&
         a.orthogonal_core() == b.orthogonal_core() && a.alpha() == b.alpha() &&
         a.gram_schmidt() == b.gram_schmidt() && a.train_base() == b.train_base();
}

// A Linear over the weight and bias tensors of `existing` (shared, not copied).
torch::nn::Linear base_of(const DeltaLinearImpl& existing) {
  auto linear = std::make_shared<torch::nn::LinearImpl>(
      torch::nn::LinearOptions(existing.options().in_features(), existing.options().out_features())
          .bias(existing.bias.defined()));
  at::NoGradGuard no_grad;
  linear->weight.set_data(existing.weight);
  if (existing.bias.defined()) linear->bias.set_data(existing.bias);
  return torch::nn::Linear(linear);
}

using Member = at::Tensor DeltaLinearImpl::*;
using Modules = torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>;

// A saved adapter read, built and checked: what the load changes of the model, once every adapter
// is.
struct Pending {
  std::string name;
  torch::nn::Module* parent;
  std::string child;
  DeltaLinear adapter;
  bool in_place;
  std::vector<std::pair<Member, at::Tensor>> values;  // converted to the adapter's dtypes
  double scaling;
};

// The Linear the adapter of layer `name` (`target`) is built over: the layer itself, or the base
// of the DeltaLinear it is (`existing`).
torch::nn::Linear base_for(const std::shared_ptr<torch::nn::Module>& target,
                           const std::shared_ptr<DeltaLinearImpl>& existing,
                           const std::string& name) {
  torch::nn::Linear base(nullptr);
  if (auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(target)) {
    base = torch::nn::Linear(linear);
  } else if (existing) {
    base = base_of(*existing);  // kept, if the layer is replaced
  } else {
    TORCH_CHECK(false, k_who, ": layer '", name, "' is a ", target->name(),
                ", not a torch::nn::Linear or gwt::nn::DeltaLinear");
  }
  return base;
}

// The options an adapter of a layer of `in` inputs and `out` outputs was saved with.
DeltaLinearOptions read_options(torch::serialize::InputArchive& entry, int64_t in, int64_t out,
                                const std::string& where) {
  DeltaLinearOptions o(in, out);
  o.rank(read_int(entry, "rank", where))
      .reflections(read_int(entry, "reflections", where))
      .orthogonal_core(read_bool(entry, "orthogonal_core", where))
      .alpha(read_double(entry, "alpha", where))
      .gram_schmidt(read_bool(entry, "gram_schmidt", where))
      .train_base(read_bool(entry, "train_base", where));
  return o;
}

// The trained base saved with an adapter (train_base), added to `values`.
void read_trained_base(torch::serialize::InputArchive& entry, const torch::nn::Linear& base,
                       int64_t in, int64_t out, const std::string& name, const std::string& where,
                       std::vector<std::pair<Member, at::Tensor>>& values) {
  // Archives written before the trained base was saved with its adapters have none: the
  // layer's base is left as it is, which is said. A fresh tensor for each look: try_read hands out
  // the archive's own tensor, and reading into a defined one would set_() that archive tensor (and
  // every alias of it) in place.
  auto has = [&](const char* key) {
    at::Tensor probe;
    return entry.try_read(key, probe);
  };
  if (has("base_weight")) {
    values.emplace_back(&DeltaLinearImpl::weight,
                        read_tensor(entry, "base_weight", where, {out, in}));
    const bool saved_bias = has("base_bias");
    TORCH_CHECK(saved_bias == base->bias.defined(), k_who, ": ", where, "'s trained base ",
                saved_bias ? "has" : "has no", " bias but layer '", name, "''s base ",
                base->bias.defined() ? "has one" : "has none");
    if (saved_bias)
      values.emplace_back(&DeltaLinearImpl::bias, read_tensor(entry, "base_bias", where, {out}));
  } else {
    TORCH_WARN(k_who, ": ", where,
               " was trained with its base (train_base) but saved without it; the base of "
               "layer '",
               name, "' is left as it is");
  }
}

// The tensors an adapter with options `o` over `base` was saved with.
std::vector<std::pair<Member, at::Tensor>> read_values(torch::serialize::InputArchive& entry,
                                                       const DeltaLinearOptions& o,
                                                       const torch::nn::Linear& base,
                                                       const std::string& name,
                                                       const std::string& where) {
  const int64_t in = o.in_features(), out = o.out_features();
  const int64_t k = o.rank(), r = o.reflections();
  // Tensors first (shape checks need valid counts; the constructor checks the ranges).
  TORCH_CHECK(k >= 0 && r >= 0 && k <= std::min(in, out) && r <= in, k_who, ": ", where,
              " has rank ", k, " and ", r, " reflections, invalid for in ", in, ", out ", out);
  std::vector<std::pair<Member, at::Tensor>> values;
  if (k > 0) {
    values.emplace_back(&DeltaLinearImpl::U, read_tensor(entry, "U", where, {out, k}));
    values.emplace_back(&DeltaLinearImpl::V, read_tensor(entry, "V", where, {in, k}));
    if (o.orthogonal_core())
      values.emplace_back(&DeltaLinearImpl::core, read_tensor(entry, "core", where, {k, k}));
  }
  if (r > 0)
    values.emplace_back(&DeltaLinearImpl::reflections,
                        read_tensor(entry, "reflection_vectors", where, {in, r}));
  if (o.train_base()) read_trained_base(entry, base, in, out, name, where, values);
  return values;
}

// The reflections must be defined as the forward computes them: a zero vector (with
// gram_schmidt, one that is zero once the ones before it are projected out) would make every
// output NaN, one whose norm overflows would be taken for the identity.
void check_reflections(const std::vector<std::pair<Member, at::Tensor>>& values,
                       const DeltaLinearOptions& o, const std::string& where) {
  for (const auto& [member, value] : values) {
    const bool core = member == &DeltaLinearImpl::core;
    if (!core && member != &DeltaLinearImpl::reflections) continue;
    const bool gram_schmidt = !core && o.gram_schmidt();
    TORCH_CHECK(detail::reflections_defined(value, gram_schmidt), k_who, ": ", where, "'s ",
                core ? "core" : "reflection",
                " vectors include one whose reflection cannot "
                "be computed in ",
                value.scalar_type(), " (",
                gram_schmidt ? "zero once the ones before it are projected out" : "a zero vector",
                ", or one whose norm under- or overflows); the file is corrupt");
  }
}

// Reads, builds and checks the archive's adapter `i` for `module` (whose modules are `modules`);
// changes nothing of the model. `names`: the adapters' names read so far; `frozen`: the bases a
// new adapter froze, with their requires_grad before; `keep_generators`: the generators it drew
// from.
Pending read_adapter(torch::serialize::InputArchive& archive, int64_t i, torch::nn::Module& module,
                     const Modules& modules, std::unordered_set<std::string>& names,
                     std::vector<std::pair<at::Tensor, bool>>& frozen,
                     KeepGeneratorStates& keep_generators) {
  torch::serialize::InputArchive entry;
  const std::string key = "adapter_" + std::to_string(i);
  TORCH_CHECK(archive.try_read(key, entry), k_who, ": ", key, " is missing; the file is corrupt");
  const auto name_value = read(entry, "name", key);
  TORCH_CHECK(name_value.isString(), k_who, ": ", key, "'s name is not a string");
  const std::string name = name_value.toStringRef();
  const std::string where = "adapter '" + name + "'";
  TORCH_CHECK(names.insert(name).second, k_who, ": ", where,
              " appears twice in the archive; the file is corrupt");
  const int64_t in = read_int(entry, "in_features", where),
                out = read_int(entry, "out_features", where);
  TORCH_CHECK(modules.contains(name), k_who, ": the module has no layer '", name,
              "' for the saved adapter");
  const auto& target = modules[name];
  const auto existing = std::dynamic_pointer_cast<DeltaLinearImpl>(target);
  torch::nn::Linear base = base_for(target, existing, name);
  TORCH_CHECK(base->weight.dim() == 2 && base->weight.size(0) == out && base->weight.size(1) == in,
              k_who, ": ", where, " was saved for a layer of weight [", out, ", ", in,
              "] but layer '", name, "' has weight ", base->weight.sizes());
  const DeltaLinearOptions o = read_options(entry, in, out, where);
  const double scaling = read_double(entry, "scaling", where);
  TORCH_CHECK(std::isfinite(scaling) && scaling >= 0, k_who, ": ", where, "'s scale ", scaling,
              " is invalid; the file is corrupt");
  std::vector<std::pair<Member, at::Tensor>> values = read_values(entry, o, base, name, where);
  const auto dot = name.rfind('.');
  torch::nn::Module* parent =
      dot == std::string::npos ? &module : modules[name.substr(0, dot)].get();
  const bool in_place = existing && same_options(existing->options(), o);
  if (!in_place && detail::runs_own_list(*parent))
    detail::refuse_layer_in_container(
        k_who, name, *parent,
        "load onto DeltaLinear layers with the saved options there (they take the values in "
        "place)");
  DeltaLinear adapter(nullptr);
  if (in_place) {
    adapter = DeltaLinear(existing);
  } else {
    frozen.emplace_back(base->weight, base->weight.requires_grad());
    if (base->bias.defined()) frozen.emplace_back(base->bias, base->bias.requires_grad());
    keep_generators.keep(base->weight.device());
    adapter = DeltaLinear(base, o);
  }
  for (auto& [member, value] : values) {
    const at::Tensor& t = (*adapter).*member;
    value = value.to(t.options()).contiguous();
  }
  check_reflections(values, o, where);
  std::string child = dot == std::string::npos ? name : name.substr(dot + 1);
  return {name, parent, std::move(child), adapter, in_place, std::move(values), scaling};
}

// Gives each adapter its values (and the model each new adapter); returns them.
std::vector<std::pair<std::string, DeltaLinear>> commit(std::vector<Pending>& pending) {
  std::vector<std::pair<std::string, DeltaLinear>> loaded;
  for (auto& p : pending) {
    {
      at::NoGradGuard no_grad;
      for (auto& [member, value] : p.values) {
        at::Tensor& t = (*p.adapter).*member;
        t.copy_(value);
        t.mutable_grad() = at::Tensor();  // a gradient of the values it held is stale
      }
    }
    DeltaLinearAccess::set_loaded(*p.adapter, p.scaling);
    if (!p.in_place) p.parent->replace_module(p.child, p.adapter.ptr());
    loaded.emplace_back(p.name, p.adapter);
  }
  return loaded;
}

}  // namespace

std::vector<std::pair<std::string, DeltaLinear>> load_delta_adapters(
    torch::nn::Module& module, torch::serialize::InputArchive& archive) {
  c10::IValue format;
  TORCH_CHECK(
      archive.try_read("format", format) && format.isString() && format.toStringRef() == k_format,
      k_who, ": not a ", k_format, " archive (written by gwt::nn::save_delta_adapters)");
  const int64_t count = read_int(archive, "count", "the archive");
  TORCH_CHECK(count >= 0, k_who, ": a negative adapter count; the file is corrupt");
  const auto modules = module.named_modules("", /*include_self=*/false);

  // Everything is read, built and checked first; the model changes only at the end. A layer that
  // is already a DeltaLinear with the saved options takes the saved values in place (its
  // parameters keep their identity, so an optimizer over the model keeps working, and a container
  // that runs its own list of modules runs it); any other layer is replaced by a new DeltaLinear
  // over its base.
  std::vector<Pending> pending;
  // Building an adapter freezes its base: on any error every base gets its requires_grad back (in
  // reverse order, so that a base two entries share gets the value it had before the first).
  std::vector<std::pair<at::Tensor, bool>> frozen;
  std::unordered_set<std::string> names;
  KeepGeneratorStates keep_generators;
  try {
    for (const auto i : c10::irange(count))
      pending.push_back(read_adapter(archive, i, module, modules, names, frozen, keep_generators));
  } catch (...) {
    for (auto it = frozen.rbegin(); it != frozen.rend(); ++it) it->first.requires_grad_(it->second);
    throw;
  }
  return commit(pending);
}

std::vector<std::pair<std::string, DeltaLinear>> load_delta_adapters(
    torch::nn::Module& module, const std::string& path, std::optional<at::Device> device) {
  torch::serialize::InputArchive archive;
  archive.load_from(path, device);
  return load_delta_adapters(module, archive);
}

// ----------------------------------------------------------------------------------------------
// Diagnostics
// ----------------------------------------------------------------------------------------------

std::string DeltaDiagnostics::summary() const {
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  int64_t outside = 0, with_ratio = 0;
  for (const auto& l : layers) {
    if (!std::isfinite(l.ratio)) continue;
    ++with_ratio;
    lo = std::min(lo, l.ratio), hi = std::max(hi, l.ratio);
    if (l.ratio < 0.1 || l.ratio > 10) ++outside;
  }
  char line[256];
  if (with_ratio > 0)
    std::snprintf(line, sizeof line,
                  "%zu adapters, orthogonality error <= %.1e, ||grad U||/||grad W|| %.3g..%.3g "
                  "(%lld outside 0.1..10), grad norm %.3g%s",
                  layers.size(), max_orthogonality_error, lo, hi, static_cast<long long>(outside),
                  grad_norm, clipped ? " (clipped)" : "");
  else
    std::snprintf(line, sizeof line,
                  "%zu adapters, orthogonality error <= %.1e, no low-rank ratio, grad norm %.3g%s",
                  layers.size(), max_orthogonality_error, grad_norm, clipped ? " (clipped)" : "");
  return line;
}

DeltaDiagnostics delta_diagnostics(torch::nn::Module& module,
                                   const std::function<at::Tensor()>& loss, double clip_norm) {
  TORCH_CHECK(loss != nullptr, "gwt::nn::delta_diagnostics needs a loss function");
  TORCH_CHECK(std::isfinite(clip_norm), "gwt::nn::delta_diagnostics: clip_norm must be finite");
  const auto adapters = adapters_of(module);
  // The trainable set, before the frozen base weights are made trainable for the measurement.
  std::vector<at::Tensor> trainable;
  for (const auto& p : module.parameters())
    if (p.requires_grad()) trainable.push_back(p);
  std::vector<at::Tensor> thawed;
  for (const auto& [name, a] : adapters)
    if (!a->weight.requires_grad()) thawed.push_back(a->weight);
  for (auto& w : thawed) w.requires_grad_(true), w.mutable_grad() = at::Tensor();
  auto restore = [&] {
    for (auto& w : thawed) w.mutable_grad() = at::Tensor(), w.requires_grad_(false);
  };
  DeltaDiagnostics d;
  try {
    for (auto& p : trainable)
      if (p.grad().defined()) p.mutable_grad().zero_();
    loss().backward();
    auto norm = [](const at::Tensor& t) {
      return t.defined() && t.grad().defined() ? t.grad().norm().item<double>() : 0.0;
    };
    for (const auto& [name, a] : adapters) {
      DeltaDiagnostics::Layer l;
      l.name = name;
      l.orthogonality = a->orthogonality_error();
      l.grad_u = norm(a->U), l.grad_v = norm(a->V), l.grad_w = norm(a->weight);
      l.ratio = a->U.defined() && l.grad_w > 0 ? l.grad_u / l.grad_w
                                               : std::numeric_limits<double>::quiet_NaN();
      d.max_orthogonality_error =
          std::max({d.max_orthogonality_error, l.orthogonality.reflections, l.orthogonality.core});
      d.layers.push_back(l);
    }
  } catch (...) {
    restore();
    throw;
  }
  restore();
  d.clip_norm = clip_norm;
  std::vector<at::Tensor> with_grad;
  for (auto& p : trainable)
    if (p.grad().defined()) with_grad.push_back(p);
  if (!with_grad.empty()) {
    d.grad_norm = clip_norm > 0 ? torch::nn::utils::clip_grad_norm_(with_grad, clip_norm)
                                : torch::nn::utils::clip_grad_norm_(
                                      with_grad, std::numeric_limits<double>::infinity());
    d.clipped = clip_norm > 0 && d.grad_norm > clip_norm;
  }
  return d;
}

}  // namespace nn
}  // namespace gwt
