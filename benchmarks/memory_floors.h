#pragma once

// Memory floors for gwt_bench_interleaved: loops that move exactly the bytes named and do next to
// no arithmetic, over a workload's tensors (each its own buffers, so they are evicted like every
// variant), split over threads as the kernels split a tensor. Their ratio to at::_fused_adam_ says
// what ratio a step moving those bytes could reach on this machine at best (docs/notes/memory_floors.md).
// In their own file: at::parallel_for runs in parallel only where the including file is built with
// -fopenmp, as gwt's kernels are.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace gwt_bench {

struct FloorBuffers {
  std::vector<at::Tensor> p, g, m, v;  // flat float32; m and v of ceil(numel / state_div) values
};

/// Copies of the parameters and gradients, and state of numel / state_div values per tensor.
FloorBuffers floor_buffers(const std::vector<at::Tensor>& params, int64_t state_div);

/// Reads p, g, m, v and writes p, m, v: the bytes of a step that reads its gradient once
/// (state_div 4: WaveletAdam L=2, 10 B read and 6 B written per value; state_div 16: the 2-D step
/// at L=2, 8.5 B and 4.5 B; state_div 1: Adam, 16 B read and 12 B written).
void floor_update(FloorBuffers& b, int64_t state_div);

/// Reads g, m, v and writes nothing: a norm pass's bytes (6 B per value at state_div 4: g, and m
/// and v at a quarter each; 4.5 B at state_div 16).
double floor_read(const FloorBuffers& b, int64_t state_div);

}  // namespace gwt_bench
