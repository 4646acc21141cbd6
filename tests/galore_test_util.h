#pragma once

// Helpers shared by the tests of gwt::GaLoreAdam (test_galore.cpp, test_galore_checkpoint.cpp,
// test_galore_fallback.cpp): its state, snapshots of what must not change on an error, and
// checkpoints in memory.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <sstream>
#include <string>
#include <vector>

#include "error_expect.h"
#include "gwt/gwt.h"

// What the tests of GaLoreAdam use, for `using namespace gwt_test::galore`.
namespace gwt_test::galore {

using gwt::GaLoreAdam;
using gwt::GaLoreAdamOptions;
using gwt::GaLoreAdamParamState;
using gwt_test::expect_error;
using gwt_test::k_inf;
using gwt_test::k_nan;

inline const GaLoreAdamParamState& state_of(GaLoreAdam& opt, const at::Tensor& p) {
  return static_cast<const GaLoreAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}
inline GaLoreAdamParamState& mutable_state_of(GaLoreAdam& opt, const at::Tensor& p) {
  return static_cast<GaLoreAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

inline at::Tensor scalar(int64_t v) {
  return at::scalar_tensor(v, at::kLong);
}

// Parameters, every state tensor and step, and the counters: what must not change on an error.
inline std::vector<at::Tensor> snapshot(GaLoreAdam& opt, const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) {
    out.push_back(p.detach().clone());
    auto it = opt.state().find(p.unsafeGetTensorImpl());
    out.push_back(scalar(it != opt.state().end()));
    if (it == opt.state().end()) continue;
    const auto& s = static_cast<const GaLoreAdamParamState&>(*it->second);
    out.push_back(scalar(s.step()));
    out.push_back(scalar(s.right()));
    out.push_back(s.exp_avg().clone());
    out.push_back(s.exp_avg_sq().clone());
    out.push_back(s.projector().defined() ? s.projector().clone() : scalar(-1));
  }
  out.push_back(scalar(opt.skipped_steps()));
  out.push_back(scalar(opt.svd_fallbacks()));
  out.push_back(scalar(static_cast<int64_t>(opt.param_groups().size())));
  return out;
}

inline void expect_same(const std::vector<at::Tensor>& got,
                        const std::vector<at::Tensor>& expected) {
  gwt_test::expect_same_tensors(got, expected);
}

inline std::string saved(const GaLoreAdam& opt) {
  std::ostringstream out;
  torch::save(opt, out);
  return out.str();
}
inline void load(GaLoreAdam& opt, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::load(opt, in);
}

}  // namespace gwt_test::galore
