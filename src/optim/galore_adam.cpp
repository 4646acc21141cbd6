#include "gwt/optim/galore_adam.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/irange.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "checkpoint.h"
#include "common.h"
#include "galore_adam_detail.h"

namespace gwt {

using galore_adam_detail::check_options_fit;
using galore_adam_detail::check_state;
using galore_adam_detail::Plan;
using galore_adam_detail::plan_for;

namespace {
constexpr const char* k_who = "gwt::GaLoreAdam";
c10::IValue read_value(torch::serialize::InputArchive& archive, const std::string& key,
                       const char* what) {
  return optim_detail::read_value(archive, key, what, k_who);
}
}  // namespace

// ----------------------------------------------------------------------------------------------
// Options and state
// ----------------------------------------------------------------------------------------------

GaLoreAdamOptions::GaLoreAdamOptions(double lr) : lr_(lr) {}
double GaLoreAdamOptions::get_lr() const {
  return lr();
}
void GaLoreAdamOptions::set_lr(const double lr) {
  this->lr(lr);
}

bool operator==(const GaLoreAdamOptions& a, const GaLoreAdamOptions& b) {
  return a.lr() == b.lr() && a.betas() == b.betas() && a.eps() == b.eps() &&
         a.weight_decay() == b.weight_decay() && a.rank() == b.rank() &&
         a.update_proj_gap() == b.update_proj_gap() && a.scale() == b.scale() &&
         a.proj_type() == b.proj_type() && a.svd() == b.svd() && a.oversample() == b.oversample() &&
         a.power_iters() == b.power_iters() && a.correct_bias() == b.correct_bias();
}

void GaLoreAdamOptions::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr()));
  archive.write("beta1", c10::IValue(std::get<0>(betas())));
  archive.write("beta2", c10::IValue(std::get<1>(betas())));
  archive.write("eps", c10::IValue(eps()));
  archive.write("weight_decay", c10::IValue(weight_decay()));
  archive.write("rank", c10::IValue(rank()));
  archive.write("update_proj_gap", c10::IValue(update_proj_gap()));
  archive.write("scale", c10::IValue(scale()));
  archive.write("proj_type", c10::IValue(proj_type()));
  archive.write("svd", c10::IValue(svd()));
  archive.write("oversample", c10::IValue(oversample()));
  archive.write("power_iters", c10::IValue(power_iters()));
  archive.write("correct_bias", c10::IValue(correct_bias()));
}

void GaLoreAdamOptions::serialize(torch::serialize::InputArchive& archive) {
  const char* what = "saved GaLoreAdamOptions";
  lr(read_value(archive, "lr", what).toDouble());
  betas(std::make_tuple(read_value(archive, "beta1", what).toDouble(),
                        read_value(archive, "beta2", what).toDouble()));
  eps(read_value(archive, "eps", what).toDouble());
  weight_decay(read_value(archive, "weight_decay", what).toDouble());
  rank(read_value(archive, "rank", what).toInt());
  update_proj_gap(read_value(archive, "update_proj_gap", what).toInt());
  scale(read_value(archive, "scale", what).toDouble());
  proj_type(read_value(archive, "proj_type", what).toStringRef());
  svd(read_value(archive, "svd", what).toStringRef());
  oversample(read_value(archive, "oversample", what).toInt());
  power_iters(read_value(archive, "power_iters", what).toInt());
  correct_bias(read_value(archive, "correct_bias", what).toBool());
}

void GaLoreAdamParamState::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("step", c10::IValue(step()));
  archive.write("exp_avg", exp_avg());
  archive.write("exp_avg_sq", exp_avg_sq());
  archive.write("has_projector", c10::IValue(projector().defined()));
  if (projector().defined()) archive.write("projector", projector());
  archive.write("right", c10::IValue(right()));
}

void GaLoreAdamParamState::serialize(torch::serialize::InputArchive& archive) {
  const char* what = "saved GaLoreAdamParamState";
  step(read_value(archive, "step", what).toInt());
  auto read_tensor =
      [&](const char* key) {  // a fresh tensor each: read() into a defined one overwrites it
        at::Tensor tensor;
        TORCH_CHECK(archive.try_read(key, tensor), "gwt: ", what, " has no ", key);
        return tensor;
      };
  exp_avg(read_tensor("exp_avg"));
  exp_avg_sq(read_tensor("exp_avg_sq"));
  projector(read_value(archive, "has_projector", what).toBool() ? read_tensor("projector")
                                                                : at::Tensor());
  right(read_value(archive, "right", what).toBool());
}

namespace galore_adam_detail {

void check_options_fit(const at::Tensor& param, const GaLoreAdamOptions& o, int64_t next_step) {
  const double step_size =
      optim_detail::adam_step_size(o.lr(), o.betas(), o.correct_bias(), next_step);
  optim_detail::check_options_fit(k_who, param,
                                  {{"eps", o.eps()},
                                   {"the step size (lr x bias correction)", step_size},
                                   {"the step size x scale", step_size * o.scale()},
                                   {"lr x weight_decay", o.lr() * o.weight_decay()}});
}

Plan plan_for(const at::Tensor& param, const GaLoreAdamOptions& o) {
  Plan plan;
  plan.state_shape = param.sizes().vec();
  if (param.dim() != 2 || o.rank() < 1 || o.rank() >= std::min(param.size(0), param.size(1)))
    return plan;
  const int64_t m = param.size(0), n = param.size(1);
  const auto& type = o.proj_type();
  plan.projected = true;
  plan.rank = o.rank();
  plan.right = type == "right" || (type == "std" && m >= n) || (type == "reverse_std" && m < n);
  plan.state_shape =
      plan.right ? std::vector<int64_t>{m, o.rank()} : std::vector<int64_t>{o.rank(), n};
  return plan;
}

void check_state(const GaLoreAdamParamState& state, const at::Tensor& param, const Plan& plan) {
  for (const at::Tensor* t : {&state.exp_avg(), &state.exp_avg_sq()})
    TORCH_CHECK(t->defined() && t->sizes().vec() == plan.state_shape, k_who,
                ": the state of a parameter of shape ", param.sizes(), " has moments of shape ",
                t->defined() ? t->sizes() : c10::IntArrayRef{}, " but its group's options need ",
                c10::IntArrayRef(plan.state_shape),
                " (were rank or proj_type changed after training started?)");
  if (plan.projected && state.projector().defined()) {
    const std::vector<int64_t> expected = plan.right
                                              ? std::vector<int64_t>{plan.rank, param.size(1)}
                                              : std::vector<int64_t>{param.size(0), plan.rank};
    TORCH_CHECK(state.projector().sizes().vec() == expected && state.right() == plan.right, k_who,
                ": a saved projector of shape ", state.projector().sizes(),
                " does not fit a parameter of shape ", param.sizes(), " at rank ", plan.rank);
  }
}

void prepare_loaded_state(GaLoreAdamParamState& state, const at::Tensor& param,
                          const GaLoreAdamOptions& options, const char* who,
                          const std::string& where, bool own_storage) {
  TORCH_CHECK(state.step() >= 0, who, ": the saved step for ", where, " is ", state.step(),
              "; steps are >= 0");
  check_state(state, param, plan_for(param, options));
  const auto math = param.options().dtype(optim_detail::compute_dtype(param));
  using optim_detail::loaded_state_tensor;
  state.exp_avg(
      loaded_state_tensor(state.exp_avg(), math, who, "exp_avg", where, false, own_storage));
  state.exp_avg_sq(
      loaded_state_tensor(state.exp_avg_sq(), math, who, "exp_avg_sq", where, true, own_storage));
  state.projector(
      loaded_state_tensor(state.projector(), math, who, "projector", where, false, own_storage));
}

}  // namespace galore_adam_detail

void validate_options(const GaLoreAdamOptions& o) {
  optim_detail::check_adam_options(k_who, o.lr(), o.betas(), o.eps(), o.weight_decay());
  TORCH_CHECK(o.rank() >= 0, k_who, ": invalid rank ", o.rank(),
              "; it must be >= 0 (0 = dense Adam)");
  TORCH_CHECK(o.update_proj_gap() >= 1, k_who, ": invalid update_proj_gap ", o.update_proj_gap(),
              "; it must be >= 1");
  TORCH_CHECK(std::isfinite(o.scale()), k_who, ": invalid scale ", o.scale(),
              "; it must be finite");
  const auto& p = o.proj_type();
  TORCH_CHECK(p == "std" || p == "reverse_std" || p == "left" || p == "right", k_who,
              ": unknown proj_type '", p, "'; valid values are std, reverse_std, left, right");
  TORCH_CHECK(o.svd() == "exact" || o.svd() == "randomized", k_who, ": unknown svd '", o.svd(),
              "'; valid values are exact, randomized");
  TORCH_CHECK(o.oversample() >= 0 && o.power_iters() >= 0, k_who,
              ": oversample and power_iters must be >= 0, got ", o.oversample(), " and ",
              o.power_iters());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> truncated_svd(const at::Tensor& matrix, int64_t rank,
                                                             bool randomized, int64_t oversample,
                                                             int64_t power_iters, uint64_t seed) {
  TORCH_CHECK(matrix.dim() == 2, "gwt::truncated_svd needs a 2-D matrix, got shape ",
              matrix.sizes());
  const int64_t m = matrix.size(0), n = matrix.size(1), k = std::min({rank, m, n});
  TORCH_CHECK(k >= 1, "gwt::truncated_svd: rank must be >= 1, got ", rank);
  if (!randomized) {
    const auto [u, s, vh] = at::linalg_svd(matrix, /*full_matrices=*/false);
    return {u.narrow(1, 0, k), s.narrow(0, 0, k), vh.narrow(0, 0, k)};
  }
  // Range finder (Halko, Martinsson, Tropp): Q spans G Omega, sharpened by subspace iterations.
  const int64_t columns = std::min(k + oversample, std::min(m, n));
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor omega =
      at::randn({n, columns}, generator, at::TensorOptions().dtype(matrix.scalar_type()))
          .to(matrix.device());
  at::Tensor q = std::get<0>(at::linalg_qr(at::matmul(matrix, omega)));
  for (int64_t i = 0; i < power_iters; ++i) {
    q = std::get<0>(at::linalg_qr(at::matmul(matrix.t(), q)));
    q = std::get<0>(at::linalg_qr(at::matmul(matrix, q)));
  }
  const auto [ub, s, vh] = at::linalg_svd(at::matmul(q.t(), matrix), /*full_matrices=*/false);
  return {at::matmul(q, ub).narrow(1, 0, k), s.narrow(0, 0, k), vh.narrow(0, 0, k)};
}

// ----------------------------------------------------------------------------------------------
// Planning and the update
// ----------------------------------------------------------------------------------------------

namespace {

const GaLoreAdamOptions& options_of(const torch::optim::OptimizerParamGroup& group) {
  return static_cast<const GaLoreAdamOptions&>(group.options());
}

// The state the update uses must live where the parameter does, in its math type, contiguous.
// Checked before a step changes anything: a model converted or moved after its first step would
// otherwise fail half-way (step counted, projector replaced, moments scaled) or compute in the old
// type.
void check_placement(const GaLoreAdamParamState& state, const at::Tensor& param, const Plan& plan) {
  const at::ScalarType dtype = optim_detail::compute_dtype(param);
  const std::pair<const char*, const at::Tensor*> tensors[] = {
      {"exp_avg", &state.exp_avg()},
      {"exp_avg_sq", &state.exp_avg_sq()},
      {"projector", plan.projected ? &state.projector() : nullptr}};
  for (const auto& [name, t] : tensors) {
    if (t == nullptr || !t->defined()) continue;
    TORCH_CHECK(t->scalar_type() == dtype && t->device() == param.device() && t->is_contiguous(),
                k_who, ": the ", name, " of a ", param.scalar_type(), " parameter of shape ",
                param.sizes(), " on ", param.device(), " is ", t->scalar_type(), " on ",
                t->device(), t->is_contiguous() ? "" : " (not contiguous)", "; it must be ", dtype,
                ", contiguous, on ", param.device(),
                ". Convert or move the model before the first step, or save the optimizer and load "
                "it again after converting or moving the model");
  }
}

std::atomic<int> g_svd_fault{static_cast<int>(detail::SvdFault::none)};

// A new projector from an SVD of the gradient, or nullopt when LAPACK does not converge or the
// result is not finite. Other errors (out of memory, CUDA errors, bugs) propagate: they are not a
// property of this gradient, and hiding them would train on stale projectors without a word.
std::optional<at::Tensor> fresh_projector(const at::Tensor& grad, const GaLoreAdamOptions& o,
                                          const Plan& plan, int64_t iteration) {
  // float32 SVD even for bfloat16/float16 gradients (float64 stays float64).
  const at::Tensor g = grad.to(optim_detail::compute_dtype(grad));
  // A finite gradient of another dtype can overflow in the conversion: no SVD of infinities (the
  // step is skipped: its projection is not finite either).
  if (!optim_detail::all_finite({g})) return std::nullopt;
  const auto fault =
      static_cast<detail::SvdFault>(g_svd_fault.exchange(static_cast<int>(detail::SvdFault::none)));
  at::Tensor projector;
  try {
    TORCH_CHECK_LINALG(fault != detail::SvdFault::linalg_error,
                       "gwt: injected SVD convergence failure (test hook)");
    TORCH_CHECK_WITH(OutOfMemoryError, fault != detail::SvdFault::out_of_memory,
                     "gwt: injected out-of-memory error in the SVD (test hook)");
    TORCH_CHECK(fault != detail::SvdFault::other_error, "gwt: injected SVD error (test hook)");
    const auto [u, s, vh] = truncated_svd(g, plan.rank, o.svd() == "randomized", o.oversample(),
                                          o.power_iters(), static_cast<uint64_t>(iteration));
    projector = plan.right ? vh.contiguous() : u.contiguous();
  } catch (const c10::LinAlgError&) {
    // ATen raises LinAlgError (TORCH_CHECK_LINALG) when LAPACK's SVD does not converge.
    return std::nullopt;
  }
  if (fault == detail::SvdFault::non_finite)
    projector.fill_(std::numeric_limits<double>::quiet_NaN());
  if (!optim_detail::all_finite({projector})) return std::nullopt;
  return projector;
}

// The first r coordinate vectors: the projector of last resort, when the very first SVD fails.
at::Tensor coordinate_projector(const at::Tensor& param, const Plan& plan, at::ScalarType dtype) {
  const auto options = param.options().dtype(dtype);
  return plan.right ? at::eye(plan.rank, param.size(1), options)
                    : at::eye(param.size(0), plan.rank, options);
}

// A parameter's step, checked.
struct Work {
  at::Tensor param;
  const GaLoreAdamOptions* options;
  Plan plan;
};

// Checks everything a caller can get wrong (options, parameters, gradients, the state they meet)
// and lists the parameters with a gradient, with what the finite check reads of each gradient in
// `grads`. Reads only; `State` is the optimizer's state map.
template <typename State>
std::vector<Work> checked_work(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                               const State& states, std::vector<at::Tensor>& grads) {
  std::vector<Work> work;
  for (const auto& group : groups) {
    const GaLoreAdamOptions& options = options_of(group);
    validate_options(options);
    for (const auto& param : group.params()) {
      optim_detail::check_param(k_who, param);
      if (!param.grad().defined()) continue;
      optim_detail::check_grad(k_who, param, param.grad());
      Plan plan = plan_for(param, options);
      auto it = states.find(param.unsafeGetTensorImpl());
      check_options_fit(
          param, options,
          (it == states.end() ? 0 : static_cast<const GaLoreAdamParamState&>(*it->second).step()) +
              1);
      if (it != states.end()) {
        const auto& state = static_cast<const GaLoreAdamParamState&>(*it->second);
        check_state(state, param, plan);
        check_placement(state, param, plan);
      }
      work.push_back({param, &options, std::move(plan)});
      grads.push_back(optim_detail::grad_for_finite_check(param, param.grad()));
    }
  }
  return work;
}

struct Projection {
  at::Tensor projector, projected;
  bool fallback = false;
};

// Projection of every projected gradient, before anything changes: a finite gradient can still
// project to infinity in float32 (values near the top of the range), and such a step is skipped
// like a non-finite gradient. New projectors are committed only with the step. Every projection
// is in `projected_all` too.
template <typename State>
std::vector<Projection> projections_of(const std::vector<Work>& work, const State& states,
                                       std::vector<at::Tensor>& projected_all) {
  std::vector<Projection> projections(work.size());
  for (const auto k : c10::irange(work.size())) {
    const auto& w = work[k];
    if (!w.plan.projected) continue;
    const GaLoreAdamOptions& o = *w.options;
    const at::ScalarType dtype = optim_detail::compute_dtype(w.param);
    const at::Tensor grad = w.param.grad().to(dtype);
    auto it = states.find(w.param.unsafeGetTensorImpl());
    const GaLoreAdamParamState* state =
        it == states.end() ? nullptr : static_cast<const GaLoreAdamParamState*>(it->second.get());
    const int64_t iteration =
        state == nullptr ? 0 : state->step();  // refresh at 0, gap, 2 gap, ...
    Projection& pr = projections[k];
    if (state != nullptr && state->projector().defined()) pr.projector = state->projector();
    if (!pr.projector.defined() || iteration % o.update_proj_gap() == 0) {
      if (auto fresh = fresh_projector(grad, o, w.plan, iteration)) {
        pr.projector = fresh->to(dtype);
      } else {
        pr.fallback = true;
        if (!pr.projector.defined()) pr.projector = coordinate_projector(w.param, w.plan, dtype);
      }
    }
    // m >= n (std): R = G Vr^T; otherwise R = Ur^T G.
    pr.projected =
        w.plan.right ? at::matmul(grad, pr.projector.t()) : at::matmul(pr.projector.t(), grad);
    projected_all.push_back(pr.projected);
  }
  return projections;
}

// One parameter's update, with its projection `pr` where it is projected (counted in
// `svd_fallbacks` when its SVD failed); a first step creates its state.
template <typename State>
void update_param(const Work& w, const Projection& pr, State& states, int64_t& svd_fallbacks) {
  const GaLoreAdamOptions& o = *w.options;
  const at::ScalarType dtype = optim_detail::compute_dtype(w.param);
  auto& slot = states[w.param.unsafeGetTensorImpl()];
  if (!slot) {
    auto fresh = std::make_unique<GaLoreAdamParamState>();
    fresh->exp_avg(at::zeros(w.plan.state_shape, w.param.options().dtype(dtype)));
    fresh->exp_avg_sq(at::zeros(w.plan.state_shape, w.param.options().dtype(dtype)));
    fresh->right(w.plan.right);
    slot = std::move(fresh);
  }
  auto& state = static_cast<GaLoreAdamParamState&>(*slot);
  state.step(state.step() + 1);
  const double step_size =
      optim_detail::adam_step_size(o.lr(), o.betas(), o.correct_bias(), state.step());
  const auto [beta1, beta2] = o.betas();
  at::Tensor param = w.param.scalar_type() == dtype ? w.param : w.param.to(dtype);

  if (!w.plan.projected) {
    const at::Tensor grad = w.param.grad().to(dtype);
    state.exp_avg().mul_(beta1).add_(grad, 1 - beta1);
    state.exp_avg_sq().mul_(beta2).addcmul_(grad, grad, 1 - beta2);
    param.addcdiv_(state.exp_avg(), state.exp_avg_sq().sqrt().add_(o.eps()), -step_size);
  } else {
    if (pr.fallback) ++svd_fallbacks;
    state.projector(pr.projector);
    state.right(w.plan.right);
    state.exp_avg().mul_(beta1).add_(pr.projected, 1 - beta1);
    state.exp_avg_sq().mul_(beta2).addcmul_(pr.projected, pr.projected, 1 - beta2);
    const at::Tensor normalized = state.exp_avg() / state.exp_avg_sq().sqrt().add_(o.eps());
    // Back: N Vr (right) or Ur N (left), times scale.
    const at::Tensor back =
        w.plan.right ? at::matmul(normalized, pr.projector) : at::matmul(pr.projector, normalized);
    param.add_(back, -step_size * o.scale());
  }
  if (o.weight_decay() != 0) param.add_(param, -o.lr() * o.weight_decay());
  if (!param.is_same(w.param)) w.param.copy_(param);
}

}  // namespace

namespace detail {
void inject_svd_fault(SvdFault fault) {
  g_svd_fault.store(static_cast<int>(fault));
}
}  // namespace detail

GaLoreAdam::GaLoreAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                       GaLoreAdamOptions defaults)
    : Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                std::make_unique<GaLoreAdamOptions>(defaults)) {
  validate_options(defaults);
  for (const auto& group : param_groups) add_param_group(group);
}

void GaLoreAdam::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  const size_t index = param_groups_.size();
  std::unique_ptr<GaLoreAdamOptions> options;
  if (param_group.has_options()) {
    const auto* given = dynamic_cast<const GaLoreAdamOptions*>(&param_group.options());
    TORCH_CHECK(given != nullptr, k_who, ": parameter group ", index,
                " has options of another optimizer; give it gwt::GaLoreAdamOptions");
    options = std::make_unique<GaLoreAdamOptions>(*given);
  } else {
    options =
        std::make_unique<GaLoreAdamOptions>(static_cast<const GaLoreAdamOptions&>(defaults()));
  }
  validate_options(*options);
  std::unordered_map<const void*, size_t> group_of;
  for (const auto i : c10::irange(index))
    for (const auto& param : param_groups_[i].params()) group_of[param.unsafeGetTensorImpl()] = i;
  std::unordered_set<const void*> seen;
  for (const auto& param : param_group.params()) {
    optim_detail::check_param(k_who, param);
    TORCH_CHECK(param.is_leaf(), k_who, ": a parameter of shape ", param.sizes(),
                " in parameter group ", index,
                " is not a leaf tensor; optimize the tensors that require grad, not results of "
                "operations on them");
    const auto it = group_of.find(param.unsafeGetTensorImpl());
    TORCH_CHECK(it == group_of.end(), k_who, ": a parameter of shape ", param.sizes(),
                " given for parameter group ", index, " is already in parameter group ",
                it == group_of.end() ? 0 : it->second,
                " (each parameter may be in one group once)");
    TORCH_CHECK(seen.insert(param.unsafeGetTensorImpl()).second, k_who, ": a parameter of shape ",
                param.sizes(), " appears more than once in parameter group ", index,
                " (each parameter may be in one group once)");
  }
  // Everything checked: LibTorch's add_param_group (with the defaults, which it clones), then the
  // group's own options, which it would have replaced.
  Optimizer::add_param_group(torch::optim::OptimizerParamGroup(param_group.params()));
  param_groups_.back().set_options(std::move(options));
}

GaLoreAdam::GaLoreAdam(std::vector<at::Tensor> params, GaLoreAdamOptions defaults)
    : GaLoreAdam({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

const GaLoreAdamOptions& GaLoreAdam::group_options(size_t i) const {
  TORCH_CHECK(i < param_groups().size(), k_who, ": group ", i, " does not exist (there are ",
              param_groups().size(), ")");
  return options_of(param_groups()[i]);
}

at::Tensor GaLoreAdam::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  // Check everything first; nothing changes before the updates below.
  std::vector<at::Tensor> grads;
  const std::vector<Work> work = checked_work(param_groups(), state_, grads);
  if (work.empty()) return loss;
  if (!optim_detail::all_finite(grads)) {
    ++skipped_steps_;
    return loss;
  }
  std::vector<at::Tensor> projected_all;
  const std::vector<Projection> projections = projections_of(work, state_, projected_all);
  if (!projected_all.empty() && !optim_detail::all_finite(projected_all)) {
    ++skipped_steps_;
    return loss;
  }
  for (const auto k : c10::irange(work.size()))
    update_param(work[k], projections[k], state_, svd_fallbacks_);
  return loss;
}

// ----------------------------------------------------------------------------------------------
// Serialization (same layout as WaveletAdam's: per group its options and its parameters' state by
// position; load() checks everything before it changes anything)
// ----------------------------------------------------------------------------------------------

namespace {
constexpr const char* k_format = "gwt.GaLoreAdam.v1";
}  // namespace

void GaLoreAdam::save(torch::serialize::OutputArchive& archive) const {
  optim_detail::save_checkpoint<GaLoreAdamOptions, GaLoreAdamParamState>(
      *this, archive, k_format,
      {{"skipped_steps", skipped_steps_}, {"svd_fallbacks", svd_fallbacks_}});
  optim_detail::save_param_digests(*this, archive);
}

void GaLoreAdam::load(torch::serialize::InputArchive& archive) {
  const std::vector<std::string> counter_names = {"skipped_steps", "svd_fallbacks"};
  // Checks of the whole archive, before load_checkpoint reads it into temporaries (the format is
  // load_checkpoint's to report).
  c10::IValue format;
  if (archive.try_read("format", format) && format.isString() && format.toStringRef() == k_format) {
    for (const auto& name : counter_names) {
      c10::IValue value;
      if (archive.try_read(name, value) && value.isInt())
        TORCH_CHECK(value.toInt() >= 0, k_who, "::load: the checkpoint's ", name, " ",
                    value.toInt(), " is invalid (counters are >= 0); the checkpoint is corrupt");
    }
    optim_detail::check_param_digests(*this, archive, k_who);
  }
  const auto where = optim_detail::param_positions(*this);
  const auto counters = optim_detail::load_checkpoint<GaLoreAdamOptions, GaLoreAdamParamState>(
      *this, archive, k_format, counter_names, k_who,
      [&where](GaLoreAdamParamState& state, const at::Tensor& param,
               const GaLoreAdamOptions& options) {
        galore_adam_detail::prepare_loaded_state(state, param, options, "gwt::GaLoreAdam::load",
                                                 where.at(param.unsafeGetTensorImpl()),
                                                 /*own_storage=*/false);
      },
      check_options_fit);
  skipped_steps_ = counters.at("skipped_steps");
  svd_fallbacks_ = counters.at("svd_fallbacks");
}

int64_t GaLoreAdam::state_bytes(const at::Tensor& param) const {
  auto it = state_.find(param.unsafeGetTensorImpl());
  if (it == state_.end()) return 0;
  const auto& state = static_cast<const GaLoreAdamParamState&>(*it->second);
  int64_t bytes = 0;
  for (const at::Tensor* t : {&state.exp_avg(), &state.exp_avg_sq(), &state.projector()})
    if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  return bytes;
}

int64_t GaLoreAdam::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& group : param_groups())
    for (const auto& param : group.params()) bytes += state_bytes(param);
  return bytes;
}

bool GaLoreAdam::is_projected_param(const at::Tensor& param) const {
  for (const auto& group : param_groups())
    for (const auto& p : group.params())
      if (p.is_same(param)) return plan_for(param, options_of(group)).projected;
  TORCH_CHECK(false, k_who,
              "::is_projected_param: the tensor is not a parameter of this optimizer");
}

}  // namespace gwt
