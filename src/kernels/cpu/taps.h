#pragma once

// The filter lengths the CPU general kernels unroll for (wavelet_adam_cpu_impl.h, one row at a
// time, and wavelet_rows8_avx2.h, eight rows at a time).

#include <cstdint>
#include <type_traits>

namespace gwt {
namespace kernels {
namespace {  // internal linkage: compiled once per instruction set

/// Calls fn(std::integral_constant<int, F>) for the filter lengths gwt has (2 to 18; 0: any
/// other, for which the callers run their loops with a runtime tap count).
template <typename Fn>
auto with_taps(int64_t taps, Fn&& fn) {
  switch (taps) {
    case 2:
      return fn(std::integral_constant<int, 2>{});
    case 4:
      return fn(std::integral_constant<int, 4>{});
    case 6:
      return fn(std::integral_constant<int, 6>{});
    case 8:
      return fn(std::integral_constant<int, 8>{});
    case 10:
      return fn(std::integral_constant<int, 10>{});
    case 12:
      return fn(std::integral_constant<int, 12>{});
    case 14:
      return fn(std::integral_constant<int, 14>{});
    case 16:
      return fn(std::integral_constant<int, 16>{});
    case 18:
      return fn(std::integral_constant<int, 18>{});
    default:
      return fn(std::integral_constant<int, 0>{});
  }
}

}  // namespace
}  // namespace kernels
}  // namespace gwt
