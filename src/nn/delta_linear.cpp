// gwt::nn::DeltaLinear: one layer's delta adapter, as functions of its state (delta_linear_*) and
// as a module. Adapters over whole models are delta_adapters.cpp.

#include "gwt/nn/delta_linear.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>

#include "../plain_tensor.h"
#include "delta_linear_detail.h"

namespace gwt {
namespace nn {

namespace {

constexpr const char* k_who = "gwt::nn::DeltaLinear";

using detail::math_dtype;

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

namespace detail {

bool is_reduced(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16;
}

at::ScalarType math_dtype(at::ScalarType t) {
  return is_reduced(t) ? at::kFloat : t;
}

bool is_base_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || is_reduced(t);
}

void check_base(const std::string& who, const at::Tensor& w, const at::Tensor& b,
                const DeltaLinearOptions& options) {
  gwt::detail::check_plain_tensor(who.c_str(), "the base weight", w);
  if (b.defined()) gwt::detail::check_plain_tensor(who.c_str(), "the base bias", b);
  TORCH_CHECK(w.dim() == 2, who, ": the base weight must be 2-D [out, in], got ", w.sizes());
  TORCH_CHECK(is_base_dtype(w.scalar_type()), who, ": the base weight is ", w.scalar_type(),
              "; valid dtypes are Float, Double, Half, BFloat16");
  const int64_t in = options.in_features(), out = options.out_features();
  TORCH_CHECK(w.size(0) == out && w.size(1) == in, who, ": the options say in ", in, ", out ", out,
              " but the base weight is ", w.sizes(), " ([out, in])");
  TORCH_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == out && b.device() == w.device() &&
                               b.scalar_type() == w.scalar_type()),
              who, ": the base bias must be [", out, "] with the weight's device and dtype");
  TORCH_CHECK(options.rank() >= 0 && options.rank() <= std::min(in, out), who, ": invalid rank ",
              options.rank(), "; it must be in [0, min(in, out) = ", std::min(in, out), "]");
  TORCH_CHECK(options.reflections() >= 0 && options.reflections() <= in, who,
              ": invalid reflections ", options.reflections(), "; it must be in [0, in = ", in,
              "]");
  TORCH_CHECK(std::isfinite(options.alpha()) && options.alpha() >= 0, who, ": invalid alpha ",
              options.alpha(), "; it must be finite and >= 0 (0: alpha = rank)");
}

}  // namespace detail

namespace {

// Checks what every delta_linear_* function takes: plain tensors of consistent shapes on the
// weight's device, and a usable scale.
void check_state(const DeltaLinearState& s) {
  const at::Tensor& w = s.weight;
  gwt::detail::check_plain_tensor(k_who, "the base weight", w);
  TORCH_CHECK(w.dim() == 2 && detail::is_base_dtype(w.scalar_type()), k_who,
              ": the base weight must be a 2-D Float, Double, Half or BFloat16 tensor, got ",
              w.scalar_type(), " of shape ", w.sizes());
  const int64_t out = w.size(0), in = w.size(1);
  const int64_t k = s.U.defined() && s.U.dim() == 2 ? s.U.size(1) : 0;
  TORCH_CHECK(s.U.defined() == s.V.defined(), k_who, ": U and V must be given together");
  struct Expected {
    const char* what;
    const at::Tensor* t;
    int64_t dims, rows, cols;  // cols -1: any
  };
  const Expected parts[] = {{"the base bias", &s.bias, 1, out, 0},
                            {"U", &s.U, 2, out, k},
                            {"V", &s.V, 2, in, k},
                            {"the reflection vectors", &s.reflections, 2, in, -1},
                            {"the core", &s.core, 2, k, k}};
  for (const auto& e : parts) {
    if (!e.t->defined()) continue;
    gwt::detail::check_plain_tensor(k_who, e.what, *e.t);
    const bool fits = e.t->dim() == e.dims && e.t->size(0) == e.rows &&
                      (e.dims == 1 || e.cols < 0 || e.t->size(1) == e.cols);
    TORCH_CHECK(fits, k_who, ": ", e.what, " has shape ", e.t->sizes(), " where out = ", out,
                ", in = ", in, " and rank = ", k, " (U's columns) need ",
                e.dims == 1
                    ? c10::str("[", e.rows, "]")
                    : c10::str("[", e.rows, ", ", e.cols < 0 ? "any" : c10::str(e.cols), "]"));
    TORCH_CHECK(e.t->device() == w.device() && e.t->is_floating_point(), k_who, ": ", e.what,
                " must be floating point on the weight's device ", w.device(), ", got ",
                e.t->scalar_type(), " on ", e.t->device());
  }
  TORCH_CHECK(std::isfinite(s.scaling) && s.scaling >= 0, k_who, ": invalid scale ", s.scaling,
              "; it must be finite and >= 0");
}

// `t` in `dtype` (itself when it is already).
at::Tensor in_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return !t.defined() || t.scalar_type() == dtype ? t : t.to(dtype);
}

// U Q V^T [out, in], without the scale, in the math dtype (undefined at rank 0).
at::Tensor unscaled_delta(const DeltaLinearState& s) {
  if (!s.U.defined() || s.U.size(1) == 0) return at::Tensor();
  const auto math = math_dtype(s.weight.scalar_type());
  const at::Tensor v = in_dtype(s.V, math);
  // U Q V^T = U (V Q^T)^T.
  const at::Tensor vq =
      s.core.defined() ? apply_product(v, wy_factors(in_dtype(s.core, math), false), true) : v;
  return at::matmul(in_dtype(s.U, math), vq.t());
}

}  // namespace

DeltaLinearState delta_linear_init(const at::Tensor& weight, const at::Tensor& bias,
                                   const DeltaLinearOptions& options) {
  detail::check_base(k_who, weight, bias, options);
  const int64_t in = options.in_features(), out = options.out_features();
  const int64_t k = options.rank(), r = options.reflections();
  DeltaLinearState s;
  s.weight = weight;
  s.bias = bias;
  s.scaling = (options.alpha() == 0 || k == 0) ? 1.0 : options.alpha() / static_cast<double>(k);
  at::NoGradGuard no_grad;
  const auto popts = weight.options().dtype(math_dtype(weight.scalar_type()));
  s.U = at::zeros({out, k}, popts);
  s.V = uniform_vectors(in, k, popts);
  if (options.orthogonal_core()) s.core = start_vectors(k, k, true, popts);
  if (r > 0) s.reflections = start_vectors(in, r, !options.gram_schmidt(), popts);
  return s;
}

at::Tensor delta_linear_forward(const at::Tensor& x, const DeltaLinearState& s, bool gram_schmidt) {
  gwt::detail::check_plain_tensor(k_who, "the input", x);
  check_state(s);
  const int64_t in = s.weight.size(1), out = s.weight.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, k_who,
              ": the input's last dimension must be in_features = ", in, ", got shape ", x.sizes());
  TORCH_CHECK(x.device() == s.weight.device(), k_who, ": the input is on ", x.device(),
              " but the layer is on ", s.weight.device());
  TORCH_CHECK(x.is_floating_point(), k_who, ": the input must be floating point, got ",
              x.scalar_type());
  const auto math = math_dtype(s.weight.scalar_type());
  const at::Tensor xm = in_dtype(x, math);
  const at::Tensor w = in_dtype(s.weight, math);
  const at::Tensor b = in_dtype(s.bias, math);
  // x (W H_1 ... H_r)^T, with the product P = H_1 ... H_r applied on the cheaper side: to x's
  // rows, (x P^T) W^T, costs O(tokens in r); to W's, x (W P)^T, O(out in r) whatever the tokens.
  // benchmarks/bench_reflections.cpp measured each side the faster one where its cost is lower.
  at::Tensor y;
  if (s.reflections.defined() && s.reflections.size(1) > 0) {
    const WY f = wy_factors(in_dtype(s.reflections, math), gram_schmidt);
    const int64_t tokens = xm.numel() / std::max<int64_t>(1, in);
    y = tokens > out ? at::linear(xm, apply_product(w, f, false), b)
                     : at::linear(apply_product(xm, f, true), w, b);
  } else {
    y = at::linear(xm, w, b);
  }
  if (s.U.defined() && s.U.size(1) > 0) {
    at::Tensor t = at::matmul(xm, in_dtype(s.V, math));  // x V
    if (s.core.defined())
      t = apply_product(t, wy_factors(in_dtype(s.core, math), false), true);  // x V Q^T
    y = y + at::matmul(t, in_dtype(s.U, math).t()) * s.scaling;
  }
  return in_dtype(y, x.scalar_type());
}

at::Tensor delta_linear_delta_weight(const DeltaLinearState& s) {
  check_state(s);
  const at::Tensor m = unscaled_delta(s);
  if (!m.defined())
    return at::zeros(s.weight.sizes(),
                     s.weight.options().dtype(math_dtype(s.weight.scalar_type())));
  return m * s.scaling;
}

at::Tensor delta_linear_merged_weight(const DeltaLinearState& s, bool gram_schmidt) {
  check_state(s);
  at::NoGradGuard no_grad;
  const at::Tensor w = in_dtype(s.weight, math_dtype(s.weight.scalar_type()));
  const at::Tensor wh =
      s.reflections.defined() && s.reflections.size(1) > 0
          ? apply_product(w, wy_factors(in_dtype(s.reflections, w.scalar_type()), gram_schmidt),
                          false)
          : w;
  return in_dtype(wh + delta_linear_delta_weight(s), s.weight.scalar_type());
}

OrthogonalityError delta_linear_orthogonality_error(const DeltaLinearState& s, bool gram_schmidt) {
  check_state(s);
  at::NoGradGuard no_grad;
  OrthogonalityError e;
  const auto math = math_dtype(s.weight.scalar_type());
  if (s.reflections.defined() && s.reflections.size(1) > 0)
    e.reflections = orthogonality_of(wy_factors(in_dtype(s.reflections, math), gram_schmidt));
  if (s.core.defined() && s.core.size(1) > 0)
    e.core = orthogonality_of(wy_factors(in_dtype(s.core, math), false));
  return e;
}

at::Tensor delta_linear_orthogonality_penalty(const DeltaLinearState& s, double lambda) {
  TORCH_CHECK(std::isfinite(lambda) && lambda >= 0, k_who,
              "::orthogonality_penalty: lambda must be finite and >= 0, got ", lambda);
  check_state(s);
  const auto math = math_dtype(s.weight.scalar_type());
  if (!s.reflections.defined() || s.reflections.size(1) == 0)
    return at::zeros({}, s.weight.options().dtype(math));
  const at::Tensor v = in_dtype(s.reflections, math);
  const at::Tensor n = v / v.norm(2, {0}, true);
  const at::Tensor gram = at::matmul(n.t(), n);
  return (at::eye(gram.size(0), gram.options()) - gram).pow(2).sum() * lambda;
}

DeltaLinearResized delta_linear_resize_rank(const DeltaLinearState& s,
                                            const DeltaLinearOptions& options, int64_t k_new) {
  check_state(s);
  const int64_t in = s.weight.size(1), out = s.weight.size(0);
  TORCH_CHECK(k_new >= 0 && k_new <= std::min(in, out), k_who, "::resize_rank: invalid rank ",
              k_new, "; it must be in [0, min(in, out) = ", std::min(in, out), "]");
  const int64_t k = s.U.defined() ? s.U.size(1) : 0;
  DeltaLinearResized result{s, 0.0};
  if (k_new == k) return result;
  at::NoGradGuard no_grad;
  const auto math = math_dtype(s.weight.scalar_type());
  const auto popts = s.weight.options().dtype(math);
  const bool with_core = options.orthogonal_core();
  DeltaLinearState& n = result.state;
  if (k_new > k) {
    const int64_t added = k_new - k;
    n.U = at::zeros({out, k_new}, popts);
    n.V = at::empty({in, k_new}, popts);
    if (k > 0) n.U.narrow(1, 0, k).copy_(s.U), n.V.narrow(1, 0, k).copy_(s.V);
    n.V.narrow(1, k, added).copy_(uniform_vectors(in, added, popts));
    // The kept vectors act on the kept coordinates only; the new ones on the new coordinates.
    if (with_core) {
      n.core = at::zeros({k_new, k_new}, popts);
      if (k > 0) n.core.narrow(0, 0, k).narrow(1, 0, k).copy_(s.core);
      n.core.narrow(0, k, added)
          .narrow(1, k, added)
          .copy_(start_vectors(added, added, true, popts));
    }
    // At rank 0 there was no delta to keep the scale of: it is fixed at the first rank.
    if (k == 0 && options.alpha() != 0) n.scaling = options.alpha() / static_cast<double>(k_new);
    return result;
  }
  // Shrink: M = U Q V^T ~ P_k S_k R_k^T; U' = P_k S_k^(1/2) Q'^T, V' = R_k S_k^(1/2), with Q' the
  // core's paired start, so that U' Q' V'^T = P_k S_k R_k^T.
  const auto svd = at::linalg_svd(unscaled_delta(s).to(at::kDouble), /*full_matrices=*/false);
  const at::Tensor& p = std::get<0>(svd);
  const at::Tensor& sv = std::get<1>(svd);
  const at::Tensor& rt = std::get<2>(svd);
  const double total = sv.pow(2).sum().item<double>();
  const double dropped = sv.narrow(0, k_new, sv.size(0) - k_new).pow(2).sum().item<double>();
  const at::Tensor root = sv.narrow(0, 0, k_new).sqrt();
  at::Tensor u = p.narrow(1, 0, k_new) * root;
  const at::Tensor v = rt.narrow(0, 0, k_new).t() * root;
  if (with_core) {
    n.core = start_vectors(k_new, k_new, true, popts);
    if (k_new > 0) u = apply_product(u, wy_factors(n.core.to(at::kDouble), false), true);
  }
  n.U = u.to(math).contiguous();
  n.V = v.to(math).contiguous();
  result.error = total > 0 ? std::sqrt(dropped / total) : 0.0;
  return result;
}

namespace {

// Replaces a parameter's tensor in place: it keeps its identity, so optimizers still hold it.
void set_parameter(at::Tensor& member, const at::Tensor& value) {
  if (member.is_same(value)) return;
  at::NoGradGuard no_grad;
  member.set_data(value);
  member.mutable_grad() = at::Tensor();
}

}  // namespace

DeltaLinearImpl::DeltaLinearImpl(torch::nn::Linear base, DeltaLinearOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK(!base.is_empty(), k_who, ": the base Linear is empty (default-constructed holder)");
  DeltaLinearState s = delta_linear_init(base->weight, base->bias, options_);
  weight = register_parameter("weight", s.weight, options_.train_base());
  if (s.bias.defined()) bias = register_parameter("bias", s.bias, options_.train_base());
  if (!options_.train_base()) {
    weight.requires_grad_(false);
    if (bias.defined()) bias.requires_grad_(false);
  }
  U = register_parameter("U", s.U);
  V = register_parameter("V", s.V);
  if (s.core.defined()) core = register_parameter("core", s.core);
  if (s.reflections.defined()) reflections = register_parameter("reflections", s.reflections);
  delta_scale_ = register_buffer(
      "delta_scale", at::scalar_tensor(s.scaling, s.weight.options().dtype(at::kDouble)));
  scaling_ = s.scaling;
}

DeltaLinearState DeltaLinearImpl::state() const {
  return {weight, bias, U, V, reflections, core, scaling_};
}

void DeltaLinearImpl::set_scaling(double scaling) {
  at::NoGradGuard no_grad;
  scaling_ = scaling;
  delta_scale_.fill_(scaling);
}

at::Tensor DeltaLinearImpl::forward(const at::Tensor& x) {
  return delta_linear_forward(x, state(), options_.gram_schmidt());
}

at::Tensor DeltaLinearImpl::delta_weight() const {
  return delta_linear_delta_weight(state());
}

torch::nn::Linear DeltaLinearImpl::merge() const {
  const at::Tensor w = delta_linear_merged_weight(state(), options_.gram_schmidt());
  // A Linear of one input and no outputs initialises an empty weight and bias (no allocation, no
  // random numbers); it then takes the merged tensors and its real sizes.
  auto merged =
      std::make_shared<torch::nn::LinearImpl>(torch::nn::LinearOptions(1, 0).bias(bias.defined()));
  at::NoGradGuard no_grad;
  merged->options.in_features(options_.in_features()).out_features(options_.out_features());
  merged->weight.set_data(w);
  if (bias.defined()) merged->bias.set_data(bias.detach().clone());
  return torch::nn::Linear(merged);
}

OrthogonalityError DeltaLinearImpl::orthogonality_error() const {
  return delta_linear_orthogonality_error(state(), options_.gram_schmidt());
}

at::Tensor DeltaLinearImpl::orthogonality_penalty(double lambda) const {
  return delta_linear_orthogonality_penalty(state(), lambda);
}

double DeltaLinearImpl::resize_rank(int64_t k_new) {
  const DeltaLinearResized r = delta_linear_resize_rank(state(), options_, k_new);
  set_parameter(U, r.state.U);
  set_parameter(V, r.state.V);
  if (core.defined()) set_parameter(core, r.state.core);
  if (r.state.scaling != scaling_) set_scaling(r.state.scaling);
  options_.rank(k_new);
  return r.error;
}

void DeltaLinearImpl::convert(const std::optional<at::Device>& device,
                              const std::optional<at::ScalarType>& dtype, bool non_blocking) {
  TORCH_CHECK(!dtype || detail::is_base_dtype(*dtype), k_who, ": cannot convert to ", *dtype,
              "; valid dtypes are Float, Double, Half, BFloat16");
  const at::Device d = device.value_or(weight.device());
  const at::ScalarType base = dtype.value_or(weight.scalar_type());
  at::NoGradGuard no_grad;
  auto convert_one = [&](at::Tensor& t, at::ScalarType type) {
    if (t.defined()) t.set_data(t.to(d, type, non_blocking));
  };
  convert_one(weight, base);
  convert_one(bias, base);
  for (at::Tensor* t : {&U, &V, &reflections, &core}) convert_one(*t, math_dtype(base));
  convert_one(delta_scale_, at::kDouble);
}

void DeltaLinearImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  convert(device, dtype, non_blocking);
}

void DeltaLinearImpl::to(torch::Dtype dtype, bool non_blocking) {
  convert(std::nullopt, dtype, non_blocking);
}

void DeltaLinearImpl::to(torch::Device device, bool non_blocking) {
  convert(device, std::nullopt, non_blocking);
}

void DeltaLinearImpl::load(torch::serialize::InputArchive& archive) {
  const std::string who = std::string(k_who) + "::load";
  // Everything is read and checked before anything changes.
  struct Entry {
    const char* name;
    at::Tensor* member;
    at::Tensor DeltaLinearState::*part;  // null for the scale
    at::Tensor value;
  };
  std::vector<Entry> entries = {{"delta_scale", &delta_scale_, nullptr, {}},
                                {"weight", &weight, &DeltaLinearState::weight, {}},
                                {"U", &U, &DeltaLinearState::U, {}},
                                {"V", &V, &DeltaLinearState::V, {}}};
  if (bias.defined()) entries.push_back({"bias", &bias, &DeltaLinearState::bias, {}});
  if (reflections.defined())
    entries.push_back({"reflections", &reflections, &DeltaLinearState::reflections, {}});
  if (core.defined()) entries.push_back({"core", &core, &DeltaLinearState::core, {}});
  for (auto& e : entries)
    TORCH_CHECK(archive.try_read(e.name, e.value, /*is_buffer=*/e.part == nullptr), who,
                ": the archive has no '", e.name,
                "' (not saved from a DeltaLinear with these options, or saved before the scale "
                "was part of its state)");
  // A saved part this layer lacks would be dropped, and the layer would compute something else
  // than the one saved (without its core Q, its reflections or its bias).
  for (const auto& [name, member] :
       {std::make_pair("bias", &bias), std::make_pair("reflections", &reflections),
        std::make_pair("core", &core)}) {
    at::Tensor saved;
    TORCH_CHECK(member->defined() || !archive.try_read(name, saved), who, ": the archive has '",
                name, "' but this layer has none (saved from a DeltaLinear with other options: ",
                "bias, reflections or orthogonal_core); nothing was changed");
  }
  TORCH_CHECK(entries[0].value.numel() == 1, who, ": the saved delta_scale has shape ",
              entries[0].value.sizes(), " (one value expected)");
  DeltaLinearState s;
  s.scaling = entries[0].value.item<double>();
  for (auto& e : entries) {
    e.value = e.value.to(e.member->options());  // this module's devices and dtypes
    if (e.part) s.*e.part = e.value;
  }
  check_state(s);
  const int64_t k = s.U.size(1);
  TORCH_CHECK(s.weight.sizes() == weight.sizes() && k <= std::min(U.size(0), V.size(0)) &&
                  (!reflections.defined() || s.reflections.sizes() == reflections.sizes()),
              who, ": the saved layer has weight ", s.weight.sizes(), ", rank ", k,
              " and reflection vectors ",
              s.reflections.defined() ? s.reflections.sizes() : c10::IntArrayRef{},
              "; this one has weight ", weight.sizes(), " and reflection vectors ",
              reflections.defined() ? reflections.sizes() : c10::IntArrayRef{});
  for (auto& e : entries) {
    if (e.member->sizes() != e.value.sizes()) {
      set_parameter(*e.member, e.value);  // U, V and core of another rank
    } else {
      at::NoGradGuard no_grad;
      e.member->copy_(e.value);
    }
  }
  scaling_ = s.scaling;
  options_.rank(k);
}

int64_t DeltaLinearImpl::trainable_parameter_count() const {
  int64_t n = 0;
  for (const auto& p : parameters())
    if (p.requires_grad()) n += p.numel();
  return n;
}

}  // namespace nn
}  // namespace gwt
