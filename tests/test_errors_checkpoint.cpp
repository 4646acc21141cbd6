// Every error in a checkpoint a caller can load names the problem and leaves parameters and state
// unchanged (the other errors a caller can cause: test_errors.cpp).

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "errors_test_util.h"
#include "gwt/gwt.h"

namespace {

using namespace gwt_test::errors;

TEST(Errors, LoadingMismatchedGroupsOrShapesLeavesEverythingUnchanged) {
  const std::string path =
      ::testing::TempDir() + "gwt_errors_" + std::to_string(::getpid()) + ".pt";
  {
    at::Tensor a = at::randn({8, 32}, at::kDouble).requires_grad_(true);
    at::Tensor c = at::randn({8}, at::kDouble).requires_grad_(true);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{a});
    groups.emplace_back(std::vector<at::Tensor>{c});
    WaveletAdam saved(std::move(groups));
    a.mutable_grad() = at::randn({8, 32}, at::kDouble);
    c.mutable_grad() = at::randn({8}, at::kDouble);
    saved.step();
    torch::save(saved, path);
  }
  {
    Fixture f;  // one group: the checkpoint has two
    expect_error([&] { torch::load(f.opt, path); }, {"2 parameter groups", "has 1"});
    f.expect_unchanged();
  }
  {
    at::Tensor a = at::randn({8, 16}, at::kDouble).requires_grad_(true);  // was [8, 32]
    at::Tensor c = at::randn({8}, at::kDouble).requires_grad_(true);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{a});
    groups.emplace_back(std::vector<at::Tensor>{c});
    WaveletAdam opt(std::move(groups));
    expect_error([&] { torch::load(opt, path); }, {"shape", "[8, 32]", "[8, 16]"});
    EXPECT_TRUE(opt.state().empty());
  }
  std::remove(path.c_str());
}

WaveletAdamParamState& state_in(WaveletAdam& opt, const at::Tensor& p) {
  return static_cast<WaveletAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

std::string saved_bytes(WaveletAdam& opt) {
  std::ostringstream out;
  torch::save(opt, out);
  return out.str();
}

void load_bytes(WaveletAdam& opt, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::load(opt, in);
}

TEST(Errors, LoadRejectsOptionsThatDoNotFitTheModelsDtype) {
  // Found by fuzz_load (GaLoreAdam; WaveletAdam shares the check): options valid for the float64
  // model they were saved with (lr 1e300) loaded into a float32 model, whose step() then threw.
  // load() makes the step's checks for every parameter, with state or without.
  at::Tensor wide = at::randn({8, 32}, at::kDouble).requires_grad_(true);
  WaveletAdam saved({wide}, WaveletAdamOptions(1e300));
  wide.mutable_grad() = at::randn({8, 32}, at::kDouble);
  saved.step();
  const std::string bytes = saved_bytes(saved);
  for (bool stepped : {false, true}) {
    at::Tensor narrow = at::randn({8, 32}).requires_grad_(true);
    WaveletAdam opt({narrow}, WaveletAdamOptions(0.01));
    if (stepped) {
      narrow.mutable_grad() = at::randn({8, 32});
      opt.step();
    }
    const std::string before = saved_bytes(opt);
    expect_error([&] { load_bytes(opt, bytes); }, {"does not fit float32", "Float parameter"});
    EXPECT_EQ(saved_bytes(opt), before);
    EXPECT_DOUBLE_EQ(opt.group_options(0).lr(), 0.01);
  }
}

TEST(Errors, LoadChecksTheDimOfParametersWithoutState) {
  // Found by fuzz_load: a checkpoint whose options have a dim out of range for a parameter that
  // has no state loaded (only parameters with state were planned), and the next step threw. The
  // constructor and add_param_group refuse such a dim for every parameter; load() now does too.
  at::Tensor a = at::randn({2, 8, 16}).requires_grad_(true);
  at::Tensor b = at::randn({8, 16}).requires_grad_(true);
  WaveletAdam saved({a, b}, WaveletAdamOptions(0.01));
  a.mutable_grad() = at::randn({2, 8, 16});
  saved.step();  // b has no gradient: no state
  // dim 2 fits a (3-D), not b (2-D); step() plans only parameters with gradients.
  static_cast<WaveletAdamOptions&>(saved.param_groups()[0].options()).dim(2);
  const std::string bytes = saved_bytes(saved);
  at::Tensor c = at::randn({2, 8, 16}).requires_grad_(true);
  at::Tensor d = at::randn({8, 16}).requires_grad_(true);
  WaveletAdam target({c, d}, WaveletAdamOptions(0.01));
  const std::string before = saved_bytes(target);
  expect_error([&] { load_bytes(target, bytes); },
               {"dim 2 is out of range for a parameter of shape [8, 16]"});
  EXPECT_EQ(saved_bytes(target), before);
}

// A checkpoint in the gwt.WaveletAdam.v1 layout written here by hand, as WaveletAdam::save wrote
// it before the per-parameter dtype entries existed: one group, every parameter with state.
std::string handwritten_checkpoint(const WaveletAdamOptions& options,
                                   const std::vector<at::Tensor>& params,
                                   const std::vector<const WaveletAdamParamState*>& states,
                                   int64_t skipped_steps) {
  torch::serialize::OutputArchive archive;
  archive.write("format", c10::IValue(std::string("gwt.WaveletAdam.v1")));
  archive.write("num_groups", c10::IValue(int64_t{1}));
  archive.write("skipped_steps", c10::IValue(skipped_steps));
  torch::serialize::OutputArchive group(archive.compilation_unit());
  torch::serialize::OutputArchive options_archive(archive.compilation_unit());
  options.serialize(options_archive);
  group.write("options", options_archive);
  group.write("num_params", c10::IValue(static_cast<int64_t>(params.size())));
  for (size_t j = 0; j < params.size(); ++j) {
    // (Built with append: GCC 12 warns falsely on `"param_" + std::to_string(j)`, GCC bug 105329.)
    const std::string key = std::string("param_").append(std::to_string(j));
    group.write(std::string(key).append("_shape"), c10::IValue(params[j].sizes().vec()));
    torch::serialize::OutputArchive state(archive.compilation_unit());
    states[j]->serialize(state);
    group.write(key, state);
  }
  archive.write("group_0", group);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

TEST(Errors, CorruptCheckpointStateIsRejectedChangingNothing) {
  // Each checkpoint comes from a trained optimizer of the Fixture's shapes whose state was
  // corrupted before saving, and whose lr (0.5) differs from the target's, so that a load that
  // went part of the way would show in the options as well as in the state.
  using Corrupt = std::function<void(WaveletAdamParamState & w, WaveletAdamParamState & b)>;
  struct Case {
    const char* what;
    Corrupt corrupt;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"nothing", [](auto&, auto&) {}, {}},
      {"NaN in exp_avg",
       [](auto& w, auto&) { w.exp_avg()[0][1] = k_nan; },
       {"exp_avg ", "[8, 32]", "NaN or an infinity"}},
      {"inf in exp_avg_sq",
       [](auto&, auto& b) { b.exp_avg_sq()[3] = k_inf; },
       {"exp_avg_sq", "[8]", "NaN or an infinity"}},
      {"negative exp_avg_sq",
       [](auto& w, auto&) { w.exp_avg_sq()[2][0] = -1e-3; },
       {"exp_avg_sq", "negative value"}},
      {"NaN limiter norm",
       [](auto& w, auto&) { w.norm(at::scalar_tensor(k_nan, at::kDouble)); },
       {"limiter norm", "NaN or an infinity"}},
      {"negative limiter norm",
       [](auto& w, auto&) { w.norm(at::scalar_tensor(-2.0, at::kDouble)); },
       {"limiter norm", "negative value"}},
      {"negative step", [](auto&, auto& b) { b.step(-3); }, {"step count is negative", "-3"}},
      {"integer moments",
       [](auto& w, auto&) { w.exp_avg(w.exp_avg().to(at::kLong)); },
       {"Long", "floating point"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    Fixture source;
    static_cast<WaveletAdamOptions&>(source.opt.param_groups()[0].options()).lr(0.5);
    c.corrupt(state_in(source.opt, source.w), state_in(source.opt, source.b));
    const std::string bytes = saved_bytes(source.opt);
    Fixture f;
    if (c.words.empty()) {  // the uncorrupted checkpoint loads
      load_bytes(f.opt, bytes);
      EXPECT_EQ(f.opt.group_options(0).lr(), 0.5);
      EXPECT_TRUE(state_in(f.opt, f.w) == state_in(source.opt, source.w));
      continue;
    }
    expect_error([&] { load_bytes(f.opt, bytes); }, c.words);
    f.expect_unchanged();
    EXPECT_EQ(f.opt.group_options(0).lr(), 0.01);
  }

  // Checked in the dtype the state will have: 1e300 is finite in float64 and infinite once the
  // moments are converted for a model that became float32 as a whole.
  Fixture source;
  state_in(source.opt, source.w).exp_avg()[0][0] = 1e300;
  at::Tensor w = at::randn({8, 32}).requires_grad_(true), b = at::randn({8}).requires_grad_(true);
  WaveletAdam target({w, b}, WaveletAdamOptions(0.01));
  expect_error([&] { load_bytes(target, saved_bytes(source.opt)); },
               {"exp_avg ", "NaN or an infinity"});
  EXPECT_TRUE(target.state().empty());
}

TEST(Errors, CheckpointOfParametersReorderedAcrossDtypesIsRejected) {
  // Equal shapes, different dtypes: the saved shapes cannot tell the reorder, the dtypes can.
  at::Tensor a = at::randn({8, 32}, at::kFloat).requires_grad_(true);
  at::Tensor c = at::randn({8, 32}, at::kDouble).requires_grad_(true);
  WaveletAdam saved({a, c}, WaveletAdamOptions(0.01));
  a.mutable_grad() = at::randn({8, 32}, at::kFloat);
  c.mutable_grad() = at::randn({8, 32}, at::kDouble);
  saved.step();
  const std::string bytes = saved_bytes(saved);

  at::Tensor a2 = a.detach().clone().requires_grad_(true);
  at::Tensor c2 = c.detach().clone().requires_grad_(true);
  // With the model's weights loaded, the digests of the parameters' bytes tell the reorder.
  WaveletAdam reordered({c2, a2}, WaveletAdamOptions(0.02));
  expect_error([&] { load_bytes(reordered, bytes); },
               {"holds the values that parameter 1 of group 0 had", "reordered"});
  EXPECT_TRUE(reordered.state().empty());
  EXPECT_EQ(reordered.group_options(0).lr(), 0.02);
  // With fresh weights the digests cannot tell, the dtypes still do.
  WaveletAdam fresh({at::randn({8, 32}, at::kDouble).requires_grad_(true),
                     at::randn({8, 32}, at::kFloat).requires_grad_(true)},
                    WaveletAdamOptions(0.02));
  expect_error([&] { load_bytes(fresh, bytes); },
               {"parameter 0 of group 0 was Float when saved but is Double here", "reordered"});
  EXPECT_TRUE(fresh.state().empty());

  WaveletAdam in_order({a2, c2}, WaveletAdamOptions(0.02));
  load_bytes(in_order, bytes);
  EXPECT_TRUE(state_in(in_order, a2) == state_in(saved, a));
  EXPECT_TRUE(state_in(in_order, c2) == state_in(saved, c));

  // A model converted as a whole between save and load (Module::to(kDouble)) still loads, its
  // moments converted (docs/options.md: save, convert the model, load).
  at::Tensor a3 = a.detach().to(at::kDouble).requires_grad_(true);
  at::Tensor c3 = c.detach().clone().requires_grad_(true);
  WaveletAdam converted({a3, c3});
  load_bytes(converted, bytes);
  EXPECT_EQ(state_in(converted, a3).exp_avg().scalar_type(), at::kDouble);
  EXPECT_TRUE(
      at::equal(state_in(converted, a3).exp_avg(), state_in(saved, a).exp_avg().to(at::kDouble)));
}

TEST(Errors, CheckpointsWithoutFingerprintsLoadAndCountersAreChecked) {
  // Written as before the dtype entries: it loads into the same parameters, state and counters.
  Fixture source;
  static_cast<WaveletAdamOptions&>(source.opt.param_groups()[0].options()).lr(0.5);
  const std::vector<const WaveletAdamParamState*> states = {&state_in(source.opt, source.w),
                                                            &state_in(source.opt, source.b)};
  const auto& options = source.opt.group_options(0);
  Fixture f;
  load_bytes(f.opt, handwritten_checkpoint(options, {source.w, source.b}, states, 2));
  EXPECT_EQ(f.opt.skipped_steps(), 2);
  EXPECT_TRUE(f.opt.group_options(0) == options);
  EXPECT_TRUE(state_in(f.opt, f.w) == *states[0]);
  EXPECT_TRUE(state_in(f.opt, f.b) == *states[1]);

  // A negative counter is rejected before anything changes.
  Fixture g;
  expect_error(
      [&] {
        load_bytes(g.opt, handwritten_checkpoint(options, {source.w, source.b}, states, -1));
      },
      {"skipped_steps is negative", "-1"});
  g.expect_unchanged();
  EXPECT_EQ(g.opt.skipped_steps(), 0);
  EXPECT_EQ(g.opt.group_options(0).lr(), 0.01);
}

}  // namespace
