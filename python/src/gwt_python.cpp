// gwt._C: the Python binding of gwt (one translation unit: each one that includes LibTorch's Python
// headers costs half a minute to compile).
//
// The optimizers' state lives in Python (torch.optim.Optimizer's `state` and `param_groups`, so
// that state_dict(), torch.save and LR schedulers work as with any torch optimizer). Each step
// builds a gwt::WaveletAdam (or gwt::GaLoreAdam) over the same parameter tensors, puts
// per-parameter states that share the Python state's tensors into its state() map, runs its step()
// (the C++ kernels update parameters and moments in place, no copies) and writes the state back:
// the step count, and the tensors the step replaced (the limiter norm, fresh moments at a first
// step, new GaLore projectors). Building the optimizer costs microseconds per parameter
// (python/gwt/bench.py measures the whole step).

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/nn/modules/linear.h>
#include <torch/serialize.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <array>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gwt/kernels.h"
#include "gwt/nn/delta_linear.h"
#include "gwt/optim/galore_adam.h"
#include "gwt/optim/wavelet_adam.h"
#include "gwt/transform.h"
#include "gwt/version.h"
#include "gwt/wavelet.h"

namespace py = pybind11;

namespace {

// ------------------------------------------------------------------------------------------------
// Arguments
// ------------------------------------------------------------------------------------------------

// A c10::Error raised by checking a caller's argument, as the ValueError Python code expects from
// bad arguments (torch.optim raises ValueError for a bad lr), with the same message.
template <typename F>
auto as_value_error(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    throw py::value_error(e.what_without_backtrace());
  }
}

gwt::Wavelet wavelet_of(const std::string& name) {
  return as_value_error([&] { return gwt::Wavelet(name); });
}

gwt::BoundaryMode mode_of(const std::string& name) {
  return as_value_error([&] { return gwt::boundary_mode_from_string(name); });
}

// An option of a parameter group, with a TypeError naming it when it has the wrong type.
template <typename T>
T option(const py::dict& group, const char* key, const char* type_name) {
  if (!group.contains(key))
    throw py::key_error(std::string("gwt: a parameter group has no '") + key + "' option");
  py::object value = group[key];
  // bool is an int to Python: refuse it where a number is meant, and numbers where a bool is.
  constexpr bool want_bool = std::is_same_v<T, bool>;
  if (!want_bool && PyBool_Check(value.ptr()))
    throw py::type_error(std::string("gwt: option '") + key + "' must be " + type_name +
                         ", got a bool");
  if (want_bool && !PyBool_Check(value.ptr()))
    throw py::type_error(std::string("gwt: option '") + key + "' must be " + type_name + ", got " +
                         std::string(py::str(py::type::of(value).attr("__name__"))));
  try {
    return value.cast<T>();
  } catch (const py::cast_error&) {
    throw py::type_error(std::string("gwt: option '") + key + "' must be " + type_name + ", got " +
                         std::string(py::str(py::type::of(value).attr("__name__"))));
  }
}

std::tuple<double, double> betas_option(const py::dict& group) {
  if (!group.contains("betas")) throw py::key_error("gwt: a parameter group has no 'betas' option");
  py::object value = group["betas"];
  if (!py::isinstance<py::sequence>(value) || py::isinstance<py::str>(value) || py::len(value) != 2)
    throw py::type_error("gwt: option 'betas' must be a pair of floats (beta1, beta2)");
  py::sequence s = value;
  try {
    return {s[0].cast<double>(), s[1].cast<double>()};
  } catch (const py::cast_error&) {
    throw py::type_error("gwt: option 'betas' must be a pair of floats (beta1, beta2)");
  }
}

int64_t int_value(const py::handle& value, const char* what) {
  if (PyBool_Check(value.ptr()) || !(PyLong_Check(value.ptr()) || PyIndex_Check(value.ptr())))
    throw py::type_error(std::string("gwt: ") + what + " must be an int");
  return py::cast<int64_t>(value);
}

at::Tensor tensor_value(const py::handle& value, const char* what) {
  if (!THPVariable_Check(value.ptr()))
    throw py::type_error(std::string("gwt: ") + what + " must be a torch.Tensor");
  return THPVariable_Unpack(value.ptr());
}

// ------------------------------------------------------------------------------------------------
// The two optimizers: options, state and counters between Python dicts and C++
// ------------------------------------------------------------------------------------------------

// What the two optimizers' per-parameter states share: Adam's step count and moments.
template <typename State>
std::unique_ptr<State> adam_state_from(const py::dict& d) {
  auto s = std::make_unique<State>();
  if (d.contains("step")) s->step(int_value(d["step"], "state 'step'"));
  if (d.contains("exp_avg")) s->exp_avg(tensor_value(d["exp_avg"], "state 'exp_avg'"));
  if (d.contains("exp_avg_sq")) s->exp_avg_sq(tensor_value(d["exp_avg_sq"], "state 'exp_avg_sq'"));
  return s;
}

template <typename State>
void adam_state_to(const State& s, py::dict& d) {
  d["step"] = s.step();
  d["exp_avg"] = s.exp_avg();
  d["exp_avg_sq"] = s.exp_avg_sq();
}

struct WaveletAdamTraits {
  using Optimizer = gwt::WaveletAdam;
  using Options = gwt::WaveletAdamOptions;
  using State = gwt::WaveletAdamParamState;

  static Options options_from(const py::dict& g) {
    Options o;
    o.lr(option<double>(g, "lr", "a float"))
        .betas(betas_option(g))
        .eps(option<double>(g, "eps", "a float"))
        .weight_decay(option<double>(g, "weight_decay", "a float"))
        .wavelet(option<std::string>(g, "wavelet", "a str"))
        .level(option<int64_t>(g, "level", "an int"))
        .boundary(option<std::string>(g, "boundary", "a str"))
        .scale(option<double>(g, "scale", "a float"))
        .norm_growth_limit(option<double>(g, "norm_growth_limit", "a float"))
        .correct_bias(option<bool>(g, "correct_bias", "a bool"))
        .dim(option<int64_t>(g, "dim", "an int"))
        .fused(option<bool>(g, "fused", "a bool"))
        .state_dtype(option<std::string>(g, "state_dtype", "a str"))
        .transform(option<std::string>(g, "transform", "a str"))
        .threshold(option<double>(g, "threshold", "a float"))
        .threshold_mode(option<std::string>(g, "threshold_mode", "a str"))
        .min_size(option<int64_t>(g, "min_size", "an int"))
        .nonfinite(option<std::string>(g, "nonfinite", "a str"));
    return o;
  }

  static void options_to(const Options& o, py::dict& g) {
    g["lr"] = o.lr();
    g["betas"] = py::make_tuple(std::get<0>(o.betas()), std::get<1>(o.betas()));
    g["eps"] = o.eps();
    g["weight_decay"] = o.weight_decay();
    g["wavelet"] = o.wavelet();
    g["level"] = o.level();
    g["boundary"] = o.boundary();
    g["scale"] = o.scale();
    g["norm_growth_limit"] = o.norm_growth_limit();
    g["correct_bias"] = o.correct_bias();
    g["dim"] = o.dim();
    g["fused"] = o.fused();
    g["state_dtype"] = o.state_dtype();
    g["transform"] = o.transform();
    g["threshold"] = o.threshold();
    g["threshold_mode"] = o.threshold_mode();
    g["min_size"] = o.min_size();
    g["nonfinite"] = o.nonfinite();
  }

  static std::unique_ptr<State> state_from(const py::dict& d) {
    auto s = adam_state_from<State>(d);
    if (d.contains("norm") && !d["norm"].is_none())
      s->norm(tensor_value(d["norm"], "state 'norm'"));
    if (d.contains("skipped")) s->skipped(int_value(d["skipped"], "state 'skipped'"));
    // The thresholding report of the parameter's last thresholded step (not in C++ checkpoints).
    if (d.contains("kept_details") && d.contains("total_details")) {
      s->kept_details(int_value(d["kept_details"], "state 'kept_details'"));
      s->total_details(int_value(d["total_details"], "state 'total_details'"));
    }
    return s;
  }

  static void state_to(const State& s, py::dict& d) {
    adam_state_to(s, d);
    if (s.norm().defined())
      d["norm"] = s.norm();
    else if (d.contains("norm"))
      PyDict_DelItemString(d.ptr(), "norm");
    d["skipped"] = s.skipped();
    if (s.total_details() >= 0) {
      d["kept_details"] = s.kept_details();
      d["total_details"] = s.total_details();
    } else {
      for (const char* key : {"kept_details", "total_details"})
        if (d.contains(key)) PyDict_DelItemString(d.ptr(), key);
    }
  }

  static std::map<std::string, int64_t> counters(const Optimizer& opt) {
    return {{"skipped_steps", opt.skipped_steps()}};
  }
};

struct GaLoreAdamTraits {
  using Optimizer = gwt::GaLoreAdam;
  using Options = gwt::GaLoreAdamOptions;
  using State = gwt::GaLoreAdamParamState;

  static Options options_from(const py::dict& g) {
    Options o;
    o.lr(option<double>(g, "lr", "a float"))
        .betas(betas_option(g))
        .eps(option<double>(g, "eps", "a float"))
        .weight_decay(option<double>(g, "weight_decay", "a float"))
        .rank(option<int64_t>(g, "rank", "an int"))
        .update_proj_gap(option<int64_t>(g, "update_proj_gap", "an int"))
        .scale(option<double>(g, "scale", "a float"))
        .proj_type(option<std::string>(g, "proj_type", "a str"))
        .svd(option<std::string>(g, "svd", "a str"))
        .oversample(option<int64_t>(g, "oversample", "an int"))
        .power_iters(option<int64_t>(g, "power_iters", "an int"))
        .correct_bias(option<bool>(g, "correct_bias", "a bool"));
    return o;
  }

  static void options_to(const Options& o, py::dict& g) {
    g["lr"] = o.lr();
    g["betas"] = py::make_tuple(std::get<0>(o.betas()), std::get<1>(o.betas()));
    g["eps"] = o.eps();
    g["weight_decay"] = o.weight_decay();
    g["rank"] = o.rank();
    g["update_proj_gap"] = o.update_proj_gap();
    g["scale"] = o.scale();
    g["proj_type"] = o.proj_type();
    g["svd"] = o.svd();
    g["oversample"] = o.oversample();
    g["power_iters"] = o.power_iters();
    g["correct_bias"] = o.correct_bias();
  }

  static std::unique_ptr<State> state_from(const py::dict& d) {
    auto s = adam_state_from<State>(d);
    if (d.contains("projector") && !d["projector"].is_none())
      s->projector(tensor_value(d["projector"], "state 'projector'"));
    if (d.contains("right")) {
      py::object right = d["right"];
      if (!PyBool_Check(right.ptr())) throw py::type_error("gwt: state 'right' must be a bool");
      s->right(right.cast<bool>());
    }
    return s;
  }

  static void state_to(const State& s, py::dict& d) {
    adam_state_to(s, d);
    if (s.projector().defined())
      d["projector"] = s.projector();
    else if (d.contains("projector"))
      PyDict_DelItemString(d.ptr(), "projector");
    d["right"] = s.right();
  }

  static std::map<std::string, int64_t> counters(const Optimizer& opt) {
    return {{"skipped_steps", opt.skipped_steps()}, {"svd_fallbacks", opt.svd_fallbacks()}};
  }
};

// ------------------------------------------------------------------------------------------------
// A C++ optimizer over the Python groups and state
// ------------------------------------------------------------------------------------------------

template <typename Traits>
struct Engine {
  std::unique_ptr<typename Traits::Optimizer> optimizer;
  std::vector<py::object> param_objects;  // the Python parameters, group by group
  std::vector<at::Tensor> params;         // the same tensors
};

// The optimizer over `groups` (torch.optim param_groups: dicts with "params" and the options), with
// the state of `state` (a dict keyed by parameter; may be None) in its state() map, sharing the
// tensors.
template <typename Traits>
Engine<Traits> build(const py::list& groups, const py::object& state) {
  Engine<Traits> engine;
  std::vector<torch::optim::OptimizerParamGroup> cpp_groups;
  cpp_groups.reserve(groups.size());
  for (const py::handle& group_handle : groups) {
    if (!py::isinstance<py::dict>(group_handle))
      throw py::type_error("gwt: each parameter group must be a dict");
    const py::dict group = py::reinterpret_borrow<py::dict>(group_handle);
    if (!group.contains("params")) throw py::key_error("gwt: a parameter group has no 'params'");
    std::vector<at::Tensor> tensors;
    for (const py::handle& p : py::list(group["params"])) {
      tensors.push_back(tensor_value(p, "each parameter"));
      engine.param_objects.push_back(py::reinterpret_borrow<py::object>(p));
      engine.params.push_back(tensors.back());
    }
    cpp_groups.emplace_back(std::move(tensors), std::make_unique<typename Traits::Options>(
                                                    Traits::options_from(group)));
  }
  engine.optimizer = std::make_unique<typename Traits::Optimizer>(std::move(cpp_groups));
  if (state.is_none()) return engine;
  if (!py::isinstance<py::dict>(state)) throw py::type_error("gwt: the state must be a dict");
  for (size_t k = 0; k < engine.params.size(); ++k) {
    // PyDict_GetItemWithError: no defaultdict entry is made for parameters without state.
    PyObject* entry = PyDict_GetItemWithError(state.ptr(), engine.param_objects[k].ptr());
    if (entry == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      continue;
    }
    if (!PyDict_Check(entry)) throw py::type_error("gwt: a parameter's state must be a dict");
    const py::dict d = py::reinterpret_borrow<py::dict>(entry);
    if (d.empty()) continue;
    engine.optimizer->state()[engine.params[k].unsafeGetTensorImpl()] = Traits::state_from(d);
  }
  return engine;
}

// Writes the C++ state of every parameter that has one into `state` (a dict keyed by parameter:
// the parameter's dict is updated in place, or made).
template <typename Traits>
void write_state(const Engine<Traits>& engine, const py::object& state) {
  const auto& cpp_state = engine.optimizer->state();
  for (size_t k = 0; k < engine.params.size(); ++k) {
    auto it = cpp_state.find(engine.params[k].unsafeGetTensorImpl());
    if (it == cpp_state.end()) continue;
    const auto& s = static_cast<const typename Traits::State&>(*it->second);
    PyObject* entry = PyDict_GetItemWithError(state.ptr(), engine.param_objects[k].ptr());
    if (entry == nullptr && PyErr_Occurred()) throw py::error_already_set();
    py::dict d = entry != nullptr && PyDict_Check(entry) ? py::reinterpret_borrow<py::dict>(entry)
                                                         : py::dict();
    Traits::state_to(s, d);
    if (entry == nullptr || entry != d.ptr())
      if (PyObject_SetItem(state.ptr(), engine.param_objects[k].ptr(), d.ptr()) != 0)
        throw py::error_already_set();
  }
}

py::dict counters_dict(const std::map<std::string, int64_t>& counters) {
  py::dict out;
  for (const auto& [name, value] : counters) out[py::str(name)] = value;
  return out;
}

// One step: returns the counters' increments ({"skipped_steps": 0 or 1, ...}).
template <typename Traits>
py::dict step(const py::list& groups, const py::object& state) {
  Engine<Traits> engine = build<Traits>(groups, state);
  std::exception_ptr failure;
  {
    py::gil_scoped_release no_gil;
    try {
      engine.optimizer->step();
    } catch (...) {
      failure = std::current_exception();
    }
  }
  // A step that failed partway (out of memory, say, after some parameters were updated) has moved
  // those parameters' moments in place: their step counts and limiter norms go back to Python too,
  // as the C++ optimizer keeps them, before the error is raised. (An error found by the checks
  // before any update writes back the state unchanged.)
  write_state(engine, state);
  if (failure) std::rethrow_exception(failure);
  return counters_dict(Traits::counters(*engine.optimizer));
}

// Construction-time check of one group (options and parameters), as a ValueError.
template <typename Traits>
void check_group(const py::dict& group) {
  py::list groups;
  groups.append(group);
  as_value_error([&] { return build<Traits>(groups, py::none()).params.size(); });
}

// The C++ checkpoint (what torch::save(optimizer, path) writes) of the Python groups and state: to
// `path`, or returned as bytes when path is None.
template <typename Traits>
py::object save_archive(const py::list& groups, const py::object& state,
                        const std::map<std::string, int64_t>& counters,
                        const std::optional<std::string>& path) {
  Engine<Traits> engine = build<Traits>(groups, state);
  torch::serialize::OutputArchive archive;
  engine.optimizer->save(archive);
  // The counters of this run (the engine's own are zero): an archive entry written again takes the
  // new value.
  for (const auto& [name, value] : counters) archive.write(name, c10::IValue(value));
  if (path) {
    archive.save_to(*path);
    return py::none();
  }
  std::ostringstream out;
  archive.save_to(out);
  return py::bytes(out.str());
}

// Loads a C++ checkpoint (a path, or bytes from save_archive) into a C++ optimizer over `groups`
// (which checks all of it first: shapes, dtypes, finite values, parameter order) and returns what
// Python keeps: the options of each group (list of dicts), the state of each parameter with one
// (list, None for none), and the counters.
template <typename Traits>
py::tuple load_archive(const py::list& groups, const py::object& source) {
  Engine<Traits> engine = build<Traits>(groups, py::none());
  torch::serialize::InputArchive archive;
  if (py::isinstance<py::bytes>(source)) {
    const std::string data = source.cast<std::string>();
    archive.load_from(data.data(), data.size());
  } else {
    archive.load_from(py::str(source).cast<std::string>());
  }
  engine.optimizer->load(archive);
  py::list options;
  for (const auto& group : engine.optimizer->param_groups()) {
    py::dict d;
    Traits::options_to(static_cast<const typename Traits::Options&>(group.options()), d);
    options.append(d);
  }
  py::list states;
  const auto& cpp_state = engine.optimizer->state();
  for (const auto& param : engine.params) {
    auto it = cpp_state.find(param.unsafeGetTensorImpl());
    if (it == cpp_state.end()) {
      states.append(py::none());
      continue;
    }
    py::dict d;
    Traits::state_to(static_cast<const typename Traits::State&>(*it->second), d);
    states.append(d);
  }
  return py::make_tuple(options, states, counters_dict(Traits::counters(*engine.optimizer)));
}

// Test helper, a code path of its own: one C++ optimizer that keeps its state in C++ across
// `grads.size()` steps (grads[t][k]: the gradient of parameter k, group by group, at step t; None
// leaves it without a gradient), optionally loaded from and saved to C++ checkpoints. Returns the
// final state of each parameter (None for none) and the counters.
template <typename Traits>
py::tuple run_cpp(const py::list& groups, const py::list& grads,
                  const std::optional<std::string>& load_path,
                  const std::optional<std::string>& save_path) {
  Engine<Traits> engine = build<Traits>(groups, py::none());
  auto& opt = *engine.optimizer;
  if (load_path) torch::load(opt, *load_path);
  for (const py::handle& step_grads : grads) {
    const py::list list = py::reinterpret_borrow<py::list>(step_grads);
    if (list.size() != engine.params.size())
      throw py::value_error("gwt: each step needs one gradient (or None) per parameter");
    for (size_t k = 0; k < engine.params.size(); ++k)
      engine.params[k].mutable_grad() =
          list[k].is_none() ? at::Tensor() : tensor_value(list[k], "a gradient").clone();
    py::gil_scoped_release no_gil;
    opt.step();
  }
  if (save_path) torch::save(opt, *save_path);
  py::list states;
  for (const auto& param : engine.params) {
    auto it = opt.state().find(param.unsafeGetTensorImpl());
    if (it == opt.state().end()) {
      states.append(py::none());
      continue;
    }
    py::dict d;
    Traits::state_to(static_cast<const typename Traits::State&>(*it->second), d);
    states.append(d);
  }
  return py::make_tuple(states, counters_dict(Traits::counters(opt)));
}

template <typename Traits>
void bind_optimizer(py::module_& m, const std::string& prefix) {
  m.def((prefix + "_step").c_str(), &step<Traits>, py::arg("groups"), py::arg("state"));
  m.def((prefix + "_check_group").c_str(), &check_group<Traits>, py::arg("group"));
  m.def((prefix + "_save").c_str(), &save_archive<Traits>, py::arg("groups"), py::arg("state"),
        py::arg("counters"), py::arg("path") = py::none());
  m.def((prefix + "_load").c_str(), &load_archive<Traits>, py::arg("groups"), py::arg("source"));
  m.def(("_run_cpp_" + prefix).c_str(), &run_cpp<Traits>, py::arg("groups"), py::arg("grads"),
        py::arg("load_path") = py::none(), py::arg("save_path") = py::none());
}

// ------------------------------------------------------------------------------------------------
// gwt::nn::DeltaLinear: the C++ module behind gwt.nn.DeltaLinear (python/gwt/nn.py). The Python
// module owns the parameters; before each call it hands them to the C++ module (set), whose members
// then are those very tensors, so that autograd, optimizers and state_dict see the Python ones.
// ------------------------------------------------------------------------------------------------

using DeltaLinearImpl = gwt::nn::DeltaLinearImpl;

std::shared_ptr<DeltaLinearImpl> make_delta_linear(const at::Tensor& weight,
                                                   const std::optional<at::Tensor>& bias,
                                                   int64_t rank, int64_t reflections,
                                                   bool orthogonal_core, double alpha,
                                                   bool gram_schmidt, bool train_base) {
  return as_value_error([&] {
    TORCH_CHECK(weight.dim() == 2,
                "gwt::nn::DeltaLinear: the base weight must be 2-D [out, in], "
                "got ",
                weight.sizes());
    const int64_t out = weight.size(0), in = weight.size(1);
    // A Linear holder around the given tensors (DeltaLinearImpl reads its weight and bias).
    torch::nn::Linear base(torch::nn::LinearOptions(in, out).bias(bias.has_value()));
    base->weight = weight;
    base->bias = bias ? *bias : at::Tensor();
    return std::make_shared<DeltaLinearImpl>(base, gwt::nn::DeltaLinearOptions(in, out)
                                                       .rank(rank)
                                                       .reflections(reflections)
                                                       .orthogonal_core(orthogonal_core)
                                                       .alpha(alpha)
                                                       .gram_schmidt(gram_schmidt)
                                                       .train_base(train_base));
  });
}

std::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

void bind_delta_linear(py::module_& m) {
  using Opt = std::optional<at::Tensor>;
  py::class_<DeltaLinearImpl, std::shared_ptr<DeltaLinearImpl>>(m, "_DeltaLinear")
      .def(py::init(&make_delta_linear), py::arg("weight"), py::arg("bias"), py::arg("rank"),
           py::arg("reflections"), py::arg("orthogonal_core"), py::arg("alpha"),
           py::arg("gram_schmidt"), py::arg("train_base"))
      .def("tensors",
           [](const DeltaLinearImpl& self) {
             return std::make_tuple(defined_or_none(self.weight), defined_or_none(self.bias),
                                    defined_or_none(self.U), defined_or_none(self.V),
                                    defined_or_none(self.reflections), defined_or_none(self.core));
           })
      .def(
          "set",
          [](DeltaLinearImpl& self, const at::Tensor& weight, const Opt& bias, const Opt& U,
             const Opt& V, const Opt& reflections, const Opt& core) {
            self.weight = weight;
            self.bias = bias.value_or(at::Tensor());
            self.U = U.value_or(at::Tensor());
            self.V = V.value_or(at::Tensor());
            self.reflections = reflections.value_or(at::Tensor());
            self.core = core.value_or(at::Tensor());
          },
          py::arg("weight"), py::arg("bias"), py::arg("U"), py::arg("V"), py::arg("reflections"),
          py::arg("core"))
      .def("forward", &DeltaLinearImpl::forward, py::arg("x"),
           py::call_guard<py::gil_scoped_release>())
      .def("merge",
           [](const DeltaLinearImpl& self) {
             py::gil_scoped_release no_gil;
             torch::nn::Linear merged = self.merge();
             return std::make_pair(merged->weight, defined_or_none(merged->bias));
           })
      .def("delta_weight", &DeltaLinearImpl::delta_weight, py::call_guard<py::gil_scoped_release>())
      .def("orthogonality_error",
           [](const DeltaLinearImpl& self) {
             const auto e = self.orthogonality_error();
             return std::make_pair(e.reflections, e.core);
           })
      .def("orthogonality_penalty", &DeltaLinearImpl::orthogonality_penalty, py::arg("lambda_"))
      .def(
          "resize_rank",
          [](DeltaLinearImpl& self, int64_t k) {
            return as_value_error([&] { return self.resize_rank(k); });
          },
          py::arg("k"))
      .def("rank", &DeltaLinearImpl::rank)
      .def("scaling", &DeltaLinearImpl::scaling);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "gwt's C++ library (wavelet-compressed Adam for LibTorch), bound for Python";
  m.attr("__version__") = gwt::version;
  m.attr("_torch_version") = GWT_PY_TORCH_VERSION;

  // c10::Error and its kinds become the Python exceptions torch raises for them (RuntimeError,
  // ValueError, TypeError, IndexError, torch.linalg.LinAlgError, torch.OutOfMemoryError, ...) with
  // the same message, as for torch's own functions.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::Error&) {
      torch::translate_exception_to_python(std::current_exception());
    }
  });

  m.def("built_with_cuda", &gwt::kernels::built_with_cuda,
        "Whether this build of gwt has its CUDA kernels (else CUDA parameters take the reference)");
  m.def("cuda_kernels_run_on", &gwt::kernels::cuda_kernels_run_on, py::arg("device_index"),
        "Whether the CUDA kernels run on that device (an image for its architecture)");
  m.def("wavelets", &gwt::Wavelet::available, "Every wavelet name gwt knows (PyWavelets' filters)");
  m.def("modes", &gwt::boundary_mode_names, "Every boundary mode gwt knows");
  m.def(
      "wavelet_filters",
      [](const std::string& name) {
        const gwt::Wavelet w = wavelet_of(name);
        return std::make_tuple(w.dec_lo(), w.dec_hi(), w.rec_lo(), w.rec_hi());
      },
      py::arg("name"));
  m.def(
      "approx_len",
      [](int64_t n, const std::string& wavelet, int64_t level, const std::string& mode) {
        return gwt::approx_len(n, wavelet_of(wavelet), level, mode_of(mode));
      },
      py::arg("n"), py::arg("wavelet"), py::arg("level"), py::arg("mode"));

  // Transforms: the GIL is released while they compute; results are converted after.
  m.def(
      "dwt",
      [](const at::Tensor& x, const std::string& wavelet, int64_t dim, const std::string& mode) {
        const auto w = wavelet_of(wavelet);
        const auto md = mode_of(mode);
        py::gil_scoped_release no_gil;
        return gwt::dwt(x, w, dim, md);
      },
      py::arg("x"), py::arg("wavelet"), py::arg("dim"), py::arg("mode"));
  m.def(
      "idwt",
      [](const at::Tensor& a, const at::Tensor& d, const std::string& wavelet, int64_t dim,
         const std::string& mode) {
        const auto w = wavelet_of(wavelet);
        const auto md = mode_of(mode);
        py::gil_scoped_release no_gil;
        return gwt::idwt(a, d, w, dim, md);
      },
      py::arg("approx"), py::arg("detail"), py::arg("wavelet"), py::arg("dim"), py::arg("mode"));
  m.def(
      "wavedec",
      [](const at::Tensor& x, const std::string& wavelet, int64_t level, int64_t dim,
         const std::string& mode) {
        const auto w = wavelet_of(wavelet);
        const auto md = mode_of(mode);
        py::gil_scoped_release no_gil;
        gwt::WaveletCoeffs c = gwt::wavedec(x, w, level, dim, md);
        std::vector<at::Tensor> out{c.approx};
        out.insert(out.end(), c.details.begin(), c.details.end());
        return out;
      },
      py::arg("x"), py::arg("wavelet"), py::arg("level"), py::arg("dim"), py::arg("mode"));
  m.def(
      "waverec",
      [](const std::vector<at::Tensor>& coeffs, const std::string& wavelet, int64_t dim,
         const std::string& mode, std::optional<int64_t> length) {
        if (coeffs.empty()) throw py::value_error("gwt: waverec needs at least the approximation");
        const auto w = wavelet_of(wavelet);
        const auto md = mode_of(mode);
        py::gil_scoped_release no_gil;
        gwt::WaveletCoeffs c{coeffs[0], {coeffs.begin() + 1, coeffs.end()}};
        return gwt::waverec(c, w, dim, md, length);
      },
      py::arg("coeffs"), py::arg("wavelet"), py::arg("dim"), py::arg("mode"), py::arg("length"));
  m.def(
      "wavedec2",
      [](const at::Tensor& x, const std::string& wavelet, int64_t level, const std::string& mode) {
        const auto w = wavelet_of(wavelet);
        const auto md = mode_of(mode);
        py::gil_scoped_release no_gil;
        gwt::WaveletCoeffs2 c = gwt::wavedec2(x, w, level, md);
        return std::make_pair(c.approx, c.details);
      },
      py::arg("x"), py::arg("wavelet"), py::arg("level"), py::arg("mode"));
  m.def(
      "waverec2",
      [](const at::Tensor& approx, const std::vector<std::array<at::Tensor, 3>>& details,
         const std::string& wavelet, const std::string& mode) {
        const auto w = wavelet_of(wavelet);
        const auto md = mode_of(mode);
        py::gil_scoped_release no_gil;
        return gwt::waverec2(gwt::WaveletCoeffs2{approx, details}, w, md);
      },
      py::arg("approx"), py::arg("details"), py::arg("wavelet"), py::arg("mode"));
  m.def(
      "threshold",
      [](const at::Tensor& x, double value, const std::string& mode) {
        as_value_error([&] {
          TORCH_CHECK(mode == "soft" || mode == "hard", "gwt: unknown threshold mode '", mode,
                      "'; valid modes are soft, hard");
          return 0;
        });
        py::gil_scoped_release no_gil;
        return gwt::threshold(x, value, mode);
      },
      py::arg("x"), py::arg("value"), py::arg("mode"));

  bind_delta_linear(m);
  bind_optimizer<WaveletAdamTraits>(m, "wavelet_adam");
  bind_optimizer<GaLoreAdamTraits>(m, "galore_adam");

  m.def(
      "wavelet_adam_param_info",
      [](const py::list& groups, const py::object& param) {
        auto engine = build<WaveletAdamTraits>(groups, py::none());
        const at::Tensor p = tensor_value(param, "the parameter");
        return as_value_error([&] {
          return std::make_pair(engine.optimizer->is_wavelet_param(p),
                                engine.optimizer->is_fused_param(p));
        });
      },
      py::arg("groups"), py::arg("param"));
  m.def(
      "galore_adam_param_info",
      [](const py::list& groups, const py::object& param) {
        auto engine = build<GaLoreAdamTraits>(groups, py::none());
        const at::Tensor p = tensor_value(param, "the parameter");
        return as_value_error([&] { return engine.optimizer->is_projected_param(p); });
      },
      py::arg("groups"), py::arg("param"));
}
