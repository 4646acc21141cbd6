// Fuzz target: WaveletAdam::load and GaLoreAdam::load of arbitrary bytes (read with
// torch::serialize::InputArchive::load_from), into optimizers that hold state of their own (one
// step taken). The seed corpus (fuzz/corpus/load, written by gwt_fuzz_seed) holds real checkpoints
// of both optimizers for the models of load_setup.h with many options.
//
// Properties, for each optimizer:
// - gwt's load() lets nothing but a c10::Error escape (LibTorch's own archive parser,
//   load_from, may throw its std::exceptions: bytes it cannot read never reach gwt);
// - after an error, options, state, counters and parameters are as before, byte for byte;
// - after a load: every state holds finite moments, second moments >= 0, a step count >= 0, a
//   finite non-negative limiter norm (WaveletAdam) and a finite projector (GaLoreAdam); saving and
//   loading the result again gives the same options and state; and a step with finite gradients
//   runs without an error.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "libtorch_guard.h"
#include "load_setup.h"

namespace {

using gwt_fuzz::fail;

struct StateSnapshot {
  bool present = false;
  std::vector<int64_t> ints;
  std::vector<at::Tensor> tensors;
};

// What each optimizer's state holds, for snapshots and checks.
struct WaveletAdamTraits {
  using Model = gwt_fuzz::WaveletAdamModel;
  using Options = gwt::WaveletAdamOptions;
  using State = gwt::WaveletAdamParamState;
  static constexpr const char* name = "WaveletAdam";
  static StateSnapshot snap(const State& s) {
    return {true,
            {s.step()},
            {gwt_fuzz::copy_of(s.exp_avg()), gwt_fuzz::copy_of(s.exp_avg_sq()),
             gwt_fuzz::copy_of(s.norm())}};
  }
  static std::vector<int64_t> counters(const gwt::WaveletAdam& o) { return {o.skipped_steps()}; }
  // The integrity of a loaded state; an empty string when it holds.
  static std::string integrity(const State& s) {
    if (s.norm().defined()) {
      if (s.norm().numel() != 1) return "a limiter norm of more than one value";
      if (!gwt_fuzz::all_finite(s.norm())) return "a non-finite limiter norm";
      if (s.norm().to(at::kDouble).item<double>() < 0) return "a negative limiter norm";
    }
    return "";
  }
};

struct GaLoreAdamTraits {
  using Model = gwt_fuzz::GaLoreAdamModel;
  using Options = gwt::GaLoreAdamOptions;
  using State = gwt::GaLoreAdamParamState;
  static constexpr const char* name = "GaLoreAdam";
  static StateSnapshot snap(const State& s) {
    return {true,
            {s.step(), s.right() ? 1 : 0},
            {gwt_fuzz::copy_of(s.exp_avg()), gwt_fuzz::copy_of(s.exp_avg_sq()),
             gwt_fuzz::copy_of(s.projector())}};
  }
  static std::vector<int64_t> counters(const gwt::GaLoreAdam& o) {
    return {o.skipped_steps(), o.svd_fallbacks()};
  }
  static std::string integrity(const State& s) {
    if (s.projector().defined() && !gwt_fuzz::all_finite(s.projector()))
      return "a non-finite projector";
    return "";
  }
};

template <typename Traits>
struct Snapshot {
  std::vector<typename Traits::Options> options;
  std::vector<StateSnapshot> states;
  std::vector<int64_t> counters;
  std::vector<at::Tensor> params;
};

template <typename Traits>
Snapshot<Traits> snapshot(const typename Traits::Model& m) {
  Snapshot<Traits> s;
  for (size_t g = 0; g < m.opt->param_groups().size(); ++g)
    s.options.push_back(m.opt->group_options(g));
  for (const auto& p : m.params) {
    auto it = m.opt->state().find(p.unsafeGetTensorImpl());
    s.states.push_back(it == m.opt->state().end()
                           ? StateSnapshot{}
                           : Traits::snap(static_cast<const typename Traits::State&>(*it->second)));
    s.params.push_back(gwt_fuzz::copy_of(p));
  }
  s.counters = Traits::counters(*m.opt);
  return s;
}

template <typename Traits>
std::string differs(const Snapshot<Traits>& a, const Snapshot<Traits>& b, bool with_params) {
  for (size_t g = 0; g < a.options.size(); ++g)
    if (!(a.options[g] == b.options[g])) return "the options of group " + std::to_string(g);
  if (a.counters != b.counters) return "the counters";
  for (size_t i = 0; i < a.states.size(); ++i) {
    const auto &x = a.states[i], &y = b.states[i];
    if (x.present != y.present || x.ints != y.ints || x.tensors.size() != y.tensors.size())
      return "the state of parameter " + std::to_string(i);
    for (size_t k = 0; k < x.tensors.size(); ++k)
      if (!gwt_fuzz::same_bytes(x.tensors[k], y.tensors[k]))
        return "state tensor " + std::to_string(k) + " of parameter " + std::to_string(i);
    if (with_params && !gwt_fuzz::same_bytes(a.params[i], b.params[i]))
      return "parameter " + std::to_string(i);
  }
  return "";
}

template <typename Traits>
std::string integrity(const typename Traits::Model& m) {
  for (size_t i = 0; i < m.params.size(); ++i) {
    auto it = m.opt->state().find(m.params[i].unsafeGetTensorImpl());
    if (it == m.opt->state().end()) continue;
    const auto& s = static_cast<const typename Traits::State&>(*it->second);
    const std::string where = " (parameter " + std::to_string(i) + ")";
    if (s.step() < 0) return "a negative step count" + where;
    if (!s.exp_avg().defined() || !s.exp_avg_sq().defined()) return "missing moments" + where;
    if (!gwt_fuzz::all_finite(s.exp_avg()) || !gwt_fuzz::all_finite(s.exp_avg_sq()))
      return "non-finite moments" + where;
    if (s.exp_avg_sq().numel() > 0 && s.exp_avg_sq().lt(0).any().template item<bool>())
      return "a negative second moment" + where;
    const std::string other = Traits::integrity(s);
    if (!other.empty()) return other + where;
  }
  return "";
}

template <typename Traits>
std::string saved_bytes(const typename Traits::Model& m) {
  torch::serialize::OutputArchive out;
  m.opt->save(out);
  std::ostringstream stream;
  out.save_to(stream);
  return stream.str();
}

// A model with state of its own: one step with the fixed gradients.
template <typename Traits>
std::unique_ptr<typename Traits::Model> fresh_model() {
  auto m = std::make_unique<typename Traits::Model>();
  gwt_fuzz::set_grads(m->params, 0);
  m->opt->step();
  return m;
}

template <typename Traits>
void check_load(std::unique_ptr<typename Traits::Model>& model,
                torch::serialize::InputArchive& archive) {
  const std::string who = Traits::name;
  const Snapshot<Traits> before = snapshot<Traits>(*model);
  try {
    model->opt->load(archive);
  } catch (const c10::Error& e) {
    const std::string changed = differs<Traits>(before, snapshot<Traits>(*model), true);
    if (!changed.empty())
      fail(who + "::load failed ('" + e.what_without_backtrace() + "') but changed " + changed);
    return;
  } catch (const std::exception& e) {
    fail(who + "::load threw an exception other than c10::Error: " + e.what());
  } catch (...) {
    fail(who + "::load threw a non-std exception");
  }
  // Loaded: the model is no longer the pristine one.
  std::unique_ptr<typename Traits::Model> loaded = std::move(model);
  model = fresh_model<Traits>();
  const std::string bad = integrity<Traits>(*loaded);
  if (!bad.empty()) fail(who + "::load accepted a checkpoint with " + bad);
  const Snapshot<Traits> after = snapshot<Traits>(*loaded);
  // Saved again and loaded into another optimizer: the same options and state.
  {
    const std::string bytes = saved_bytes<Traits>(*loaded);
    torch::serialize::InputArchive again;
    again.load_from(bytes.data(), bytes.size());
    auto other = std::make_unique<typename Traits::Model>();
    try {
      other->opt->load(again);
    } catch (const c10::Error& e) {
      fail(who + ": a checkpoint it loaded, saved again, does not load: " +
           e.what_without_backtrace());
    }
    const std::string changed = differs<Traits>(after, snapshot<Traits>(*other), false);
    if (!changed.empty()) fail(who + ": saving and loading a loaded checkpoint changed " + changed);
  }
  // A loaded checkpoint is one training continues from.
  gwt_fuzz::set_grads(loaded->params, 7);
  try {
    loaded->opt->step();
  } catch (const c10::Error& e) {
    fail(who + "::load accepted a checkpoint that step() then rejects: " +
         e.what_without_backtrace());
  }
}

std::unique_ptr<gwt_fuzz::WaveletAdamModel> g_wavelet_adam;
std::unique_ptr<gwt_fuzz::GaLoreAdamModel> g_galore_adam;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  gwt_fuzz::init();
  g_wavelet_adam = fresh_model<WaveletAdamTraits>();
  g_galore_adam = fresh_model<GaLoreAdamTraits>();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  torch::serialize::InputArchive archive;
  if (!gwt_fuzz::read_archive(data, size, archive)) return 0;  // see libtorch_guard.h
  check_load<WaveletAdamTraits>(g_wavelet_adam, archive);
  check_load<GaLoreAdamTraits>(g_galore_adam, archive);
  return 0;
}
