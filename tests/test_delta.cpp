// gwt::nn::DeltaLinear: HRA reflections, the low-rank delta with and without an orthogonal core,
// merging, rank changes, the module's own state and bad input. Whole models (wrapping, merging,
// learning-rate groups, saved adapters): test_delta_adapters.cpp; rank changes under an
// optimizer: test_delta_rank.cpp.
//
// Exactness is tested in float64, against dense products computed here from the definitions
// (H_i = I - 2 u u^T / u^T u multiplied out as [in, in] matrices, which the layer never forms) and
// against NumPy's values in tests/data/delta_hra_golden.txt (tests/gen_delta_golden.py). The
// float64 tolerances are ~1e4 ulps of the O(1) values involved: each quantity is a handful of
// products of O(1) matrices of size <= 64, whose rounding error is ~1e-14.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "delta_test_util.h"
#include "gwt/gwt.h"
#include "test_util.h"

namespace {

using gwt::nn::DeltaLinear;
using gwt::nn::DeltaLinearOptions;
using gwt_test::max_abs_diff;

using namespace gwt_test::delta;

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

// ------------------------------------------------------------------------------------------------
// Issue 38: the module's own state, conversions, meta tensors.
// ------------------------------------------------------------------------------------------------

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

}  // namespace
