#pragma once

// What the parent and the ranks of the tests of gwt::distributed share (test_distributed*.cpp):
// the problem every rank and the single process solve, the files they exchange, and the ranks'
// entry point. Why the tolerances are what they are: test_distributed.cpp.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <gwt/distributed.h>
#include <gwt/optim/wavelet_adam.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace gwt_test::dist {

namespace fs = std::filesystem;

// ------------------------------------------------------------------------------------------------
// The problem every rank and the single process solve
// ------------------------------------------------------------------------------------------------

constexpr int64_t kLayers = 6, kWidth = 32, kBatch = 12, kSteps = 20;

struct Problem {
  std::vector<at::Tensor> params;  // W0, b0, W1, b1, ...
  at::Tensor x, y;
};

inline Problem make_problem() {
  at::manual_seed(7);
  const auto o = at::TensorOptions(at::kDouble);
  Problem p;
  for (int64_t i = 0; i < kLayers; ++i) {
    p.params.push_back(
        (at::randn({kWidth, kWidth}, o) / std::sqrt(double(kWidth))).requires_grad_());
    p.params.push_back((0.1 * at::randn({kWidth}, o)).requires_grad_());
  }
  p.x = at::randn({kBatch, kWidth}, o);
  p.y = 0.5 * at::randn({kBatch, kWidth}, o);
  return p;
}

inline gwt::WaveletAdamOptions options() {
  return gwt::WaveletAdamOptions(1e-2).eps(1e-3).weight_decay(0.01);
}

// Scenarios named "skipparam..." skip only the parameter whose gradient is not finite.
inline gwt::WaveletAdamOptions options(const std::string& kind) {
  return kind.rfind("skipparam", 0) == 0 ? options().nonfinite("skip_param") : options();
}

// Two groups in another order than the model's (weights, then biases at level 0 with their own
// learning rate), as paper_param_groups makes them.
inline std::vector<torch::optim::OptimizerParamGroup> groups(const Problem& p) {
  std::vector<at::Tensor> weights, biases;
  for (size_t i = 0; i < p.params.size(); ++i)
    (i % 2 == 0 ? weights : biases).push_back(p.params[i]);
  std::vector<torch::optim::OptimizerParamGroup> out;
  out.emplace_back(weights, std::make_unique<gwt::WaveletAdamOptions>(options()));
  out.emplace_back(biases, std::make_unique<gwt::WaveletAdamOptions>(options().lr(5e-3).level(0)));
  return out;
}

// This rank's loss: its rows' squared error, scaled so that the average of the ranks' gradients
// is the single process's gradient of the mean squared error over the whole batch.
inline at::Tensor loss(const Problem& p, int64_t rank, int64_t world) {
  const int64_t rows = kBatch / world;
  at::Tensor h = p.x.narrow(0, rank * rows, rows);
  for (int64_t i = 0; i < kLayers; ++i) {
    h = at::addmm(p.params[2 * i + 1], h, p.params[2 * i].t());
    if (i + 1 < kLayers) h = at::tanh(h);
  }
  const at::Tensor d = h - p.y.narrow(0, rank * rows, rows);
  return (d * d).sum() * (static_cast<double>(world) / static_cast<double>(kBatch * kWidth));
}

struct TrainingRun {
  c10::intrusive_ptr<c10d::Backend> pg;    // null: one process, the whole batch
  bool average = false;                    // call all_reduce_gradients before step()
  int64_t nan_step = -1, nan_rank = -1;    // poison one gradient entry there
  int64_t exit_step = -1, exit_rank = -1;  // that rank dies before this step's collective
};

inline void train(Problem& p, torch::optim::Optimizer& opt, const TrainingRun& run, int64_t from,
                  int64_t to) {
  const int64_t rank = run.pg ? run.pg->getRank() : 0, world = run.pg ? run.pg->getSize() : 1;
  for (int64_t s = from; s < to; ++s) {
    opt.zero_grad();
    loss(p, rank, world).backward();
    if (s == run.nan_step && rank == run.nan_rank) {
      at::NoGradGuard no_grad;
      p.params[2].grad()[1][3] = std::numeric_limits<double>::quiet_NaN();
    }
    if (s == run.exit_step && rank == run.exit_rank) _exit(3);
    if (run.average) gwt::distributed::all_reduce_gradients(run.pg, p.params);
    opt.step();
  }
}

inline std::vector<at::Tensor> values(const Problem& p) {
  std::vector<at::Tensor> out;
  for (const auto& t : p.params) out.push_back(t.detach().clone());
  return out;
}

inline void set_values(Problem& p, const std::vector<at::Tensor>& v) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < v.size(); ++i) p.params[i].copy_(v[i]);
}

inline double max_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
  return d;
}

inline bool bit_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!at::equal(a[i], b[i])) return false;
  return true;
}

// ------------------------------------------------------------------------------------------------
// Files the ranks and the parent exchange
// ------------------------------------------------------------------------------------------------

inline std::string dir() {
  const char* d = std::getenv("GWT_DIST_DIR");
  return d ? d : "";
}

inline void save_values(const std::vector<at::Tensor>& v, const std::string& name) {
  torch::save(v, dir() + "/" + name);
}

inline std::vector<at::Tensor> load_values(const std::string& d, const std::string& name) {
  std::vector<at::Tensor> v;
  torch::load(v, d + "/" + name);
  return v;
}

inline void write_text(const std::string& name, const std::string& text) {
  std::ofstream(dir() + "/" + name) << text;
}

inline std::string read_text(const std::string& d, const std::string& name) {
  std::ifstream in(d + "/" + name);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline std::string rank_file(const std::string& stem, int64_t rank) {
  return stem + "-" + std::to_string(rank);
}

inline std::string fresh_dir(const std::string& name) {
  const fs::path d =
      fs::temp_directory_path() / ("gwt-dist-" + name + "-" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

#ifdef GWT_DIST_TEST_LM
// The tiny LM trained twice in the same group: the full all-reduce and the wavelet-compressed one
// with error feedback, from the same initial model and batches.
constexpr int64_t kLmSteps = 150, kLmBatch = 8;
#endif

// Runs the scenario named `scenario` (GWT_DIST_SCENARIO) as one rank and exits the process: 0
// when it returned normally, 1 when it threw (test_distributed_ranks.cpp).
int worker(const std::string& scenario);

}  // namespace gwt_test::dist
