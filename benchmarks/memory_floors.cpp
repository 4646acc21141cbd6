#include "memory_floors.h"

#include <ATen/Parallel.h>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include <algorithm>

namespace gwt_bench {
namespace {

// One core can keep too few DRAM misses in flight for the hardware prefetchers alone
// (docs/performance.md, "How the kernels work"): the floors prefetch 4 KB ahead as gwt's kernels
// do, or they would not be floors.
inline void ahead(const float* x) {
  __builtin_prefetch(x + 1024, 0, 3);
}

// Chunks of k_chunk values: p and g over the chunk, m and v over its k_chunk / state_div state
// values (for_groups below).
constexpr int64_t k_chunk = 4096;
template <typename Body>
void for_chunks(int64_t n, const Body& body) {
  at::parallel_for(0, (n + k_chunk - 1) / k_chunk, 8, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) body(c * k_chunk, std::min(n, (c + 1) * k_chunk));
  });
}

// x <- x * scale + add * add_scale over [0, n), four values at a time with SSE (every x86-64
// CPU), the next line of each prefetched every 16 values.
void scale_add(float* x, const float* add, float add_scale, float scale, int64_t n) {
  int64_t i = 0;
#if defined(__SSE__)
  const __m128 s = _mm_set1_ps(scale), as = _mm_set1_ps(add_scale);
  for (; i + 16 <= n; i += 16) {
    ahead(x + i), ahead(add + i);
    for (int k = 0; k < 16; k += 4)
      _mm_storeu_ps(x + i + k, _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(x + i + k), s),
                                          _mm_mul_ps(_mm_loadu_ps(add + i + k), as)));
  }
#endif
  for (; i < n; ++i) x[i] = x[i] * scale + add[i] * add_scale;
}

// The floors walk p and g 16 values at a time and, in the same loop, the state values those map
// to (state_div values per state): [i / state_div, (i + 16) / state_div), the last span rounded
// up to the chunk's end. All arrays advance together, as at::_fused_adam_ walks its seven; each
// is prefetched 4 KB ahead once per line. (A loop over p and g, then m, then v per chunk measured
// slower than at::_fused_adam_ moving the same bytes: no floor. docs/notes/memory_floors.md.)
template <typename Group, typename States>
void for_groups(int64_t i0, int64_t i1, int64_t state_div, int64_t states, const Group& group,
                const States& state_values) {
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16) {
    group(i, int64_t{16});
    const int64_t j0 = i / state_div, j1 = std::min(states, (i + 16) / state_div);
    if (j1 > j0) state_values(j0, j1, j0 % 16 == 0);
  }
  group(i, i1 - i);
  const int64_t j0 = i / state_div, j1 = std::min(states, (i1 + state_div - 1) / state_div);
  if (j1 > j0) state_values(j0, j1, false);
}

void update_streams(float* p, const float* g, float* m, float* v, int64_t i0, int64_t i1,
                    int64_t state_div, int64_t states) {
  for_groups(
      i0, i1, state_div, states,
      [&](int64_t i, int64_t n) { scale_add(p + i, g + i, 1e-7f, 0.9999f, n); },
      [&](int64_t j0, int64_t j1, bool new_line) {
        if (new_line) ahead(m + j0), ahead(v + j0);
        for (int64_t j = j0; j < j1; ++j) m[j] = m[j] * 0.9f + 1e-4f, v[j] = v[j] * 0.999f + 1e-9f;
      });
}

// Sum of g[i0, i1) and of m[j] v[j] over the state values they map to. Vector accumulators
// where the spans allow, so that no chain of dependent adds limits the loop.
float read_streams(const float* g, const float* m, const float* v, int64_t i0, int64_t i1,
                   int64_t state_div, int64_t states) {
  float sum = 0;
#if defined(__SSE__)
  __m128 acc[5] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(),
                   _mm_setzero_ps()};
#endif
  for_groups(
      i0, i1, state_div, states,
      [&](int64_t i, int64_t n) {
        int64_t k = 0;
#if defined(__SSE__)
        if (n == 16) {
          ahead(g + i);
          for (; k < 16; k += 4) acc[k / 4] = _mm_add_ps(acc[k / 4], _mm_loadu_ps(g + i + k));
        }
#endif
        for (; k < n; ++k) sum += g[i + k];
      },
      [&](int64_t j0, int64_t j1, bool new_line) {
        if (new_line) ahead(m + j0), ahead(v + j0);
        int64_t j = j0;
#if defined(__SSE__)
        for (; j + 4 <= j1; j += 4)
          acc[4] = _mm_add_ps(acc[4], _mm_mul_ps(_mm_loadu_ps(m + j), _mm_loadu_ps(v + j)));
#endif
        for (; j < j1; ++j) sum += m[j] * v[j];
      });
#if defined(__SSE__)
  float lanes[4];
  _mm_storeu_ps(
      lanes,
      _mm_add_ps(_mm_add_ps(_mm_add_ps(acc[0], acc[1]), _mm_add_ps(acc[2], acc[3])), acc[4]));
  sum += lanes[0] + lanes[1] + lanes[2] + lanes[3];
#endif
  return sum;
}

}  // namespace

FloorBuffers floor_buffers(const std::vector<at::Tensor>& params, int64_t state_div) {
  // A chunk's state values end where the next chunk's begin only if state_div divides the chunk.
  TORCH_CHECK(state_div > 0 && k_chunk % state_div == 0, "memory floors: state_div must divide ",
              k_chunk, " (1, 4, 16, ...), got ", state_div);
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
      update_streams(p, g, m, v, i0, i1, state_div, states);
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
    std::vector<float> partial(static_cast<size_t>((n + k_chunk - 1) / k_chunk), 0.f);
    for_chunks(n, [&](int64_t i0, int64_t i1) {
      partial[static_cast<size_t>(i0 / k_chunk)] = read_streams(g, m, v, i0, i1, state_div, states);
    });
    for (float x : partial) total += x;
  }
  return total;
}

}  // namespace gwt_bench
