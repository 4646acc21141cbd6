// gwt::distributed in one process: a group of one, and what is refused (on spawned ranks:
// test_distributed.cpp).

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <gwt/distributed.h>
#include <gwt/optim/wavelet_adam.h>
#include <gwt/transform.h>
#include <gwt/wavelet.h>

#include "../src/distributed/comm.h"

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dist_test_util.h"

using gwt::distributed::GradSyncOptions;
using gwt::distributed::ShardedWaveletAdam;
using namespace gwt_test::dist;

namespace {

// ------------------------------------------------------------------------------------------------
// In one process: a group of one, and what is refused
// ------------------------------------------------------------------------------------------------

struct EnvGuard {
  explicit EnvGuard(std::vector<std::pair<std::string, std::string>> vars) {
    for (const auto& [k, v] : vars) {
      const char* old = std::getenv(k.c_str());
      saved.emplace_back(k, old ? std::optional<std::string>(old) : std::nullopt);
      if (v.empty())
        unsetenv(k.c_str());
      else
        setenv(k.c_str(), v.c_str(), 1);
    }
  }
  ~EnvGuard() {
    for (const auto& [k, v] : saved) {
      if (v)
        setenv(k.c_str(), v->c_str(), 1);
      else
        unsetenv(k.c_str());
    }
  }
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
};

void expect_error(const std::function<void()>& f, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing: " << text;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

// NCCL's device (issue 39, item 4): one GPU per process, the one torchrun's LOCAL_RANK names (the
// NCCL group itself needs GPUs; the choice is tested here).
TEST(Distributed, NcclDeviceComesFromLocalRank) {
  using gwt::distributed::detail::cuda_device_for_rank;
  {
    EnvGuard env({{"LOCAL_RANK", "3"}, {"GWT_DIST_UNUSED", ""}});
    EXPECT_EQ(cuda_device_for_rank(11, 8), 3);
  }
  {
    EnvGuard env({{"LOCAL_RANK", ""}, {"GWT_DIST_UNUSED", ""}});
    EXPECT_EQ(cuda_device_for_rank(11, 8), 3);
    EXPECT_EQ(cuda_device_for_rank(5, 8), 5);
  }
  {
    EnvGuard env({{"LOCAL_RANK", "8"}, {"GWT_DIST_UNUSED", ""}});
    expect_error([] { cuda_device_for_rank(0, 8); },
                 "LOCAL_RANK=8 but this process sees 8 CUDA devices");
    // A launcher that gives each process its own GPU leaves it one device.
    EXPECT_EQ(cuda_device_for_rank(0, 1), 0);
  }
  expect_error([] { cuda_device_for_rank(0, 0); }, "this process sees none");
}

TEST(Distributed, BadEnvironmentAndOptionsAreClearErrors) {
  const std::string d = fresh_dir("env");
  {
    EnvGuard env({{"WORLD_SIZE", "2"}, {"RANK", "5"}, {"GWT_STORE_FILE", d + "/s"}});
    expect_error([] { gwt::distributed::init_from_env(); },
                 "RANK='5' is not a whole number from 0 to 1");
  }
  {
    EnvGuard env({{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"GWT_STORE_FILE", ""}, {"MASTER_PORT", ""}});
    expect_error([] { gwt::distributed::init_from_env(); }, "MASTER_PORT is not set");
  }
  {
    EnvGuard env({{"WORLD_SIZE", "1"}, {"RANK", "0"}, {"GWT_DIST_TIMEOUT_S", "soon"}});
    expect_error([] { gwt::distributed::init_from_env(); }, "GWT_DIST_TIMEOUT_S='soon'");
  }
  {
    EnvGuard env({{"WORLD_SIZE", "1"}, {"RANK", "0"}, {"GWT_STORE_FILE", d + "/s1"}});
    expect_error([] { gwt::distributed::init_from_env("mpi"); }, "unknown backend 'mpi'");
    auto pg = gwt::distributed::init_from_env("gloo");
    ASSERT_EQ(pg->getSize(), 1);
    Problem p = make_problem();
    loss(p, 0, 1).backward();
    const std::vector<at::Tensor> before = [&] {
      std::vector<at::Tensor> g;
      for (const auto& t : p.params) g.push_back(t.grad().clone());
      return g;
    }();
    GradSyncOptions bad;
    bad.compression = "topk";
    expect_error([&] { gwt::distributed::all_reduce_gradients(pg, p.params, bad); },
                 "unknown compression 'topk' (valid: none, wavelet)");
    bad.compression = "wavelet", bad.level = 0;
    expect_error([&] { gwt::distributed::all_reduce_gradients(pg, p.params, bad); }, "level 0");
    for (size_t i = 0; i < before.size(); ++i)
      EXPECT_TRUE(at::equal(p.params[i].grad(), before[i])) << "a refused call changed a gradient";
    // One rank: the full average is the gradient itself; the bytes are counted.
    gwt::distributed::all_reduce_gradients(pg, p.params);
    for (size_t i = 0; i < before.size(); ++i)
      EXPECT_TRUE(at::equal(p.params[i].grad(), before[i]));
    const auto stats = gwt::distributed::last_grad_sync_stats();
    EXPECT_EQ(stats.bytes_sent, stats.bytes_full);
    EXPECT_EQ(stats.bytes_full, (kLayers * (kWidth * kWidth + kWidth)) * 8);
    expect_error([&] { ShardedWaveletAdam(nullptr, p.params, options()); },
                 "process group is null");
    expect_error([&] { gwt::distributed::broadcast_parameters(pg, p.params, 1); },
                 "root 1 is not a rank");
  }
  fs::remove_all(d);
}

// The compressed all-reduce on one rank: a constant float64 gradient g of [16, 64] sent 200 times
// at level 2. The approximation band (16 of the 64 coefficients of each row) arrives exactly at
// every call; the 48 detail coefficients of a row go as signs and one scale, and error feedback
// keeps what the sketch missed. So the mean of what was sent approaches g: its error is the last
// residual / calls, and the residual stays bounded (measured: 0.031 |g| after 200 calls, 0.088
// after 50: residuals of 6 |g| and 4 |g|). Nothing here is random (fixed data, float64), so those
// cannot drift to the bounds (0.1, and a halving from 50 to 200 calls) on another machine. Without
// error feedback every call sends the same sketch, whose error (per row, a
// 1-bit sketch of 48 Gaussian values keeps only sqrt(2/pi) of their norm) is about 0.5 |g|.
TEST(Distributed, ErrorFeedbackDeliversTheWholeGradient) {
  const std::string d = fresh_dir("ef");
  EnvGuard env({{"WORLD_SIZE", "1"}, {"RANK", "0"}, {"GWT_STORE_FILE", d + "/s"}});
  auto pg = gwt::distributed::init_from_env("gloo");
  at::manual_seed(3);
  const int64_t rows = 16, n = 64, calls = 200;
  at::Tensor w = at::zeros({rows, n}, at::kDouble).requires_grad_();
  const at::Tensor g = at::randn({rows, n}, at::kDouble);
  const at::Tensor approx = gwt::wavedec(g, gwt::Wavelet("haar"), 2).approx;
  const double gn = g.norm().item<double>();
  for (const bool feedback : {true, false}) {
    GradSyncOptions o;
    o.compression = "wavelet", o.level = 2, o.error_feedback = feedback;
    gwt::distributed::reset_error_feedback();
    at::Tensor sent = at::zeros_like(g);
    double error_at_50 = 0;
    for (int64_t k = 0; k < calls; ++k) {
      if (k == 50) error_at_50 = (sent / k - g).norm().item<double>() / gn;
      w.mutable_grad() = g.clone();
      gwt::distributed::all_reduce_gradients(pg, {w}, o);
      sent += w.grad();
      const double band_error = (gwt::wavedec(w.grad(), gwt::Wavelet("haar"), 2).approx - approx)
                                    .abs()
                                    .max()
                                    .item<double>();
      EXPECT_LT(band_error, 1e-12)
          << "call " << k << ": the approximation band must arrive exactly";
      const auto stats = gwt::distributed::last_grad_sync_stats();
      // The band in float64, one bit per detail coefficient, one float64 scale per row.
      EXPECT_EQ(stats.bytes_sent, rows * (n / 4) * 8 + rows * (3 * n / 4) / 8 + rows * 8);
      EXPECT_EQ(stats.bytes_full, rows * n * 8);
      EXPECT_EQ(stats.compressed_tensors, 1);
    }
    const double error = (sent / calls - g).norm().item<double>() / gn;
    std::cout << "error feedback " << (feedback ? "on" : "off") << ": |mean sent - g| after 50 / "
              << calls << " calls: " << error_at_50 << " / " << error << " |g|\n";
    if (feedback) {
      EXPECT_LT(error, 0.1);
      EXPECT_LT(error, 0.5 * error_at_50)
          << "the residual must stay bounded: the error falls as 1/calls";
    } else {
      EXPECT_GT(error, 0.3);
    }
  }
  fs::remove_all(d);
}

}  // namespace
