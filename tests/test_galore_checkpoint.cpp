// gwt::GaLoreAdam's checkpoints: integrity, parameter order, the layout without digests (the
// rule: test_galore.cpp).

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "galore_test_util.h"
#include "gwt/gwt.h"

namespace {

using namespace gwt_test::galore;

// ---------------------------------------------------------------------------------------------
// Checkpoints: integrity, parameter order, the layout without digests
// ---------------------------------------------------------------------------------------------

// A trained optimizer over a projected [10, 6] weight and a dense [6] bias.
struct Trained {
  at::Tensor w, b;
  std::unique_ptr<GaLoreAdam> opt;
  Trained(uint64_t seed, double lr, int steps) {
    at::manual_seed(seed);
    w = at::randn({10, 6}, at::kDouble).requires_grad_(true);
    b = at::randn({6}, at::kDouble).requires_grad_(true);
    opt = std::make_unique<GaLoreAdam>(std::vector<at::Tensor>{w, b},
                                       GaLoreAdamOptions(lr).rank(2).update_proj_gap(2));
    for (int t = 0; t < steps; ++t) {
      w.mutable_grad() = at::randn({10, 6}, at::kDouble);
      b.mutable_grad() = at::randn({6}, at::kDouble);
      opt->step();
    }
  }
  std::vector<at::Tensor> snap() { return snapshot(*opt, {w, b}); }
};

TEST(GaLoreAdam, LoadRejectsCorruptStateWithNothingChanged) {
  struct Corruption {
    const char* name;
    bool on_weight;
    std::function<void(GaLoreAdamParamState&)> apply;
    std::vector<std::string> words;
  };
  auto set_first = [](const at::Tensor& t, double v) { t.view({-1})[0].fill_(v); };
  const std::vector<Corruption> corruptions = {
      {"NaN first moment",
       true,
       [&](auto& s) { set_first(s.exp_avg(), k_nan); },
       {"exp_avg", "NaN or an infinity"}},
      {"infinite first moment (dense)",
       false,
       [&](auto& s) { set_first(s.exp_avg(), -k_inf); },
       {"exp_avg", "NaN or an infinity"}},
      {"NaN second moment",
       true,
       [&](auto& s) { set_first(s.exp_avg_sq(), k_nan); },
       {"exp_avg_sq", "NaN or an infinity"}},
      {"negative second moment",
       true,
       [&](auto& s) { set_first(s.exp_avg_sq(), -1e-3); },
       {"exp_avg_sq", "negative"}},
      {"negative second moment (dense)",
       false,
       [&](auto& s) { set_first(s.exp_avg_sq(), -1); },
       {"exp_avg_sq", "negative"}},
      {"negative step",
       true,
       [&](auto& s) { s.step(-3); },
       {"step for parameter 0 of group 0", "is -3", ">= 0"}},
      {"NaN projector",
       true,
       [&](auto& s) { set_first(s.projector(), k_nan); },
       {"projector", "NaN or an infinity"}},
      {"infinite projector",
       true,
       [&](auto& s) { set_first(s.projector(), k_inf); },
       {"projector", "NaN or an infinity"}},
  };
  for (const auto& c : corruptions) {
    SCOPED_TRACE(c.name);
    Trained source(20, 0.01, 3);
    c.apply(mutable_state_of(*source.opt, c.on_weight ? source.w : source.b));
    const std::string bytes = saved(*source.opt);
    // The same model (its weights loaded), but an optimizer in another state: lr 0.3, 1 step.
    Trained target(20, 0.3, 0);
    target.w.mutable_grad() = at::randn({10, 6}, at::kDouble);
    target.b.mutable_grad() = at::randn({6}, at::kDouble);
    target.opt->step();
    {
      at::NoGradGuard no_grad;
      target.w.copy_(source.w), target.b.copy_(source.b);
    }
    const auto before = target.snap();
    auto words = c.words;
    words.push_back(c.on_weight ? "parameter 0 of group 0" : "parameter 1 of group 0");
    expect_error([&] { load(*target.opt, bytes); }, words);
    expect_same(target.snap(), before);
    EXPECT_EQ(target.opt->group_options(0).lr(), 0.3);
  }
}

// The checkpoint layout of gwt.GaLoreAdam.v1 before parameter digests were added, written key by
// key: counters, then per group its options, its parameters' shapes and their states by position.
std::string digestless_checkpoint(const std::vector<at::Tensor>& params,
                                  const GaLoreAdamOptions& options,
                                  const std::vector<const GaLoreAdamParamState*>& states,
                                  int64_t skipped_steps, int64_t svd_fallbacks,
                                  const std::string& drop = "") {
  torch::serialize::OutputArchive archive;
  archive.write("format", c10::IValue(std::string("gwt.GaLoreAdam.v1")));
  archive.write("num_groups", c10::IValue(int64_t{1}));
  archive.write("skipped_steps", c10::IValue(skipped_steps));
  archive.write("svd_fallbacks", c10::IValue(svd_fallbacks));
  torch::serialize::OutputArchive group(archive.compilation_unit()),
      options_archive(archive.compilation_unit());
  options.serialize(options_archive);
  group.write("options", options_archive);
  group.write("num_params", c10::IValue(static_cast<int64_t>(params.size())));
  for (size_t j = 0; j < params.size(); ++j) {
    group.write("param_" + std::to_string(j) + "_shape", c10::IValue(params[j].sizes().vec()));
    torch::serialize::OutputArchive state(archive.compilation_unit());
    if (j == 0 && !drop.empty()) {  // the state key by key, as serialize writes it, less `drop`
      const GaLoreAdamParamState& s = *states[0];
      auto put = [&](const std::string& key, const c10::IValue& value) {
        if (key != drop) state.write(key, value);
      };
      put("step", s.step());
      put("exp_avg", s.exp_avg());
      put("exp_avg_sq", s.exp_avg_sq());
      put("has_projector", s.projector().defined());
      if (s.projector().defined()) put("projector", s.projector());
      put("right", s.right());
    } else {
      states[j]->serialize(state);
    }
    group.write("param_" + std::to_string(j), state);
  }
  archive.write("group_0", group);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

TEST(GaLoreAdam, CheckpointWithoutDigestsLoadsAndNegativeCountersAreRejected) {
  Trained source(21, 0.01, 3);
  const auto options = source.opt->group_options(0);
  const std::vector<const GaLoreAdamParamState*> states = {&state_of(*source.opt, source.w),
                                                           &state_of(*source.opt, source.b)};
  Trained target(22, 0.3, 1);  // other values: nothing identifies the parameters
  const auto before = target.snap();
  expect_error(
      [&] {
        load(*target.opt, digestless_checkpoint({source.w, source.b}, options, states, -1, 0));
      },
      {"skipped_steps -1", ">= 0"});
  expect_error(
      [&] {
        load(*target.opt, digestless_checkpoint({source.w, source.b}, options, states, 0, -2));
      },
      {"svd_fallbacks -2", ">= 0"});
  expect_same(target.snap(), before);

  // The old layout loads, and then steps exactly like the optimizer it was written from.
  load(*target.opt, digestless_checkpoint({source.w, source.b}, options, states, 4, 1));
  EXPECT_EQ(target.opt->skipped_steps(), 4);
  EXPECT_EQ(target.opt->svd_fallbacks(), 1);
  EXPECT_EQ(target.opt->group_options(0), options);
  {
    at::NoGradGuard no_grad;
    target.w.copy_(source.w), target.b.copy_(source.b);
  }
  for (int t = 0; t < 3; ++t) {
    const at::Tensor gw = at::randn({10, 6}, at::kDouble), gb = at::randn({6}, at::kDouble);
    source.w.mutable_grad() = gw.clone(), target.w.mutable_grad() = gw.clone();
    source.b.mutable_grad() = gb.clone(), target.b.mutable_grad() = gb.clone();
    source.opt->step();
    target.opt->step();
  }
  EXPECT_TRUE(at::equal(source.w, target.w));
  EXPECT_TRUE(at::equal(source.b, target.b));
}

// A checkpoint whose parameter state lacks one of its tensors names it, and changes nothing.
TEST(GaLoreAdam, CheckpointStateWithoutATensorIsAClearErrorWithNothingChanged) {
  Trained source(23, 0.01, 3);
  const std::vector<const GaLoreAdamParamState*> states = {&state_of(*source.opt, source.w),
                                                           &state_of(*source.opt, source.b)};
  ASSERT_TRUE(states[0]->projector().defined());
  for (const std::string key : {"exp_avg", "exp_avg_sq", "projector"}) {
    SCOPED_TRACE(key);
    Trained target(24, 0.3, 1);
    const auto before = target.snap();
    expect_error(
        [&] {
          load(*target.opt, digestless_checkpoint({source.w, source.b},
                                                  source.opt->group_options(0), states, 0, 0, key));
        },
        {"has no " + key});
    expect_same(target.snap(), before);
    EXPECT_EQ(target.opt->group_options(0).lr(), 0.3);
  }
}

// step(closure) runs the closure with gradients enabled and returns its loss; state_bytes() is the
// sum over the parameters; asking whether a tensor that is not a parameter is projected is an
// error naming the call.
TEST(GaLoreAdam, ClosureTotalAndATensorThatIsNotAParameter) {
  Trained t(25, 0.01, 0);
  bool grad_mode = false;
  const at::Tensor loss = t.opt->step([&] {
    grad_mode = at::GradMode::is_enabled();
    t.w.mutable_grad() = at::randn({10, 6}, at::kDouble);
    t.b.mutable_grad() = at::randn({6}, at::kDouble);
    return at::scalar_tensor(2.5, at::kDouble);
  });
  EXPECT_TRUE(grad_mode);
  EXPECT_EQ(loss.item<double>(), 2.5);
  EXPECT_EQ(state_of(*t.opt, t.w).step(), 1);
  EXPECT_GT(t.opt->state_bytes(t.w), 0);
  EXPECT_GT(t.opt->state_bytes(t.b), 0);
  EXPECT_EQ(t.opt->state_bytes(), t.opt->state_bytes(t.w) + t.opt->state_bytes(t.b));
  expect_error(
      [&] {
        t.opt->is_projected_param(at::zeros({10, 6}, at::kDouble));
      },
      {"is_projected_param", "not a parameter of this optimizer"});
}

TEST(GaLoreAdam, LoadDetectsParametersReorderedSinceTheSave) {
  // Two weights of one shape: positions and shapes alone cannot tell them apart. The checkpoint
  // holds a digest of each parameter's bytes; loaded into the same model (its weights loaded, so
  // the values are as saved) with the parameters in another order or group, it is an error.
  at::manual_seed(23);
  const auto options = GaLoreAdamOptions(0.01).rank(2);
  auto leaf = [](const at::Tensor& t) { return t.detach().clone().requires_grad_(true); };
  const at::Tensor a = leaf(at::randn({10, 6}, at::kDouble)),
                   b = leaf(at::randn({10, 6}, at::kDouble)), c = leaf(at::randn({6}, at::kDouble));
  auto make = [&](const std::vector<std::vector<at::Tensor>>& lists) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (const auto& l : lists)
      groups.emplace_back(l, std::make_unique<GaLoreAdamOptions>(options));
    return std::make_unique<GaLoreAdam>(std::move(groups), options);
  };
  auto train = [](GaLoreAdam& opt) {
    for (int t = 0; t < 2; ++t) {
      for (auto& group : opt.param_groups())
        for (auto& p : group.params()) p.mutable_grad() = at::randn(p.sizes(), at::kDouble);
      opt.step();
    }
  };
  for (const bool two_groups : {false, true}) {
    SCOPED_TRACE(two_groups ? "groups {a}, {b, c}" : "group {a, b, c}");
    const auto layout = two_groups ? std::vector<std::vector<at::Tensor>>{{a}, {b, c}}
                                   : std::vector<std::vector<at::Tensor>>{{a, b, c}};
    const auto swapped = two_groups ? std::vector<std::vector<at::Tensor>>{{b}, {a, c}}
                                    : std::vector<std::vector<at::Tensor>>{{b, a, c}};
    auto source = make(layout);
    train(*source);
    const std::string bytes = saved(*source);
    // Copies of the model's parameters, listed as in `lists` (which names a, b and c).
    auto copies = [&](const std::vector<std::vector<at::Tensor>>& lists, const at::Tensor& a2,
                      const at::Tensor& b2, const at::Tensor& c2) {
      std::vector<std::vector<at::Tensor>> out;
      for (const auto& l : lists) {
        out.emplace_back();
        for (const auto& t : l) out.back().push_back(t.is_same(a) ? a2 : t.is_same(b) ? b2 : c2);
      }
      return out;
    };
    // The model as saved (its weights loaded), its parameters listed in another order.
    const at::Tensor a2 = leaf(a), b2 = leaf(b), c2 = leaf(c);
    auto target = make(copies(swapped, a2, b2, c2));
    train(*target);
    {
      at::NoGradGuard no_grad;
      a2.copy_(a), b2.copy_(b), c2.copy_(c);
    }
    const auto before = snapshot(*target, {a2, b2, c2});
    expect_error([&] { load(*target, bytes); },
                 {"reordered", "parameter 0 of group 0",
                  two_groups ? "parameter 0 of group 1" : "parameter 1 of group 0"});
    expect_same(snapshot(*target, {a2, b2, c2}), before);

    // In the saved order it loads.
    const at::Tensor a3 = leaf(a), b3 = leaf(b), c3 = leaf(c);
    auto right_order = make(copies(layout, a3, b3, c3));
    load(*right_order, bytes);
    EXPECT_TRUE(at::equal(state_of(*right_order, a3).exp_avg(), state_of(*source, a).exp_avg()));
    EXPECT_TRUE(at::equal(state_of(*right_order, b3).exp_avg(), state_of(*source, b).exp_avg()));
    // A model whose values differ from the saved ones (freshly initialised, its weights not
    // loaded yet) cannot be checked: it loads, whatever the order (the documented limit).
    auto fresh = make(copies(swapped, leaf(a + 1), leaf(b + 1), leaf(c + 1)));
    load(*fresh, bytes);
  }
}

}  // namespace
