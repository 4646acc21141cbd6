// gwt::FoamAdam: the readable ATen rule of FOAM (docs/algorithm.md#foam), its step (checked, then
// taken), its checkpoints and its reports.

#include "gwt/optim/foam_adam.h"

#include <ATen/ATen.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint.h"
#include "common.h"
#include "device_steps.h"
#include "foam_adam_detail.h"
#include "group_checks.h"

namespace gwt {

namespace {

using foam_adam_detail::options_of;
using foam_adam_detail::Plan;
using foam_adam_detail::plan_for;
using optim_detail::compute_dtype;

constexpr const char* k_who = "gwt::FoamAdam";

// ----------------------------------------------------------------------------------------------
// The rule (docs/algorithm.md#foam), in ATen ops
// ----------------------------------------------------------------------------------------------

// The moments as the update reads them, in the math dtype: the state's own tensors, or (moments
// kept narrower, state_dtype("bfloat16")) copies in the math dtype, which store_moments() rounds
// into the state and reads back, so that what follows sees exactly what the next step will.
struct Moments {
  at::Tensor exp_avg, exp_avg_sq;
};

Moments moments_in(const FoamAdamParamState& state, at::ScalarType math) {
  return {state.exp_avg().to(math), state.exp_avg_sq().to(math)};
}

void store_moments(FoamAdamParamState& state, Moments& moments) {
  if (moments.exp_avg.is_same(state.exp_avg())) return;
  state.exp_avg().copy_(moments.exp_avg);
  state.exp_avg_sq().copy_(moments.exp_avg_sq);
  moments = moments_in(state, moments.exp_avg.scalar_type());
}

// The mean of each block of `block` elements along the last dimension: [..., n] to
// [..., ceil(n / block)]. The authors pad the last block with zeros and still divide by `block`;
// the same sums without the padding (with 2^level elements per block, padding could be far larger
// than the row).
at::Tensor block_mean(const at::Tensor& rows, int64_t block) {
  const int64_t n = rows.size(-1), full = n / block, tail = n % block;
  std::vector<at::Tensor> sums;
  if (full > 0)
    sums.push_back(rows.narrow(-1, 0, full * block).unflatten(-1, {full, block}).sum(-1));
  if (tail > 0) sums.push_back(rows.narrow(-1, full * block, tail).sum(-1, /*keepdim=*/true));
  if (sums.empty()) return rows.clone();  // no elements along the row: no blocks
  return at::cat(sums, -1).div_(static_cast<double>(block));
}

// A dense parameter: Adam's update (the authors' rule without a level: no scale).
void dense_update(at::Tensor& param, const at::Tensor& grad, FoamAdamParamState& state,
                  const FoamAdamOptions& o, double step_size) {
  const auto [beta1, beta2] = o.betas();
  Moments moments = moments_in(state, grad.scalar_type());
  moments.exp_avg.mul_(beta1).add_(grad, 1 - beta1);
  moments.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  store_moments(state, moments);
  param.addcdiv_(moments.exp_avg, moments.exp_avg_sq.sqrt().add_(o.eps()), -step_size);
}

// A folded parameter: the moments of the block means of g and g^2, and the residual of g about
// its block means in both moments (rho and rho^2), along the last dimension after moving `dim`
// there.
void folded_update(at::Tensor& param, const at::Tensor& grad, FoamAdamParamState& state,
                   const FoamAdamOptions& o, const Plan& plan, double step_size) {
  const auto [beta1, beta2] = o.betas();
  const double rho = o.res_scale();
  const int64_t block = int64_t{1} << o.level();
  // Views with the folded dimension last (a 0-dim tensor as one row of one element).
  auto rows = [&plan](const at::Tensor& t) {
    return plan.dim < 0 ? t.view({1}) : t.movedim(plan.dim, -1);
  };
  const at::Tensor g = rows(grad);
  // unfold(x): each block's value repeated over its elements, the padding dropped; that is, x read
  // at the block of each element.
  const at::Tensor block_of =
      at::arange(g.size(-1), g.options().dtype(at::kLong)).div_(block, "floor");
  auto unfold = [&block_of](const at::Tensor& x) { return x.index_select(-1, block_of); };

  const at::Tensor mean = block_mean(g, block);
  const at::Tensor mean_sq = block_mean(g * g, block);
  const at::Tensor residual = g - unfold(mean);
  Moments moments = moments_in(state, grad.scalar_type());
  rows(moments.exp_avg).mul_(beta1).add_(mean, 1 - beta1);
  rows(moments.exp_avg_sq).mul_(beta2).add_(mean_sq, 1 - beta2);
  store_moments(state, moments);
  const at::Tensor first = unfold(rows(moments.exp_avg)).add_(residual, rho);
  const at::Tensor second = unfold(rows(moments.exp_avg_sq)).add_(residual.square(), rho * rho);
  const at::Tensor update = (first * o.scale()).div_(second.sqrt_().add_(o.eps()));
  rows(param).add_(update, -step_size);
}

// One parameter's step: in a fused kernel where one takes it (foam_adam_fused.cpp), else by the
// rule above in the math dtype (compute_dtype: float64 stays, everything else float32), then the
// decoupled weight decay (only when positive, as the authors), then the parameter's own dtype.
void update_param(const at::Tensor& param, FoamAdamParamState& state, const FoamAdamOptions& o,
                  const Plan& plan) {
  state.step(state.step() + 1);
  const double step_size =
      optim_detail::adam_step_size(o.lr(), o.betas(), o.correct_bias(), state.step());
  const auto path = foam_adam_detail::path_for(param, o, plan, state.exp_avg().scalar_type());
  if (path != foam_adam_detail::Path::reference) {
    foam_adam_detail::fused_update(param, state, o, path, step_size);
    return;
  }
  const at::ScalarType math = compute_dtype(param);
  at::Tensor value = param.scalar_type() == math ? param : param.to(math);
  const at::Tensor grad = param.grad().to(math);
  if (plan.folded)
    folded_update(value, grad, state, o, plan, step_size);
  else
    dense_update(value, grad, state, o, step_size);
  if (o.weight_decay() > 0) value.add_(value, -o.lr() * o.weight_decay());
  if (!value.is_same(param)) param.copy_(value);
}

// ----------------------------------------------------------------------------------------------
// The step: checked, then taken
// ----------------------------------------------------------------------------------------------

struct Work {
  at::Tensor param;
  const FoamAdamOptions* options;
  Plan plan;
  bool per_param = false;  // nonfinite("skip_param")
};

// The moments must live where the parameter does, contiguous, in a dtype the step keeps them in
// (the math dtype, or bfloat16): a model converted or moved after its first step is an error
// before anything changes, rather than a step in the old type.
void check_placement(const FoamAdamParamState& state, const at::Tensor& param) {
  const at::ScalarType math = compute_dtype(param);
  for (const at::Tensor* t : {&state.exp_avg(), &state.exp_avg_sq()})
    TORCH_CHECK(t->device() == param.device() && t->is_contiguous() &&
                    (t->scalar_type() == math || t->scalar_type() == at::kBFloat16),
                k_who, ": the moments of a ", param.scalar_type(), " parameter of shape ",
                param.sizes(), " on ", param.device(), " are ", t->scalar_type(), " on ",
                t->device(), t->is_contiguous() ? "" : " (not contiguous)", "; they must be ", math,
                " or BFloat16, contiguous, on ", param.device(),
                ". Convert or move the model before the first step, or save the optimizer and load "
                "it again after converting or moving the model");
}

// Pass 1 of a step: checks everything a caller can get wrong (options, parameters, gradients, the
// state they meet) and lists the parameters with a gradient. Reads only.
template <typename StateMap>
std::vector<Work> checked_work(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                               const StateMap& states) {
  std::vector<Work> work;
  optim_detail::for_each_param_to_step<FoamAdamOptions, const FoamAdamParamState>(
      k_who, groups, states,
      [&work](const at::Tensor& param, const FoamAdamOptions& options,
              const FoamAdamParamState* state) {
        Plan plan = plan_for(param, options);
        foam_adam_detail::check_options_fit(param, options,
                                            (state == nullptr ? 0 : state->step()) + 1);
        if (state != nullptr) {
          foam_adam_detail::check_state(*state, param, plan);
          check_placement(*state, param);
        }
        work.push_back({param, &options, std::move(plan), options.nonfinite() == "skip_param"});
      });
  return work;
}

// Whether a NaN or infinity in the gradients of "skip_step" groups skips the whole step (one read
// of each CPU gradient, one synchronisation for the others). The gradients are read last to
// first: the step then updates first the parameters whose gradients were read last, which may
// still be in the cache (on a step larger than the cache, its first tensors' gradients are then
// read from memory once rather than twice).
bool nonfinite_skips_step(const std::vector<Work>& work) {
  std::vector<at::Tensor> grads;
  for (auto w = work.rbegin(); w != work.rend(); ++w)
    if (!w->per_param)
      grads.push_back(optim_detail::grad_for_finite_check(w->param, w->param.grad()));
  return !optim_detail::all_finite(grads);
}

// The state of a parameter about to step: its own, or fresh zero moments (step 0).
template <typename StateMap>
FoamAdamParamState& state_of(StateMap& states, const Work& w) {
  auto& slot = states[w.param.unsafeGetTensorImpl()];
  if (!slot) {
    auto fresh = std::make_unique<FoamAdamParamState>();
    const auto options =
        w.param.options().dtype(foam_adam_detail::state_dtype(w.param, *w.options));
    fresh->exp_avg(at::zeros(w.plan.state_shape, options));
    fresh->exp_avg_sq(at::zeros(w.plan.state_shape, options));
    slot = std::move(fresh);
  }
  return static_cast<FoamAdamParamState&>(*slot);
}

// The step in the multi-tensor kernels (device_steps.h) when every parameter can take them, all
// on one device; false (nothing done) otherwise.
template <typename StateMap>
bool step_on_device(const std::vector<Work>& work, StateMap& states,
                    std::shared_ptr<optim_detail::DeviceSteps>& device_steps) {
  const c10::Device device = work.front().param.device();
  for (const auto& w : work) {
    auto it = states.find(w.param.unsafeGetTensorImpl());
    const at::ScalarType moments =
        it == states.end()
            ? foam_adam_detail::state_dtype(w.param, *w.options)
            : static_cast<const FoamAdamParamState&>(*it->second).exp_avg().scalar_type();
    if (w.param.device() != device ||
        !foam_adam_detail::device_eligible(w.param, *w.options, w.plan, moments))
      return false;
  }
  // Only now, when every parameter qualifies, is a missing state created: the pass above only
  // reads (a second lookup per parameter rather than a fresh state left behind by a step that
  // then runs on the host).
  std::vector<optim_detail::DeviceItem> items;
  for (const auto& w : work)
    items.push_back(
        foam_adam_detail::device_item(w.param, state_of(states, w), *w.options, w.plan));
  if (!device_steps) device_steps = std::make_shared<optim_detail::DeviceSteps>(k_who);
  device_steps->step(items);
  return true;
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// FoamAdam
// ----------------------------------------------------------------------------------------------

// The groups go through our add_param_group, not LibTorch's (which would replace their options
// with the defaults).
FoamAdam::FoamAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                   FoamAdamOptions defaults)
    : Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                std::make_unique<FoamAdamOptions>(defaults)) {
  validate_options(defaults);
  for (const auto& group : param_groups) add_param_group(group);
}

FoamAdam::FoamAdam(std::vector<at::Tensor> params, FoamAdamOptions defaults)
    : FoamAdam({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

void FoamAdam::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  const size_t index = param_groups_.size();
  auto options = optim_detail::options_to_add<FoamAdamOptions>(*this, param_group, index, k_who,
                                                               "gwt::FoamAdamOptions");
  optim_detail::check_params_to_add(k_who, param_groups_, param_group.params(), index);
  for (const auto& param : param_group.params()) plan_for(param, *options);  // dim in range
  // Everything checked: commit.
  torch::optim::OptimizerParamGroup group(param_group.params());
  group.set_options(std::move(options));
  param_groups_.push_back(std::move(group));
}

const FoamAdamOptions& FoamAdam::group_options(size_t i) const {
  TORCH_CHECK(i < param_groups().size(), k_who, ": group ", i, " does not exist (there are ",
              param_groups().size(), ")");
  return options_of(param_groups()[i]);
}

// A skipped parameter keeps its value and state; on its first step the fresh, zero state is kept
// with step 0 (the same as none), and it holds the count.
at::Tensor FoamAdam::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  // Pass 1: check everything a caller can get wrong; nothing has changed yet.
  const std::vector<Work> work = checked_work(param_groups(), state_);
  if (work.empty()) return loss;
  // CUDA: when every parameter of the step can take the multi-tensor kernels, one step of them,
  // deciding on the device what the loop below decides on the host (a skipped first step keeps
  // the fresh, zero state with step 0, as "skip_param" does). Otherwise the host's counts are
  // brought up to date and the step goes on below.
  if (step_on_device(work, state_, device_steps_)) return loss;
  if (device_steps_ && !device_steps_->empty()) {
    sync_device_steps();
    device_steps_->clear();
  }
  if (nonfinite_skips_step(work)) {
    ++skipped_steps_;
    return loss;
  }
  bool skipped_any = false;
  for (const auto& w : work) {
    auto& state = state_of(state_, w);
    if (w.per_param &&
        !optim_detail::all_finite({optim_detail::grad_for_finite_check(w.param, w.param.grad())})) {
      state.skipped(state.skipped() + 1);
      skipped_any = true;
      continue;
    }
    update_param(w.param, state, *w.options, w.plan);
  }
  if (skipped_any) ++skipped_steps_;
  return loss;
}

// ----------------------------------------------------------------------------------------------
// Checkpoints (the layout of checkpoint.h: per group its options and its parameters' state by
// position, and a digest of each parameter; load() checks everything before it changes anything)
// ----------------------------------------------------------------------------------------------

namespace {
constexpr const char* k_format = "gwt.FoamAdam.v1";
}  // namespace

void FoamAdam::save(torch::serialize::OutputArchive& archive) const {
  sync_device_steps();
  optim_detail::save_checkpoint<FoamAdamOptions, FoamAdamParamState>(
      *this, archive, k_format, {{"skipped_steps", skipped_steps_}});
  optim_detail::save_param_digests(*this, archive);
}

void FoamAdam::load(torch::serialize::InputArchive& archive) {
  // Parameters reordered (or moved between groups) since the save, seen by their bytes; only for
  // our own format (load_checkpoint reports any other).
  c10::IValue format;
  if (archive.try_read("format", format) && format.isString() && format.toStringRef() == k_format)
    optim_detail::check_param_digests(*this, archive, k_who);
  const auto where = optim_detail::param_positions(*this);
  const auto counters = optim_detail::load_checkpoint<FoamAdamOptions, FoamAdamParamState>(
      *this, archive, k_format, {"skipped_steps"}, k_who,
      [&where](FoamAdamParamState& state, const at::Tensor& param, const FoamAdamOptions& options) {
        foam_adam_detail::prepare_loaded_state(state, param, options, "gwt::FoamAdam::load",
                                               where.at(param.unsafeGetTensorImpl()),
                                               /*own_storage=*/false);
      },
      [](const at::Tensor& param, const FoamAdamOptions& options, int64_t next_step) {
        // As add_param_group and step() check every parameter, with state or without.
        plan_for(param, options);
        foam_adam_detail::check_options_fit(param, options, next_step);
      });
  skipped_steps_ = counters.at("skipped_steps");
  if (device_steps_) device_steps_->clear();  // the loaded counts are the host's
}

// ----------------------------------------------------------------------------------------------
// Reports
// ----------------------------------------------------------------------------------------------

int64_t FoamAdam::state_bytes(const at::Tensor& param) const {
  auto it = state_.find(param.unsafeGetTensorImpl());
  if (it == state_.end()) return 0;
  const auto& state = static_cast<const FoamAdamParamState&>(*it->second);
  return static_cast<int64_t>(state.exp_avg().nbytes() + state.exp_avg_sq().nbytes());
}

int64_t FoamAdam::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& group : param_groups())
    for (const auto& param : group.params()) bytes += state_bytes(param);
  return bytes;
}

void FoamAdam::sync_device_steps() const {
  if (!device_steps_ || device_steps_->empty()) return;
  // Logically const: the host's copy of the counts catches up with the device's.
  auto& states = const_cast<FoamAdam&>(*this).state_;
  device_steps_->sync(
      [&states](const void* key, optim_detail::DeviceSlots& slots) {
        auto it = states.find(const_cast<void*>(key));
        if (it == states.end()) return false;
        auto& state = static_cast<FoamAdamParamState&>(*it->second);
        slots.step = &state.step(), slots.skipped = &state.skipped();
        return true;
      },
      skipped_steps_);
}

int64_t FoamAdam::skipped_steps() const {
  sync_device_steps();
  return skipped_steps_;
}

int64_t FoamAdam::skipped_steps(const at::Tensor& param) const {
  sync_device_steps();
  auto it = state_.find(param.unsafeGetTensorImpl());
  return it == state_.end() ? 0 : static_cast<const FoamAdamParamState&>(*it->second).skipped();
}

namespace {
// The options of the group `param` is in, or an error naming `caller`.
const FoamAdamOptions& options_for(const torch::optim::Optimizer& optimizer,
                                   const at::Tensor& param, const char* caller) {
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params())
      if (p.is_same(param)) return options_of(group);
  TORCH_CHECK(false, k_who, "::", caller, ": the tensor is not a parameter of this optimizer");
}
}  // namespace

bool FoamAdam::is_folded_param(const at::Tensor& param) const {
  return plan_for(param, options_for(*this, param, "is_folded_param")).folded;
}

bool FoamAdam::is_fused_param(const at::Tensor& param) const {
  const FoamAdamOptions& o = options_for(*this, param, "is_fused_param");
  auto it = state_.find(param.unsafeGetTensorImpl());
  const at::ScalarType moments =
      it == state_.end()
          ? foam_adam_detail::state_dtype(param, o)
          : static_cast<const FoamAdamParamState&>(*it->second).exp_avg().scalar_type();
  const Plan plan = plan_for(param, o);
  if (!param.device().is_cpu())
    return foam_adam_detail::device_kernel_takes(param, o, plan, moments);
  return foam_adam_detail::path_for(param, o, plan, moments) != foam_adam_detail::Path::reference;
}

}  // namespace gwt
