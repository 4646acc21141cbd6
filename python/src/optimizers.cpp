// gwt._C: the optimizers (gwt::WaveletAdam, gwt::GaLoreAdam, gwt::FoamAdam) over torch.optim's
// groups and state.
//
// The state lives in Python (torch.optim.Optimizer's `state` and `param_groups`, so that
// state_dict(), torch.save and LR schedulers work as with any torch optimizer). A Python optimizer
// keeps a Session: a C++ optimizer over the same parameter tensors whose per-parameter states
// share the Python state's tensors, made at the first step and kept while the parameters stay the
// same. Each step copies the groups' options into it (an LR scheduler's lr, say) and runs its
// step(): the C++ kernels update parameters and moments in place. Step counts, limiter norms and
// the counters go back to the Python dicts only when Python code looks at the state (sync), so a
// step of CUDA parameters never waits for the device and can be captured in a CUDA graph; if the
// state was changed from Python in the meantime (state_unchanged), the next step makes a new
// Session from it.

#include <c10/util/irange.h>
#include <torch/serialize.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "optim/common.h"
#include "optim/device_steps.h"  // emulate_device_steps_on_cpu (tests)
#include "optimizer_traits.h"

namespace gwt_python {
namespace {

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

// A C++ optimizer kept across steps by a Python optimizer (its `_session`, python/gwt/optim.py).
template <typename Traits>
class Session {
 public:
  using Options = typename Traits::Options;

  Session(const py::list& groups, const py::object& state)
      : engine_(build<Traits>(groups, state)) {}

  // Whether `groups` holds the parameters this session was made over: as many groups, the same
  // parameter objects in each, in the same order.
  bool matches(const py::list& groups) const {
    const auto& cpp_groups = engine_.optimizer->param_groups();
    if (groups.size() != cpp_groups.size()) return false;
    size_t k = 0;
    for (const py::handle& group : groups) {
      if (!py::isinstance<py::dict>(group)) return false;
      const py::dict d = py::reinterpret_borrow<py::dict>(group);
      if (!d.contains("params")) return false;
      const py::list params(d["params"]);
      for (const py::handle& p : params)
        if (k >= engine_.param_objects.size() || !p.is(engine_.param_objects[k++])) return false;
    }
    return k == engine_.param_objects.size();
  }

  // One step with the groups' current options (all read before any is set: a TypeError changes
  // nothing). The GIL is released while the C++ optimizer steps.
  void step(const py::list& groups) {
    std::vector<Options> options;
    options.reserve(groups.size());
    for (const py::handle& group : groups)
      options.push_back(Traits::options_from(py::reinterpret_borrow<py::dict>(group)));
    auto& cpp_groups = engine_.optimizer->param_groups();
    for (const auto i : c10::irange(cpp_groups.size()))
      static_cast<Options&>(cpp_groups[i].options()) = options[i];
    py::gil_scoped_release no_gil;
    engine_.optimizer->step();
  }

  // Writes the C++ state of every parameter that has one into `state` and returns the counters
  // since the session was made. Reading the counters first brings the step counts and norms of
  // CUDA parameters up from the device (one synchronisation).
  py::dict sync(const py::object& state) {
    const auto counters = Traits::counters(*engine_.optimizer);
    write_state(engine_, state);
    return counters_dict(counters);
  }

  // Whether `state` holds what the last sync() wrote, for every parameter: the same tensor objects
  // and equal values, and nothing for a parameter without C++ state. When Python code has changed
  // the state since (a moment replaced, a step count set, an entry removed), the next step makes a
  // new session from it.
  bool state_unchanged(const py::object& state) const {
    const auto& cpp_state = engine_.optimizer->state();
    for (size_t k = 0; k < engine_.params.size(); ++k) {
      PyObject* entry = PyDict_GetItemWithError(state.ptr(), engine_.param_objects[k].ptr());
      if (entry == nullptr && PyErr_Occurred()) throw py::error_already_set();
      const bool has_entry = entry != nullptr && (!PyDict_Check(entry) || PyDict_Size(entry) > 0);
      auto it = cpp_state.find(engine_.params[k].unsafeGetTensorImpl());
      if (it == cpp_state.end()) {
        if (has_entry) return false;
        continue;
      }
      if (!has_entry || !PyDict_Check(entry)) return false;
      py::dict expected;
      Traits::state_to(static_cast<const typename Traits::State&>(*it->second), expected);
      const py::dict d = py::reinterpret_borrow<py::dict>(entry);
      if (d.size() != expected.size()) return false;
      for (const auto& [key, value] : expected) {
        if (!d.contains(key)) return false;
        const py::object held = d[key];
        if (THPVariable_Check(held.ptr()) || THPVariable_Check(value.ptr())) {
          if (!held.is(value)) return false;
        } else if (!held.equal(value)) {
          return false;
        }
      }
    }
    return true;
  }

 private:
  Engine<Traits> engine_;
};

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

// The state of each parameter as a dict (None for a parameter without state), group by group.
template <typename Traits>
py::list state_list(const Engine<Traits>& engine) {
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
  return states;
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
  const py::list states = state_list(engine);
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
      Traits::prepare_loaded(opt, static_cast<typename Traits::State&>(*it->second), param, options,
                             gwt::optim_detail::param_where(i, j, param));
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
  // The counters first: reading them brings device counts into the states.
  const auto counters = Traits::counters(opt);
  return py::make_tuple(state_list(engine), counters_dict(counters));
}

template <typename Traits>
void bind_optimizer(py::module_& m, const std::string& prefix) {
  py::class_<Session<Traits>>(m, ("_" + prefix + "_session").c_str())
      .def(py::init<const py::list&, const py::object&>(), py::arg("groups"), py::arg("state"))
      .def("matches", &Session<Traits>::matches, py::arg("groups"))
      .def("step", &Session<Traits>::step, py::arg("groups"))
      .def("sync", &Session<Traits>::sync, py::arg("state"))
      .def("state_unchanged", &Session<Traits>::state_unchanged, py::arg("state"));
  m.def((prefix + "_check_group").c_str(), &check_group<Traits>, py::arg("group"));
  m.def((prefix + "_save").c_str(), &save_archive<Traits>, py::arg("groups"), py::arg("state"),
        py::arg("counters"), py::arg("path"));
  m.def((prefix + "_load").c_str(), &load_archive<Traits>, py::arg("groups"), py::arg("path"));
  m.def((prefix + "_load_state").c_str(), &load_state<Traits>, py::arg("groups"), py::arg("state"),
        py::arg("counters"));
  m.def(("_run_cpp_" + prefix).c_str(), &run_cpp<Traits>, py::arg("groups"), py::arg("grads"),
        py::arg("load_path") = py::none(), py::arg("save_path") = py::none());
}

}  // namespace

void bind_optimizers(py::module_& m) {
  bind_optimizer<WaveletAdamTraits>(m, "wavelet_adam");
  bind_optimizer<GaLoreAdamTraits>(m, "galore_adam");
  bind_optimizer<FoamAdamTraits>(m, "foam_adam");

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
  m.def(
      "foam_adam_param_info",
      [](const py::list& groups, const py::object& param) {
        auto engine = build<FoamAdamTraits>(groups, py::none());
        const at::Tensor p = tensor_value(param, "the parameter");
        return as_value_error([&] {
          return std::make_pair(engine.optimizer->is_folded_param(p),
                                engine.optimizer->is_fused_param(p));
        });
      },
      py::arg("groups"), py::arg("param"));
  // Tests only: the device path's kernels emulated on the host for CPU parameters
  // (src/optim/device_steps.h), so that the counts a step keeps on the device and their
  // sync are tested without a GPU.
  m.def("_emulate_device_steps_on_cpu", &gwt::optim_detail::emulate_device_steps_on_cpu,
        py::arg("on"));
}

}  // namespace gwt_python
