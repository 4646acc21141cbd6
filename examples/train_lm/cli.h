#pragma once

// Command-line pieces shared by the LM programs (train_lm, train_finetune, lm_soak, the scale-out
// runs): checked numbers and lists, one-line InputErrors, and the progress bar.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <sstream>
#include <string>
#include <vector>

#include "lm.h"

namespace lm {

/// A comma-separated list; empty items are dropped.
inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

/// A finite number > 0, or an InputError naming the flag.
inline double parse_positive(const std::string& flag, const std::string& value) {
  try {
    size_t used = 0;
    const double v = std::stod(value, &used);
    if (used == value.size() && std::isfinite(v) && v > 0) return v;
  } catch (const std::exception&) {
  }
  throw InputError(flag + " needs a positive number, got '" + value + "'");
}

/// A whole number in [lo, hi] (a fraction or a value past int64 would be truncated or undefined),
/// or an InputError saying "<flag> needs <what>".
inline int64_t parse_whole(const std::string& flag, const std::string& value, int64_t lo,
                           int64_t hi, const std::string& what) {
  try {
    size_t used = 0;
    const long long v = std::stoll(value, &used);
    if (used == value.size() && v >= lo && v <= hi) return static_cast<int64_t>(v);
  } catch (const std::exception&) {
  }
  throw InputError(flag + " needs " + what + ", got '" + value + "'");
}

/// "\r<label> [=====     ] step/total loss L ETA s" on stderr; a newline after the last step.
inline void progress_bar(const std::string& label, int label_width, int64_t step, int64_t total,
                         double loss, double elapsed) {
  const int width = 30;
  const int filled = static_cast<int>(width * (step + 1) / total);
  const double eta =
      elapsed / static_cast<double>(step + 1) * static_cast<double>(total - step - 1);
  std::fprintf(stderr, "\r%-*s [%s%s] %5lld/%lld loss %.3f ETA %4.0fs ", label_width, label.c_str(),
               std::string(filled, '=').c_str(), std::string(width - filled, ' ').c_str(),
               static_cast<long long>(step + 1), static_cast<long long>(total), loss, eta);
  if (step + 1 == total) std::fprintf(stderr, "\n");
}

}  // namespace lm
