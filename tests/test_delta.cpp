// gwt::nn::DeltaLinear: HRA reflections, the low-rank delta with and without an orthogonal core,
// merging, rank changes, whole-model wrapping, learning-rate groups and bad input.
//
// Exactness is tested in float64, against dense products computed here from the definitions
// (H_i = I - 2 u u^T / u^T u multiplied out as [in, in] matrices, which the layer never forms) and
// against NumPy's values in tests/data/delta_hra_golden.txt (tests/gen_delta_golden.py). The
// float64 tolerances are ~1e4 ulps of the O(1) values involved: each quantity is a handful of
// products of O(1) matrices of size <= 64, whose rounding error is ~1e-14.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "gwt/gwt.h"
#include "test_util.h"

namespace {

using gwt::nn::DeltaLinear;
using gwt::nn::DeltaLinearOptions;
using gwt_test::max_abs_diff;

// Linear layers "0", "1", ... called by name (gwt::nn::child_forward), so that adapters put in by
// add_delta_adapters take part in the forward (a torch::nn::Sequential runs its own list).
struct StackImpl : torch::nn::Module {
  explicit StackImpl(const std::vector<std::pair<int64_t, int64_t>>& sizes) {
    for (size_t i = 0; i < sizes.size(); ++i)
      register_module(std::to_string(i), torch::nn::Linear(sizes[i].first, sizes[i].second));
    layers = static_cast<int64_t>(sizes.size());
    to(at::kDouble);
  }
  at::Tensor forward(at::Tensor x) {
    for (int64_t i = 0; i < layers; ++i) x = gwt::nn::child_forward(*this, std::to_string(i), x);
    return x;
  }
  std::shared_ptr<torch::nn::Module> layer(int64_t i) {
    return named_children()[std::to_string(i)];
  }
  int64_t layers = 0;
};
TORCH_MODULE(Stack);

// Expects `fn` to throw a c10::Error whose message contains `words`.
void expect_error(const std::function<void()>& fn, const std::string& words) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << words;
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find(words), std::string::npos) << "'" << words << "' not in: " << msg;
  }
}

// Every child of `model` still a plain Linear and every parameter trainable: nothing was replaced
// or frozen.
void expect_untouched(const torch::nn::Module& model) {
  for (const auto& child : model.children())
    EXPECT_TRUE(std::dynamic_pointer_cast<torch::nn::LinearImpl>(child) != nullptr);
  for (const auto& p : model.parameters()) EXPECT_TRUE(p.requires_grad());
}

torch::nn::Linear make_base(int64_t in, int64_t out, at::ScalarType dtype = at::kDouble) {
  torch::nn::Linear base(torch::nn::LinearOptions(in, out));
  base->to(dtype);
  return base;
}

// H_1 ... H_r multiplied out densely from the columns of u [in, r].
at::Tensor dense_reflections(const at::Tensor& u) {
  const int64_t n = u.size(0);
  at::Tensor h = at::eye(n, u.options());
  for (int64_t i = 0; i < u.size(1); ++i) {
    const at::Tensor v = u.narrow(1, i, 1);
    h = at::matmul(h, at::eye(n, u.options()) - 2 * at::matmul(v, v.t()) / at::matmul(v.t(), v));
  }
  return h;
}

// I - 2 Q Q^T, Q the columns of u orthonormalised in order (classical Gram-Schmidt, written out).
at::Tensor dense_gram_schmidt(const at::Tensor& u) {
  std::vector<at::Tensor> q;
  for (int64_t i = 0; i < u.size(1); ++i) {
    at::Tensor v = u.select(1, i).clone();
    for (const auto& prev : q) v -= at::dot(prev, u.select(1, i)) * prev;
    q.push_back(v / v.norm());
  }
  const at::Tensor qm = at::stack(q, 1);
  return at::eye(u.size(0), u.options()) - 2 * at::matmul(qm, qm.t());
}

// The layer's function written densely: x (W H)^T + s x (U Q V^T)^T + b.
at::Tensor dense_forward(const DeltaLinear& layer, const at::Tensor& x) {
  at::Tensor w = layer->weight;
  if (layer->reflections.defined())
    w = at::matmul(w, layer->options().gram_schmidt() ? dense_gram_schmidt(layer->reflections)
                                                      : dense_reflections(layer->reflections));
  if (layer->U.defined()) {
    const at::Tensor q = layer->core.defined() ? dense_reflections(layer->core)
                                               : at::eye(layer->U.size(1), x.options());
    w = w + layer->scaling() * at::matmul(at::matmul(layer->U, q), layer->V.t());
  }
  at::Tensor y = at::matmul(x, w.t());
  return layer->bias.defined() ? y + layer->bias : y;
}

// Copies the adapter parameters (U, V, reflections, core) of `from` into `to` (same options).
void copy_parameters_of(const gwt::nn::DeltaLinearImpl& from, gwt::nn::DeltaLinearImpl& to) {
  at::NoGradGuard no_grad;
  for (const auto& [src, dst] :
       {std::make_pair(&from.U, &to.U), std::make_pair(&from.V, &to.V),
        std::make_pair(&from.reflections, &to.reflections), std::make_pair(&from.core, &to.core)})
    if (src->defined() && src->numel() > 0) dst->copy_(*src);
}

void randomize_impl(gwt::nn::DeltaLinearImpl& layer) {
  at::NoGradGuard no_grad;
  for (auto& p : layer.parameters())
    if (p.requires_grad()) p.copy_(at::randn(p.sizes(), p.options()));
}

void randomize(DeltaLinear& layer) {
  randomize_impl(*layer);
}

TEST(DeltaLinear, HraForwardMatchesNumPy) {
  // Golden values from NumPy (tests/gen_delta_golden.py): W, b, u_i, x and y = x (W H_1..H_r)^T + b
  // with the reflections multiplied out densely there, for r = 1..4 and Gram-Schmidt on and off.
  const auto records = gwt_test::read_records("delta_hra_golden.txt", "case");
  ASSERT_EQ(records.size(), 6u);
  for (const auto& rec : records) {
    const int64_t in = std::stoll(rec.header[0]), out = std::stoll(rec.header[1]),
                  r = std::stoll(rec.header[2]), batch = std::stoll(rec.header[3]);
    const bool gs = rec.header[4] == "1";
    torch::nn::Linear base = make_base(in, out);
    {
      at::NoGradGuard no_grad;
      base->weight.copy_(gwt_test::to_tensor(rec.rows.at("W")).view({out, in}));
      base->bias.copy_(gwt_test::to_tensor(rec.rows.at("b")));
    }
    DeltaLinear layer(base, DeltaLinearOptions(in, out).reflections(r).gram_schmidt(gs));
    {
      at::NoGradGuard no_grad;
      layer->reflections.copy_(gwt_test::to_tensor(rec.rows.at("u")).view({in, r}));
    }
    const at::Tensor x = gwt_test::to_tensor(rec.rows.at("x")).view({batch, in});
    const at::Tensor y = gwt_test::to_tensor(rec.rows.at("y")).view({batch, out});
    EXPECT_LE(max_abs_diff(layer->forward(x), y), 1e-12) << "r " << r << " gs " << gs;
  }
}

TEST(DeltaLinear, ForwardEqualsTheDenseProductForEveryVariant) {
  at::manual_seed(1);
  for (int64_t r : {0, 1, 2, 5, 8})
    for (bool gs : {false, true})
      for (int64_t k : {0, 3, 8})
        for (bool core : {false, true}) {
          torch::nn::Linear base = make_base(24, 16);
          DeltaLinear layer(base, DeltaLinearOptions(24, 16)
                                      .reflections(r)
                                      .gram_schmidt(gs)
                                      .rank(k)
                                      .orthogonal_core(core)
                                      .alpha(2.0));
          randomize(layer);
          // 15 tokens (<= out: the reflections act on x) and 40 (> out: on W).
          for (int64_t t : {3, 8}) {
            const at::Tensor x = at::randn({5, t, 24}, at::kDouble);
            EXPECT_LE(max_abs_diff(layer->forward(x), dense_forward(layer, x)), 1e-12)
                << "r " << r << " gs " << gs << " k " << k << " core " << core << " t " << t;
          }
        }
}

TEST(DeltaLinear, StartsAtItsBase) {
  at::manual_seed(2);
  const at::Tensor x = at::randn({7, 32}, at::kDouble);
  // Paired reflections (even r): H_{2j} H_{2j+1} = I, to rounding.
  for (int64_t r : {2, 8, 16}) {
    torch::nn::Linear base = make_base(32, 12);
    DeltaLinear layer(base,
                      DeltaLinearOptions(32, 12).reflections(r).rank(4).orthogonal_core(true));
    EXPECT_LE(max_abs_diff(layer->forward(x), base->forward(x)), 1e-12) << "r " << r;
    EXPECT_LE(max_abs_diff(layer->merge()->weight, base->weight), 1e-12);
  }
  // A delta-only adapter: U = 0, so it computes exactly what its base computes, in any dtype.
  for (auto dtype : {at::kDouble, at::kFloat}) {
    torch::nn::Linear base = make_base(32, 12, dtype);
    for (bool core : {false, true}) {
      DeltaLinear layer(base, DeltaLinearOptions(32, 12).rank(8).orthogonal_core(core));
      EXPECT_TRUE(at::equal(layer->forward(x.to(dtype)), base->forward(x.to(dtype))));
    }
  }
  // An odd r starts as W H_r: orthogonal, so the base's singular values are kept, not its output.
  torch::nn::Linear base = make_base(32, 12);
  DeltaLinear odd(base, DeltaLinearOptions(32, 12).reflections(3));
  EXPECT_GT(max_abs_diff(odd->forward(x), base->forward(x)), 1e-3);
  EXPECT_LE(
      max_abs_diff(at::linalg_svdvals(odd->merge()->weight), at::linalg_svdvals(base->weight)),
      1e-12);
}

TEST(DeltaLinear, MergeEqualsTheAdapter) {
  at::manual_seed(3);
  for (auto dtype : {at::kDouble, at::kFloat}) {
    for (bool gs : {false, true}) {
      torch::nn::Linear base = make_base(40, 24, dtype);
      DeltaLinear layer(base, DeltaLinearOptions(40, 24)
                                  .reflections(6)
                                  .gram_schmidt(gs)
                                  .rank(8)
                                  .orthogonal_core(true)
                                  .alpha(16));
      randomize(layer);
      const at::Tensor x = at::randn({9, 40}, dtype);
      const at::Tensor y = layer->forward(x);
      torch::nn::Linear merged = layer->merge();
      EXPECT_EQ(merged->weight.scalar_type(), dtype);
      const at::Tensor ym = merged->forward(x);
      // float32: both sides round O(1) products of length <= 40 (~40 ulps), and the merged side
      // rounds its weight once more: 1e-5 of the output's scale leaves a ~20x margin.
      const double tol = dtype == at::kDouble ? 1e-12 : 1e-5;
      const double scale = y.abs().max().item<double>();
      EXPECT_LE(max_abs_diff(ym, y), tol * scale) << "dtype " << dtype << " gs " << gs;
    }
  }
}

TEST(DeltaLinear, GradientsMatchFiniteDifferences) {
  at::manual_seed(4);
  torch::nn::Linear base = make_base(10, 7);
  DeltaLinear layer(
      base,
      DeltaLinearOptions(10, 7).reflections(3).rank(4).orthogonal_core(true).train_base(true));
  randomize(layer);
  // 6 rows (<= out = 7: the reflections act on x) and 12 (> out: on W).
  for (const int64_t rows : {6, 12}) {
    SCOPED_TRACE(rows);
    const at::Tensor x = at::randn({rows, 10}, at::kDouble);
    const at::Tensor weights = at::randn({rows, 7}, at::kDouble);
    auto loss = [&] { return (layer->forward(x) * weights).sum(); };
    layer->zero_grad();
    loss().backward();
    // Central differences: truncation h^2 f''' ~ 1e-12, rounding 1e-16 / h ~ 1e-10 with h = 1e-6;
    // 1e-7 relative to the largest gradient is far above both.
    const double h = 1e-6;
    for (const auto& item : layer->named_parameters()) {
      at::Tensor p = item.value();
      const at::Tensor grad = p.grad().clone();
      const double gmax = grad.abs().max().item<double>();
      const at::Tensor flat = p.detach().view({-1});
      for (int64_t i = 0; i < flat.numel(); i += std::max<int64_t>(1, flat.numel() / 7)) {
        const double orig = flat[i].item<double>();
        double up, down;
        {
          at::NoGradGuard no_grad;
          flat[i] = orig + h;
          up = loss().item<double>();
          flat[i] = orig - h;
          down = loss().item<double>();
          flat[i] = orig;
        }
        EXPECT_NEAR(grad.view({-1})[i].item<double>(), (up - down) / (2 * h),
                    1e-7 * std::max(1.0, gmax))
            << item.key() << "[" << i << "]";
      }
    }
  }
}

// A few AdamW steps on a regression towards a random linear map, so that every part moves.
void train(DeltaLinear& layer, int steps, double lr = 1e-2) {
  torch::optim::AdamW opt(layer->parameters(), torch::optim::AdamWOptions(lr).weight_decay(0));
  const int64_t in = layer->options().in_features(), out = layer->options().out_features();
  const at::Tensor target = at::randn({out, in}, at::kDouble);
  for (int t = 0; t < steps; ++t) {
    const at::Tensor x = at::randn({16, in}, at::kDouble);
    opt.zero_grad();
    (layer->forward(x) - at::matmul(x, target.t())).pow(2).mean().backward();
    opt.step();
  }
}

TEST(DeltaLinear, GrowingTheRankLeavesTheFunctionUnchangedAndTrainingContinues) {
  at::manual_seed(5);
  for (bool core : {false, true}) {
    torch::nn::Linear base = make_base(32, 24);
    DeltaLinear layer(base,
                      DeltaLinearOptions(32, 24).rank(8).orthogonal_core(core).reflections(2));
    train(layer, 5);
    const at::Tensor x = at::randn({11, 32}, at::kDouble);
    const at::Tensor before = layer->forward(x).detach();
    at::Tensor* u_identity = &layer->U;
    const auto* impl = layer->U.unsafeGetTensorImpl();
    EXPECT_EQ(layer->resize_rank(16), 0.0);
    EXPECT_EQ(layer->rank(), 16);
    EXPECT_EQ(layer->U.sizes(), (c10::IntArrayRef{24, 16}));
    EXPECT_EQ(layer->U.unsafeGetTensorImpl(), impl);  // the same parameter, resized
    EXPECT_EQ(u_identity, &layer->U);
    // The new columns add exact zeros; the kept ones go through products of another size, which
    // may round differently (the forward no longer reads U's values to keep the bits, a host
    // synchronisation on CUDA): equal to the float64 rounding of these O(1) products.
    EXPECT_LE(max_abs_diff(layer->forward(x), before), 1e-12) << "core " << core;
    // The new columns get gradients: training moves them.
    layer->zero_grad();
    layer->forward(x).pow(2).sum().backward();
    EXPECT_GT(layer->U.grad().narrow(1, 8, 8).abs().max().item<double>(), 0);
    train(layer, 3);
    EXPECT_GT(layer->U.detach().narrow(1, 8, 8).abs().max().item<double>(), 0);
    EXPECT_LE(max_abs_diff(layer->forward(x), dense_forward(layer, x)), 1e-12);
  }
}

TEST(DeltaLinear, ShrinkingReportsTheExactTruncationError) {
  at::manual_seed(6);
  for (bool core : {false, true}) {
    torch::nn::Linear base = make_base(30, 20);
    DeltaLinear layer(base, DeltaLinearOptions(30, 20).rank(12).orthogonal_core(core));
    randomize(layer);
    const at::Tensor delta = layer->delta_weight().detach();
    const at::Tensor s = at::linalg_svdvals(delta);
    const double expected = std::sqrt(s.narrow(0, 5, s.size(0) - 5).pow(2).sum().item<double>() /
                                      s.pow(2).sum().item<double>());
    const double reported = layer->resize_rank(5);
    EXPECT_EQ(layer->U.sizes(), (c10::IntArrayRef{20, 5}));
    EXPECT_EQ(layer->V.sizes(), (c10::IntArrayRef{30, 5}));
    const double actual = ((layer->delta_weight() - delta).norm() / delta.norm()).item<double>();
    EXPECT_NEAR(reported, expected, 1e-12);
    EXPECT_NEAR(actual, expected, 1e-12);
    EXPECT_GT(expected, 0.1);  // a real truncation, not a no-op
    const at::Tensor x = at::randn({4, 30}, at::kDouble);
    EXPECT_LE(max_abs_diff(layer->forward(x), dense_forward(layer, x)), 1e-12);
  }
}

TEST(DeltaLinear, ProductsStayOrthogonalThroughTraining) {
  at::manual_seed(7);
  for (bool gs : {false, true}) {
    torch::nn::Linear base = make_base(24, 16);
    DeltaLinear layer(
        base,
        DeltaLinearOptions(24, 16).reflections(6).gram_schmidt(gs).rank(6).orthogonal_core(true));
    train(layer, 100);
    const auto e = layer->orthogonality_error();
    EXPECT_LE(e.reflections, 1e-12) << "gs " << gs;
    EXPECT_LE(e.core, 1e-12);
    // HRA's regulariser: lambda ||I - N^T N||^2 of the unit vectors, differentiable.
    const at::Tensor pen = layer->orthogonality_penalty(0.5);
    const at::Tensor n = layer->reflections / layer->reflections.norm(2, {0}, true);
    EXPECT_NEAR(pen.item<double>(),
                0.5 * (at::eye(6, at::kDouble) - at::matmul(n.t(), n)).pow(2).sum().item<double>(),
                1e-12);
    EXPECT_TRUE(pen.requires_grad());
  }
}

TEST(DeltaLinear, ReducedPrecisionInputsComputeInFloat32) {
  at::manual_seed(8);
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(dtype);
    torch::nn::Linear base = make_base(32, 16, dtype);
    DeltaLinear layer(base, DeltaLinearOptions(32, 16).reflections(4).rank(4).alpha(8));
    EXPECT_EQ(layer->reflections.scalar_type(), at::kFloat);
    randomize(layer);
    const at::Tensor x = at::randn({5, 32}).to(dtype);
    const at::Tensor y = layer->forward(x);
    EXPECT_EQ(y.scalar_type(), dtype);
    // The float64 value of the same function: the same parameters (every one exact in float64)
    // in a float64 layer, multiplied out densely.
    torch::nn::Linear base64 = make_base(32, 16);
    {
      at::NoGradGuard no_grad;
      base64->weight.copy_(layer->weight), base64->bias.copy_(layer->bias);
    }
    DeltaLinear layer64(base64, DeltaLinearOptions(32, 16).reflections(4).rank(4).alpha(8));
    copy_parameters_of(*layer, *layer64);
    const at::Tensor xd = x.to(at::kDouble);
    const at::Tensor yd = dense_forward(layer64, xd);
    // Why this bound cannot fail by chance: the float32 evaluation rounds each sum of k terms to
    // within k u32 of the sum of |terms| (first-order, any order of summation), and every term
    // it forms is bounded by the same product taken with absolute values ("shadow"): |x| through
    // I + |Y| |T| |Y|^T (the WY factors of the reflections), |W|, and s |x| |V| |U|^T. No chain
    // of roundings is longer than in + 4 r + k + 8 = 60 < 64. Rounding the float32 value to the
    // dtype adds at most half an ulp of it, at most one ulp of the float64 value's binade. A
    // computation in the reduced dtype itself would miss by ~u_dtype |y|, far above u32.
    const int64_t r = 4;
    const at::Tensor refl = layer64->reflections.detach();
    const at::Tensor yv = refl / refl.norm(2, {0}, true);
    const at::Tensor t =
        at::linalg_inv(at::triu(at::matmul(yv.t(), yv), 1) + 0.5 * at::eye(r, at::kDouble));
    const at::Tensor p_abs =
        at::eye(32, at::kDouble) + at::matmul(at::matmul(yv.abs(), t.abs().t()), yv.abs().t());
    const at::Tensor shadow =
        at::matmul(at::matmul(xd.abs(), p_abs), layer64->weight.detach().abs().t()) +
        layer64->scaling() * at::matmul(at::matmul(xd.abs(), layer64->V.detach().abs()),
                                        layer64->U.detach().abs().t()) +
        layer64->bias.detach().abs();
    const double u32 = std::ldexp(1.0, -24);
    const int mantissa = dtype == at::kBFloat16 ? 7 : 10;
    const double smallest = dtype == at::kBFloat16 ? std::ldexp(1.0, -133) : std::ldexp(1.0, -24);
    const at::Tensor ulp =
        at::exp2(at::floor(at::log2(yd.abs().clamp_min(smallest))) - mantissa).clamp_min(smallest);
    const at::Tensor bound = ulp + 64 * u32 * shadow;
    EXPECT_TRUE(((y.to(at::kDouble) - yd).abs() <= bound).all().item<bool>())
        << "worst excess " << ((y.to(at::kDouble) - yd).abs() - bound).max().item<double>();
    // The bound is worth something: its float32 part is far below the dtype's own rounding.
    EXPECT_LT((64 * u32 * shadow / yd.abs().clamp_min(1e-3)).median().item<double>(),
              std::ldexp(1.0, -mantissa) / 8);
  }
}

TEST(DeltaLinear, BadInputIsAClearErrorWithNothingChanged) {
  torch::nn::Linear base = make_base(8, 6);
  expect_error([&] { DeltaLinear(base, DeltaLinearOptions(8, 6).rank(-1)); }, "invalid rank -1");
  expect_error([&] { DeltaLinear(base, DeltaLinearOptions(8, 6).rank(7)); }, "min(in, out) = 6");
  expect_error([&] { DeltaLinear(base, DeltaLinearOptions(8, 6).reflections(9)); }, "in = 8");
  expect_error([&] { DeltaLinear(base, DeltaLinearOptions(6, 8)); }, "options say in 6, out 8");
  expect_error([&] { DeltaLinear(base, DeltaLinearOptions(8, 6).alpha(-1)); }, "invalid alpha");
  expect_error([&] { DeltaLinear(torch::nn::Linear(nullptr), DeltaLinearOptions(8, 6)); }, "empty");
  EXPECT_TRUE(base->weight.requires_grad());  // a failed construction froze nothing
  DeltaLinear layer(base, DeltaLinearOptions(8, 6).rank(2));
  EXPECT_FALSE(base->weight.requires_grad());
  expect_error([&] { layer->forward(at::randn({3, 7}, at::kDouble)); }, "in_features = 8");
  expect_error([&] { layer->forward(at::ones({3, 8}, at::kLong)); }, "floating point");
  expect_error(
      [&] {
        layer->forward(at::randn({3, 8}, at::TensorOptions(at::kMeta).dtype(at::kDouble)));
      },
      "is on meta");
  const at::Tensor u = layer->U.detach().clone();
  expect_error([&] { layer->resize_rank(7); }, "invalid rank 7");
  EXPECT_TRUE(at::equal(layer->U, u));
  EXPECT_EQ(layer->rank(), 2);
  // add_delta_adapters checks every layer first: nothing is replaced when one cannot take it.
  Stack stack(std::vector<std::pair<int64_t, int64_t>>{{16, 16}, {16, 4}});
  expect_error(
      [&] { gwt::nn::add_delta_adapters(*stack, DeltaLinearOptions(0, 0).rank(8), nullptr); },
      "layer '1' of weight [4, 16] cannot take rank 8");
  expect_untouched(*stack);
  // A Sequential runs its own list of modules: replacing its children would change nothing that
  // runs, so it is refused.
  torch::nn::Sequential seq(torch::nn::Linear(16, 16), torch::nn::Linear(16, 4));
  expect_error(
      [&] { gwt::nn::add_delta_adapters(*seq, DeltaLinearOptions(0, 0).rank(2), nullptr); },
      "inside a torch::nn::Sequential");
  for (const auto& child : seq->children())
    EXPECT_TRUE(std::dynamic_pointer_cast<torch::nn::LinearImpl>(child) != nullptr);
}

TEST(DeltaAdapters, WrapAModelTrainAndMergeBack) {
  at::manual_seed(9);
  Stack model(std::vector<std::pair<int64_t, int64_t>>{{12, 16}, {16, 16}, {16, 3}});
  const at::Tensor x = at::randn({5, 12}, at::kDouble);
  const at::Tensor before = model->forward(x).detach();
  const auto adapters =
      gwt::nn::add_delta_adapters(*model, DeltaLinearOptions(0, 0).rank(4).reflections(2),
                                  [](const std::string& name) { return name != "2"; });
  ASSERT_EQ(adapters.size(), 2u);
  EXPECT_EQ(adapters[0].first, "0");
  EXPECT_EQ(adapters[1].first, "1");
  EXPECT_LE(max_abs_diff(model->forward(x), before), 1e-12);  // paired start
  // Trainable: the adapters' parameters and the head that was not wrapped.
  int64_t trainable = 0;
  for (const auto& p : model->parameters()) trainable += p.requires_grad() ? p.numel() : 0;
  EXPECT_EQ(trainable, (16 * 4 + 12 * 4 + 12 * 2) + (16 * 4 + 16 * 4 + 16 * 2) + (16 * 3 + 3));
  // Learning-rate groups: base (the head) at lr, U/V at 3x, reflections at 0.25x.
  auto groups = gwt::nn::delta_param_groups(
      *model, 1e-2, [](double lr) { return std::make_unique<torch::optim::AdamWOptions>(lr); });
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_DOUBLE_EQ(groups[0].options().get_lr(), 1e-2);
  EXPECT_EQ(groups[0].params().size(), 2u);
  EXPECT_DOUBLE_EQ(groups[1].options().get_lr(), 3e-2);
  EXPECT_EQ(groups[1].params().size(), 4u);
  EXPECT_DOUBLE_EQ(groups[2].options().get_lr(), 2.5e-3);
  torch::optim::AdamW opt(std::move(groups));
  EXPECT_DOUBLE_EQ(opt.param_groups()[1].options().get_lr(), 3e-2);  // the groups' own options
  for (int t = 0; t < 5; ++t) {
    opt.zero_grad();
    model->forward(x).pow(2).sum().backward();
    opt.step();
  }
  const at::Tensor adapted = model->forward(x).detach();
  EXPECT_GT(max_abs_diff(adapted, before), 1e-4);
  // The adapters took part: layer 0's U moved (it starts at zero).
  EXPECT_GT(model->layer(0)->as<gwt::nn::DeltaLinearImpl>()->U.abs().max().item<double>(), 0);
  EXPECT_EQ(gwt::nn::merge_delta_adapters(*model), 2);
  for (const auto& child : model->children())
    EXPECT_TRUE(std::dynamic_pointer_cast<torch::nn::LinearImpl>(child) != nullptr);
  EXPECT_LE(max_abs_diff(model->forward(x), adapted), 1e-12);
  // WaveletAdam takes the same groups (U and V are matrices: their state is compressed too).
  gwt::nn::add_delta_adapters(*model, DeltaLinearOptions(0, 0).rank(8),
                              [](const std::string& name) { return name != "2"; });
  gwt::WaveletAdam wopt(gwt::nn::delta_param_groups(*model, 1e-3, [](double lr) {
    return std::make_unique<gwt::WaveletAdamOptions>(gwt::WaveletAdamOptions(lr).min_size(0));
  }));
  ASSERT_EQ(wopt.param_groups().size(), 2u);
  EXPECT_DOUBLE_EQ(wopt.group_options(0).lr(), 1e-3);
  EXPECT_DOUBLE_EQ(wopt.group_options(1).lr(), 3e-3);
  EXPECT_TRUE(wopt.is_wavelet_param(model->named_parameters()["1.U"]));
}

// `steps` AdamW steps (lr 1e-2) on `loss`, over `params`.
void adamw_steps(const std::vector<at::Tensor>& params, const std::function<at::Tensor()>& loss,
                 int steps) {
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2));
  for (int t = 0; t < steps; ++t) {
    opt.zero_grad();
    loss().backward();
    opt.step();
  }
}

// A copy of `model`'s parameters into `other` (same architecture).
void copy_parameters(torch::nn::Module& from, torch::nn::Module& to) {
  at::NoGradGuard no_grad;
  auto dst = to.named_parameters();
  for (const auto& item : from.named_parameters()) dst[item.key()].copy_(item.value());
}

Stack three_layers(int64_t hidden = 16) {
  return Stack(std::vector<std::pair<int64_t, int64_t>>{{12, 16}, {16, hidden}, {hidden, 3}});
}

TEST(DeltaAdapters, SavedAloneTheyLoadOntoAFreshBaseAndRefuseAnotherShape) {
  at::manual_seed(10);
  Stack model = three_layers();
  Stack fresh = three_layers();
  copy_parameters(*model, *fresh);  // the same base, never adapted
  gwt::nn::add_delta_adapters(*model,
                              DeltaLinearOptions(0, 0).rank(4).reflections(2).orthogonal_core(true),
                              [](const std::string& name) { return name != "2"; });
  const at::Tensor x = at::randn({5, 12}, at::kDouble);
  auto train_steps = [&](int steps) {
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int t = 0; t < steps; ++t) {
      opt.zero_grad();
      model->forward(x).pow(2).sum().backward();
      opt.step();
    }
  };
  train_steps(5);
  model->layer(1)->as<gwt::nn::DeltaLinearImpl>()->resize_rank(8);  // a rank-changed adapter
  train_steps(5);
  const at::Tensor expected = model->forward(x).detach();
  torch::serialize::OutputArchive out;
  gwt::nn::save_delta_adapters(*model, out);
  std::ostringstream bytes;
  out.save_to(bytes);
  auto archive_of = [&] {
    auto in = std::make_shared<torch::serialize::InputArchive>();
    std::istringstream stream(bytes.str());
    in->load_from(stream);
    return in;
  };
  // Onto the fresh base: the same function, bit for bit (the head was trained in `model` only, so
  // it is copied too: it is not an adapter).
  copy_parameters(*model->layer(2), *fresh->layer(2));
  const auto loaded = gwt::nn::load_delta_adapters(*fresh, *archive_of());
  ASSERT_EQ(loaded.size(), 2u);
  EXPECT_EQ(loaded[1].second->rank(), 8);
  EXPECT_TRUE(at::equal(fresh->forward(x), expected));
  // Onto the adapted model after more training: back to the saved adapters.
  train_steps(3);
  gwt::nn::load_delta_adapters(*model, *archive_of());
  copy_parameters(*fresh->layer(2), *model->layer(2));  // the head is not an adapter: put it back
  EXPECT_TRUE(at::equal(model->forward(x), expected));
  // Onto a base of another shape: an error naming it, and nothing replaced or frozen.
  Stack other = three_layers(/*hidden=*/8);
  expect_error([&] { gwt::nn::load_delta_adapters(*other, *archive_of()); },
               "was saved for a layer of weight [16, 16] but layer '1' has weight [8, 16]");
  for (const auto& child : other->children())
    EXPECT_TRUE(std::dynamic_pointer_cast<torch::nn::LinearImpl>(child) != nullptr);
  for (const auto& p : other->parameters()) EXPECT_TRUE(p.requires_grad());
  // Not an adapter archive.
  torch::serialize::OutputArchive foreign;
  foreign.write("format", c10::IValue(std::string("something.else")));
  std::ostringstream foreign_bytes;
  foreign.save_to(foreign_bytes);
  torch::serialize::InputArchive foreign_in;
  std::istringstream foreign_stream(foreign_bytes.str());
  foreign_in.load_from(foreign_stream);
  expect_error([&] { gwt::nn::load_delta_adapters(*other, foreign_in); },
               "not a gwt.DeltaAdapters.v1");
}

// The bytes of `module`'s adapters (save_delta_adapters), and an archive that reads them.
std::string adapter_bytes(const torch::nn::Module& module) {
  torch::serialize::OutputArchive out;
  gwt::nn::save_delta_adapters(module, out);
  std::ostringstream bytes;
  out.save_to(bytes);
  return bytes.str();
}
std::shared_ptr<torch::serialize::InputArchive> archive_of(const std::string& bytes) {
  auto in = std::make_shared<torch::serialize::InputArchive>();
  std::istringstream stream(bytes);
  in->load_from(stream);
  return in;
}

torch::nn::Sequential sequential_of_adapters(const DeltaLinearOptions& o) {
  return torch::nn::Sequential(
      DeltaLinear(make_base(12, 16), DeltaLinearOptions(o).in_features(12).out_features(16)),
      DeltaLinear(make_base(16, 3), DeltaLinearOptions(o).in_features(16).out_features(3)));
}

TEST(DeltaAdapters, LoadIntoASequentialOfAdaptersSetsTheirValuesInPlace) {
  // A Sequential runs its own list of modules: a loaded adapter must be that list's. Before, load
  // replaced the Sequential's child in name only, and its forward kept the old adapter. Adapters
  // with the saved options now take the values in place: the forward is the saved model's, and
  // the parameters keep their identity, so an optimizer built before the load trains the loaded
  // values.
  at::manual_seed(12);
  const DeltaLinearOptions o =
      DeltaLinearOptions(0, 0).rank(3).reflections(2).orthogonal_core(true);
  torch::nn::Sequential trained = sequential_of_adapters(o);
  torch::nn::Sequential fresh = sequential_of_adapters(o);
  copy_parameters(*trained, *fresh);  // the same bases
  const at::Tensor x = at::randn({5, 12}, at::kDouble);
  adamw_steps(
      trained->parameters(), [&] { return trained->forward(x).pow(2).sum(); }, 5);
  const at::Tensor expected = trained->forward(x).detach();
  std::vector<const void*> identity;
  for (const auto& p : fresh->parameters()) identity.push_back(p.unsafeGetTensorImpl());
  torch::optim::AdamW opt(fresh->parameters(), torch::optim::AdamWOptions(1e-2));
  ASSERT_FALSE(at::equal(fresh->forward(x), expected));
  fresh->forward(x).pow(2).sum().backward();  // gradients of the values about to be replaced
  const auto loaded = gwt::nn::load_delta_adapters(*fresh, *archive_of(adapter_bytes(*trained)));
  for (const auto& p : fresh->parameters()) EXPECT_FALSE(p.grad().defined());  // stale: reset
  ASSERT_EQ(loaded.size(), 2u);
  EXPECT_EQ(loaded[0].second.get(), fresh->ptr(0).get());
  EXPECT_EQ(loaded[1].second.get(), fresh->ptr(1).get());
  EXPECT_TRUE(at::equal(fresh->forward(x), expected));  // the same values, the same operations
  std::vector<const void*> after;
  for (const auto& p : fresh->parameters()) after.push_back(p.unsafeGetTensorImpl());
  EXPECT_EQ(after, identity);
  const at::Tensor u_before = loaded[0].second->U.detach().clone();
  opt.zero_grad();
  fresh->forward(x).pow(2).sum().backward();
  opt.step();
  EXPECT_FALSE(at::equal(loaded[0].second->U, u_before));  // the optimizer trains the loaded U
}

TEST(DeltaAdapters, LoadAndMergeRefuseToReplaceALayerInsideASequential) {
  at::manual_seed(13);
  torch::nn::Sequential adapted = sequential_of_adapters(DeltaLinearOptions(0, 0).rank(2));
  const std::string bytes = adapter_bytes(*adapted);
  // Onto plain Linear layers in a Sequential (which add_delta_adapters refuses to adapt), and onto
  // adapters of another rank: each would have to be replaced, which the Sequential would not see.
  torch::nn::Sequential plain(make_base(12, 16), make_base(16, 3));
  torch::nn::Sequential other = sequential_of_adapters(DeltaLinearOptions(0, 0).rank(3));
  for (torch::nn::Sequential* target : {&plain, &other}) {
    std::vector<std::pair<const void*, at::Tensor>> before;
    for (const auto& child : (*target)->children())
      for (const auto& p : child->parameters())
        before.emplace_back(child.get(), p.detach().clone());
    std::vector<bool> requires_grad;
    for (const auto& p : (*target)->parameters()) requires_grad.push_back(p.requires_grad());
    expect_error([&] { gwt::nn::load_delta_adapters(**target, *archive_of(bytes)); },
                 "layer '0' is inside a torch::nn::Sequential, which runs its own list of modules");
    expect_error([&] { gwt::nn::load_delta_adapters(**target, *archive_of(bytes)); },
                 "load onto DeltaLinear layers with the saved options there");
    size_t i = 0;
    for (const auto& child : (*target)->children())
      for (const auto& p : child->parameters()) {
        EXPECT_EQ(before[i].first, child.get());
        EXPECT_TRUE(at::equal(p, before[i].second));
        ++i;
      }
    std::vector<bool> requires_grad_after;
    for (const auto& p : (*target)->parameters()) requires_grad_after.push_back(p.requires_grad());
    EXPECT_EQ(requires_grad_after, requires_grad);
  }
  // Merging would replace the adapters in name only, too; in a ModuleList as well.
  expect_error([&] { gwt::nn::merge_delta_adapters(*adapted); },
               "gwt::nn::merge_delta_adapters: layer '0' is inside a torch::nn::Sequential");
  for (const auto& child : adapted->children())
    EXPECT_TRUE(std::dynamic_pointer_cast<gwt::nn::DeltaLinearImpl>(child) != nullptr);
  torch::nn::ModuleList list(DeltaLinear(make_base(4, 4), DeltaLinearOptions(4, 4).rank(1)),
                             make_base(4, 4));
  expect_error([&] { gwt::nn::merge_delta_adapters(*list); },
               "layer '0' is inside a torch::nn::ModuleList");
  EXPECT_TRUE(std::dynamic_pointer_cast<gwt::nn::DeltaLinearImpl>(list->ptr(0)) != nullptr);
  // A ModuleDict keeps its own list too: adding adapters there is refused.
  torch::nn::ModuleDict dict(
      std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{
          {"q", make_base(4, 4).ptr()}});
  expect_error(
      [&] { gwt::nn::add_delta_adapters(*dict, DeltaLinearOptions(0, 0).rank(1), nullptr); },
      "layer 'q' is inside a torch::nn::ModuleDict");
  EXPECT_TRUE(std::dynamic_pointer_cast<torch::nn::LinearImpl>(dict["q"]) != nullptr);
}

TEST(DeltaAdapters, LoadRejectsARepeatedNameAndDrawsNoRandomNumbers) {
  at::manual_seed(15);
  Stack source = three_layers();
  gwt::nn::add_delta_adapters(*source, DeltaLinearOptions(0, 0).rank(2).reflections(2),
                              [](const std::string& name) { return name != "2"; });
  const std::string bytes = adapter_bytes(*source);
  // The same name twice (an archive written by hand): the second entry would be built on the
  // layer the first replaces.
  {
    torch::serialize::OutputArchive out;
    out.write("format", c10::IValue(std::string("gwt.DeltaAdapters.v1")));
    out.write("count", c10::IValue(int64_t{2}));
    for (int i = 0; i < 2; ++i) {
      torch::serialize::OutputArchive entry;
      entry.write("name", c10::IValue(std::string("1")));
      entry.write("in_features", c10::IValue(int64_t{16}));
      entry.write("out_features", c10::IValue(int64_t{16}));
      entry.write("rank", c10::IValue(int64_t{0}));
      entry.write("reflections", c10::IValue(int64_t{1}));
      entry.write("orthogonal_core", c10::IValue(false));
      entry.write("alpha", c10::IValue(0.0));
      entry.write("gram_schmidt", c10::IValue(false));
      entry.write("train_base", c10::IValue(false));
      entry.write("scaling", c10::IValue(1.0));
      entry.write("reflection_vectors", at::ones({16, 1}));
      out.write("adapter_" + std::to_string(i), entry);
    }
    std::ostringstream twice;
    out.save_to(twice);
    Stack target = three_layers();
    expect_error([&] { gwt::nn::load_delta_adapters(*target, *archive_of(twice.str())); },
                 "adapter '1' appears twice in the archive");
    EXPECT_TRUE(std::dynamic_pointer_cast<torch::nn::LinearImpl>(target->layer(1)) != nullptr);
    for (const auto& p : target->parameters()) EXPECT_TRUE(p.requires_grad());
  }
  // Building the replacements draws start values that the saved ones overwrite: the default
  // generator's state is put back, after a load and after a failed one.
  for (const bool fail : {false, true}) {
    Stack target = three_layers(fail ? 8 : 16);  // hidden 8: layer 1 has another shape
    at::manual_seed(16);
    const at::Tensor expected = at::rand({8});
    at::manual_seed(16);
    if (fail)
      EXPECT_THROW(gwt::nn::load_delta_adapters(*target, *archive_of(bytes)), c10::Error);
    else
      EXPECT_EQ(gwt::nn::load_delta_adapters(*target, *archive_of(bytes)).size(), 2u);
    EXPECT_TRUE(at::equal(at::rand({8}), expected)) << (fail ? "failed load" : "load");
  }
}

TEST(DeltaAdapters, LoadRejectsReflectionVectorsThatDefineNoReflection) {
  // A zero reflection vector (with gram_schmidt, one that is zero once the vectors before it are
  // projected out) has no reflection: its normalisation is 0 / 0, and every output of the layer
  // was NaN after such a load. Such archives are rejected, with nothing changed.
  at::manual_seed(14);
  struct Case {
    DeltaLinearOptions options;
    std::function<void(gwt::nn::DeltaLinearImpl&)> spoil;
    std::string words;
    bool nan_forward = true;  // what such values do to the forward
  };
  const std::vector<Case> cases = {
      {DeltaLinearOptions(0, 0).reflections(2),
       [](gwt::nn::DeltaLinearImpl& a) { a.reflections.select(1, 1).zero_(); },
       "reflection vectors include one whose reflection cannot be computed in Double (a zero "
       "vector"},
      {DeltaLinearOptions(0, 0).reflections(3).gram_schmidt(true),
       [](gwt::nn::DeltaLinearImpl& a) {
         // The third vector in the span of the first two, exactly in float64: 2 e0 + e1 after
         // the first two are made e0 and e1.
         a.reflections.zero_();
         a.reflections[0][0] = 1, a.reflections[1][1] = 1;
         a.reflections[0][2] = 2, a.reflections[1][2] = 1;
       },
       "reflection vectors include one whose reflection cannot be computed in Double (zero once "
       "the ones before it are projected out"},
      {DeltaLinearOptions(0, 0).rank(2).orthogonal_core(true),
       [](gwt::nn::DeltaLinearImpl& a) { a.core.select(1, 0).zero_(); },
       "core vectors include one whose reflection cannot be computed in Double (a zero vector"},
      // A norm that overflows normalises the vector to zero: the forward took that reflection for
      // the identity, without a word.
      {DeltaLinearOptions(0, 0).reflections(2),
       [](gwt::nn::DeltaLinearImpl& a) { a.reflections.select(1, 0).fill_(1e300); },
       "reflection vectors include one whose reflection cannot be computed in Double (a zero "
       "vector, or one whose norm under- or overflows)",
       /*nan_forward=*/false}};
  for (const auto& c : cases) {
    Stack source = three_layers();
    Stack target = three_layers();
    copy_parameters(*source, *target);
    const auto adapters = gwt::nn::add_delta_adapters(
        *source, c.options, [](const std::string& name) { return name == "1"; });
    {
      at::NoGradGuard no_grad;
      // A delta that is not zero, so that the core takes part.
      // (at::randn, not normal_(): GCC's -Wmaybe-uninitialized misfires on normal_'s default
      // generator argument in the sanitizer build.)
      at::Tensor& u = adapters[0].second.ptr()->U;
      if (u.defined()) u.copy_(at::randn(u.sizes(), u.options()));
      c.spoil(*adapters[0].second.ptr());
    }
    const at::Tensor x = at::randn({5, 12}, at::kDouble);
    if (c.nan_forward) {  // why
      EXPECT_FALSE(at::isfinite(source->forward(x)).all().item<bool>()) << c.words;
    }
    const at::Tensor before = target->forward(x);
    const std::string bytes = adapter_bytes(*source);
    expect_error([&] { gwt::nn::load_delta_adapters(*target, *archive_of(bytes)); },
                 "adapter '1''s " + c.words);
    EXPECT_TRUE(std::dynamic_pointer_cast<torch::nn::LinearImpl>(target->layer(1)) != nullptr);
    EXPECT_TRUE(target->layer(1)->parameters()[0].requires_grad());
    EXPECT_TRUE(at::equal(target->forward(x), before));
  }
}

TEST(DeltaAdapters, DiagnosticsMeasureTheFrozenWeightsGradientAndClip) {
  at::manual_seed(11);
  Stack model(std::vector<std::pair<int64_t, int64_t>>{{10, 6}});
  gwt::nn::add_delta_adapters(*model, DeltaLinearOptions(0, 0).rank(3).reflections(2), nullptr);
  auto layer = model->layer(0)->as<gwt::nn::DeltaLinearImpl>();
  randomize_impl(*layer);
  const at::Tensor x = at::randn({7, 10}, at::kDouble), r = at::randn({7, 6}, at::kDouble);
  auto loss = [&] { return (model->forward(x) * r).sum(); };
  // Without clipping: the figures against dense derivatives written here. L = sum(r * y), so
  // dL/dW = r^T (x H^T) (the would-be gradient of the frozen W) and dL/dU = s r^T (x V).
  const auto d = gwt::nn::delta_diagnostics(*model, loss, 0.0);
  ASSERT_EQ(d.layers.size(), 1u);
  const at::Tensor h = dense_reflections(layer->reflections);
  const double grad_w = at::matmul(r.t(), at::matmul(x, h.t())).norm().item<double>();
  const double grad_u =
      (at::matmul(r.t(), at::matmul(x, layer->V)) * layer->scaling()).norm().item<double>();
  EXPECT_NEAR(d.layers[0].grad_w, grad_w, 1e-12 * grad_w);
  EXPECT_NEAR(d.layers[0].grad_u, grad_u, 1e-12 * grad_u);
  EXPECT_NEAR(d.layers[0].ratio, grad_u / grad_w, 1e-12 * grad_u / grad_w);
  EXPECT_FALSE(d.clipped);
  EXPECT_FALSE(layer->weight.requires_grad());  // frozen again
  EXPECT_FALSE(layer->weight.grad().defined());
  EXPECT_LE(d.max_orthogonality_error, 1e-12);
  EXPECT_NE(d.summary().find("1 adapters"), std::string::npos) << d.summary();
  // With clipping: fired, and the gradients left total clip_norm.
  const auto c = gwt::nn::delta_diagnostics(*model, loss, 1e-3);
  EXPECT_TRUE(c.clipped);
  EXPECT_NEAR(c.grad_norm, d.grad_norm, 1e-12 * d.grad_norm);  // the same step, measured again
  double total = 0;
  for (const auto& p : model->parameters())
    if (p.requires_grad() && p.grad().defined()) total += p.grad().pow(2).sum().item<double>();
  EXPECT_NEAR(std::sqrt(total), 1e-3, 1e-9);
  EXPECT_NE(c.summary().find("(clipped)"), std::string::npos);
}

}  // namespace

namespace {

using gwt::nn::StateFollow;

// A regression that rank 8 cannot fit (the target differs from the base by a rank-16 map).
struct Regression {
  at::Tensor x, y;
  Regression(const torch::nn::Linear& base, int64_t rank) {
    const int64_t in = base->weight.size(1), out = base->weight.size(0);
    x = at::randn({64, in}, at::kDouble);
    const at::Tensor target =
        base->weight.detach() +
        0.3 * at::matmul(at::randn({out, rank}, at::kDouble), at::randn({rank, in}, at::kDouble)) /
            std::sqrt(static_cast<double>(in));
    y = at::matmul(x, target.t()) + base->bias.detach();
  }
  at::Tensor loss(DeltaLinear& layer) const { return (layer->forward(x) - y).pow(2).mean(); }
};

std::vector<at::Tensor> trainable(const DeltaLinear& layer) {
  std::vector<at::Tensor> out;
  for (const auto& p : layer->parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

double train_on(const Regression& data, DeltaLinear& layer, torch::optim::Optimizer& opt, int steps,
                std::vector<double>* losses = nullptr) {
  double last = 0;
  for (int t = 0; t < steps; ++t) {
    opt.zero_grad();
    const at::Tensor loss = data.loss(layer);
    last = loss.item<double>();
    if (losses) losses->push_back(last);
    loss.backward();
    opt.step();
  }
  return last;
}

TEST(RankAdaptation, GrowingCarriesTheMomentsAndTrainingContinuesWithoutASpike) {
  for (int which = 0; which < 2; ++which) {
    at::manual_seed(12);
    torch::nn::Linear base = make_base(32, 24);
    DeltaLinear layer(base, DeltaLinearOptions(32, 24).rank(8).orthogonal_core(which == 1));
    const Regression data(base, 16);
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (which == 0)
      opt = std::make_unique<torch::optim::AdamW>(trainable(layer),
                                                  torch::optim::AdamWOptions(3e-3).weight_decay(0));
    else
      opt = std::make_unique<gwt::WaveletAdam>(trainable(layer),
                                               gwt::WaveletAdamOptions(3e-3).min_size(0));
    train_on(data, layer, *opt, 60);
    at::Tensor m_before;
    {
      const auto& s = *opt->state().at(layer->U.unsafeGetTensorImpl());
      m_before = which == 0 ? static_cast<const torch::optim::AdamWParamState&>(s).exp_avg().clone()
                            : static_cast<const gwt::WaveletAdamParamState&>(s).exp_avg().clone();
    }
    const double at_growth = data.loss(layer).item<double>();
    const auto report = gwt::nn::resize_rank(layer, 16, *opt);
    EXPECT_EQ(report.to, 16);
    ASSERT_EQ(report.state.size(), which == 0 ? 2u : 3u);
    for (const auto& [name, follow] : report.state)
      EXPECT_EQ(follow, StateFollow::kept) << name << " optimizer " << which;
    // The function is unchanged (to the rounding of products of another size), and the kept
    // components' moments are exactly as they were.
    EXPECT_NEAR(data.loss(layer).item<double>(), at_growth, 1e-12 * at_growth);
    const auto& s = *opt->state().at(layer->U.unsafeGetTensorImpl());
    const at::Tensor m = which == 0 ? static_cast<const torch::optim::AdamWParamState&>(s).exp_avg()
                                    : static_cast<const gwt::WaveletAdamParamState&>(s).exp_avg();
    // AdamW keeps U's shape; WaveletAdam (haar, level 2) keeps a quarter of each row.
    EXPECT_EQ(m.size(1), which == 0 ? 16 : 4);
    EXPECT_TRUE(at::equal(m.narrow(1, 0, m_before.size(1)), m_before));
    EXPECT_EQ(
        m.narrow(1, m_before.size(1), m.size(1) - m_before.size(1)).abs().max().item<double>(), 0);
    // Training goes on without a spike: the new columns start at zero with zero moments, and
    // their first Adam steps (m / sqrt(v) = (1 - b1) / sqrt(1 - b2) ~ 3 at a late step count) are
    // lr-sized, so the loss may bump by a few percent (measured here: AdamW 0%, WaveletAdam
    // 5%) but not jump; 10% is the line. And the added rank is put to use.
    std::vector<double> losses;
    train_on(data, layer, *opt, 60, &losses);
    const double worst = *std::max_element(losses.begin(), losses.end());
    std::printf("growth %s: worst loss after / at growth = %.4f, final = %.4f\n",
                which == 0 ? "AdamW" : "WaveletAdam", worst / at_growth, losses.back() / at_growth);
    EXPECT_LE(worst, 1.10 * at_growth) << which;
    EXPECT_LT(losses.back(), 0.9 * at_growth) << which;
    EXPECT_GT(layer->U.detach().narrow(1, 8, 8).abs().max().item<double>(), 0);
  }
}

TEST(RankAdaptation, ShrinkingRestartsTheStateOfTheRotatedComponents) {
  at::manual_seed(13);
  torch::nn::Linear base = make_base(32, 24);
  DeltaLinear layer(base, DeltaLinearOptions(32, 24).rank(16));
  const Regression data(base, 16);
  torch::optim::AdamW opt(trainable(layer), torch::optim::AdamWOptions(3e-3));
  train_on(data, layer, opt, 20);
  const auto report = gwt::nn::resize_rank(layer, 8, opt);
  EXPECT_GT(report.error, 0);
  for (const auto& [name, follow] : report.state) EXPECT_EQ(follow, StateFollow::restarted) << name;
  EXPECT_EQ(opt.state().count(layer->U.unsafeGetTensorImpl()), 0u);
  train_on(data, layer, opt, 5);  // the optimizer starts fresh state for the new shapes
  EXPECT_EQ(static_cast<const torch::optim::AdamWParamState&>(
                *opt.state().at(layer->U.unsafeGetTensorImpl()))
                .step(),
            5);
  // A bad rank changes nothing.
  expect_error([&] { gwt::nn::resize_rank(layer, 99, opt); }, "invalid rank 99");
  EXPECT_EQ(layer->rank(), 8);
}

TEST(RankAdaptation, ScheduleGrowsAFullRankAndShrinksAnUnusedOne) {
  at::manual_seed(14);
  // Deltas with chosen singular values: U = P diag(s), V = R (orthonormal P, R).
  auto with_spectrum = [](const std::vector<double>& s) {
    torch::nn::Linear base = make_base(40, 32);
    const int64_t k = static_cast<int64_t>(s.size());
    DeltaLinear layer(base, DeltaLinearOptions(40, 32).rank(k));
    at::NoGradGuard no_grad;
    const at::Tensor p = std::get<0>(at::linalg_qr(at::randn({32, k}, at::kDouble)));
    const at::Tensor r = std::get<0>(at::linalg_qr(at::randn({40, k}, at::kDouble)));
    layer->U.copy_(p * gwt_test::to_tensor(s));
    layer->V.copy_(r);
    return layer;
  };
  DeltaLinear full = with_spectrum(std::vector<double>(16, 1.0));  // last 8 hold sqrt(1/2)
  std::vector<double> decaying(16, 1.0);
  for (int i = 8; i < 16; ++i) decaying[i] = 1e-4;  // last 8 hold ~1e-4
  DeltaLinear unused = with_spectrum(decaying);
  EXPECT_NEAR(gwt::nn::RankSchedule::tail_energy(full, 8), std::sqrt(0.5), 1e-12);
  EXPECT_NEAR(gwt::nn::RankSchedule::tail_energy(unused, 8), 1e-4, 1e-6);
  std::vector<at::Tensor> params = trainable(full);
  for (const auto& p : trainable(unused)) params.push_back(p);
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-3));
  gwt::nn::RankSchedule schedule({{"full", full}, {"unused", unused}}, opt,
                                 gwt::nn::RankScheduleOptions().every(3).min_rank(8).max_rank(24));
  EXPECT_TRUE(schedule.step().empty());
  EXPECT_TRUE(schedule.step().empty());
  const auto changes = schedule.step();  // the third call evaluates
  ASSERT_EQ(changes.size(), 2u);
  EXPECT_EQ(changes[0].name, "full");
  EXPECT_EQ(changes[0].to, 24);
  EXPECT_EQ(changes[1].name, "unused");
  EXPECT_EQ(changes[1].to, 8);
  EXPECT_NEAR(changes[1].error, 1e-4, 1e-6);  // sqrt(8e-8 / (8 + 8e-8))
  EXPECT_EQ(full->rank(), 24);
  EXPECT_EQ(unused->rank(), 8);
  // Bounds: max_rank 24 reached (the grown columns are zero: tail energy 0, so it would shrink
  // back only by the rule, not past min_rank).
  expect_error(
      [&] {
        gwt::nn::RankSchedule(std::vector<std::pair<std::string, DeltaLinear>>{}, opt,
                              gwt::nn::RankScheduleOptions().threshold(0));
      },
      "threshold must be in (0, 1)");
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Issue 38: the module's own state, growth from rank 0, conversions and whole-model functions.
// ------------------------------------------------------------------------------------------------

namespace {

// `module` written by torch::save and read back by torch::load into `into`.
template <typename A, typename B>
void save_and_load(const A& module, B& into) {
  std::stringstream bytes;
  torch::save(module, bytes);
  torch::load(into, bytes);
}

TEST(DeltaLinear, ModuleSerializationKeepsTheScaleAfterAResize) {
  // The scale alpha / k0 was a plain member: saved at rank 8 with alpha 16 (scale 2), resized to
  // 16 and loaded into a layer built at rank 16 (scale 1), the delta came back at half its size.
  at::manual_seed(21);
  for (bool core : {false, true}) {
    SCOPED_TRACE(core);
    torch::nn::Linear base = make_base(24, 16);
    DeltaLinear layer(base, DeltaLinearOptions(24, 16).rank(8).alpha(16).orthogonal_core(core));
    randomize(layer);
    layer->resize_rank(16);
    randomize(layer);
    const at::Tensor x = at::randn({5, 24}, at::kDouble);
    const at::Tensor y = layer->forward(x).detach();
    DeltaLinear at16(make_base(24, 16),
                     DeltaLinearOptions(24, 16).rank(16).alpha(16).orthogonal_core(core));
    save_and_load(layer, at16);
    EXPECT_EQ(at16->scaling(), 2.0);
    EXPECT_TRUE(at::equal(at16->forward(x), y));
    // Into a layer built at the first rank, with another alpha (scale 1): the rank and the scale
    // are the saved ones.
    DeltaLinear at8(make_base(24, 16),
                    DeltaLinearOptions(24, 16).rank(8).alpha(8).orthogonal_core(core));
    ASSERT_EQ(at8->scaling(), 1.0);
    save_and_load(layer, at8);
    EXPECT_EQ(at8->rank(), 16);
    EXPECT_EQ(at8->scaling(), 2.0);
    EXPECT_TRUE(at::equal(at8->forward(x), y));
    // A grown rank-0 layer fixes its scale at its first rank, and keeps it through a round trip
    // into a layer of that rank whose scale (alpha 6 over rank 6, kept when it shrank) is not it.
    DeltaLinear zero(make_base(24, 16), DeltaLinearOptions(24, 16).alpha(6).orthogonal_core(core));
    zero->resize_rank(3);
    randomize(zero);
    DeltaLinear other(make_base(24, 16),
                      DeltaLinearOptions(24, 16).rank(6).alpha(6).orthogonal_core(core));
    other->resize_rank(3);
    ASSERT_EQ(other->scaling(), 1.0);
    save_and_load(zero, other);
    EXPECT_EQ(other->scaling(), 2.0);
    EXPECT_TRUE(at::equal(other->forward(x), zero->forward(x)));
  }
}

TEST(DeltaLinear, ModuleLoadRefusesAnArchiveOfOtherParts) {
  // A saved core, reflection vectors or bias that the layer lacks were skipped: the loaded layer
  // computed without them, silently.
  at::manual_seed(29);
  const at::Tensor x = at::randn({5, 24}, at::kDouble);
  struct Case {
    const char* part;
    DeltaLinearOptions saved, into;
    bool saved_bias, into_bias;
  };
  const DeltaLinearOptions plain = DeltaLinearOptions(24, 16).rank(4).reflections(2);
  const Case cases[] = {
      {"core", DeltaLinearOptions(plain).orthogonal_core(true), plain, true, true},
      {"reflections", plain, DeltaLinearOptions(plain).reflections(0), true, true},
      {"bias", plain, plain, true, false},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.part);
    auto base_of = [](bool with_bias) {
      torch::nn::Linear base(torch::nn::LinearOptions(24, 16).bias(with_bias));
      base->to(at::kDouble);
      return base;
    };
    DeltaLinear saved(base_of(c.saved_bias), c.saved);
    randomize(saved);
    DeltaLinear into(base_of(c.into_bias), c.into);
    randomize(into);
    const at::Tensor y = into->forward(x);
    const auto before = into->named_parameters();
    std::vector<at::Tensor> values;
    for (const auto& p : before) values.push_back(p.value().clone());
    expect_error([&] { save_and_load(saved, into); },
                 std::string("the archive has '") + c.part + "' but this layer has none");
    size_t i = 0;
    for (const auto& p : into->named_parameters()) EXPECT_TRUE(at::equal(p.value(), values[i++]));
    EXPECT_TRUE(at::equal(into->forward(x), y));
    // The other way round: the layer's part is not in the archive.
    expect_error([&] { save_and_load(into, saved); },
                 std::string("the archive has no '") + c.part + "'");
  }
}

TEST(DeltaLinear, AGrownRankZeroLayerTrainsUnderTheOptimizerItWasBuiltWith) {
  // resize_rank registered U and V when the layer had none: an optimizer built before held
  // neither, so they never trained.
  for (int which = 0; which < 2; ++which)
    for (bool core : {false, true}) {
      SCOPED_TRACE(std::to_string(which) + (core ? " core" : ""));
      at::manual_seed(22);
      torch::nn::Linear base = make_base(16, 12);
      DeltaLinear layer(base, DeltaLinearOptions(16, 12).reflections(2).orthogonal_core(core));
      std::unique_ptr<torch::optim::Optimizer> opt;
      if (which == 0)
        opt = std::make_unique<torch::optim::AdamW>(layer->parameters(),
                                                    torch::optim::AdamWOptions(1e-2));
      else
        opt = std::make_unique<gwt::WaveletAdam>(layer->parameters(),
                                                 gwt::WaveletAdamOptions(1e-2).min_size(0));
      const at::Tensor x = at::randn({8, 16}, at::kDouble);
      const at::Tensor target = at::randn({8, 12}, at::kDouble);
      auto steps = [&](int n) {
        for (int t = 0; t < n; ++t) {
          opt->zero_grad();
          (layer->forward(x) - target).pow(2).mean().backward();
          opt->step();
        }
      };
      steps(2);  // the optimizer has state for the rank-0 parts before the growth
      ASSERT_TRUE(layer->U.defined());
      const auto* u = layer->U.unsafeGetTensorImpl();
      gwt::nn::resize_rank(layer, 4, *opt);
      EXPECT_EQ(layer->U.unsafeGetTensorImpl(), u);
      EXPECT_EQ(layer->U.sizes(), (c10::IntArrayRef{12, 4}));
      steps(3);
      EXPECT_GT(layer->U.detach().abs().max().item<double>(), 0);
    }
}

TEST(DeltaLinear, ConvertingAnAdaptedModelKeepsTheAdapterInItsMathDtype) {
  // model->to(bfloat16) made U, V and the reflections bfloat16 while the math ran in float32: a
  // dtype error at the forward.
  at::manual_seed(23);
  Stack model = three_layers();
  gwt::nn::add_delta_adapters(*model, DeltaLinearOptions(0, 0).rank(2).reflections(2).alpha(8),
                              nullptr);
  auto layer = model->layer(1)->as<gwt::nn::DeltaLinearImpl>();
  randomize_impl(*layer);
  const at::Tensor x = at::randn({5, 12}, at::kDouble);
  const double scale = layer->scaling();
  model->to(at::kBFloat16);
  EXPECT_EQ(layer->weight.scalar_type(), at::kBFloat16);
  for (const at::Tensor* t : {&layer->U, &layer->V, &layer->reflections})
    EXPECT_EQ(t->scalar_type(), at::kFloat);
  at::Tensor y;
  EXPECT_NO_THROW(y = model->forward(x.to(at::kBFloat16)));
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_EQ(layer->scaling(), scale);
  model->to(at::kDouble);
  EXPECT_EQ(layer->U.scalar_type(), at::kDouble);
  EXPECT_NO_THROW(model->forward(x));
  expect_error([&] { layer->to(at::kLong); }, "valid dtypes are Float, Double, Half, BFloat16");
  EXPECT_EQ(layer->weight.scalar_type(), at::kDouble);
}

TEST(DeltaLinear, MergeDrawsNoRandomNumbers) {
  // merge() built a randomly initialised Linear that it then overwrote, consuming the default
  // generator's stream.
  at::manual_seed(24);
  DeltaLinear layer(make_base(16, 8), DeltaLinearOptions(16, 8).rank(2).reflections(2));
  randomize(layer);
  const at::Tensor x = at::randn({3, 16}, at::kDouble);
  at::manual_seed(25);
  const at::Tensor expected = at::rand({8});
  at::manual_seed(25);
  torch::nn::Linear merged = layer->merge();
  EXPECT_TRUE(at::equal(at::rand({8}), expected));
  EXPECT_EQ(merged->options.in_features(), 16);
  EXPECT_EQ(merged->options.out_features(), 8);
  EXPECT_LE(max_abs_diff(merged->forward(x), layer->forward(x)), 1e-12);
  EXPECT_FALSE(merged->bias.is_same(layer->bias));
}

TEST(DeltaLinear, MetaTensorsAreAClearError) {
  // A meta base weight built an adapter without a word (the forward failed later, somewhere).
  torch::nn::Linear base = make_base(8, 6);
  const at::Tensor real_weight = base->weight;
  base->weight = at::empty({6, 8}, at::TensorOptions(at::kMeta).dtype(at::kDouble));
  expect_error([&] { DeltaLinear(base, DeltaLinearOptions(8, 6).rank(2)); },
               "the base weight of shape [6, 8] is on meta");
  EXPECT_TRUE(real_weight.requires_grad());
  DeltaLinear layer(make_base(8, 6), DeltaLinearOptions(8, 6).rank(2));
  expect_error(
      [&] {
        layer->forward(at::empty({3, 8}, at::TensorOptions(at::kMeta).dtype(at::kDouble)));
      },
      "the input of shape [3, 8] is on meta");
}

TEST(DeltaAdapters, AddChecksEveryLayerFirstAndCallsTheFilterOnce) {
  at::manual_seed(26);
  Stack model = three_layers();
  {
    // Layer 1's bias in another dtype: the constructor refuses it, and add_delta_adapters did not
    // check it first, so layer 0 was already replaced.
    at::NoGradGuard no_grad;
    auto l1 = model->layer(1)->as<torch::nn::LinearImpl>();
    l1->bias.set_data(l1->bias.to(at::kFloat));
  }
  std::map<std::string, int> calls;
  auto filter = [&](const std::string& name) {
    ++calls[name];
    return true;
  };
  expect_error(
      [&] { gwt::nn::add_delta_adapters(*model, DeltaLinearOptions(0, 0).rank(2), filter); },
      "the base bias must be [16] with the weight's device and dtype");
  expect_untouched(*model);
  {
    at::NoGradGuard no_grad;
    auto l1 = model->layer(1)->as<torch::nn::LinearImpl>();
    l1->bias.set_data(l1->bias.to(at::kDouble));
  }
  calls.clear();
  EXPECT_EQ(gwt::nn::add_delta_adapters(*model, DeltaLinearOptions(0, 0).rank(2), filter).size(),
            3u);
  EXPECT_EQ(calls, (std::map<std::string, int>{{"0", 1}, {"1", 1}, {"2", 1}}));
}

// A module with a parameter of its own named "U", next to an adapted layer.
struct WithOwnUImpl : torch::nn::Module {
  WithOwnUImpl() {
    U = register_parameter("U", at::randn({4}, at::kDouble));
    layer =
        register_module("layer", DeltaLinear(make_base(6, 4), DeltaLinearOptions(6, 4).rank(2)));
  }
  at::Tensor U;
  DeltaLinear layer{nullptr};
};

TEST(DeltaAdapters, ParamGroupsGoByModuleTypeNotByName) {
  // A parameter named U (or V, core, reflections) outside any DeltaLinear took the adapters' rate.
  auto model = std::make_shared<WithOwnUImpl>();
  const auto groups = gwt::nn::delta_param_groups(
      *model, 1e-2, [](double lr) { return std::make_unique<torch::optim::AdamWOptions>(lr); });
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_DOUBLE_EQ(groups[0].options().get_lr(), 1e-2);
  ASSERT_EQ(groups[0].params().size(), 1u);
  EXPECT_TRUE(groups[0].params()[0].is_same(model->U));
  EXPECT_DOUBLE_EQ(groups[1].options().get_lr(), 3e-2);
  EXPECT_EQ(groups[1].params().size(), 2u);
}

TEST(DeltaAdapters, ATrainedBaseTravelsWithItsAdapters) {
  // save_delta_adapters wrote the adapters of a train_base layer without the base they were
  // trained with: loaded onto the original base, the model computed something else.
  at::manual_seed(27);
  Stack model = three_layers();
  Stack fresh = three_layers();
  copy_parameters(*model, *fresh);
  gwt::nn::add_delta_adapters(*model, DeltaLinearOptions(0, 0).rank(2).train_base(true),
                              [](const std::string& name) { return name == "1"; });
  const at::Tensor x = at::randn({5, 12}, at::kDouble);
  adamw_steps(
      model->parameters(), [&] { return model->forward(x).pow(2).sum(); }, 3);
  copy_parameters(*model->layer(0), *fresh->layer(0));  // not adapters: trained in `model` only
  copy_parameters(*model->layer(2), *fresh->layer(2));
  Stack again = three_layers();
  copy_parameters(*fresh, *again);
  gwt::nn::load_delta_adapters(*fresh, *archive_of(adapter_bytes(*model)));
  EXPECT_TRUE(at::equal(fresh->forward(x), model->forward(x)));
  // Through a file, read to a named device (the map location: CUDA-saved adapters load on the CPU).
  const std::string path = ::testing::TempDir() + "gwt_delta_train_base.pt";
  gwt::nn::save_delta_adapters(*model, path);
  gwt::nn::load_delta_adapters(*again, path, at::Device(at::kCPU));
  std::remove(path.c_str());
  EXPECT_TRUE(at::equal(again->forward(x), model->forward(x)));
}

TEST(RankAdaptation, ScheduleRefusesMinRankZeroAndGrowsALayerBelowMinRank) {
  // With min_rank 0 a layer could shrink to rank 0, where its tail energy is 0: it never grew
  // again.
  at::manual_seed(28);
  DeltaLinear layer(make_base(16, 12), DeltaLinearOptions(16, 12));
  torch::optim::AdamW opt(layer->parameters(), torch::optim::AdamWOptions(1e-2));
  expect_error(
      [&] {
        gwt::nn::RankSchedule({{"l", layer}}, opt, gwt::nn::RankScheduleOptions().min_rank(0));
      },
      "min_rank must be >= 1");
  gwt::nn::RankSchedule schedule(
      {{"l", layer}}, opt, gwt::nn::RankScheduleOptions().every(1).step(2).min_rank(4).max_rank(8));
  const auto changes = schedule.step();
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].from, 0);
  EXPECT_EQ(changes[0].to, 4);
  EXPECT_EQ(layer->rank(), 4);
}

}  // namespace
