#pragma once

// gtest expectations for bad input, shared by the tests of errors: a c10::Error that names the
// problem, and the non-finite values that cause many.

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <string>
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

}  // namespace gwt_test
