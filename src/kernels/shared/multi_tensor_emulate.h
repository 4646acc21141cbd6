#pragma once

// The multi-tensor kernels (multi_tensor.h) run on the host, as the GPU runs them: every block of
// each launch's grid, every thread of a block, the phases split where cuda/multi_tensor_adam.cu
// has a barrier, the same functions in between. The tests compare steps through it with the CPU
// reference, so the device code is tested on machines without a GPU. General rows run with one
// lane (row::HostLanes) in the block's shared memory; tests/test_kernel_lanes.cpp runs the same
// row bodies with 2 to 32 threads and real barriers.

#include <cstdint>
#include <vector>

#include "kernels/shared/dispatch.h"
#include "kernels/shared/multi_tensor.h"

namespace gwt {
namespace kernels {
namespace mt {
namespace {

/// The block's tree sum (tree_step at each barrier), leaving the sum in s[0].
inline void host_tree_sum(double* s) {
  for (int half = k_threads / 2; half > 0; half /= 2)
    for (int lane = 0; lane < k_threads; ++lane) tree_step(s, lane, half);
}

struct HostKernels {
  void norm(const GroupKey& key, const Launch& l) const {
    with_kinds(key.param_kind, key.state_kind, key.math_f64, [&](auto types) {
      using P = typename decltype(types)::param_t;
      using S = typename decltype(types)::state_t;
      using Acc = typename decltype(types)::acc_t;
      double s[k_threads];
      std::vector<Acc> shared(static_cast<size_t>(l.shared_bytes) / sizeof(Acc));
      for (int64_t c = 0; c < l.num_chunks; ++c) {
        if (key.general) {
          l.partials[c] = general_norm_share<P, S, Acc>(row::HostLanes{}, l, c, shared.data());
        } else {
          for (int lane = 0; lane < k_threads; ++lane) s[lane] = norm_share<P, S, Acc>(l, c, lane);
          host_tree_sum(s);
          l.partials[c] = s[0];
        }
        norm_bookkeeping(l, c);
      }
    });
  }
  void finalize(const GroupKey& key, const Launch& l) const {
    with_kinds(key.param_kind, key.state_kind, key.math_f64, [&](auto types) {
      double s[k_threads];
      for (int64_t i = 0; i < l.num_tensors; ++i) {
        for (int lane = 0; lane < k_threads; ++lane) s[lane] = partials_share(l, i, lane);
        host_tree_sum(s);
        finalize_tensor<typename decltype(types)::acc_t>(l, i, s[0]);
      }
    });
  }
  void update(const GroupKey& key, const Launch& l) const {
    with_kinds(key.param_kind, key.state_kind, key.math_f64, [&](auto types) {
      using P = typename decltype(types)::param_t;
      using S = typename decltype(types)::state_t;
      using Acc = typename decltype(types)::acc_t;
      std::vector<Acc> shared(static_cast<size_t>(l.shared_bytes) / sizeof(Acc));
      for (int64_t c = 0; c < l.num_chunks; ++c) {
        if (key.general) {
          const int64_t kept =
              general_update_share<P, S, Acc>(row::HostLanes{}, l, c, shared.data());
          general_update_bookkeeping<Acc>(l, c, kept);
          continue;
        }
        for (int lane = 0; lane < k_threads; ++lane) update_share<P, S, Acc>(l, c, lane);
        update_bookkeeping<Acc>(l, c);
      }
    });
  }
};

/// One step of `groups` on the host (their pointers are host memory), with the step-wide `flags`.
inline void emulate_step(const std::vector<Group>& groups, StepFlags* flags) {
  const StepLayout layout(groups);
  std::vector<unsigned char> buffer(layout.bytes());
  layout.write(groups, buffer.data());
  run_step(groups, layout, buffer.data(), flags, HostKernels{});
}

}  // namespace
}  // namespace mt
}  // namespace kernels
}  // namespace gwt
