#pragma once

// What the kernel bodies share (CPU and CUDA host code): the dtype dispatch, from the runtime kinds
// of a HaarAdamArgs to the compile-time parameter type P, moment type S and math type Acc, and the
// moment update of one coefficient.
//
// Everything here has internal linkage (an unnamed namespace): the CPU bodies are compiled twice
// with different instruction sets (baseline and AVX2), and an inline function shared by both would
// let the linker keep either copy for both callers.

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

#include <cstdlib>
#include <string>
#include <type_traits>

#include "kernels/kernels.h"

namespace gwt {
namespace kernels {
namespace {

/// Whether the CPU entries run the AVX2/FMA builds of the kernel bodies: the CPU has both, and
/// F16C (float16 conversions, f16_avx2.h: every CPU with AVX2 has it, a virtual machine might hide
/// it), and the environment does not say GWT_NO_AVX2 (set and not "0"), which forces the baseline
/// build, e.g. to test it on a machine with AVX2 (scripts/cpu_matrix.sh). Read once per process.
inline bool avx2_kernels_enabled() {
  static const bool enabled = [] {
#if defined(__x86_64__) || defined(_M_X64)
    const char* off = std::getenv("GWT_NO_AVX2");
    // F16C by CPUID (leaf 1, ECX bit 29): clang's __builtin_cpu_supports does not know it.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c &&
           !(off != nullptr && *off != '\0' && std::string(off) != "0");
#else
    return false;
#endif
  }();
  return enabled;
}

/// The types one kernel instance works in.
template <typename P, typename S, typename Acc, typename G = P>
struct Types {
  using param_t = P;  // parameters (and gradients, unless grad_t says otherwise)
  using state_t = S;  // moments
  using acc_t = Acc;  // math: double for float64 parameters, float otherwise
  using grad_t = G;   // gradients: P, or float for a float16/bfloat16 parameter (grad_f32)
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

/// with_types for the kinds alone (the multi-tensor groups' keys).
template <typename Fn>
auto with_kinds(ScalarKind param_kind, ScalarKind state_kind, bool math_f64, Fn&& fn) {
  HaarAdamArgs args;
  args.param_kind = param_kind, args.state_kind = state_kind, args.math_f64 = math_f64;
  return with_types(args, fn);
}

/// As with_types, with the gradient's type as well: Types::grad_t is float when args.grad_f32 (the
/// float32 gradient of a float16/bfloat16 parameter), the parameter's type otherwise. The CPU
/// bodies dispatch here.
template <typename Fn>
auto with_grad_types(const HaarAdamArgs& args, Fn&& fn) {
  return with_types(args, [&](auto types) {
    using T = decltype(types);
    using P = typename T::param_t;
    if constexpr (std::is_same_v<P, c10::Half> || std::is_same_v<P, c10::BFloat16>) {
      if (args.grad_f32) return fn(Types<P, typename T::state_t, typename T::acc_t, float>{});
    }
    return fn(types);
  });
}

/// Whether every type is float, bfloat16 or float16: the tensors the AVX2 bodies read and write
/// (values8_avx2.h), with the math in float.
template <typename... T>
constexpr bool k_avx2_value_types = ((std::is_same_v<T, float> ||
                                      std::is_same_v<T, c10::BFloat16> ||
                                      std::is_same_v<T, c10::Half>)&&...);

/// Adam's moments of one coefficient after this step, in the math type and rounded to S as they
/// will be stored, so that the limiter and the update see what the next step will read.
template <typename S, typename Acc>
struct NewMoments {
  Acc m, v;
  NewMoments(const HaarAdamArgs& a, S m_old, S v_old, Acc x) {
    const Acc b1 = static_cast<Acc>(a.beta1), b2 = static_cast<Acc>(a.beta2);
    const Acc c1 = static_cast<Acc>(1 - a.beta1), c2 = static_cast<Acc>(1 - a.beta2);
    m = static_cast<Acc>(static_cast<S>(b1 * static_cast<Acc>(m_old) + c1 * x));
    v = static_cast<Acc>(static_cast<S>(b2 * static_cast<Acc>(v_old) + c2 * x * x));
  }
};

}  // namespace
}  // namespace kernels
}  // namespace gwt
