// gwt::WaveletAdam: its parameter groups, its step (checked, then planned, then taken by the
// paths of wavelet_adam_step.h) and its reports.

#include "gwt/optim/wavelet_adam.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common.h"
#include "device_steps.h"
#include "gwt/wavelet.h"
#include "kernels/kernels.h"
#include "wavelet_adam_detail.h"
#include "wavelet_adam_step.h"

namespace gwt {

namespace {

using optim_detail::compute_dtype;
using wavelet_adam_detail::assign_carry;
using wavelet_adam_detail::check_options_fit;
using wavelet_adam_detail::check_state;
using wavelet_adam_detail::dense_fusable;
using wavelet_adam_detail::dense_update;
using wavelet_adam_detail::fused_norm_pass;
using wavelet_adam_detail::fused_update;
using wavelet_adam_detail::general_args;
using wavelet_adam_detail::options_of;
using wavelet_adam_detail::Path;
using wavelet_adam_detail::path_for;
using wavelet_adam_detail::Plan;
using wavelet_adam_detail::plan_for;
using wavelet_adam_detail::reference_update;
using wavelet_adam_detail::state_dtype;
using wavelet_adam_detail::wavelet_named;
using wavelet_adam_detail::Work;

void check_param(const at::Tensor& param) {
  optim_detail::check_param("gwt::WaveletAdam", param);
}

const WaveletAdamOptions& options_of_defaults(const torch::optim::Optimizer& optimizer) {
  return static_cast<const WaveletAdamOptions&>(optimizer.defaults());
}

double step_size_of(const WaveletAdamOptions& o, int64_t step) {
  return optim_detail::adam_step_size(o.lr(), o.betas(), o.correct_bias(), step);
}

void update_param(const Work& work) {
  WaveletAdamParamState& state = *work.state;
  state.step(state.step() + 1);
  const double step_size = step_size_of(*work.options, state.step());
  if (work.path != Path::reference)
    fused_update(work, state, step_size);
  else if (dense_fusable(work, state))
    dense_update(work, state, step_size);
  else
    reference_update(work, state, step_size);
}

// Whether a parameter's step can run in the multi-tensor CUDA kernels (device_steps.h):
// fused Haar or dense, contiguous, its gradient of its dtype, on `device`.
bool device_eligible(const Work& w, const c10::Device& device) {
  const at::Tensor& p = w.param;
  const at::Tensor& g = p.grad();
  const bool haar = w.path == Path::haar, dense = !w.plan.wavelet && w.options->fused();
  const bool general = w.path == Path::general;
  return p.device() == device && (haar || dense || general) &&
         optim_detail::device_steps_run_on(device) && p.is_contiguous() &&
         g.scalar_type() == p.scalar_type() && g.is_contiguous() && g.layout() == at::kStrided;
}

// Pass 1 of a step: checks everything a caller can get wrong (options, parameters, gradients, the
// state they meet) and says how each parameter with a gradient will be stepped. Reads only; `State`
// is the optimizer's state map.
template <typename State>
std::vector<Work> checked_work(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                               const State& state) {
  std::vector<Work> work;
  for (const auto i : c10::irange(groups.size())) {
    const auto& group = groups[i];
    const WaveletAdamOptions& options = options_of(group);
    validate_options(options);
    for (const auto& param : group.params()) {
      check_param(param);
      const at::Tensor& grad = param.grad();
      if (!grad.defined()) continue;
      optim_detail::check_grad("gwt::WaveletAdam", param, grad);
      Plan plan = plan_for(param, options);
      auto it = state.find(param.unsafeGetTensorImpl());
      check_options_fit(
          param, options,
          (it == state.end() ? 0 : static_cast<const WaveletAdamParamState&>(*it->second).step()) +
              1);
      if (it != state.end()) {
        const auto& saved = static_cast<const WaveletAdamParamState&>(*it->second);
        check_state(saved, param, plan);
        // The kernels take raw pointers: the moments must live where the parameter does, in a
        // type they read (the parameter's math type, or bfloat16).
        for (const at::Tensor* t : {&saved.exp_avg(), &saved.exp_avg_sq()}) {
          TORCH_CHECK(t->device() == param.device() && t->is_contiguous(),
                      "gwt::WaveletAdam: the moments of a parameter on ", param.device(),
                      " are on ", t->device(), t->is_contiguous() ? "" : " (not contiguous)",
                      "; move the model before the first step, or save the optimizer and load "
                      "it again after moving the model");
          TORCH_CHECK(t->scalar_type() == at::kBFloat16 || t->scalar_type() == compute_dtype(param),
                      "gwt::WaveletAdam: the moments of a ", param.scalar_type(), " parameter are ",
                      t->scalar_type(), " (valid: ", compute_dtype(param),
                      " or BFloat16); convert the model before the first step, or save the "
                      "optimizer and load it again after converting the model");
        }
      }
      Work w;
      w.param = param;
      w.options = &options;
      w.per_param = options.nonfinite() == "skip_param";
      w.path = path_for(param, options, plan);
      // The CUDA bodies read a gradient in its parameter's type: a float16/bfloat16 parameter with
      // a gradient of another type takes the reference there, which reads it in float32 (the CPU
      // bodies read such a gradient as float32 themselves: HaarAdamArgs::grad_f32).
      if (w.path != Path::reference && param.is_cuda() &&
          grad.scalar_type() != param.scalar_type() && compute_dtype(param) != param.scalar_type())
        w.path = Path::reference;
      w.plan = std::move(plan);
      if (it != state.end()) w.state = static_cast<WaveletAdamParamState*>(it->second.get());
      work.push_back(std::move(w));
    }
  }
  return work;
}

// Fresh state for first steps, committed only if the step is taken.
void add_fresh_states(std::vector<Work>& work) {
  for (auto& w : work) {
    if (w.state != nullptr) continue;
    w.fresh_state = std::make_unique<WaveletAdamParamState>();
    const auto options = w.param.options().dtype(state_dtype(w.param, *w.options));
    w.fresh_state->exp_avg(at::zeros(w.plan.state_shape, options));
    w.fresh_state->exp_avg_sq(at::zeros(w.plan.state_shape, options));
    w.state = w.fresh_state.get();
  }
}

// Whether every parameter of the step can take the multi-tensor kernels, all on one device.
bool all_device_eligible(const std::vector<Work>& work) {
  const c10::Device first_device = work.front().param.device();
  return std::all_of(work.begin(), work.end(),
                     [&](const Work& w) { return device_eligible(w, first_device); });
}

// A parameter's step as the multi-tensor kernels take it: its kind and geometry (Haar, general
// rows or dense), its options' values, and where its counts, limiter norm and kept details live.
optim_detail::DeviceItem device_item(const Work& w) {
  namespace mt = kernels::mt;
  const WaveletAdamOptions& o = *w.options;
  WaveletAdamParamState& state = *w.state;
  const at::Tensor& p = w.param;
  optim_detail::DeviceItem item;
  item.param = p, item.exp_avg = state.exp_avg(), item.exp_avg_sq = state.exp_avg_sq();
  item.slots.step = &state.step(), item.slots.skipped = &state.skipped();
  item.slots.kept_details = &state.kept_details();
  item.slots.total_details = &state.total_details();
  mt::TensorMeta& t = item.meta;
  if (w.path == Path::general) {
    item.general = general_args(w, 0.0);
    t.kind = mt::Kind::general;
    t.n = item.general.n, t.rows = item.general.rows, t.approx_len = item.general.approx_len;
  } else if (w.path == Path::haar) {
    t.n = p.size(-1);
    t.rows = p.numel() / t.n;
    t.two_d = w.plan.two_d;
    if (t.two_d) t.height = p.size(-2);
    mt::complete_haar_meta(t, o.level());
  } else {
    t.kind = mt::Kind::dense;
    t.n = p.numel();
    t.rows = 1;
  }
  const bool limiter = t.kind != mt::Kind::dense && o.norm_growth_limit() > 0;
  if (limiter) item.slots.norm = &state.norm();
  std::tie(t.beta1, t.beta2) = o.betas();
  t.eps = o.eps(), t.lr = o.lr(), t.weight_decay = o.weight_decay(), t.scale = o.scale();
  t.gamma = limiter ? o.norm_growth_limit() : 0.0;
  t.correct_bias = o.correct_bias();
  t.skip_param = o.nonfinite() == "skip_param";
  return item;
}

// The step in the multi-tensor kernels (all_device_eligible), which decide on the device what
// step_params decides on the host; the fresh states are committed first. `State` is the
// optimizer's state map.
template <typename State>
void step_on_device(std::vector<Work>& work, State& state,
                    std::shared_ptr<optim_detail::DeviceSteps>& device_steps) {
  std::vector<optim_detail::DeviceItem> items;
  for (auto& w : work) {
    if (w.fresh_state) state[w.param.unsafeGetTensorImpl()] = std::move(w.fresh_state);
    if (w.path == Path::general) {
      w.grad = w.param.grad();  // of the parameter's dtype and contiguous (device_eligible)
      w.wavelet = &wavelet_named(w.options->wavelet());
    }
    items.push_back(device_item(w));
  }
  if (!device_steps) device_steps = std::make_shared<optim_detail::DeviceSteps>("gwt::WaveletAdam");
  device_steps->step(items);
}

// What is left to check of a parameter's gradient for a NaN or infinity, after the fused norm pass
// where it has one: the gradient (reference path), the norm on the device, or nothing when the CPU
// norm pass's result (a double) was checked already (`host_nonfinite` is set when it is not
// finite).
at::Tensor left_to_check(Work& w, bool& host_nonfinite) {
  if (w.path == Path::reference)
    return optim_detail::grad_for_finite_check(w.param, w.param.grad());
  fused_norm_pass(w);
  if (!w.param.is_cuda() && !std::isfinite(w.norm_sq_host)) host_nonfinite = true;
  return w.norm_sq;
}

// A NaN or infinity in any gradient of a "skip_step" group skips the whole step. The fused norm
// pass reads only and turns NaN on such a gradient, so it is the check for its parameters; other
// CPU gradients take one read each, gradients on other devices one synchronisation for all of
// them. Parameters of "skip_param" groups are checked one by one (step_params).
bool nonfinite_skips_step(std::vector<Work>& work) {
  bool host_nonfinite = false;
  std::vector<at::Tensor> to_check;
  for (auto& w : work) {
    if (w.per_param) continue;
    at::Tensor check = left_to_check(w, host_nonfinite);
    if (check.defined()) to_check.push_back(std::move(check));
  }
  return host_nonfinite || !optim_detail::all_finite(to_check);
}

// The updates, with the fresh states committed. "skip_param": the norm pass, the check and the
// update of one parameter back to back, while its gradient is in the cache. A skipped parameter
// keeps its value and state (a first step's fresh, zero state is kept with step 0: the same as
// none, and it holds the count). Returns whether a parameter was skipped.
template <typename State>
bool step_params(std::vector<Work>& work, State& state) {
  bool skipped_any = false;
  for (auto& w : work) {
    bool skip = false;
    if (w.per_param) {
      bool host_nonfinite = false;
      const at::Tensor check = left_to_check(w, host_nonfinite);
      skip = host_nonfinite || (check.defined() && !optim_detail::all_finite({check}));
    }
    if (w.fresh_state) state[w.param.unsafeGetTensorImpl()] = std::move(w.fresh_state);
    if (skip) {
      w.state->skipped(w.state->skipped() + 1);
      skipped_any = true;
      continue;
    }
    update_param(w);
  }
  return skipped_any;
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// WaveletAdam
// ----------------------------------------------------------------------------------------------

// The groups go through our add_param_group, not LibTorch's (which would merge their options
// into the defaults field by field only for LibTorch's own optimizers).
WaveletAdam::WaveletAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                         WaveletAdamOptions defaults)
    : Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                std::make_unique<WaveletAdamOptions>(defaults)) {
  validate_options(defaults);
  for (const auto& group : param_groups) add_param_group(group);
}

void WaveletAdam::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  const size_t index = param_groups_.size();
  std::unique_ptr<WaveletAdamOptions> options;
  if (param_group.has_options()) {
    const auto* given = dynamic_cast<const WaveletAdamOptions*>(&param_group.options());
    TORCH_CHECK(given != nullptr, "gwt::WaveletAdam: parameter group ", index,
                " has options of another optimizer; give it gwt::WaveletAdamOptions");
    options = std::make_unique<WaveletAdamOptions>(*given);
  } else {
    options = std::make_unique<WaveletAdamOptions>(options_of_defaults(*this));
  }
  validate_options(*options);
  std::unordered_set<const void*> seen;
  for (const auto& group : param_groups_)
    for (const auto& param : group.params()) seen.insert(param.unsafeGetTensorImpl());
  for (const auto& param : param_group.params()) {
    check_param(param);
    TORCH_CHECK(param.is_leaf(), "gwt::WaveletAdam: parameter group ", index,
                " holds a non-leaf tensor of shape ", param.sizes(),
                "; optimize leaf tensors (e.g. detach().requires_grad_())");
    TORCH_CHECK(seen.insert(param.unsafeGetTensorImpl()).second,
                "gwt::WaveletAdam: a parameter of shape ", param.sizes(),
                " appears more than once (each parameter may be in one group once)");
    plan_for(param, *options);  // checks dim against the parameter's rank
  }
  // Everything checked: commit.
  torch::optim::OptimizerParamGroup group(param_group.params());
  group.set_options(std::move(options));
  param_groups_.push_back(std::move(group));
}

WaveletAdam::WaveletAdam(std::vector<at::Tensor> params, WaveletAdamOptions defaults)
    : WaveletAdam({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

const WaveletAdamOptions& WaveletAdam::group_options(size_t i) const {
  TORCH_CHECK(i < param_groups().size(), "gwt::WaveletAdam: group ", i,
              " does not exist (there are ", param_groups().size(), ")");
  return options_of(param_groups()[i]);
}

void WaveletAdam::check_step() const {
  at::NoGradGuard no_grad;
  checked_work(param_groups(), state_);
}

at::Tensor WaveletAdam::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }

  // Pass 1: check everything a caller can get wrong; nothing has changed yet.
  std::vector<Work> work = checked_work(param_groups(), state_);
  if (work.empty()) return loss;
  add_fresh_states(work);
  assign_carry(work, carry_);

  // CUDA: when every parameter of the step can take the multi-tensor kernels, one step of them,
  // deciding on the device what the loop below decides on the host (a skipped first step keeps
  // the fresh, zero state with step 0, as "skip_param" does). Otherwise the host's counts are
  // brought up to date and the step goes on below.
  if (all_device_eligible(work)) {
    step_on_device(work, state_, device_steps_);
    return loss;
  }
  if (device_steps_ && !device_steps_->empty()) {
    sync_device_steps();
    device_steps_->clear();
  }

  if (nonfinite_skips_step(work)) {
    ++skipped_steps_;
    return loss;
  }
  if (step_params(work, state_)) ++skipped_steps_;
  return loss;
}

// ----------------------------------------------------------------------------------------------
// Reports
// ----------------------------------------------------------------------------------------------

int64_t WaveletAdam::state_bytes(const at::Tensor& param) const {
  auto it = state_.find(param.unsafeGetTensorImpl());
  if (it == state_.end()) return 0;
  const auto& state = static_cast<const WaveletAdamParamState&>(*it->second);
  int64_t bytes = 0;
  for (const at::Tensor* t : {&state.exp_avg(), &state.exp_avg_sq(), &state.norm()})
    if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  return bytes;
}

int64_t WaveletAdam::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& group : param_groups())
    for (const auto& param : group.params()) bytes += state_bytes(param);
  return bytes;
}

std::pair<int64_t, int64_t> WaveletAdam::kept_details() const {
  sync_device_steps();
  int64_t kept = 0, total = 0;
  for (const auto& item : state_) {
    const auto& s = static_cast<const WaveletAdamParamState&>(*item.second);
    if (s.total_details() < 0) continue;
    kept += s.kept_details(), total += s.total_details();
  }
  return {kept, total};
}

void WaveletAdam::sync_device_steps() const {
  if (!device_steps_ || device_steps_->empty()) return;
  // Logically const: the host's copy of the counts catches up with the device's.
  auto& self = const_cast<WaveletAdam&>(*this);
  device_steps_->sync(
      [&self](const void* key, optim_detail::DeviceSlots& slots) {
        auto it = self.state_.find(const_cast<void*>(key));
        if (it == self.state_.end()) return false;
        auto& state = static_cast<WaveletAdamParamState&>(*it->second);
        slots.step = &state.step(), slots.skipped = &state.skipped(), slots.norm = &state.norm();
        slots.kept_details = &state.kept_details();
        slots.total_details = &state.total_details();
        return true;
      },
      skipped_steps_);
}

int64_t WaveletAdam::skipped_steps() const {
  sync_device_steps();
  return skipped_steps_;
}

int64_t WaveletAdam::skipped_steps(const at::Tensor& param) const {
  sync_device_steps();
  auto it = state_.find(param.unsafeGetTensorImpl());
  return it == state_.end() ? 0 : static_cast<const WaveletAdamParamState&>(*it->second).skipped();
}

bool WaveletAdam::is_fused_param(const at::Tensor& param) const {
  for (const auto& group : param_groups())
    for (const auto& p : group.params())
      if (p.is_same(param)) {
        const auto& options = options_of(group);
        return path_for(param, options, plan_for(param, options)) != Path::reference;
      }
  TORCH_CHECK(false,
              "gwt::WaveletAdam::is_fused_param: the tensor is not a parameter of this optimizer");
}

bool WaveletAdam::is_wavelet_param(const at::Tensor& param) const {
  for (const auto& group : param_groups())
    for (const auto& p : group.params())
      if (p.is_same(param)) return plan_for(param, options_of(group)).wavelet;
  TORCH_CHECK(
      false, "gwt::WaveletAdam::is_wavelet_param: the tensor is not a parameter of this optimizer");
}

}  // namespace gwt
