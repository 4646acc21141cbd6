#include "gwt/nn/rank_schedule.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>

#include "gwt/optim/wavelet_adam.h"
#include "gwt/wavelet.h"

namespace gwt {
namespace nn {

namespace {

// `t` zero-padded at the end of every dimension to `shape` (each at least t's size).
at::Tensor padded(const at::Tensor& t, c10::IntArrayRef shape) {
  at::Tensor out = at::zeros(shape, t.options());
  at::Tensor view = out;
  for (const auto d : c10::irange(t.dim())) view = view.narrow(d, 0, t.size(d));
  view.copy_(t);
  return out;
}

template <typename State>
bool pad_adam_state(torch::optim::OptimizerParamState& base, const at::Tensor& param) {
  auto* s = dynamic_cast<State*>(&base);
  if (s == nullptr) return false;
  s->exp_avg(padded(s->exp_avg(), param.sizes()));
  s->exp_avg_sq(padded(s->exp_avg_sq(), param.sizes()));
  if (s->max_exp_avg_sq().defined() && s->max_exp_avg_sq().numel() > 0)
    s->max_exp_avg_sq(padded(s->max_exp_avg_sq(), param.sizes()));
  return true;
}

const WaveletAdamOptions* wavelet_options_of(const WaveletAdam& opt, const at::Tensor& param) {
  for (const auto g : c10::irange(opt.param_groups().size()))
    for (const auto& p : opt.param_groups()[g].params())
      if (p.is_same(param)) return &opt.group_options(g);
  return nullptr;
}

// WaveletAdam state of a grown parameter whose old shape was `old_shape`: padded where the kept
// columns' coefficients are unchanged by the growth, else false (restart).
bool pad_wavelet_state(WaveletAdam& opt, WaveletAdamParamState& s, const at::Tensor& param,
                       c10::IntArrayRef old_shape) {
  const WaveletAdamOptions* o = wavelet_options_of(opt, param);
  if (o == nullptr) return false;
  const bool was_dense = s.exp_avg().sizes() == old_shape;
  const bool is_wavelet = opt.is_wavelet_param(param);
  std::vector<int64_t> shape = param.sizes().vec();
  if (was_dense) {
    if (is_wavelet) return false;  // crossed into the wavelet path: a new kind of state
  } else {
    const int64_t last = param.dim() - 1;
    const bool along_last = o->transform() == "1d" && (o->dim() == -1 || o->dim() == last);
    const Wavelet wavelet(o->wavelet());
    const int64_t block = int64_t{1} << o->level();
    if (!is_wavelet || !along_last || wavelet.length() != 2 || old_shape[last] % block != 0)
      return false;
    shape[last] =
        approx_len(param.size(last), wavelet, o->level(), boundary_mode_from_string(o->boundary()));
  }
  s.exp_avg(padded(s.exp_avg(), shape));
  s.exp_avg_sq(padded(s.exp_avg_sq(), shape));
  return true;
}

}  // namespace

ResizeReport resize_rank(DeltaLinear& layer, int64_t k_new, torch::optim::Optimizer& optimizer) {
  ResizeReport report;
  report.from = layer->rank();
  // The shapes before, to tell which state belongs to which path.
  std::vector<std::pair<std::string, at::Tensor*>> parts = {
      {"U", &layer->U}, {"V", &layer->V}, {"core", &layer->core}};
  std::vector<std::vector<int64_t>> old_shapes;
  for (const auto& [name, t] : parts)
    old_shapes.push_back(t->defined() ? t->sizes().vec() : std::vector<int64_t>{});
  report.error = layer->resize_rank(k_new);  // checks k_new; throws with nothing changed
  report.to = layer->rank();
  const bool grown = report.to > report.from;
  auto& state = optimizer.state();
  for (const auto i : c10::irange(parts.size())) {
    const auto& [name, t] = parts[i];
    if (!t->defined()) continue;
    auto it = state.find(t->unsafeGetTensorImpl());
    if (it == state.end()) {
      report.state.emplace_back(name, StateFollow::none);
      continue;
    }
    bool kept = false;
    if (grown && !old_shapes[i].empty()) {
      auto& base = *it->second;
      kept = pad_adam_state<torch::optim::AdamWParamState>(base, *t) ||
             pad_adam_state<torch::optim::AdamParamState>(base, *t);
      if (!kept) {
        auto* w = dynamic_cast<WaveletAdam*>(&optimizer);
        auto* ws = dynamic_cast<WaveletAdamParamState*>(&base);
        if (w != nullptr && ws != nullptr) kept = pad_wavelet_state(*w, *ws, *t, old_shapes[i]);
      }
    }
    if (!kept) state.erase(it);
    report.state.emplace_back(name, kept ? StateFollow::kept : StateFollow::restarted);
  }
  return report;
}

RankSchedule::RankSchedule(std::vector<std::pair<std::string, DeltaLinear>> adapters,
                           torch::optim::Optimizer& optimizer, RankScheduleOptions options)
    : adapters_(std::move(adapters)), optimizer_(optimizer), options_(options) {
  TORCH_CHECK(options_.every() >= 1, "gwt::nn::RankSchedule: every must be >= 1, got ",
              options_.every());
  TORCH_CHECK(options_.step() >= 1, "gwt::nn::RankSchedule: step must be >= 1, got ",
              options_.step());
  TORCH_CHECK(
      std::isfinite(options_.threshold()) && options_.threshold() > 0 && options_.threshold() < 1,
      "gwt::nn::RankSchedule: threshold must be in (0, 1), got ", options_.threshold());
  // At rank 0 there is no delta whose spectrum could ask for more: a layer shrunk to 0 would stay
  // there. So min_rank is at least 1, and a layer below it (built at rank 0, say) grows to it.
  TORCH_CHECK(options_.min_rank() >= 1 && options_.min_rank() <= options_.max_rank(),
              "gwt::nn::RankSchedule: need 1 <= min_rank <= max_rank, got ", options_.min_rank(),
              " and ", options_.max_rank(),
              " (min_rank must be >= 1: a layer at rank 0 has no delta to measure, so it could "
              "never grow again)");
  for (const auto& [name, a] : adapters_)
    TORCH_CHECK(!a.is_empty(), "gwt::nn::RankSchedule: adapter '", name, "' is empty");
}

double RankSchedule::tail_energy(const DeltaLinear& layer, int64_t step) {
  const int64_t k = layer->rank();
  if (k == 0) return 0.0;
  at::NoGradGuard no_grad;
  const at::Tensor s = at::linalg_svdvals(layer->delta_weight().to(at::kDouble));
  const double total = s.pow(2).sum().item<double>();
  if (total == 0) return 0.0;
  if (k <= step) return 1.0;
  // The delta has rank <= k: its singular values past k are rounding.
  const double tail = s.narrow(0, k - step, step).pow(2).sum().item<double>();
  return std::sqrt(tail / total);
}

std::vector<RankSchedule::Change> RankSchedule::step() {
  ++step_count_;
  std::vector<Change> changes;
  if (step_count_ % options_.every() != 0) return changes;
  for (auto& [name, layer] : adapters_) {
    const int64_t k = layer->rank();
    const auto& o = layer->options();
    const int64_t top = std::min(options_.max_rank(), std::min(o.in_features(), o.out_features()));
    const double e = tail_energy(layer, options_.step());
    int64_t k_new = k;
    if (k < options_.min_rank())
      k_new = std::min(options_.min_rank(), top);
    else if (e > options_.threshold() && k + options_.step() <= top)
      k_new = k + options_.step();
    else if (e < options_.threshold() / 2 && k - options_.step() >= options_.min_rank())
      k_new = k - options_.step();
    if (k_new == k) continue;
    const ResizeReport r = resize_rank(layer, k_new, optimizer_);
    changes.push_back({name, k, k_new, e, r.error});
  }
  return changes;
}

}  // namespace nn
}  // namespace gwt
