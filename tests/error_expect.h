#pragma once

// gtest expectations for bad input, shared by the tests of errors: a c10::Error that names the
// problem, nothing changed, and the non-finite values that cause many.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace gwt_test {

constexpr double k_nan = std::numeric_limits<double>::quiet_NaN();
constexpr double k_inf = std::numeric_limits<double>::infinity();

// Expects `fn` to throw a c10::Error whose message contains every one of `words`.
inline void expect_error(const std::function<void()>& fn, const std::vector<std::string>& words) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << words.front();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& w : words)
      EXPECT_NE(msg.find(w), std::string::npos) << "'" << w << "' not in: " << msg;
  }
}

// A count as a tensor, for snapshots.
inline at::Tensor count_tensor(int64_t v) {
  return at::scalar_tensor(v, at::kLong);
}

// What an error must leave as it was in a torch::optim optimizer: each of `params`, whether it has
// state and, where it has, what `state_tensors` lists of its state (a `State`), then the number of
// groups.
template <typename State, typename Optimizer, typename StateTensors>
std::vector<at::Tensor> optimizer_snapshot(const Optimizer& opt,
                                           const std::vector<at::Tensor>& params,
                                           StateTensors&& state_tensors) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) {
    out.push_back(p.detach().clone());
    const auto it = opt.state().find(p.unsafeGetTensorImpl());
    out.push_back(count_tensor(it != opt.state().end()));
    if (it == opt.state().end()) continue;
    for (at::Tensor& t : state_tensors(static_cast<const State&>(*it->second)))
      out.push_back(std::move(t));
  }
  out.push_back(count_tensor(static_cast<int64_t>(opt.param_groups().size())));
  return out;
}

// Expects each tensor of `got` to equal the same entry of `expected` in dtype, shape and every
// value: a snapshot of what an error must leave unchanged, taken again after it.
inline void expect_same_tensors(const std::vector<at::Tensor>& got,
                                const std::vector<at::Tensor>& expected) {
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(got[i].scalar_type() == expected[i].scalar_type() &&
                got[i].sizes() == expected[i].sizes() && at::equal(got[i], expected[i]))
        << "snapshot entry " << i << " changed";
}

}  // namespace gwt_test
