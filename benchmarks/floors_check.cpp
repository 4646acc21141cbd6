// Checks that the memory floors of gwt_bench_interleaved (memory_floors.cpp) move exactly the
// bytes their names say: every value of p, g, m and v is read, and p, m and v written, once per
// call, for each state_div the benchmark uses and for sizes that leave partial chunks, groups and
// state spans. Run by ctest (floors_move_each_value_once); prints "all floor checks passed".

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "memory_floors.h"

namespace {

int failures = 0;

void expect(bool ok, const char* what, int64_t n, int64_t state_div) {
  if (ok) return;
  ++failures;
  std::printf("FAILED: %s (n %lld, state_div %lld)\n", what, static_cast<long long>(n),
              static_cast<long long>(state_div));
}

// All of x equal to `want` within `rel` (one update against none or two: 1e-4 apart at least).
bool all_near(const at::Tensor& x, double want, double rel) {
  return ((x.to(at::kDouble) - want).abs() <= rel * std::abs(want)).all().item<bool>();
}

}  // namespace

int main() {
  at::set_num_threads(2);
  // Sizes: under one group of 16, whole chunks of 4096, and partial chunks and groups; a second
  // tensor so that every tensor of a workload is visited.
  for (const int64_t n : {int64_t{5}, int64_t{4096}, int64_t{3 * 4096 + 37}, int64_t{70001}})
    for (const int64_t state_div : {int64_t{1}, int64_t{4}, int64_t{16}}) {
      std::vector<at::Tensor> params;
      for (const int64_t size : {n, n + 3}) {
        at::Tensor p = at::ones({size});
        p.mutable_grad() = at::ones({size});
        params.push_back(p);
      }
      // Reads: the sum of g (ones) and of m * v over the states. floor_buffers sets m to 1e-3 and
      // v to 1e-6; set them to ones so the sum is a count. Every partial sum is an integer below
      // 2^24, exact in float, so the total is exact.
      gwt_bench::FloorBuffers b = gwt_bench::floor_buffers(params, state_div);
      double want = 0;
      for (size_t t = 0; t < b.p.size(); ++t) {
        b.m[t].fill_(1), b.v[t].fill_(1);
        want += static_cast<double>(b.g[t].numel() + b.m[t].numel());
      }
      expect(gwt_bench::floor_read(b, state_div) == want, "floor_read counts each value once", n,
             state_div);
      // Writes: one call scales p by 0.9999 and adds 1e-7 g, m by 0.9 plus 1e-4, v by 0.999 plus
      // 1e-9 (memory_floors.cpp). With g = 3000, p = 1 becomes 1.0002: p left alone (1), updated
      // without g (0.9999) or twice (1.0004) is 1e-4 or more away, m and v likewise; float
      // rounding (with or without fused multiply-adds) moves each by an ulp or so, 1e-7 relative.
      for (auto& g : b.g) g.fill_(3000);
      gwt_bench::floor_update(b, state_div);
      for (size_t t = 0; t < b.p.size(); ++t) {
        expect(all_near(b.p[t], 0.9999 + 3e-4, 1e-6), "floor_update writes each p once, with g", n,
               state_div);
        expect(all_near(b.m[t], 0.9 + 1e-4, 1e-6), "floor_update writes each m once", n, state_div);
        expect(all_near(b.v[t], 0.999 + 1e-9, 1e-6), "floor_update writes each v once", n,
               state_div);
        expect(b.g[t].eq(3000).all().item<bool>(), "floor_update leaves g", n, state_div);
      }
    }
  if (failures > 0) return 1;
  std::printf("all floor checks passed\n");
  return 0;
}
