// How to apply HRA's product of r Householder reflections in a training step (issue 13): the
// forward and backward of y = x (W H_1 ... H_r)^T with the reflection vectors trainable and W
// frozen, x [tokens, in], W [out = in, in], float32, one thread count for all. Four ways, timed in
// the same run:
//   wy-x     the compact WY form I - Y T Y^T applied to x (gwt::nn::DeltaLinear's forward when
//            tokens <= out): two [tokens, in] x [in, r] products, O(tokens in r)
//   wy-w     the WY form applied to W's rows (W H_1 ... H_r), then x W'^T: O(out in r), whatever
//            the tokens (DeltaLinear's forward when tokens > out)
//   rank1-x  r rank-1 updates of x, x <- x - 2 (x u) u^T / (u^T u), H_r first
//   dense    the [in, in] product P formed by r rank-1 updates of I, then x (W P)^T, as PEFT's HRA
//            layer does: O(in^2 r) to form it, O(out in^2) to apply it to W
// Prints a Markdown table (median of 7 timings, each the mean of enough steps for ~50 ms) with
// each way's time over wy-x's, and the machine.
//
//   gwt_bench_reflections [--quick]        (scripts/bench_reflections.sh)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <cmath>

namespace {

using Clock = std::chrono::steady_clock;

// Unit columns and the upper-triangular T of H_1 ... H_r = I - Y T Y^T, T the inverse of
// striu(Y^T Y) + I / 2, as DeltaLinear builds it.
std::pair<at::Tensor, at::Tensor> wy(const at::Tensor& u) {
  const at::Tensor y = u / u.norm(2, {0}, true);
  const at::Tensor eye = at::eye(u.size(1), u.options());
  return {y, at::linalg_solve_triangular(at::triu(at::matmul(y.t(), y), 1) + eye.mul(0.5), eye,
                                         /*upper=*/true)};
}

at::Tensor forward(const std::string& way, const at::Tensor& x, const at::Tensor& w,
                   const at::Tensor& u) {
  if (way == "wy-x") {  // x P^T
    const auto [y, t] = wy(u);
    return at::linear(x - at::matmul(at::matmul(at::matmul(x, y), t.t()), y.t()), w);
  }
  if (way == "wy-w") {  // W P
    const auto [y, t] = wy(u);
    return at::linear(x, w - at::matmul(at::matmul(at::matmul(w, y), t), y.t()));
  }
  if (way == "rank1-x") {  // x P^T = x H_r ... H_1
    at::Tensor h = x;
    for (int64_t i = u.size(1) - 1; i >= 0; --i) {
      const at::Tensor v = u.select(1, i);
      h = h - at::outer(at::mv(h, v), v) * (2.0 / at::dot(v, v));
    }
    return at::linear(h, w);
  }
  // dense: P = H_1 ... H_r as an [in, in] matrix, by r rank-1 updates of I
  at::Tensor p = at::eye(u.size(0), u.options());
  for (int64_t i = 0; i < u.size(1); ++i) {
    const at::Tensor v = u.select(1, i);
    p = p - at::outer(at::mv(p, v), v) * (2.0 / at::dot(v, v));
  }
  return at::linear(x, at::matmul(w, p));
}

double time_ms(const std::function<void()>& step) {
  step();  // warm-up: allocations, kernel choice
  int64_t reps = 1;
  for (;;) {
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < reps; ++i) step();
    if (std::chrono::duration<double>(Clock::now() - t0).count() > 0.05 || reps >= 1 << 14) break;
    reps *= 2;
  }
  std::vector<double> ms;
  for (int k = 0; k < 7; ++k) {
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < reps; ++i) step();
    ms.push_back(1e3 * std::chrono::duration<double>(Clock::now() - t0).count() /
                 static_cast<double>(reps));
  }
  std::nth_element(ms.begin(), ms.begin() + 3, ms.end());
  return ms[3];
}

std::string machine() {
  std::ifstream cpu("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpu, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  const std::vector<int64_t> ins =
      quick ? std::vector<int64_t>{128} : std::vector<int64_t>{128, 512, 2048};
  const std::vector<int64_t> ranks = quick ? std::vector<int64_t>{8} : std::vector<int64_t>{8, 32};
  const std::vector<int64_t> tokens =
      quick ? std::vector<int64_t>{256} : std::vector<int64_t>{256, 4096};
  const std::vector<std::string> ways = {"wy-x", "wy-w", "rank1-x", "dense"};
  std::printf(
      "Forward + backward of x (W H_1 ... H_r)^T, float32, W [in, in] frozen, reflections "
      "trainable; %s, %d threads. ms per step (median of 7), and over wy-x.\n\n",
      machine().c_str(), at::get_num_threads());
  std::printf("| in | r | tokens | wy-x ms | wy-w | rank1-x | dense | fastest |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---|\n");
  at::manual_seed(0);
  for (const int64_t in : ins)
    for (const int64_t r : ranks)
      for (const int64_t n : tokens) {
        const at::Tensor x = at::randn({n, in});
        const at::Tensor w = at::randn({in, in}) / std::sqrt(static_cast<double>(in));
        const at::Tensor u = at::randn({in, r}).requires_grad_(true);
        std::vector<double> ms;
        for (const auto& way : ways) {
          // Every way computes the same product: check it before timing (float32, unit-scale
          // entries: 1e-3 is far above the rounding of r reflections and one GEMM).
          if (way != "wy-x") {
            at::NoGradGuard no_grad;
            TORCH_CHECK(at::allclose(forward(way, x, w, u), forward("wy-x", x, w, u), 1e-3, 1e-3),
                        way, " disagrees with wy-x");
          }
          ms.push_back(time_ms([&] {
            u.mutable_grad() = at::Tensor();
            forward(way, x, w, u).sum().backward();
          }));
        }
        const auto best = std::min_element(ms.begin(), ms.end()) - ms.begin();
        std::printf("| %lld | %lld | %lld | %.3f | %.2fx | %.2fx | %.2fx | %s |\n",
                    static_cast<long long>(in), static_cast<long long>(r),
                    static_cast<long long>(n), ms[0], ms[1] / ms[0], ms[2] / ms[0], ms[3] / ms[0],
                    ways[static_cast<size_t>(best)].c_str());
        std::fflush(stdout);
      }
  return 0;
}
