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
#include <c10/util/irange.h>
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

#include "kernels/kernels.h"
#include "gwt/nn/delta_linear.h"
#include "gwt/optim/galore_adam.h"
#include "gwt/optim/wavelet_adam.h"
#include "gwt/transform.h"
#include "gwt/version.h"
#include "gwt/wavelet.h"
// Internal (not installed): the optimizers' own checks of a loaded state, which load_state applies
// to a Python state_dict's tensors where they are.
#include "../../src/optim/common.h"
#include "../../src/optim/galore_adam_detail.h"
#include "../../src/optim/wavelet_adam_detail.h"

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

  // What WaveletAdam::load checks of a checkpoint's state and how it converts it (one function
  // for both), on a Python state_dict's tensors, copied once into storage of their own; then the
  // options must fit the next step.
  static void prepare_loaded(const Optimizer& /*opt*/, State& s, const at::Tensor& param,
                             const Options& o, const std::string& where) {
    gwt::wavelet_adam_detail::prepare_loaded_state(s, param, o, k_who, where,
                                                   /*own_storage=*/true);
    // The thresholding report is of the steps since the optimizer was made or loaded, as in C++.
    s.kept_details(-1).total_details(-1);
    fits(param, o, s.step() + 1);
  }

  static void fits(const at::Tensor& param, const Options& o, int64_t next_step) {
    gwt::wavelet_adam_detail::check_options_fit(param, o, next_step);
  }

  static std::map<std::string, int64_t> counters(const Optimizer& opt) {
    return {{"skipped_steps", opt.skipped_steps()}};
  }

  static constexpr const char* k_who = "gwt.WaveletAdam.load_state_dict";
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

  // What GaLoreAdam::load checks of a checkpoint's state and how it converts it (one function
  // for both), on a Python state_dict's tensors, copied once into storage of their own; then the
  // options must fit the next step.
  static void prepare_loaded(const Optimizer& /*opt*/, State& s, const at::Tensor& param,
                             const Options& o, const std::string& where) {
    gwt::galore_adam_detail::prepare_loaded_state(s, param, o, k_who, where, /*own_storage=*/true);
    fits(param, o, s.step() + 1);
  }

  static void fits(const at::Tensor& param, const Options& o, int64_t next_step) {
    gwt::galore_adam_detail::check_options_fit(param, o, next_step);
  }

  static std::map<std::string, int64_t> counters(const Optimizer& opt) {
    return {{"skipped_steps", opt.skipped_steps()}, {"svd_fallbacks", opt.svd_fallbacks()}};
  }

  static constexpr const char* k_who = "gwt.GaLoreAdam.load_state_dict";
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
  // The counters first: for CUDA parameters, reading them brings the C++ states' step counts and
  // norms up from the device (WaveletAdam keeps them there during a step).
  const auto counters = Traits::counters(*engine.optimizer);
  write_state(engine, state);
  if (failure) std::rethrow_exception(failure);
  return counters_dict(counters);
}

// Construction-time check of one group (options and parameters), as a ValueError.
template <typename Traits>
void check_group(const py::dict& group) {
  py::list groups;
  groups.append(group);
  as_value_error([&] { return build<Traits>(groups, py::none()).params.size(); });
}

// Writes the C++ checkpoint (what torch::save(optimizer, path) writes) of the Python groups and
// state to `path`.
template <typename Traits>
void save_archive(const py::list& groups, const py::object& state,
                  const std::map<std::string, int64_t>& counters, const std::string& path) {
  Engine<Traits> engine = build<Traits>(groups, state);
  torch::serialize::OutputArchive archive;
  engine.optimizer->save(archive);
  // The counters of this run (the engine's own are zero): an archive entry written again takes the
  // new value.
  for (const auto& [name, value] : counters) archive.write(name, c10::IValue(value));
  archive.save_to(path);
}

// What Python keeps of the C++ optimizer after a load: the options of each group (list of dicts),
// the state of each parameter with one (list, None for none), and the counters.
template <typename Traits>
py::tuple loaded(const Engine<Traits>& engine, const std::map<std::string, int64_t>& counters) {
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
  return py::make_tuple(options, states, counters_dict(counters));
}

// Loads the C++ checkpoint at `path` into a C++ optimizer over `groups` (which checks all of it
// first: shapes, dtypes, finite values, parameter order) and returns what Python keeps (loaded()).
template <typename Traits>
py::tuple load_archive(const py::list& groups, const std::string& path) {
  Engine<Traits> engine = build<Traits>(groups, py::none());
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  engine.optimizer->load(archive);
  return loaded(engine, Traits::counters(*engine.optimizer));
}

// A Python state_dict loaded (load_state_dict): `groups` hold its options, `state` (keyed by
// parameter) its state, `counters` its counters. Checks and converts them as the C++ loader does a
// checkpoint's (Traits::prepare_loaded), on the tensors where they are: no checkpoint is written
// and read back, and each state tensor is copied once, into the dtype and onto the device the
// optimizer keeps it in. Returns what Python keeps (loaded()); throws before Python changes
// anything.
template <typename Traits>
py::tuple load_state(const py::list& groups, const py::object& state,
                     const std::map<std::string, int64_t>& counters) {
  Engine<Traits> engine = build<Traits>(groups, state);  // checks the options
  auto& opt = *engine.optimizer;
  for (const auto i : c10::irange(opt.param_groups().size())) {
    const auto& group = opt.param_groups()[i];
    const auto& options = static_cast<const typename Traits::Options&>(group.options());
    for (const auto j : c10::irange(group.params().size())) {
      const at::Tensor& param = group.params()[j];
      auto it = opt.state().find(param.unsafeGetTensorImpl());
      if (it == opt.state().end()) {
        Traits::fits(param, options, 1);
        continue;
      }
      Traits::prepare_loaded(opt, static_cast<typename Traits::State&>(*it->second), param,
                             options, gwt::optim_detail::param_where(i, j, param));
    }
  }
  for (const auto& [name, value] : counters)
    TORCH_CHECK(value >= 0, Traits::k_who, ": the state_dict's ", name, " is ", value,
                "; it counts events (>= 0)");
  return loaded(engine, counters);
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
        py::arg("counters"), py::arg("path"));
  m.def((prefix + "_load").c_str(), &load_archive<Traits>, py::arg("groups"), py::arg("path"));
  m.def((prefix + "_load_state").c_str(), &load_state<Traits>, py::arg("groups"),
        py::arg("state"), py::arg("counters"));
  m.def(("_run_cpp_" + prefix).c_str(), &run_cpp<Traits>, py::arg("groups"), py::arg("grads"),
        py::arg("load_path") = py::none(), py::arg("save_path") = py::none());
}

// ------------------------------------------------------------------------------------------------
// gwt::nn::DeltaLinear: the stateless delta_linear_* functions behind gwt.nn.DeltaLinear
// (python/gwt/nn.py). The Python module's parameters and buffer are all its state; each call takes
// them (weight, bias, U, V, reflections, core: None where absent) and returns new tensors, so the
// module copies, pickles and runs in several threads as any torch module.
// ------------------------------------------------------------------------------------------------

using OptTensor = std::optional<at::Tensor>;

gwt::nn::DeltaLinearState delta_state(const at::Tensor& weight, const OptTensor& bias,
                                      const OptTensor& U, const OptTensor& V,
                                      const OptTensor& reflections, const OptTensor& core,
                                      double scaling) {
  return {weight,
          bias.value_or(at::Tensor()),
          U.value_or(at::Tensor()),
          V.value_or(at::Tensor()),
          reflections.value_or(at::Tensor()),
          core.value_or(at::Tensor()),
          scaling};
}

OptTensor defined_or_none(const at::Tensor& t) {
  return t.defined() ? OptTensor(t) : std::nullopt;
}

gwt::nn::DeltaLinearOptions delta_options(const at::Tensor& weight, int64_t rank,
                                          int64_t reflections, bool orthogonal_core, double alpha,
                                          bool gram_schmidt) {
  TORCH_CHECK(weight.dim() == 2,
              "gwt::nn::DeltaLinear: the base weight must be 2-D [out, in], got ", weight.sizes());
  return gwt::nn::DeltaLinearOptions(weight.size(1), weight.size(0))
      .rank(rank)
      .reflections(reflections)
      .orthogonal_core(orthogonal_core)
      .alpha(alpha)
      .gram_schmidt(gram_schmidt);
}

void bind_delta_linear(py::module_& m) {
  m.def(
      "_delta_init",
      [](const at::Tensor& weight, const OptTensor& bias, int64_t rank, int64_t reflections,
         bool orthogonal_core, double alpha, bool gram_schmidt) {
        const auto s = as_value_error([&] {
          return gwt::nn::delta_linear_init(
              weight, bias.value_or(at::Tensor()),
              delta_options(weight, rank, reflections, orthogonal_core, alpha, gram_schmidt));
        });
        return std::make_tuple(s.U, s.V, defined_or_none(s.reflections), defined_or_none(s.core),
                               s.scaling);
      },
      py::arg("weight"), py::arg("bias"), py::arg("rank"), py::arg("reflections"),
      py::arg("orthogonal_core"), py::arg("alpha"), py::arg("gram_schmidt"));
  m.def(
      "_delta_forward",
      [](const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, const OptTensor& U,
         const OptTensor& V, const OptTensor& reflections, const OptTensor& core, double scaling,
         bool gram_schmidt) {
        return gwt::nn::delta_linear_forward(
            x, delta_state(weight, bias, U, V, reflections, core, scaling), gram_schmidt);
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("U"), py::arg("V"),
      py::arg("reflections"), py::arg("core"), py::arg("scaling"), py::arg("gram_schmidt"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "_delta_weight",
      [](const at::Tensor& weight, const OptTensor& bias, const OptTensor& U, const OptTensor& V,
         const OptTensor& reflections, const OptTensor& core, double scaling) {
        return gwt::nn::delta_linear_delta_weight(
            delta_state(weight, bias, U, V, reflections, core, scaling));
      },
      py::arg("weight"), py::arg("bias"), py::arg("U"), py::arg("V"), py::arg("reflections"),
      py::arg("core"), py::arg("scaling"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "_delta_merged_weight",
      [](const at::Tensor& weight, const OptTensor& bias, const OptTensor& U, const OptTensor& V,
         const OptTensor& reflections, const OptTensor& core, double scaling, bool gram_schmidt) {
        return gwt::nn::delta_linear_merged_weight(
            delta_state(weight, bias, U, V, reflections, core, scaling), gram_schmidt);
      },
      py::arg("weight"), py::arg("bias"), py::arg("U"), py::arg("V"), py::arg("reflections"),
      py::arg("core"), py::arg("scaling"), py::arg("gram_schmidt"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "_delta_orthogonality_error",
      [](const at::Tensor& weight, const OptTensor& bias, const OptTensor& U, const OptTensor& V,
         const OptTensor& reflections, const OptTensor& core, bool gram_schmidt) {
        const auto e = gwt::nn::delta_linear_orthogonality_error(
            delta_state(weight, bias, U, V, reflections, core, 1.0), gram_schmidt);
        return std::make_pair(e.reflections, e.core);
      },
      py::arg("weight"), py::arg("bias"), py::arg("U"), py::arg("V"), py::arg("reflections"),
      py::arg("core"), py::arg("gram_schmidt"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "_delta_orthogonality_penalty",
      [](const at::Tensor& weight, const OptTensor& bias, const OptTensor& U, const OptTensor& V,
         const OptTensor& reflections, const OptTensor& core, double lambda) {
        const auto s = delta_state(weight, bias, U, V, reflections, core, 1.0);
        return as_value_error(
            [&] { return gwt::nn::delta_linear_orthogonality_penalty(s, lambda); });
      },
      py::arg("weight"), py::arg("bias"), py::arg("U"), py::arg("V"), py::arg("reflections"),
      py::arg("core"), py::arg("lambda_"));
  m.def(
      "_delta_resize_rank",
      [](const at::Tensor& weight, const OptTensor& bias, const OptTensor& U, const OptTensor& V,
         const OptTensor& reflections, const OptTensor& core, double scaling, double alpha,
         int64_t k) {
        const auto r = as_value_error([&] {
          const int64_t rank = U ? U->size(-1) : 0;
          return gwt::nn::delta_linear_resize_rank(
              delta_state(weight, bias, U, V, reflections, core, scaling),
              delta_options(weight, rank, reflections ? reflections->size(-1) : 0, core.has_value(),
                            alpha, false),
              k);
        });
        return std::make_tuple(r.state.U, r.state.V, defined_or_none(r.state.core), r.state.scaling,
                               r.error);
      },
      py::arg("weight"), py::arg("bias"), py::arg("U"), py::arg("V"), py::arg("reflections"),
      py::arg("core"), py::arg("scaling"), py::arg("alpha"), py::arg("k"));
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
