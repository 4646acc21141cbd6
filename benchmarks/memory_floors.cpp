#include "memory_floors.h"

#include <ATen/Parallel.h>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include <algorithm>

namespace gwt_bench {
namespace {

// A core of the Intel Xeon measured keeps too few DRAM misses in flight for the hardware
// prefetchers alone (README, "Fast kernels"): the floors prefetch 4 KB ahead as gwt's kernels do,
// or they would not be floors.
inline void ahead(const float* x) {
  __builtin_prefetch(x + 1024, 0, 3);
}

// Chunks of 4096 values: p and g over the chunk, m and v over its 4096 / state_div state values.
template <typename Body>
void for_chunks(int64_t n, const Body& body) {
  constexpr int64_t chunk = 4096;
  at::parallel_for(0, (n + chunk - 1) / chunk, 8, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) body(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

// x <- x * scale + add * add_scale + add_const over [0, n) (add may be null), four values at a
// time with SSE (every x86-64 CPU), the next line prefetched every 16 values.
void scale_add(float* x, const float* add, float add_scale, float scale, float add_const,
               int64_t n) {
  int64_t i = 0;
#if defined(__SSE__)
  const __m128 s = _mm_set1_ps(scale), as = _mm_set1_ps(add_scale), c = _mm_set1_ps(add_const);
  for (; i + 16 <= n; i += 16) {
    ahead(x + i);
    if (add != nullptr) ahead(add + i);
    for (int k = 0; k < 16; k += 4) {
      const __m128 extra =
          add != nullptr ? _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(add + i + k), as), c) : c;
      _mm_storeu_ps(x + i + k, _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(x + i + k), s), extra));
    }
  }
#endif
  for (; i < n; ++i) x[i] = x[i] * scale + (add != nullptr ? add[i] * add_scale : 0.f) + add_const;
}

// Sum of g[0, n) and of m[j] v[j] over [0, states).
float read_sum(const float* g, int64_t n, const float* m, const float* v, int64_t states) {
  float sum = 0;
  int64_t i = 0, j = 0;
#if defined(__SSE__)
  __m128 acc[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
  for (; i + 16 <= n; i += 16) {
    ahead(g + i);
    for (int k = 0; k < 4; ++k) acc[k] = _mm_add_ps(acc[k], _mm_loadu_ps(g + i + 4 * k));
  }
  for (; j + 4 <= states; j += 4)
    acc[0] = _mm_add_ps(acc[0], _mm_mul_ps(_mm_loadu_ps(m + j), _mm_loadu_ps(v + j)));
  float lanes[4];
  _mm_storeu_ps(lanes, _mm_add_ps(_mm_add_ps(acc[0], acc[1]), _mm_add_ps(acc[2], acc[3])));
  sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#endif
  for (; i < n; ++i) sum += g[i];
  for (; j < states; ++j) sum += m[j] * v[j];
  return sum;
}

}  // namespace

FloorBuffers floor_buffers(const std::vector<at::Tensor>& params, int64_t state_div) {
  FloorBuffers b;
  for (const auto& x : params) {
    const int64_t n = x.numel();
    b.p.push_back(x.detach().clone().reshape({n}));
    b.g.push_back(x.grad().clone().reshape({n}));
    b.m.push_back(at::full({(n + state_div - 1) / state_div}, 1e-3, x.options()));
    b.v.push_back(at::full({(n + state_div - 1) / state_div}, 1e-6, x.options()));
  }
  return b;
}

void floor_update(FloorBuffers& b, int64_t state_div) {
  for (size_t t = 0; t < b.p.size(); ++t) {
    float* p = b.p[t].data_ptr<float>();
    const float* g = b.g[t].data_ptr<float>();
    float* m = b.m[t].data_ptr<float>();
    float* v = b.v[t].data_ptr<float>();
    const int64_t states = b.m[t].numel();
    for_chunks(b.p[t].numel(), [&](int64_t i0, int64_t i1) {
      scale_add(p + i0, g + i0, 1e-7f, 0.9999f, 0.f, i1 - i0);
      const int64_t j0 = i0 / state_div, j1 = std::min(states, (i1 + state_div - 1) / state_div);
      scale_add(m + j0, nullptr, 0.f, 0.9f, 1e-4f, j1 - j0);
      scale_add(v + j0, nullptr, 0.f, 0.999f, 1e-9f, j1 - j0);
    });
  }
}

double floor_read(const FloorBuffers& b, int64_t state_div) {
  double total = 0;
  for (size_t t = 0; t < b.g.size(); ++t) {
    const float* g = b.g[t].data_ptr<float>();
    const float* m = b.m[t].data_ptr<float>();
    const float* v = b.v[t].data_ptr<float>();
    const int64_t n = b.g[t].numel(), states = b.m[t].numel();
    std::vector<float> partial(static_cast<size_t>((n + 4095) / 4096), 0.f);
    for_chunks(n, [&](int64_t i0, int64_t i1) {
      const int64_t j0 = i0 / state_div, j1 = std::min(states, (i1 + state_div - 1) / state_div);
      partial[static_cast<size_t>(i0 / 4096)] = read_sum(g + i0, i1 - i0, m + j0, v + j0, j1 - j0);
    });
    for (float x : partial) total += x;
  }
  return total;
}

}  // namespace gwt_bench
