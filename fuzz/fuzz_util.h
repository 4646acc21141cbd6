#pragma once

// Shared by gwt's libFuzzer targets: the one way a target reports a violated property (a message
// and __builtin_trap(), which libFuzzer records as a crash with its input), byte-exact snapshots of
// tensors, and values drawn from the input that favour the cases arithmetic gets wrong.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace gwt_fuzz {

/// One thread: a fuzz execution is a handful of small tensor operations, and the machine is shared.
inline void init() {
  at::set_num_threads(1);
  at::set_num_interop_threads(1);
}

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "\ngwt fuzz: PROPERTY VIOLATED: %s\n", what.c_str());
  std::fflush(stderr);
  __builtin_trap();
}

#define GWT_FUZZ_CHECK(cond, what)                                             \
  do {                                                                         \
    if (!(cond)) ::gwt_fuzz::fail(std::string(#cond) + ": " + std::string(what)); \
  } while (0)

/// Something worth reporting that is not a defect by the targets' rules (for example finite but
/// extreme inputs whose update overflows): printed once per key; with GWT_FUZZ_NOTES=<dir> the
/// input is written there as <key>.bin for a reproducer.
inline void note(const std::string& key, const std::string& what, const uint8_t* data,
                 size_t size) {
  static std::set<std::string> seen;
  if (!seen.insert(key).second) return;
  std::fprintf(stderr, "gwt fuzz note [%s]: %s\n", key.c_str(), what.c_str());
  if (const char* dir = std::getenv("GWT_FUZZ_NOTES")) {
    const std::string path = std::string(dir) + "/" + key + ".bin";
    if (FILE* f = std::fopen(path.c_str(), "wb")) {
      std::fwrite(data, 1, size, f);
      std::fclose(f);
    }
  }
}

/// Byte-exact equality (NaN equals the same NaN): definedness, dtype, shape, and contents.
inline bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes() || a.device() != b.device())
    return false;
  const at::Tensor ca = a.contiguous(), cb = b.contiguous();
  if (ca.nbytes() == 0) return true;  // empty tensors may have no data pointer (memcmp(nullptr))
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

/// A deep copy (undefined stays undefined).
inline at::Tensor copy_of(const at::Tensor& t) {
  return t.defined() ? t.detach().clone() : at::Tensor();
}

/// Whether every element is finite (an empty or undefined tensor counts as finite).
inline bool all_finite(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return true;
  if (!t.is_floating_point()) return true;
  return at::isfinite(t).all().item<bool>();
}

inline double max_abs(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return 0.0;
  return t.abs().max().to(at::kDouble).item<double>();
}

/// A double from the input: 1 byte picks a class (ordinary value, zero, denormal, huge, NaN, Inf,
/// ...); `specials` allows the non-finite classes.
inline double draw_value(FuzzedDataProvider& in, bool specials, double typical = 1.0) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  const uint8_t kind = in.ConsumeIntegral<uint8_t>();
  const auto mantissa = static_cast<double>(in.ConsumeIntegral<int16_t>()) / 32768.0;
  switch (kind % 32) {
    case 0:
      return 0.0;
    case 1:
      return -0.0;
    case 2:
      return mantissa * std::numeric_limits<double>::denorm_min() * 1e4;
    case 3:
      return mantissa * std::numeric_limits<float>::denorm_min() * 64;
    case 4:
      return mantissa * 1e30;
    case 5:
      return mantissa * 3e38;
    case 6:
      return mantissa * 65504.0;
    case 7:
      return mantissa * 1e-30;
    case 8:
      return specials ? std::numeric_limits<double>::quiet_NaN() : mantissa;
    case 9:
      return specials ? inf : mantissa;
    case 10:
      return specials ? -inf : mantissa;
    case 11:
      return specials ? 1e300 * mantissa : mantissa;
    default:
      return mantissa * typical;
  }
}

/// A tensor of `shape` filled from the input (zeros once it runs out), in `dtype` (values that do
/// not fit a narrow dtype round to its infinity, as a cast would).
inline at::Tensor draw_tensor(FuzzedDataProvider& in, c10::IntArrayRef shape, at::ScalarType dtype,
                              bool specials, double typical = 1.0) {
  at::Tensor t = at::empty(shape, at::kDouble);
  double* p = t.data_ptr<double>();
  // A constant tensor (one value repeated) half the time: cheap inputs that reach every size.
  const bool constant = in.ConsumeBool();
  const double first = draw_value(in, specials, typical);
  for (int64_t i = 0; i < t.numel(); ++i)
    p[i] = (constant || i == 0) ? first : draw_value(in, specials, typical);
  return t.to(dtype);
}

/// A shape of `rank` dimensions, each in [0, max_size], with at most `max_numel` elements.
inline std::vector<int64_t> draw_shape(FuzzedDataProvider& in, int64_t rank, int64_t max_size,
                                       int64_t max_numel) {
  std::vector<int64_t> shape;
  int64_t numel = 1;
  for (int64_t d = 0; d < rank; ++d) {
    int64_t s = in.ConsumeIntegralInRange<int64_t>(0, max_size);
    if (numel > 0 && s > max_numel / numel) s = max_numel / numel;
    shape.push_back(s);
    numel *= s;
  }
  return shape;
}

template <typename T>
const T& pick(FuzzedDataProvider& in, const std::vector<T>& values) {
  return values[in.ConsumeIntegralInRange<size_t>(0, values.size() - 1)];
}

/// A floating-point dtype gwt's optimizers take, or (allow_bad) now and then one they refuse.
inline at::ScalarType draw_dtype(FuzzedDataProvider& in, bool allow_bad) {
  const uint8_t b = in.ConsumeIntegral<uint8_t>();
  if (allow_bad && b >= 250) return b % 2 ? at::kInt : at::kComplexFloat;
  return std::vector<at::ScalarType>{at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}[b % 4];
}

// A gradient for `param` drawn from the input: usually of its shape and dtype, sometimes missing,
// mis-shaped, of another dtype, non-contiguous or sparse.
inline at::Tensor draw_grad(FuzzedDataProvider& in, const at::Tensor& param) {
  const uint8_t kind = in.ConsumeIntegral<uint8_t>();
  const bool specials = in.ConsumeIntegral<uint8_t>() >= 200;
  const double typical = std::ldexp(1.0, in.ConsumeIntegralInRange<int>(-40, 40));
  if (kind < 8) return at::Tensor();
  if (kind < 12) {  // wrong shape
    auto shape = param.sizes().vec();
    if (shape.empty())
      shape.push_back(2);
    else
      shape.back() += 1;
    return draw_tensor(in, shape, param.scalar_type(), specials, typical);
  }
  if (kind < 14) return at::ones(param.sizes(), at::kInt);
  if (kind < 16 && param.dim() > 0) {
    return draw_tensor(in, param.sizes(), at::kDouble, specials, typical).to_sparse();
  }
  const at::ScalarType dtype = kind < 24 ? draw_dtype(in, false) : param.scalar_type();
  at::Tensor g = draw_tensor(in, param.sizes(), dtype, specials, typical);
  if (kind < 30 && g.dim() >= 2) g = g.transpose(0, 1).contiguous().transpose(0, 1);
  return g;
}

/// The largest finite value of a floating-point dtype.
inline double dtype_max(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return 65504.0;
    case at::kBFloat16:
      return 3.38e38;
    case at::kFloat:
      return 3.40e38;
    default:
      return std::numeric_limits<double>::max();
  }
}

/// One line per parameter: dtype, shape, and whether it is a non-contiguous view.
inline std::string describe_params(const std::vector<at::Tensor>& params) {
  std::string s;
  for (const auto& p : params) {
    s += "param " + std::string(c10::toString(p.scalar_type())) + " [";
    for (int64_t d = 0; d < p.dim(); ++d) s += (d ? "," : "") + std::to_string(p.size(d));
    s += std::string("]") + (p.is_contiguous() ? "" : " non-contiguous") + "\n";
  }
  return s;
}

}  // namespace gwt_fuzz
