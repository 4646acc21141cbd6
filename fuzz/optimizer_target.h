#pragma once

// What the optimizer targets (fuzz_step.cpp: WaveletAdam, fuzz_galore.cpp: GaLoreAdam) share: the
// case they draw (1 to 3 parameters in 1 or 2 groups, two steps with gradients drawn before each
// and a change between them) and the properties every step is held to:
// - nothing but a c10::Error escapes; after one, parameters, state and counters are as before
//   (byte for byte);
// - a non-finite gradient skips the step: nothing changes and skipped_steps() grows by one; in a
//   group whose options skip alone (T::skips_alone: WaveletAdam's nonfinite("skip_param")) it
//   skips only its parameter, which keeps its value and state (a first step's fresh state may be
//   kept, with step 0), while the others step and skipped_steps() grows by one;
// - a step taken advances the step count of exactly the parameters with a gradient, leaves the
//   others untouched, and, when its inputs are finite and within the target's bound, leaves every
//   parameter and state tensor finite. Finite inputs outside the bound that give a non-finite
//   result, and steps with finite gradients that were skipped, are notes (gwt_fuzz::note).
//
// A target is a struct T with
//   using Optimizer, Options, State;
//   static Options draw_options(FuzzedDataProvider&);
//   static int64_t draw_rank(FuzzedDataProvider&);          // dimensions of a parameter
//   static void mutate(FuzzedDataProvider&, Optimizer&, std::vector<at::Tensor>& params);
//   static void before_step(FuzzedDataProvider&);           // after the gradients are drawn
//   static const Options& group_options(const Optimizer&, size_t group);
//   static std::vector<at::Tensor> state_tensors(const State&);  // flags as 0-dim tensors
//   static std::vector<std::string> state_names();              // one per state tensor
//   static std::vector<int64_t> counters(const Optimizer&);     // skipped_steps() first
//   static bool skips_alone(const Options&);  // a non-finite gradient skips only its parameter
//   static Bound bound(const Optimizer&, const at::Tensor& param, const Options&,
//                      const at::Tensor& grad, double coeff_before, int64_t step);
//   static bool within(const Bound&, const ParamSnapshot& before, const Options&);
//   static std::string note_key(const Optimizer&, const at::Tensor& param, const Options&);
//   static std::string describe(const std::vector<at::Tensor>& params, const Optimizer&);

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_util.h"

namespace gwt_fuzz {

/// Bounds a target derives for one parameter's step (infinity where it derives none): on |p|
/// after the step, and on the coefficients its moments see (whatever the optimizer feeds them:
/// transform coefficients, projections, gradients), with the coefficients squared and the norm
/// the limiter takes where a target has them.
struct Bound {
  double param = std::numeric_limits<double>::infinity();
  double coeff = std::numeric_limits<double>::infinity();
  double coeff_sq = std::numeric_limits<double>::infinity();
  double norm_sq = std::numeric_limits<double>::infinity();
};

struct ParamSnapshot {
  at::Tensor param;
  bool has_state = false;
  int64_t step = 0;
  std::vector<at::Tensor> state;  // T::state_tensors, deep copies
};

struct Snapshot {
  std::vector<ParamSnapshot> params;
  std::vector<int64_t> counters;  // T::counters, skipped_steps() first
  size_t states = 0;
};

inline bool same_param(const ParamSnapshot& a, const ParamSnapshot& b) {
  if (!same_bytes(a.param, b.param) || a.has_state != b.has_state || a.step != b.step ||
      a.state.size() != b.state.size())
    return false;
  for (size_t i = 0; i < a.state.size(); ++i)
    if (!same_bytes(a.state[i], b.state[i])) return false;
  return true;
}

inline void expect_unchanged(const Snapshot& before, const Snapshot& after,
                             const std::string& why) {
  GWT_FUZZ_CHECK(before.counters == after.counters && before.states == after.states, why);
  for (size_t i = 0; i < before.params.size(); ++i)
    if (!same_param(before.params[i], after.params[i]))
      fail(why + ": parameter " + std::to_string(i) + " or its state changed");
}

inline bool all_finite(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors)
    if (!all_finite(t)) return false;
  return true;
}

template <typename T>
Snapshot snapshot(const typename T::Optimizer& opt, const std::vector<at::Tensor>& params) {
  Snapshot s;
  for (const auto& p : params) {
    ParamSnapshot ps;
    ps.param = copy_of(p);
    auto it = opt.state().find(p.unsafeGetTensorImpl());
    if (it != opt.state().end()) {
      const auto& state = static_cast<const typename T::State&>(*it->second);
      ps.has_state = true;
      ps.step = state.step();
      for (const auto& t : T::state_tensors(state)) ps.state.push_back(copy_of(t));
    }
    s.params.push_back(std::move(ps));
  }
  s.counters = T::counters(opt);
  s.states = opt.state().size();
  return s;
}

// Each parameter's group options (null for one in no group).
template <typename T>
std::vector<const typename T::Options*> param_options(const typename T::Optimizer& opt,
                                                      const std::vector<at::Tensor>& params) {
  std::vector<const typename T::Options*> options(params.size(), nullptr);
  for (size_t g = 0; g < opt.param_groups().size(); ++g)
    for (const auto& p : opt.param_groups()[g].params())
      for (size_t i = 0; i < params.size(); ++i)
        if (p.is_same(params[i])) options[i] = &T::group_options(opt, g);
  return options;
}

// Non-finite gradients of parameters that skip alone, and whether any other one skips the step.
struct NonFinite {
  std::vector<bool> skips_alone;
  bool skips_step = false;
  bool grads_finite = true;
};

template <typename T>
NonFinite nonfinite_grads(const std::vector<at::Tensor>& params,
                          const std::vector<const typename T::Options*>& options) {
  NonFinite out;
  out.skips_alone.assign(params.size(), false);
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& grad = params[i].grad();
    if (!grad.defined() || grad.is_sparse() || !grad.is_floating_point()) continue;
    if (all_finite(grad)) continue;
    out.grads_finite = false;
    if (options[i] != nullptr && T::skips_alone(*options[i]))
      out.skips_alone[i] = true;
    else
      out.skips_step = true;
  }
  return out;
}

// The bound for each parameter with its options at this step.
template <typename T>
std::vector<Bound> step_bounds(const typename T::Optimizer& opt,
                               const std::vector<at::Tensor>& params,
                               const std::vector<const typename T::Options*>& options,
                               const std::vector<double>& coeff_bound, const Snapshot& before) {
  std::vector<Bound> bounds(params.size());
  try {
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& grad = params[i].grad();
      if (!grad.defined() || grad.is_sparse() || grad.sizes() != params[i].sizes() ||
          !grad.is_floating_point() || options[i] == nullptr)
        continue;
      bounds[i] =
          T::bound(opt, params[i], *options[i], grad, coeff_bound[i], before.params[i].step + 1);
    }
  } catch (const c10::Error&) {
    // Options the step will reject (unknown wavelet, dim out of range): no bound needed.
  }
  return bounds;
}

// Runs the step: whether it threw a c10::Error (its message in `message`); any other exception
// fails.
template <typename T>
bool step_threw(typename T::Optimizer& opt, const std::vector<at::Tensor>& params,
                std::string& message) {
  bool threw = false;
  try {
    opt.step();
  } catch (const c10::Error& e) {
    threw = true;
    message = e.what_without_backtrace();
  } catch (const std::exception& e) {
    fail(std::string("an exception other than c10::Error: ") + e.what() + "\n" +
         T::describe(params, opt));
  } catch (...) {
    fail("a non-std exception\n" + T::describe(params, opt));
  }
  return threw;
}

// After a step that changed something: the parameters of groups that skip alone that were
// skipped, which keep their value and state (a first step's fresh state may be kept, with step 0).
// Every one with a non-finite gradient must be; one with finite gradients (its norm overflowed)
// is a note, as a whole step so skipped is. The step is `counted` as skipped exactly when one was.
template <typename T>
std::vector<bool> skipped_alone(const std::vector<at::Tensor>& params,
                                const std::vector<const typename T::Options*>& options,
                                const NonFinite& nonfinite, const Snapshot& before,
                                const Snapshot& after, bool counted, const std::string& what,
                                const uint8_t* data, size_t size) {
  std::vector<bool> skipped(params.size(), false);
  bool any_skipped = false;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSnapshot& b = before.params[i];
    const ParamSnapshot& a = after.params[i];
    const bool alone =
        options[i] != nullptr && T::skips_alone(*options[i]) && params[i].grad().defined();
    const bool kept = b.has_state ? same_param(b, a)
                                  : same_bytes(b.param, a.param) && (!a.has_state || a.step == 0);
    if (alone && kept) {
      skipped[i] = any_skipped = true;
      if (!nonfinite.skips_alone[i])
        note("skip-finite-grads", "a parameter with finite gradients was skipped alone\n" + what,
             data, size);
    } else if (nonfinite.skips_alone[i]) {
      fail("a parameter with a non-finite gradient was not skipped alone\n" + what);
    }
  }
  if (any_skipped != counted)
    fail(std::string(counted ? "a step was counted as skipped, but no parameter was"
                             : "a parameter was skipped alone, but the step was not counted") +
         "\n" + what);
  return skipped;
}

// The parameters the step took: each with a gradient advanced its step, one without is unchanged,
// and, with finite inputs within its bound, every result is finite.
template <typename T>
void check_stepped(const typename T::Optimizer& opt, const std::vector<at::Tensor>& params,
                   const std::vector<const typename T::Options*>& options,
                   const std::vector<Bound>& bounds, const std::vector<bool>& skipped,
                   const Snapshot& before, const Snapshot& after, std::vector<double>& coeff_bound,
                   const std::string& what, const uint8_t* data, size_t size) {
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSnapshot& b = before.params[i];
    const ParamSnapshot& a = after.params[i];
    if (skipped[i]) continue;
    if (!params[i].grad().defined()) {
      if (!same_param(b, a)) fail("a parameter without gradient changed\n" + what);
      continue;
    }
    GWT_FUZZ_CHECK(a.has_state && a.step == b.step + 1, what);
    coeff_bound[i] = std::max(coeff_bound[i], bounds[i].coeff);  // NaN-free: inf when unknown
    if (all_finite(a.param) && all_finite(a.state)) continue;
    if (options[i] != nullptr && all_finite(b.state) && T::within(bounds[i], b, *options[i])) {
      std::string which = all_finite(a.param) ? "" : " param";
      const auto names = T::state_names();
      for (size_t k = 0; k < a.state.size(); ++k)
        if (!all_finite(a.state[k])) which += " " + names[k];
      fail("finite, bounded inputs gave a non-finite parameter or state (parameter " +
           std::to_string(i) + ", step " + std::to_string(a.step) + "; not finite:" + which +
           "; bound on |p| " + c10::str(bounds[i].param) + ", on the coefficients " +
           c10::str(bounds[i].coeff) + ", max |p| before " +
           c10::str(max_abs(b.param.to(at::kDouble))) + ", max |g| " +
           c10::str(max_abs(params[i].grad().to(at::kDouble))) + ")\n" + what);
    }
    if (all_finite(b.param) && all_finite(params[i].grad()) && options[i] != nullptr)
      note(T::note_key(opt, params[i], *options[i]),
           "finite but unbounded inputs gave a non-finite parameter or state\n" + what, data, size);
  }
}

// One step with every check in the file comment. coeff_bound[i]: a bound on every coefficient
// parameter i's moments have seen so far.
template <typename T>
void checked_step(typename T::Optimizer& opt, const std::vector<at::Tensor>& params,
                  std::vector<double>& coeff_bound, const uint8_t* data, size_t size) {
  const Snapshot before = snapshot<T>(opt, params);
  const std::vector<const typename T::Options*> options = param_options<T>(opt, params);
  const NonFinite nonfinite = nonfinite_grads<T>(params, options);
  const std::vector<Bound> bounds = step_bounds<T>(opt, params, options, coeff_bound, before);
  std::string message;
  const bool threw = step_threw<T>(opt, params, message);
  const Snapshot after = snapshot<T>(opt, params);
  const std::string what = T::describe(params, opt);
  if (threw) {
    expect_unchanged(before, after, "after the error '" + message + "'\n" + what);
    return;
  }
  const bool counted = after.counters.front() != before.counters.front();
  if (counted) GWT_FUZZ_CHECK(after.counters.front() == before.counters.front() + 1, what);
  bool none_changed = before.states == after.states;
  for (size_t i = 0; i < params.size(); ++i)
    none_changed = none_changed && same_param(before.params[i], after.params[i]);
  if (counted && none_changed) {  // the whole step skipped (or every parameter that had one)
    GWT_FUZZ_CHECK(std::equal(before.counters.begin() + 1, before.counters.end(),
                              after.counters.begin() + 1, after.counters.end()),
                   "after a skipped step\n" + what);
    if (nonfinite.grads_finite)
      note("skip-finite-grads", "a step with finite gradients was skipped as non-finite\n" + what,
           data, size);
    return;
  }
  if (nonfinite.skips_step) fail("a non-finite gradient did not skip the step\n" + what);
  const std::vector<bool> skipped =
      skipped_alone<T>(params, options, nonfinite, before, after, counted, what, data, size);
  check_stepped<T>(opt, params, options, bounds, skipped, before, after, coeff_bound, what, data,
                   size);
}

// The whole case: the optimizer over drawn parameters and groups, then two checked steps.
template <typename T>
int run_case(const uint8_t* data, size_t size) {
  using Optimizer = typename T::Optimizer;
  using Options = typename T::Options;
  FuzzedDataProvider in(data, size);
  const int64_t groups = in.ConsumeIntegralInRange<int64_t>(1, 2);
  const int64_t count = in.ConsumeIntegralInRange<int64_t>(groups, 3);
  std::vector<Options> options;
  for (int64_t g = 0; g < groups; ++g) options.push_back(T::draw_options(in));
  std::vector<at::Tensor> params;
  std::vector<std::vector<at::Tensor>> members(static_cast<size_t>(groups));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t rank = T::draw_rank(in);
    const auto shape = draw_shape(in, rank, 12, 192);
    const at::ScalarType dtype = draw_dtype(in, true);
    const bool specials = in.ConsumeIntegral<uint8_t>() >= 250;
    at::Tensor p = draw_tensor(in, shape, at::kDouble, specials).to(dtype);
    if (rank >= 2 && in.ConsumeIntegral<uint8_t>() >= 224)
      p = p.transpose(0, 1).contiguous().transpose(0, 1);  // a non-contiguous parameter
    params.push_back(p);
    members[static_cast<size_t>(i < groups ? i : in.ConsumeIntegralInRange<int64_t>(0, groups - 1))]
        .push_back(p);
  }
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  for (int64_t g = 0; g < groups; ++g)
    param_groups.emplace_back(members[static_cast<size_t>(g)],
                              std::make_unique<Options>(options[static_cast<size_t>(g)]));
  std::unique_ptr<Optimizer> opt;
  std::vector<at::Tensor> untouched;
  for (const auto& p : params) untouched.push_back(copy_of(p));
  try {
    opt = std::make_unique<Optimizer>(std::move(param_groups), options.front());
  } catch (const c10::Error&) {
    for (size_t i = 0; i < params.size(); ++i)
      GWT_FUZZ_CHECK(same_bytes(params[i], untouched[i]), "constructor changed a param");
    return 0;
  } catch (const std::exception& e) {
    fail(std::string("constructor: an exception other than c10::Error: ") + e.what());
  }
  std::vector<double> coeff_bound(params.size(), 0.0);
  for (int step = 0; step < 2; ++step) {
    if (step == 1) {
      try {
        T::mutate(in, *opt, params);
      } catch (const c10::Error&) {
        // set_data refused a dtype change (a view): the step runs without it.
      }
    }
    for (auto& p : params) p.mutable_grad() = draw_grad(in, p);
    T::before_step(in);
    checked_step<T>(*opt, params, coeff_bound, data, size);
  }
  return 0;
}

}  // namespace gwt_fuzz
