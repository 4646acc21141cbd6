#pragma once

// gwt._C: what the Python binding needs to know of each optimizer (gwt::WaveletAdam,
// gwt::GaLoreAdam): its options, per-parameter state and counters between Python dicts and C++,
// and how a loaded state is checked. optimizers.cpp is written once over these traits.

#include <map>
#include <memory>
#include <string>

#include "binding.h"
#include "gwt/optim/foam_adam.h"
#include "gwt/optim/galore_adam.h"
#include "gwt/optim/wavelet_adam.h"
// Internal (not installed): the optimizers' own checks of a loaded state, which load_state applies
// to a Python state_dict's tensors where they are.
#include "optim/foam_adam_detail.h"
#include "optim/galore_adam_detail.h"
#include "optim/wavelet_adam_detail.h"

namespace gwt_python {

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

struct FoamAdamTraits {
  using Optimizer = gwt::FoamAdam;
  using Options = gwt::FoamAdamOptions;
  using State = gwt::FoamAdamParamState;

  static Options options_from(const py::dict& g) {
    Options o;
    o.lr(option<double>(g, "lr", "a float"))
        .betas(betas_option(g))
        .eps(option<double>(g, "eps", "a float"))
        .weight_decay(option<double>(g, "weight_decay", "a float"))
        .level(option<int64_t>(g, "level", "an int"))
        .scale(option<double>(g, "scale", "a float"))
        .res_scale(option<double>(g, "res_scale", "a float"))
        .correct_bias(option<bool>(g, "correct_bias", "a bool"))
        .dim(option<int64_t>(g, "dim", "an int"))
        .fused(option<bool>(g, "fused", "a bool"))
        .state_dtype(option<std::string>(g, "state_dtype", "a str"))
        .nonfinite(option<std::string>(g, "nonfinite", "a str"))
        .min_size(option<int64_t>(g, "min_size", "an int"));
    return o;
  }

  static void options_to(const Options& o, py::dict& g) {
    g["lr"] = o.lr();
    g["betas"] = py::make_tuple(std::get<0>(o.betas()), std::get<1>(o.betas()));
    g["eps"] = o.eps();
    g["weight_decay"] = o.weight_decay();
    g["level"] = o.level();
    g["scale"] = o.scale();
    g["res_scale"] = o.res_scale();
    g["correct_bias"] = o.correct_bias();
    g["dim"] = o.dim();
    g["fused"] = o.fused();
    g["state_dtype"] = o.state_dtype();
    g["nonfinite"] = o.nonfinite();
    g["min_size"] = o.min_size();
  }

  static std::unique_ptr<State> state_from(const py::dict& d) {
    auto s = adam_state_from<State>(d);
    if (d.contains("skipped")) s->skipped(int_value(d["skipped"], "state 'skipped'"));
    return s;
  }

  static void state_to(const State& s, py::dict& d) {
    adam_state_to(s, d);
    d["skipped"] = s.skipped();
  }

  // What FoamAdam::load checks of a checkpoint's state and how it converts it, on a Python
  // state_dict's tensors, copied once into storage of their own; then the options must fit the
  // next step.
  static void prepare_loaded(const Optimizer& /*opt*/, State& s, const at::Tensor& param,
                             const Options& o, const std::string& where) {
    gwt::foam_adam_detail::prepare_loaded_state(s, param, o, k_who, where, /*own_storage=*/true);
    fits(param, o, s.step() + 1);
  }

  static void fits(const at::Tensor& param, const Options& o, int64_t next_step) {
    gwt::foam_adam_detail::check_options_fit(param, o, next_step);
  }

  static std::map<std::string, int64_t> counters(const Optimizer& opt) {
    return {{"skipped_steps", opt.skipped_steps()}};
  }

  static constexpr const char* k_who = "gwt.FoamAdam.load_state_dict";
};

}  // namespace gwt_python
