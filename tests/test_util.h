#pragma once

// Helpers shared by gwt's tests: golden-file readers and tensor comparisons.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace gwt_test {

inline std::string data_path(const std::string& file) {
  return std::string(GWT_TEST_DATA_DIR) + "/" + file;
}

// A record: a header line split into words, then named rows of doubles.
struct Record {
  std::vector<std::string> header;
  std::map<std::string, std::vector<double>> rows;
  std::vector<std::string> row_order;
};

// Reads records that start with a line whose first word is `start`; '#' lines are comments.
inline std::vector<Record> read_records(const std::string& file, const std::string& start) {
  std::ifstream in(data_path(file));
  EXPECT_TRUE(in.good()) << "cannot open " << data_path(file);
  std::vector<Record> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream words(line);
    std::string key;
    words >> key;
    if (key == start) {
      out.emplace_back();
      std::string w;
      while (words >> w) out.back().header.push_back(w);
      continue;
    }
    EXPECT_FALSE(out.empty()) << "data before the first record in " << file;
    if (out.empty()) continue;
    std::vector<double> values;
    std::string token;
    while (words >> token) values.push_back(std::stod(token));
    out.back().rows[key] = values;
    out.back().row_order.push_back(key);
  }
  return out;
}

inline at::Tensor to_tensor(const std::vector<double>& v) {
  return at::tensor(v, at::TensorOptions().dtype(at::kDouble));
}

inline double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// Max |a - b| / max(|b|, floor) over all elements.
inline double max_rel_diff(const at::Tensor& a, const at::Tensor& b, double floor = 1e-300) {
  const auto bd = b.to(at::kDouble);
  return ((a.to(at::kDouble) - bd).abs() / bd.abs().clamp_min(floor)).max().item<double>();
}

}  // namespace gwt_test
