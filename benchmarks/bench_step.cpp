// Optimizer step time against torch::optim::Adam, measured in the same run.
//
// Workloads: (a) the LLaMA-60M wavelet-eligible set (8 layers of q, k, v, o 512x512, gate and up
// 1376x512, down 512x1376: 25.3M values); (b) one 4096x4096 matrix; (c) 500 matrices of 64x64 and
// 500 biases of 64 (per-tensor overhead). All fp32, gradients fixed.
// Each benchmark reports bytes_per_second for the bytes the step must move (counter "bytes/param")
// and scripts/bench_table.py turns the JSON into the table with ratios.

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gwt/gwt.h"
#include "workloads.h"

namespace {

using gwt_bench::make_workload;

int64_t numel(const std::vector<at::Tensor>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel();
  return n;
}

const char* workload_name(int which) {
  return which == 0 ? "llama60m" : which == 1 ? "4096x4096" : "500x(64x64+64)";
}

// Times optimizer steps; bytes_per_param is what the step must move (reads + writes).
void run_optimizer(
    benchmark::State& st, int which, double bytes_per_param,
    const std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>& make) {
  auto params = make_workload(which);
  auto opt = make(params);
  opt->step();  // creates the state outside the timed loop
  for (auto _ : st) opt->step();
  const auto n = static_cast<double>(numel(params));
  st.SetBytesProcessed(static_cast<int64_t>(bytes_per_param * n) * st.iterations());
  st.counters["params"] = n;
  st.counters["bytes/param"] = bytes_per_param;
  st.SetLabel(workload_name(which));
}

// WaveletAdam with Haar at level L moves p, g, p' (12 B) and m, v read+written at 1/2^L (16/2^L B).
double wavelet_bytes(int level) {
  return 12.0 + 16.0 / static_cast<double>(1 << level);
}

void BM_Copy(benchmark::State& st) {
  const int which = static_cast<int>(st.range(0));
  const int64_t n = which == 0 ? 25296896 : which == 1 ? 4096 * 4096 : 500 * (64 * 64 + 64);
  // Same bytes as the Haar L=2 step (16 B/param): copy 8 B/param into another 8 B/param.
  at::Tensor src = at::randn({2 * n}), dst = at::empty({2 * n});
  for (auto _ : st) dst.copy_(src);
  st.SetBytesProcessed(16 * n * st.iterations());
  st.counters["params"] = static_cast<double>(n);
  st.counters["bytes/param"] = 16;
  st.SetLabel(workload_name(which));
}

void BM_TorchAdam(benchmark::State& st) {
  run_optimizer(st, static_cast<int>(st.range(0)), 28, [](std::vector<at::Tensor> p) {
    return std::make_unique<torch::optim::Adam>(std::move(p), torch::optim::AdamOptions(1e-3));
  });
}

// ATen's fused multi-tensor Adam (the kernel behind torch.optim.Adam(fused=True)).
void BM_FusedAdam(benchmark::State& st) {
  const int which = static_cast<int>(st.range(0));
  auto params = make_workload(which);
  std::vector<at::Tensor> p, g, m, v, steps;
  for (const auto& x : params) {
    p.push_back(x.detach()), g.push_back(x.grad());
    m.push_back(at::zeros_like(x)), v.push_back(at::zeros_like(x));
    steps.push_back(at::zeros({}, x.options()));
  }
  auto step = [&] {
    for (auto& s : steps) s.add_(1);
    at::_fused_adam_(p, g, m, v, {}, steps, 1e-3, 0.9, 0.999, 0.0, 1e-8, false, false);
  };
  step();
  for (auto _ : st) step();
  const auto n = static_cast<double>(numel(params));
  st.SetBytesProcessed(static_cast<int64_t>(28 * n) * st.iterations());
  st.counters["params"] = n;
  st.counters["bytes/param"] = 28;
  st.SetLabel(workload_name(which));
}

void BM_TorchAdamW(benchmark::State& st) {
  run_optimizer(st, static_cast<int>(st.range(0)), 28, [](std::vector<at::Tensor> p) {
    return std::make_unique<torch::optim::AdamW>(std::move(p), torch::optim::AdamWOptions(1e-3));
  });
}

void wavelet(benchmark::State& st, const std::string& wavelet_name, int level, bool fused,
             const std::string& transform = "1d", const std::string& nonfinite = "skip_step") {
  // 2-D: the moments shrink by 4^L instead of 2^L.
  const double bytes = transform == "2d" ? 12 + 16.0 / (1 << (2 * level)) : wavelet_bytes(level);
  run_optimizer(st, static_cast<int>(st.range(0)), bytes, [&](std::vector<at::Tensor> p) {
    return std::make_unique<gwt::WaveletAdam>(std::move(p), gwt::WaveletAdamOptions(1e-3)
                                                                .wavelet(wavelet_name)
                                                                .level(level)
                                                                .fused(fused)
                                                                .transform(transform)
                                                                .nonfinite(nonfinite));
  });
}

// GaLore at rank n/4 (the moments of WaveletAdam L=2 on workload a); the projector refresh (an SVD
// of every gradient) is timed on its own, the step without it.
void galore(benchmark::State& st, int64_t gap, const std::string& svd) {
  run_optimizer(st, static_cast<int>(st.range(0)), 16, [&](std::vector<at::Tensor> p) {
    return std::make_unique<gwt::GaLoreAdam>(
        std::move(p), gwt::GaLoreAdamOptions(1e-3).rank(128).update_proj_gap(gap).svd(svd));
  });
}
void BM_GaLoreAdam_r128(benchmark::State& st) {
  galore(st, 1000000, "exact");
}
void BM_GaLoreRefreshExact_r128(benchmark::State& st) {
  galore(st, 1, "exact");
}
void BM_GaLoreRefreshRandomized_r128(benchmark::State& st) {
  galore(st, 1, "randomized");
}

void BM_WaveletAdamReference_haar_L2(benchmark::State& st) {
  wavelet(st, "haar", 2, false);
}
void BM_WaveletAdamFused_haar_L1(benchmark::State& st) {
  wavelet(st, "haar", 1, true);
}
void BM_WaveletAdamFused_haar_L2(benchmark::State& st) {
  wavelet(st, "haar", 2, true);
}
void BM_WaveletAdamFused_haar_L3(benchmark::State& st) {
  wavelet(st, "haar", 3, true);
}
void BM_WaveletAdamFused_db2_L2(benchmark::State& st) {
  wavelet(st, "db2", 2, true);
}
void BM_WaveletAdamFused_haar2d_L2(benchmark::State& st) {
  wavelet(st, "haar", 2, true, "2d");
}
// nonfinite("skip_param"): each tensor's norm pass and update back to back (cache-resident).
void BM_WaveletAdamFusedSkipParam_haar_L2(benchmark::State& st) {
  wavelet(st, "haar", 2, true, "1d", "skip_param");
}
void BM_WaveletAdamFusedSkipParam_db2_L2(benchmark::State& st) {
  wavelet(st, "db2", 2, true, "1d", "skip_param");
}
void BM_WaveletAdamFusedSkipParam_haar2d_L2(benchmark::State& st) {
  wavelet(st, "haar", 2, true, "2d", "skip_param");
}

}  // namespace

#define GWT_BENCH(fn) \
  BENCHMARK(fn)->Arg(0)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1.0)

GWT_BENCH(BM_Copy);
GWT_BENCH(BM_TorchAdam);
GWT_BENCH(BM_TorchAdamW);
GWT_BENCH(BM_FusedAdam);
GWT_BENCH(BM_WaveletAdamReference_haar_L2);
GWT_BENCH(BM_WaveletAdamFused_haar_L1);
GWT_BENCH(BM_WaveletAdamFused_haar_L2);
GWT_BENCH(BM_WaveletAdamFused_haar_L3);
GWT_BENCH(BM_WaveletAdamFused_db2_L2);
GWT_BENCH(BM_WaveletAdamFused_haar2d_L2);
GWT_BENCH(BM_WaveletAdamFusedSkipParam_haar_L2);
GWT_BENCH(BM_WaveletAdamFusedSkipParam_db2_L2);
GWT_BENCH(BM_WaveletAdamFusedSkipParam_haar2d_L2);
// Workload a only: an exact SVD of a 4096x4096 gradient is too slow to repeat in a benchmark.
BENCHMARK(BM_GaLoreAdam_r128)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(1.0);
BENCHMARK(BM_GaLoreRefreshExact_r128)
    ->Arg(0)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(1.0);
BENCHMARK(BM_GaLoreRefreshRandomized_r128)
    ->Arg(0)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(1.0);

BENCHMARK_MAIN();
