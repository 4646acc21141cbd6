#pragma once

// The one dtype dispatch of the kernel bodies (CPU and CUDA): from the runtime kinds of a
// HaarAdamArgs to the compile-time parameter type P, moment type S and math type Acc.

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "gwt/kernels.h"

namespace gwt {
namespace kernels {

/// The types one kernel instance works in.
template <typename P, typename S, typename Acc>
struct Types {
  using param_t = P;  // parameters and gradients
  using state_t = S;  // moments
  using acc_t = Acc;  // math: double for float64 parameters, float otherwise
};

/// Calls fn(Types<P, S, Acc>{}) for the argument's kinds and returns what it returns.
template <typename P, typename Fn>
auto with_state_types(const HaarAdamArgs& args, Fn&& fn) {
  const bool bf16_state = args.state_kind == ScalarKind::bf16;
  if (args.math_f64) {
    if (bf16_state) return fn(Types<P, c10::BFloat16, double>{});
    return fn(Types<P, double, double>{});
  }
  if (bf16_state) return fn(Types<P, c10::BFloat16, float>{});
  return fn(Types<P, float, float>{});
}

template <typename Fn>
auto with_types(const HaarAdamArgs& args, Fn&& fn) {
  switch (args.param_kind) {
    case ScalarKind::f64:
      return with_state_types<double>(args, fn);
    case ScalarKind::f16:
      return with_state_types<c10::Half>(args, fn);
    case ScalarKind::bf16:
      return with_state_types<c10::BFloat16>(args, fn);
    case ScalarKind::f32:
    default:
      return with_state_types<float>(args, fn);
  }
}

}  // namespace kernels
}  // namespace gwt
