#include "gwt/nn/delta_linear.h"

#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>

#include "delta_linear_detail.h"
#include "gwt/nn/low_rank_linear.h"

namespace gwt {
namespace nn {

namespace {

constexpr const char* k_who = "gwt::nn::DeltaLinear";

bool is_reduced(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16;
}

// The dtype the adapter's parameters and arithmetic use for a base of dtype `t`.
at::ScalarType math_dtype(at::ScalarType t) {
  return is_reduced(t) ? at::kFloat : t;
}

// Uniform in [-1/sqrt(n), 1/sqrt(n)]: [n, m], as nn::Linear initialises a layer of n inputs.
at::Tensor uniform_vectors(int64_t n, int64_t m, const at::TensorOptions& options) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(n, 1)));
  return at::rand({n, m}, options).mul_(2 * bound).sub_(bound);
}

// m vectors of length n as columns; `paired`: in equal consecutive pairs (the last one alone when
// m is odd), so that their reflections cancel pairwise.
at::Tensor start_vectors(int64_t n, int64_t m, bool paired, const at::TensorOptions& options) {
  if (!paired || m == 0) return uniform_vectors(n, m, options);
  return uniform_vectors(n, (m + 1) / 2, options)
      .repeat_interleave(2, 1)
      .narrow(1, 0, m)
      .contiguous();
}

// The product H_1 ... H_m of the reflections of the columns of `vectors` [n, m] in compact WY form
// I - Y T Y^T (Schreiber and Van Loan): Y the unit vectors, T [m, m] upper triangular. T is the
// inverse of striu(Y^T Y) + I / 2 (the "UT transform": the recurrence
// T_j = [[T_{j-1}, -2 T_{j-1} Y_{j-1}^T y_j], [0, 2]] inverts blockwise to exactly that), found by
// one triangular solve: three ATen operations however many reflections, where the recurrence
// took ~6 per reflection, forward and backward. With gram_schmidt the vectors are orthonormalised
// in order (modified Gram-Schmidt) and T = 2 I: HRA's I - 2 Q Q^T.
struct WY {
  at::Tensor y, t;
};

WY wy_factors(const at::Tensor& vectors, bool gram_schmidt) {
  const int64_t m = vectors.size(1);
  const at::Tensor eye = at::eye(m, vectors.options());
  if (gram_schmidt) {
    std::vector<at::Tensor> q;
    for (const auto i : c10::irange(m)) {
      at::Tensor v = vectors.select(1, i);
      for (const auto& prev : q) v = v - at::dot(prev, v) * prev;
      q.push_back(v / v.norm());
    }
    return {at::stack(q, 1), eye.mul(2)};
  }
  const at::Tensor y = vectors / vectors.norm(2, {0}, /*keepdim=*/true);
  const at::Tensor t_inv = at::triu(at::matmul(y.t(), y), 1) + eye.mul(0.5);
  return {y, at::linalg_solve_triangular(t_inv, eye, /*upper=*/true)};
}

// a P (transpose false) or a P^T (true), P = I - Y T Y^T, for rows a [..., n].
at::Tensor apply_product(const at::Tensor& a, const WY& f, bool transpose) {
  const at::Tensor ay = at::matmul(a, f.y);
  return a - at::matmul(at::matmul(ay, transpose ? f.t.t() : f.t), f.y.t());
}

// ||P^T P - I||_F of P = I - Y T Y^T, in float64.
double orthogonality_of(const WY& f) {
  const int64_t n = f.y.size(0);
  const at::Tensor eye = at::eye(n, f.y.options().dtype(at::kDouble));
  const WY d{f.y.to(at::kDouble), f.t.to(at::kDouble)};
  const at::Tensor p = apply_product(eye, d, false);
  return (at::matmul(p.t(), p) - eye).norm().item<double>();
}

}  // namespace

namespace detail {

bool runs_own_list(const torch::nn::Module& module) {
  return dynamic_cast<const torch::nn::SequentialImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::ModuleListImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::ModuleDictImpl*>(&module) != nullptr;
}

void refuse_layer_in_container(const char* who, const std::string& layer,
                               const torch::nn::Module& container, const char* instead) {
  // "torch::nn::SequentialImpl": the holder's name reads better.
  std::string type = container.name();
  if (type.size() > 4 && type.compare(type.size() - 4, 4, "Impl") == 0)
    type.resize(type.size() - 4);
  TORCH_CHECK(false, who, ": layer '", layer, "' is inside a ", type,
              ", which runs its own list of modules that replace_module cannot change (the layer "
              "would be replaced in name only, and left out of the forward); ", instead,
              "; nothing was changed");
}

bool reflections_defined(const at::Tensor& vectors, bool gram_schmidt) {
  at::NoGradGuard no_grad;
  if (!vectors.defined() || vectors.size(1) == 0) return true;
  const WY f = wy_factors(vectors, gram_schmidt);
  // Finite factors, and no normalised column that is zero (a vector whose norm overflowed
  // normalises to 0, and its "reflection" would be the identity).
  return at::isfinite(f.y).all().item<bool>() && at::isfinite(f.t).all().item<bool>() &&
         (f.y.abs().amax(0) > 0).all().item<bool>();
}

}  // namespace detail

namespace {

// Replaces a parameter's tensor in place (it keeps its identity, so optimizers still hold it), or
// registers it when the layer has none yet.
void set_parameter(torch::nn::Module& module, at::Tensor& member, const std::string& name,
                   const at::Tensor& value) {
  at::NoGradGuard no_grad;
  if (member.defined()) {
    member.set_data(value);
    member.mutable_grad() = at::Tensor();
  } else {
    member = module.register_parameter(name, value, /*requires_grad=*/true);
  }
}

}  // namespace

DeltaLinearImpl::DeltaLinearImpl(torch::nn::Linear base, DeltaLinearOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK(!base.is_empty(), k_who, ": the base Linear is empty (default-constructed holder)");
  const at::Tensor& w = base->weight;
  TORCH_CHECK(w.defined() && w.dim() == 2, k_who, ": the base weight must be 2-D [out, in], got ",
              w.defined() ? w.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(
      w.is_floating_point() && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kDouble ||
                                is_reduced(w.scalar_type())),
      k_who, ": the base weight is ", w.scalar_type(),
      "; valid dtypes are Float, Double, Half, BFloat16");
  const int64_t in = options_.in_features(), out = options_.out_features();
  TORCH_CHECK(w.size(0) == out && w.size(1) == in, k_who, ": the options say in ", in, ", out ",
              out, " but the base weight is ", w.sizes(), " ([out, in])");
  TORCH_CHECK(!base->bias.defined() || (base->bias.dim() == 1 && base->bias.size(0) == out &&
                                        base->bias.device() == w.device() &&
                                        base->bias.scalar_type() == w.scalar_type()),
              k_who, ": the base bias must be [", out, "] with the weight's device and dtype");
  TORCH_CHECK(options_.rank() >= 0 && options_.rank() <= std::min(in, out), k_who,
              ": invalid rank ", options_.rank(),
              "; it must be in [0, min(in, out) = ", std::min(in, out), "]");
  TORCH_CHECK(options_.reflections() >= 0 && options_.reflections() <= in, k_who,
              ": invalid reflections ", options_.reflections(), "; it must be in [0, in = ", in,
              "]");
  TORCH_CHECK(std::isfinite(options_.alpha()) && options_.alpha() >= 0, k_who, ": invalid alpha ",
              options_.alpha(), "; it must be finite and >= 0 (0: alpha = rank)");
  const int64_t k = options_.rank(), r = options_.reflections();
  scaling_ = (options_.alpha() == 0 || k == 0) ? 1.0 : options_.alpha() / static_cast<double>(k);

  weight = register_parameter("weight", w, options_.train_base());
  if (base->bias.defined()) bias = register_parameter("bias", base->bias, options_.train_base());
  if (!options_.train_base()) {
    weight.requires_grad_(false);
    if (bias.defined()) bias.requires_grad_(false);
  }
  const auto popts = w.options().dtype(math_dtype(w.scalar_type()));
  if (k > 0) {
    U = register_parameter("U", at::zeros({out, k}, popts));
    V = register_parameter("V", uniform_vectors(in, k, popts));
    if (options_.orthogonal_core())
      core = register_parameter("core", start_vectors(k, k, true, popts));
  }
  if (r > 0)
    reflections =
        register_parameter("reflections", start_vectors(in, r, !options_.gram_schmidt(), popts));
}

at::Tensor DeltaLinearImpl::adapted(const at::Tensor& x, int64_t kept) const {
  const auto math = math_dtype(weight.scalar_type());
  const at::Tensor xm = x.scalar_type() == math ? x : x.to(math);
  const at::Tensor w = weight.scalar_type() == math ? weight : weight.to(math);
  const at::Tensor b = !bias.defined() || bias.scalar_type() == math ? bias : bias.to(math);
  // x (W H_1 ... H_r)^T, with the product P = H_1 ... H_r applied on the cheaper side: to x's
  // rows, (x P^T) W^T, costs O(tokens in r); to W's, x (W P)^T, O(out in r) whatever the tokens.
  // benchmarks/bench_reflections.cpp measured each side the faster one where its cost is lower.
  at::Tensor y;
  if (reflections.defined() && reflections.size(1) > 0) {
    const WY f = wy_factors(reflections, options_.gram_schmidt());
    const int64_t tokens = xm.numel() / std::max<int64_t>(1, options_.in_features());
    y = tokens > options_.out_features() ? at::linear(xm, apply_product(w, f, false), b)
                                         : at::linear(apply_product(xm, f, true), w, b);
  } else {
    y = at::linear(xm, w, b);
  }
  if (kept > 0) {
    auto first = [&](const at::Tensor& t) {
      return kept == t.size(1) ? t : t.narrow(1, 0, kept).contiguous();
    };
    at::Tensor t = at::matmul(xm, first(V));  // x V
    if (core.defined()) {
      const at::Tensor c =
          kept == core.size(1) ? core : core.narrow(0, 0, kept).narrow(1, 0, kept).contiguous();
      t = apply_product(t, wy_factors(c, false), true);  // x V Q^T
    }
    y = y + at::matmul(t, first(U).t()) * scaling_;
  }
  return x.scalar_type() == math ? y : y.to(x.scalar_type());
}

at::Tensor DeltaLinearImpl::forward(const at::Tensor& x) {
  TORCH_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == options_.in_features(), k_who,
              ": the input's last dimension must be in_features = ", options_.in_features(),
              ", got shape ", x.defined() ? x.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(x.device() == weight.device(), k_who, ": the input is on ", x.device(),
              " but the layer is on ", weight.device());
  TORCH_CHECK(x.is_floating_point(), k_who, ": the input must be floating point, got ",
              x.scalar_type());
  const int64_t k = U.defined() ? U.size(1) : 0;
  if (zero_from_ >= 0 &&
      (zero_from_ >= k || U.narrow(1, zero_from_, k - zero_from_).any().item<bool>()))
    zero_from_ = -1;
  if (zero_from_ < 0) return adapted(x, k);
  // U's columns from zero_from_ on are still the zeros that resize_rank appended: the output is the
  // one of the kept columns alone (the same operations on the same values as before the growth,
  // so the same bits), while the gradient is the full layer's (full - full.detach() is exactly 0).
  const at::Tensor kept = adapted(x, zero_from_);
  if (!at::GradMode::is_enabled()) return kept;
  const at::Tensor full = adapted(x, k);
  return kept.detach() + (full - full.detach());
}

at::Tensor DeltaLinearImpl::delta_weight() const {
  const auto math = math_dtype(weight.scalar_type());
  if (!U.defined() || U.size(1) == 0)
    return at::zeros(weight.sizes(), weight.options().dtype(math));
  // U Q V^T = U (V Q^T)^T.
  const at::Tensor vq = core.defined() ? apply_product(V, wy_factors(core, false), true) : V;
  return at::matmul(U, vq.t()) * scaling_;
}

torch::nn::Linear DeltaLinearImpl::merge() const {
  at::NoGradGuard no_grad;
  const auto math = math_dtype(weight.scalar_type());
  const at::Tensor w = weight.to(math);
  const at::Tensor wh =
      reflections.defined() && reflections.size(1) > 0
          ? apply_product(w, wy_factors(reflections, options_.gram_schmidt()), false)
          : w;
  torch::nn::Linear merged(torch::nn::LinearOptions(options_.in_features(), options_.out_features())
                               .bias(bias.defined()));
  merged->to(weight.device(), weight.scalar_type());
  merged->weight.copy_(wh + delta_weight());
  if (bias.defined()) merged->bias.copy_(bias);
  return merged;
}

OrthogonalityError DeltaLinearImpl::orthogonality_error() const {
  at::NoGradGuard no_grad;
  OrthogonalityError e;
  if (reflections.defined() && reflections.size(1) > 0)
    e.reflections = orthogonality_of(wy_factors(reflections, options_.gram_schmidt()));
  if (core.defined() && core.size(1) > 0) e.core = orthogonality_of(wy_factors(core, false));
  return e;
}

at::Tensor DeltaLinearImpl::orthogonality_penalty(double lambda) const {
  TORCH_CHECK(std::isfinite(lambda) && lambda >= 0, k_who,
              "::orthogonality_penalty: lambda must be finite and >= 0, got ", lambda);
  if (!reflections.defined() || reflections.size(1) == 0)
    return at::zeros({}, weight.options().dtype(math_dtype(weight.scalar_type())));
  const at::Tensor n = reflections / reflections.norm(2, {0}, true);
  const at::Tensor gram = at::matmul(n.t(), n);
  return (at::eye(gram.size(0), gram.options()) - gram).pow(2).sum() * lambda;
}

double DeltaLinearImpl::resize_rank(int64_t k_new) {
  const int64_t in = options_.in_features(), out = options_.out_features();
  TORCH_CHECK(k_new >= 0 && k_new <= std::min(in, out), k_who, "::resize_rank: invalid rank ",
              k_new, "; it must be in [0, min(in, out) = ", std::min(in, out), "]");
  const int64_t k = U.defined() ? U.size(1) : 0;
  if (k_new == k) return 0.0;
  at::NoGradGuard no_grad;
  const auto popts = weight.options().dtype(math_dtype(weight.scalar_type()));
  const bool with_core = options_.orthogonal_core();
  if (k_new > k) {
    const int64_t added = k_new - k;
    const at::Tensor u = at::zeros({out, k_new}, popts);
    const at::Tensor v = at::empty({in, k_new}, popts);
    if (k > 0) u.narrow(1, 0, k).copy_(U), v.narrow(1, 0, k).copy_(V);
    v.narrow(1, k, added).copy_(uniform_vectors(in, added, popts));
    // The kept vectors act on the kept coordinates only; the new ones on the new coordinates.
    at::Tensor c;
    if (with_core) {
      c = at::zeros({k_new, k_new}, popts);
      if (k > 0) c.narrow(0, 0, k).narrow(1, 0, k).copy_(core);
      c.narrow(0, k, added).narrow(1, k, added).copy_(start_vectors(added, added, true, popts));
    }
    set_parameter(*this, U, "U", u);
    set_parameter(*this, V, "V", v);
    if (with_core) set_parameter(*this, core, "core", c);
    if (k == 0 && options_.alpha() != 0) scaling_ = options_.alpha() / static_cast<double>(k_new);
    zero_from_ = k;
    options_.rank(k_new);
    return 0.0;
  }
  // Shrink: M = U Q V^T ~ P_k S_k R_k^T; U' = P_k S_k^(1/2) Q'^T, V' = R_k S_k^(1/2), with Q' the
  // core's paired start, so that U' Q' V'^T = P_k S_k R_k^T.
  const at::Tensor m = (delta_weight() / scaling_).to(at::kDouble);
  const auto svd = at::linalg_svd(m, /*full_matrices=*/false);
  const at::Tensor& p = std::get<0>(svd);
  const at::Tensor& s = std::get<1>(svd);
  const at::Tensor& rt = std::get<2>(svd);
  const double total = s.pow(2).sum().item<double>();
  const double dropped = s.narrow(0, k_new, s.size(0) - k_new).pow(2).sum().item<double>();
  const at::Tensor root = s.narrow(0, 0, k_new).sqrt();
  at::Tensor u = p.narrow(1, 0, k_new) * root;
  const at::Tensor v = rt.narrow(0, 0, k_new).t() * root;
  at::Tensor c;
  if (with_core) {
    c = start_vectors(k_new, k_new, true, popts);
    if (k_new > 0) u = apply_product(u, wy_factors(c.to(at::kDouble), false), true);
  }
  set_parameter(*this, U, "U", u.to(math_dtype(weight.scalar_type())).contiguous());
  set_parameter(*this, V, "V", v.to(math_dtype(weight.scalar_type())).contiguous());
  if (with_core) set_parameter(*this, core, "core", c);
  zero_from_ = -1;
  options_.rank(k_new);
  return total > 0 ? std::sqrt(dropped / total) : 0.0;
}

int64_t DeltaLinearImpl::trainable_parameter_count() const {
  int64_t n = 0;
  for (const auto& p : parameters())
    if (p.requires_grad()) n += p.numel();
  return n;
}

// ----------------------------------------------------------------------------------------------
// Whole models
// ----------------------------------------------------------------------------------------------

namespace {

void add_adapters(torch::nn::Module& parent, const std::string& prefix,
                  const DeltaLinearOptions& options, const NameFilter& filter,
                  std::vector<std::pair<std::string, DeltaLinear>>& out) {
  for (const auto& item : parent.named_children()) {
    const std::string name = prefix.empty() ? item.key() : prefix + "." + item.key();
    const auto& child = item.value();
    if (auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(child)) {
      if (!filter || filter(name)) {
        const auto& w = linear->weight;
        DeltaLinearOptions o = options;
        o.in_features(w.size(1)).out_features(w.size(0));
        DeltaLinear adapter(torch::nn::Linear(linear), o);
        parent.replace_module(item.key(), adapter.ptr());
        out.emplace_back(name, adapter);
      }
      continue;
    }
    if (std::dynamic_pointer_cast<DeltaLinearImpl>(child)) continue;  // already adapted
    add_adapters(*child, name, options, filter, out);
  }
}

int64_t merge_adapters(torch::nn::Module& parent) {
  int64_t merged = 0;
  for (const auto& item : parent.named_children()) {
    if (auto adapter = std::dynamic_pointer_cast<DeltaLinearImpl>(item.value())) {
      parent.replace_module(item.key(), adapter->merge().ptr());
      ++merged;
    } else {
      merged += merge_adapters(*item.value());
    }
  }
  return merged;
}

}  // namespace

std::vector<std::pair<std::string, DeltaLinear>> add_delta_adapters(
    torch::nn::Module& module, const DeltaLinearOptions& options, const NameFilter& filter) {
  std::vector<std::pair<std::string, DeltaLinear>> out;
  // Checked once up front (with each layer's own sizes below): a bad option changes nothing.
  TORCH_CHECK(options.rank() >= 0 && options.reflections() >= 0,
              "gwt::nn::add_delta_adapters: ", "rank and reflections must be >= 0, got ",
              options.rank(), " and ", options.reflections());
  const auto modules = module.named_modules("", /*include_self=*/false);
  for (const auto& item : modules) {
    auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(item.value());
    if (!linear || (filter && !filter(item.key()))) continue;
    const auto dot = item.key().rfind('.');
    const torch::nn::Module* parent =
        dot == std::string::npos ? &module : modules[item.key().substr(0, dot)].get();
    if (detail::runs_own_list(*parent))
      detail::refuse_layer_in_container(
          "gwt::nn::add_delta_adapters", item.key(), *parent,
          "build the container from DeltaLinear layers instead, or leave the layer out with the "
          "filter");
    const auto& w = linear->weight;
    TORCH_CHECK(w.dim() == 2 && options.rank() <= std::min(w.size(0), w.size(1)) &&
                    options.reflections() <= w.size(1),
                "gwt::nn::add_delta_adapters: layer '", item.key(), "' of weight ", w.sizes(),
                " cannot take rank ", options.rank(), " and ", options.reflections(),
                " reflections (rank <= min(in, out), reflections <= in); nothing was replaced");
  }
  add_adapters(module, "", options, filter, out);
  return out;
}

int64_t merge_delta_adapters(torch::nn::Module& module) {
  // Checked before anything is merged: a container that runs its own list would keep running the
  // adapter.
  const auto modules = module.named_modules("", /*include_self=*/false);
  for (const auto& item : modules) {
    if (!std::dynamic_pointer_cast<DeltaLinearImpl>(item.value())) continue;
    const auto dot = item.key().rfind('.');
    const torch::nn::Module& parent =
        dot == std::string::npos ? module : *modules[item.key().substr(0, dot)];
    if (detail::runs_own_list(parent))
      detail::refuse_layer_in_container(
          "gwt::nn::merge_delta_adapters", item.key(), parent,
          "build the container again from each adapter's merge() (DeltaLinear::merge)");
  }
  return merge_adapters(module);
}

at::Tensor linear_forward(torch::nn::Module& layer, const at::Tensor& x) {
  if (auto* l = dynamic_cast<torch::nn::LinearImpl*>(&layer)) return l->forward(x);
  if (auto* d = dynamic_cast<DeltaLinearImpl*>(&layer)) return d->forward(x);
  if (auto* r = dynamic_cast<LowRankLinearImpl*>(&layer)) return r->forward(x);
  TORCH_CHECK(false, "gwt::nn::linear_forward: a ", layer.name(),
              " is not a torch::nn::Linear, gwt::nn::DeltaLinear or gwt::nn::LowRankLinear");
}

at::Tensor child_forward(torch::nn::Module& parent, const std::string& name, const at::Tensor& x) {
  const auto children = parent.named_children();
  TORCH_CHECK(children.contains(name), "gwt::nn::child_forward: ", parent.name(), " has no child '",
              name, "'");
  return linear_forward(*children[name], x);
}

std::vector<torch::optim::OptimizerParamGroup> delta_param_groups(
    const torch::nn::Module& module, double lr,
    const std::function<std::unique_ptr<torch::optim::OptimizerOptions>(double lr)>& make_options,
    const DeltaLrMultipliers& multipliers) {
  TORCH_CHECK(make_options != nullptr, "gwt::nn::delta_param_groups needs make_options");
  std::vector<at::Tensor> base, low_rank, refl, core;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    const std::string& name = item.key();
    const std::string last =
        name.substr(name.rfind('.') == std::string::npos ? 0 : name.rfind('.') + 1);
    if (last == "U" || last == "V")
      low_rank.push_back(item.value());
    else if (last == "reflections")
      refl.push_back(item.value());
    else if (last == "core")
      core.push_back(item.value());
    else
      base.push_back(item.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const auto& [params, mult] :
       {std::make_pair(&base, multipliers.base), std::make_pair(&low_rank, multipliers.low_rank),
        std::make_pair(&refl, multipliers.reflections), std::make_pair(&core, multipliers.core)}) {
    if (params->empty()) continue;
    groups.emplace_back(*params, make_options(lr * mult));
  }
  return groups;
}

}  // namespace nn
}  // namespace gwt
