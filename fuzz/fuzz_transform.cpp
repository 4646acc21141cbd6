// Fuzz target: wavedec/waverec (1-D, along any dim) and wavedec2/waverec2 for arbitrary lengths,
// levels, wavelets, boundary modes and dtypes, valid or not.
//
// Properties:
// - nothing but a c10::Error ever escapes, and invalid arguments (unknown wavelet or mode, negative
//   level, dim out of range, an empty transform axis, a non-float dtype, too few dimensions) are
//   always one;
// - valid arguments never throw, give `level` detail levels in the input's dtype, and in float64
//   reconstruct the input: every orthogonal wavelet in every mode reconstructs perfectly, so
//   max |waverec(wavedec(x)) - x| <= 1e-9 * max |x| (+1e-300 for subnormal inputs), far above
//   float64 rounding (~1e-15 relative per level) and far below any real defect;
// - coefficients tampered with (a detail dropped, shortened, of another dtype, undefined) give a
//   c10::Error or a result, never a crash.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fuzzer/FuzzedDataProvider.h>

#include <string>
#include <vector>

#include "fuzz_util.h"
#include "gwt/transform.h"
#include "gwt/wavelet.h"

namespace {

using gwt_fuzz::fail;

struct Case {
  bool two_d = false;
  std::string wavelet, mode;
  int64_t level = 0, dim = -1;
  at::ScalarType dtype = at::kDouble;
  std::vector<int64_t> shape;
  bool valid = true;
  std::string why_invalid;
  int tamper = 0;  // 0 = none
};

void invalid(Case& c, const char* why) {
  if (c.valid) c.why_invalid = why;
  c.valid = false;
}

std::string describe(const Case& c) {
  std::string s = std::string(c.two_d ? "2-D" : "1-D") + " wavelet=" + c.wavelet +
                  " mode=" + c.mode + " level=" + std::to_string(c.level) +
                  " dim=" + std::to_string(c.dim) + " dtype=" + c10::toString(c.dtype) +
                  " shape=[";
  for (size_t i = 0; i < c.shape.size(); ++i) s += (i ? "," : "") + std::to_string(c.shape[i]);
  return s + "] tamper=" + std::to_string(c.tamper);
}

Case draw_case(FuzzedDataProvider& in) {
  static const std::vector<std::string> wavelets = gwt::Wavelet::available();
  static const std::vector<std::string> bad_wavelets = {"", "db0", "db9", "HAAR", "sym1",
                                                        "coif4", "bior1.3", "haar "};
  static const std::vector<std::string> modes = gwt::boundary_mode_names();
  static const std::vector<std::string> bad_modes = {"reflect", "", "Zero", "periodic"};
  static const std::vector<at::ScalarType> bad_dtypes = {at::kInt, at::kLong, at::kBool,
                                                         at::kByte, at::kComplexFloat};
  Case c;
  c.two_d = in.ConsumeBool();
  const uint8_t w = in.ConsumeIntegral<uint8_t>();
  if (w < 248) {
    c.wavelet = wavelets[w % wavelets.size()];
  } else {
    c.wavelet = bad_wavelets[w % bad_wavelets.size()];
    invalid(c, "unknown wavelet");
  }
  const uint8_t m = in.ConsumeIntegral<uint8_t>();
  if (m < 250) {
    c.mode = modes[m % modes.size()];
  } else {
    c.mode = bad_modes[m % bad_modes.size()];
    invalid(c, "unknown mode");
  }
  const uint8_t l = in.ConsumeIntegral<uint8_t>();
  if (l < 250) {
    c.level = l % 9;  // 0..8: every level of interest for lengths up to a few hundred
  } else {
    c.level = l == 255 ? std::numeric_limits<int64_t>::min() : -static_cast<int64_t>(l - 249);
    invalid(c, "negative level");
  }
  const uint8_t d = in.ConsumeIntegral<uint8_t>();
  if (d < 150) {
    c.dtype = at::kDouble;
  } else if (d < 190) {
    c.dtype = at::kFloat;
  } else if (d < 215) {
    c.dtype = at::kHalf;
  } else if (d < 240) {
    c.dtype = at::kBFloat16;
  } else {
    c.dtype = bad_dtypes[d % bad_dtypes.size()];
    invalid(c, "non-float dtype");
  }
  if (!c.two_d) {
    const int64_t rank = in.ConsumeIntegralInRange<int64_t>(1, 3);
    c.dim = in.ConsumeIntegralInRange<int64_t>(-rank - 1, rank);
    const int64_t n = in.ConsumeIntegralInRange<int64_t>(0, 300);
    c.shape = gwt_fuzz::draw_shape(in, rank, 4, 4);  // batch dimensions: at most 4 rows
    if (c.dim < -rank || c.dim >= rank) {
      invalid(c, "dim out of range");
      c.shape.back() = n;
    } else {
      c.shape[c.dim < 0 ? c.dim + rank : c.dim] = n;
      if (n == 0) invalid(c, "empty transform axis");
    }
  } else {
    const int64_t rank = in.ConsumeIntegralInRange<int64_t>(1, 3);
    c.shape = gwt_fuzz::draw_shape(in, rank, 40, 600);
    if (rank < 2) {
      invalid(c, "2-D transform of a 1-D tensor");
    } else if (c.level > 0 && (c.shape[rank - 1] == 0 || c.shape[rank - 2] == 0)) {
      invalid(c, "empty transform axis");
    }
  }
  const uint8_t t = in.ConsumeIntegral<uint8_t>();
  c.tamper = t < 224 ? 0 : 1 + t % 6;
  return c;
}

at::Tensor tampered(const at::Tensor& t, int tamper) {
  switch (tamper) {
    case 1:
      return at::Tensor();
    case 2:
      return t.dim() > 0 && t.size(-1) > 0 ? t.narrow(-1, 0, t.size(-1) - 1) : t;
    case 3:
      return t.to(at::kInt);
    case 4:
      return t.to(t.scalar_type() == at::kDouble ? at::kFloat : at::kDouble);
    case 5:
      return at::cat({t, t}, -1);
    default:
      return t.unsqueeze(0);
  }
}

// The round-trip check of a valid float64 case (see the file comment for the bound).
void check_reconstruction(const at::Tensor& x, const at::Tensor& back, const Case& c) {
  if (c.dtype != at::kDouble || !gwt_fuzz::all_finite(x)) return;
  const double scale = gwt_fuzz::max_abs(x);
  const double err = x.numel() == 0 ? 0.0 : gwt_fuzz::max_abs(back - x);
  if (!(err <= 1e-9 * scale + 1e-300))
    fail("round trip error " + std::to_string(err) + " for max |x| " + std::to_string(scale) +
         ": " + describe(c));
}

void run_1d(const Case& c, const at::Tensor& x, bool& tampering) {
  const gwt::Wavelet wavelet(c.wavelet);
  const gwt::BoundaryMode mode = gwt::boundary_mode_from_string(c.mode);
  gwt::WaveletCoeffs coeffs = gwt::wavedec(x, wavelet, c.level, c.dim, mode);
  if (!c.valid) return;  // the caller reports the missing error
  GWT_FUZZ_CHECK(static_cast<int64_t>(coeffs.details.size()) == c.level, describe(c));
  GWT_FUZZ_CHECK(coeffs.approx.scalar_type() == c.dtype, describe(c));
  const int64_t dim = c.dim < 0 ? c.dim + x.dim() : c.dim, n = x.size(dim);
  int64_t expected = n;
  for (int64_t l = 0; l < c.level; ++l)
    expected = gwt::dwt_coeff_len(expected, wavelet.length(), mode);
  GWT_FUZZ_CHECK(coeffs.approx.size(dim) == expected, describe(c));
  if (c.tamper != 0) {
    tampering = true;  // any outcome but a crash is fine from here
    if (coeffs.details.empty()) {
      coeffs.approx = tampered(coeffs.approx, c.tamper);
    } else {
      auto& victim = coeffs.details[coeffs.details.size() / 2];
      victim = tampered(victim, c.tamper);
    }
    (void)gwt::waverec(coeffs, wavelet, c.dim, mode);
    return;
  }
  const at::Tensor back = gwt::waverec(coeffs, wavelet, c.dim, mode, n);
  GWT_FUZZ_CHECK(back.sizes() == x.sizes() && back.scalar_type() == c.dtype, describe(c));
  check_reconstruction(x, back, c);
  // Without a length: PyWavelets' length, n or n + 1, starting with the same samples.
  const at::Tensor full = gwt::waverec(coeffs, wavelet, c.dim, mode);
  GWT_FUZZ_CHECK(full.size(dim) == n || full.size(dim) == n + 1, describe(c));
  check_reconstruction(x, full.narrow(dim, 0, n), c);
}

void run_2d(const Case& c, const at::Tensor& x, bool& tampering) {
  const gwt::Wavelet wavelet(c.wavelet);
  const gwt::BoundaryMode mode = gwt::boundary_mode_from_string(c.mode);
  gwt::WaveletCoeffs2 coeffs = gwt::wavedec2(x, wavelet, c.level, mode);
  if (!c.valid) return;
  GWT_FUZZ_CHECK(static_cast<int64_t>(coeffs.details.size()) == c.level, describe(c));
  GWT_FUZZ_CHECK(coeffs.approx.scalar_type() == c.dtype, describe(c));
  if (c.tamper != 0) {
    tampering = true;
    if (coeffs.details.empty()) {
      coeffs.approx = tampered(coeffs.approx, c.tamper);
    } else {
      auto& level = coeffs.details[coeffs.details.size() / 2];
      level[c.tamper % 3] = tampered(level[c.tamper % 3], c.tamper);
    }
    (void)gwt::waverec2(coeffs, wavelet, mode);
    return;
  }
  const at::Tensor full = gwt::waverec2(coeffs, wavelet, mode);
  GWT_FUZZ_CHECK(full.dim() == x.dim() && full.scalar_type() == c.dtype, describe(c));
  const int64_t rows = x.size(-2), cols = x.size(-1);
  GWT_FUZZ_CHECK(full.size(-2) == rows || full.size(-2) == rows + 1, describe(c));
  GWT_FUZZ_CHECK(full.size(-1) == cols || full.size(-1) == cols + 1, describe(c));
  for (int64_t i = 0; i + 2 < x.dim(); ++i) GWT_FUZZ_CHECK(full.size(i) == x.size(i), describe(c));
  check_reconstruction(x, full.narrow(-2, 0, rows).narrow(-1, 0, cols), c);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  gwt_fuzz::init();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const Case c = draw_case(in);
  // Values: a magnitude for the whole tensor (2^-1000 to 2^300), then per element.
  const double typical = std::ldexp(1.0, in.ConsumeIntegralInRange<int>(-1000, 300));
  const bool specials = in.ConsumeIntegral<uint8_t>() >= 240;
  const at::Tensor x = gwt_fuzz::draw_tensor(in, c.shape, c.dtype, specials, typical);
  bool tampering = false;
  try {
    if (c.two_d)
      run_2d(c, x, tampering);
    else
      run_1d(c, x, tampering);
  } catch (const c10::Error& e) {
    if (c.valid && !tampering)
      fail(std::string("valid arguments threw: ") + e.what_without_backtrace() + "\n" +
           describe(c));
    return 0;
  } catch (const std::exception& e) {
    fail(std::string("an exception other than c10::Error: ") + e.what() + "\n" + describe(c));
  } catch (...) {
    fail("a non-std exception: " + describe(c));
  }
  if (!c.valid && !tampering) fail("invalid arguments (" + c.why_invalid + ") accepted: " + describe(c));
  return 0;
}
