#pragma once

// Helpers shared by the tests of gwt::FoamAdam (test_foam.cpp, test_foam_errors.cpp): its state,
// snapshots of what must not change, checkpoints in memory, and the golden records' configs.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <sstream>
#include <string>
#include <vector>

#include "error_expect.h"
#include "gwt/gwt.h"
#include "test_util.h"

// What the tests of FoamAdam use, for `using namespace gwt_test::foam`.
namespace gwt_test::foam {

using gwt::FoamAdam;
using gwt::FoamAdamOptions;
using gwt::FoamAdamParamState;
using gwt_test::expect_error;
using gwt_test::expect_same_tensors;
using gwt_test::k_inf;
using gwt_test::k_nan;

inline at::Tensor make_param(at::IntArrayRef shape, at::ScalarType dtype = at::kDouble) {
  return at::randn(shape, at::TensorOptions().dtype(dtype)).requires_grad_(true);
}

inline void set_grad(const at::Tensor& p, const at::Tensor& g) {
  p.mutable_grad() = g.to(p.scalar_type()).clone();
}

inline FoamAdamParamState& state_of(FoamAdam& opt, const at::Tensor& p) {
  return static_cast<FoamAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

// Parameters, every state tensor, step and skip count, the number of groups and the skip counter:
// what must not change on an error.
inline std::vector<at::Tensor> snapshot(FoamAdam& opt, const std::vector<at::Tensor>& params) {
  using gwt_test::count_tensor;
  auto out = gwt_test::optimizer_snapshot<FoamAdamParamState>(
      opt, params, [](const FoamAdamParamState& s) {
        return std::vector<at::Tensor>{count_tensor(s.step()), count_tensor(s.skipped()),
                                       s.exp_avg().clone(), s.exp_avg_sq().clone()};
      });
  out.push_back(count_tensor(opt.skipped_steps()));
  return out;
}

inline std::string saved(const FoamAdam& opt) {
  std::ostringstream out;
  torch::save(opt, out);
  return out.str();
}
inline void load(FoamAdam& opt, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::load(opt, in);
}

// A golden record's `key=value` header entry, or `fallback` when the record has none.
inline std::string config_value(const Record& rec, const std::string& key,
                                const std::string& fallback = "") {
  for (const auto& word : rec.header)
    if (word.rfind(key + "=", 0) == 0) return word.substr(key.size() + 1);
  if (fallback.empty()) ADD_FAILURE() << "no " << key << " in the config";
  return fallback;
}

inline std::vector<int64_t> config_shape(const Record& rec) {
  std::vector<int64_t> shape;
  std::istringstream sizes(config_value(rec, "shape"));
  for (std::string size; std::getline(sizes, size, ',');) shape.push_back(std::stoll(size));
  return shape;
}

// The options a record's config describes: beta1 0.9; level 0 is a dense group; dim and bias
// (correct_bias) only in foam_rule_golden.txt, else -1 and on, as the authors ran.
inline FoamAdamOptions config_options(const Record& rec) {
  auto number = [&](const char* key, const char* fallback = "") {
    return std::stod(config_value(rec, key, fallback));
  };
  return FoamAdamOptions(number("lr"))
      .betas({0.9, number("b2")})
      .eps(number("eps"))
      .weight_decay(number("wd"))
      .level(std::stoll(config_value(rec, "level")))
      .scale(number("scale"))
      .res_scale(number("res_scale"))
      .dim(std::stoll(config_value(rec, "dim", "-1")))
      .correct_bias(config_value(rec, "bias", "1") == "1");
}

}  // namespace gwt_test::foam
