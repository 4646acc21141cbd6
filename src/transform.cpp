#include "gwt/transform.h"
#include "plain_tensor.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <utility>

namespace gwt {
namespace detail {

at::ScalarType transform_compute_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble:
      return at::kDouble;
    case at::kFloat:
    case at::kHalf:
    case at::kBFloat16:
      return at::kFloat;
    default:
      TORCH_CHECK(false, "gwt: wavelet transforms need a floating-point tensor (float64, float32, ",
                  "float16 or bfloat16), got ", dtype);
  }
}

}  // namespace detail

namespace {

int64_t floor_div(int64_t a, int64_t b) {
  return a / b - ((a % b != 0) && ((a < 0) != (b < 0)));
}
int64_t positive_mod(int64_t a, int64_t m) {
  return ((a % m) + m) % m;
}

// Where sample t of the extended signal comes from; zero mode points outside samples at slot n,
// which the caller fills with a zero.
int64_t source_index(int64_t t, int64_t n, BoundaryMode mode) {
  const int64_t s = extension_index(t, n, mode);
  return s < 0 ? n : s;
}

at::Tensor index_tensor(const std::vector<int64_t>& values, const at::Device& device) {
  return at::tensor(values, at::TensorOptions().dtype(at::kLong)).to(device);
}

// One analysis level on the last dimension of a [rows, n] tensor.
// PyWavelets: coeff[o] = sum_j dec[j] * ext[2o + 1 - j]        (zero, symmetric)
//             coeff[o] = sum_j dec[j] * ext[(2o + F/2 - j) % n'] (periodization)
// written as windows of F samples at stride 2 times the reversed filters (= rec_lo, rec_hi).
std::pair<at::Tensor, at::Tensor> dwt_rows(const at::Tensor& x, const Wavelet& wavelet,
                                           BoundaryMode mode) {
  const int64_t rows = x.size(0), n = x.size(1), taps = wavelet.length();
  const int64_t len = dwt_coeff_len(n, taps, mode);
  const int64_t offset = mode == BoundaryMode::periodization ? 1 - taps / 2 : 2 - taps;
  std::vector<int64_t> idx(static_cast<size_t>(len * taps));
  for (int64_t o = 0; o < len; ++o)
    for (int64_t k = 0; k < taps; ++k)
      idx[o * taps + k] = source_index(2 * o + k + offset, n, mode);
  at::Tensor source = x;
  if (mode == BoundaryMode::zero) source = at::cat({x, at::zeros({rows, 1}, x.options())}, 1);
  const at::Tensor windows =
      source.index_select(1, index_tensor(idx, x.device())).view({rows, len, taps});
  const at::Tensor bank = at::stack({at::tensor(wavelet.rec_lo(), at::kDouble),
                                     at::tensor(wavelet.rec_hi(), at::kDouble)},
                                    1)
                              .to(x.options());         // [F, 2]
  const at::Tensor coeffs = at::matmul(windows, bank);  // [rows, len, 2]
  return {coeffs.select(2, 0).contiguous(), coeffs.select(2, 1).contiguous()};
}

// One synthesis level on [rows, K] approximation and detail.
// out[2m + e] = sum_q (dec_lo[j] * a[m + q] + dec_hi[j] * d[m + q]),  j = phase + 2q - e in [0, F)
// phase = 1 reproduces PyWavelets' upsampling_convolution_valid_sf (zero, symmetric: m in
// [0, K - F/2]); phase = F/2 with indices taken mod K is the exact inverse of periodization.
at::Tensor idwt_rows(const at::Tensor& approx, const at::Tensor& detail, const Wavelet& wavelet,
                     BoundaryMode mode) {
  const int64_t rows = approx.size(0), len = approx.size(1), taps = wavelet.length();
  const bool periodic = mode == BoundaryMode::periodization;
  const int64_t phase = periodic ? taps / 2 : 1;
  const int64_t q_lo = floor_div(-phase, 2), q_hi = floor_div(taps - phase, 2);
  const int64_t window = q_hi - q_lo + 1;
  const int64_t outputs = periodic ? len : len - taps / 2 + 1;
  TORCH_CHECK(outputs >= 1, "gwt: idwt with wavelet ", wavelet.name(), " needs at least ", taps / 2,
              " coefficients per subband in mode ", to_string(mode), ", got ", len);

  std::vector<int64_t> idx(static_cast<size_t>(outputs * window));
  for (int64_t m = 0; m < outputs; ++m)
    for (int64_t q = q_lo; q <= q_hi; ++q) {
      const int64_t t = m + q;
      // Out-of-range taps only occur where the filter weight below is zero; clamp them.
      idx[m * window + (q - q_lo)] =
          periodic ? positive_mod(t, len) : std::clamp<int64_t>(t, 0, len - 1);
    }
  std::vector<double> bank(static_cast<size_t>(2 * window * 2), 0.0);  // [2 * window, 2]
  for (int64_t q = q_lo; q <= q_hi; ++q)
    for (int64_t e = 0; e < 2; ++e) {
      const int64_t j = phase + 2 * q - e;
      if (j < 0 || j >= taps) continue;
      bank[((q - q_lo)) * 2 + e] = wavelet.dec_lo()[j];
      bank[((window + q - q_lo)) * 2 + e] = wavelet.dec_hi()[j];
    }
  const at::Tensor index = index_tensor(idx, approx.device());
  const at::Tensor windows = at::cat({approx.index_select(1, index).view({rows, outputs, window}),
                                      detail.index_select(1, index).view({rows, outputs, window})},
                                     2);
  const at::Tensor weights =
      at::tensor(bank, at::kDouble).view({2 * window, 2}).to(approx.options());
  return at::matmul(windows, weights).view({rows, 2 * outputs});
}

int64_t checked_dim(const at::Tensor& x, int64_t dim, const char* what) {
  TORCH_CHECK(x.defined(), "gwt: ", what, " got an undefined tensor");
  TORCH_CHECK(x.dim() >= 1, "gwt: ", what, " needs a tensor with at least one dimension");
  TORCH_CHECK(dim >= -x.dim() && dim < x.dim(), "gwt: ", what, ": dim ", dim,
              " is out of range for a tensor with ", x.dim(), " dimensions (valid: ", -x.dim(),
              " to ", x.dim() - 1, ")");
  return dim < 0 ? dim + x.dim() : dim;
}

// [lead..., n] view of x with `dim` moved last, flattened to [rows, n] in the compute dtype.
at::Tensor to_rows(const at::Tensor& x, int64_t dim) {
  const at::Tensor moved = x.movedim(dim, -1);
  return moved.reshape({-1, moved.size(-1)}).to(detail::transform_compute_dtype(x.scalar_type()));
}

at::Tensor from_rows(const at::Tensor& rows, const at::Tensor& like, int64_t dim) {
  auto shape = like.movedim(dim, -1).sizes().vec();
  shape.back() = rows.size(1);
  return rows.reshape(shape).movedim(-1, dim).to(like.scalar_type());
}

void check_transform_input(const at::Tensor& x) {
  detail::check_plain_tensor("gwt: a wavelet transform", "its input", x);
  detail::transform_compute_dtype(x.scalar_type());
  TORCH_CHECK(x.layout() == at::kStrided,
              "gwt: wavelet transforms need a dense (strided) tensor, got layout ", x.layout());
}

}  // namespace

std::pair<at::Tensor, at::Tensor> dwt(const at::Tensor& x, const Wavelet& wavelet, int64_t dim,
                                      BoundaryMode mode) {
  dim = checked_dim(x, dim, "dwt");
  check_transform_input(x);
  auto [approx, detail] = dwt_rows(to_rows(x, dim), wavelet, mode);
  return {from_rows(approx, x, dim), from_rows(detail, x, dim)};
}

at::Tensor idwt(const at::Tensor& approx, const at::Tensor& detail, const Wavelet& wavelet,
                int64_t dim, BoundaryMode mode) {
  dim = checked_dim(approx, dim, "idwt");
  check_transform_input(approx);
  check_transform_input(detail);
  TORCH_CHECK(approx.sizes() == detail.sizes(),
              "gwt: idwt needs approximation and detail of one shape, got ", approx.sizes(),
              " and ", detail.sizes());
  TORCH_CHECK(approx.scalar_type() == detail.scalar_type() && approx.device() == detail.device(),
              "gwt: idwt needs approximation and detail of one dtype and device");
  return from_rows(idwt_rows(to_rows(approx, dim), to_rows(detail, dim), wavelet, mode), approx,
                   dim);
}

WaveletCoeffs wavedec(const at::Tensor& x, const Wavelet& wavelet, int64_t level, int64_t dim,
                      BoundaryMode mode) {
  dim = checked_dim(x, dim, "wavedec");
  check_transform_input(x);
  TORCH_CHECK(level >= 0, "gwt: wavedec level must be >= 0, got ", level);
  TORCH_CHECK(x.size(dim) >= 1, "gwt: wavedec needs at least one sample along dim ", dim);
  WaveletCoeffs out;
  at::Tensor approx = to_rows(x, dim);
  std::vector<at::Tensor> details_rows;
  for (int64_t l = 0; l < level; ++l) {
    auto [a, d] = dwt_rows(approx, wavelet, mode);
    approx = std::move(a);
    details_rows.push_back(std::move(d));
  }
  out.approx = from_rows(approx, x, dim);
  for (auto it = details_rows.rbegin(); it != details_rows.rend(); ++it)
    out.details.push_back(from_rows(*it, x, dim));
  return out;
}

at::Tensor waverec(const WaveletCoeffs& coeffs, const Wavelet& wavelet, int64_t dim,
                   BoundaryMode mode, std::optional<int64_t> length) {
  const at::Tensor& approx = coeffs.approx;
  dim = checked_dim(approx, dim, "waverec");
  check_transform_input(approx);
  auto lead = approx.movedim(dim, -1).sizes().vec();
  lead.pop_back();
  at::Tensor rows = to_rows(approx, dim);
  for (size_t k = 0; k < coeffs.details.size(); ++k) {
    const at::Tensor& d = coeffs.details[k];
    checked_dim(d, dim, "waverec");
    check_transform_input(d);
    TORCH_CHECK(
        d.dim() == approx.dim() && d.scalar_type() == approx.scalar_type() &&
            d.device() == approx.device(),
        "gwt: waverec needs every subband with the approximation's rank, dtype and device; detail ",
        k, " differs");
    auto d_lead = d.movedim(dim, -1).sizes().vec();
    const int64_t d_len = d_lead.back();
    d_lead.pop_back();
    TORCH_CHECK(d_lead == lead, "gwt: waverec detail ", k, " has batch shape ", d.sizes(),
                " that does not match the approximation's ", approx.sizes());
    // PyWavelets: a partial reconstruction one longer than the next detail loses its last sample.
    if (rows.size(1) == d_len + 1) rows = rows.narrow(1, 0, d_len);
    TORCH_CHECK(rows.size(1) == d_len, "gwt: waverec coefficient lengths do not fit: detail ", k,
                " (coarsest first) has ", d_len, " coefficients along dim ", dim,
                " but the coarser level gives ", rows.size(1));
    rows = idwt_rows(rows, to_rows(d, dim), wavelet, mode);
  }
  if (length.has_value()) {
    TORCH_CHECK(*length >= 1 && *length <= rows.size(1), "gwt: waverec length must be in [1, ",
                rows.size(1), "] for these coefficients, got ", *length);
    rows = rows.narrow(1, 0, *length);
  }
  return from_rows(rows.contiguous(), approx, dim);
}

// ----------------------------------------------------------------------------------------------
// 2-D (separable) and thresholding
// ----------------------------------------------------------------------------------------------

WaveletCoeffs2 wavedec2(const at::Tensor& x, const Wavelet& wavelet, int64_t level,
                        BoundaryMode mode) {
  TORCH_CHECK(x.defined() && x.dim() >= 2,
              "gwt: wavedec2 needs a tensor with at least two dimensions");
  check_transform_input(x);  // also at level 0, which returns x itself (found by fuzz_transform)
  TORCH_CHECK(level >= 0, "gwt: wavedec2 level must be >= 0, got ", level);
  WaveletCoeffs2 out;
  at::Tensor approx = x;
  std::vector<std::array<at::Tensor, 3>> finest_first;
  for (int64_t l = 0; l < level; ++l) {
    // pywt.dwtn: along rows first, then each result along columns; keys 'aa', 'ad', 'da', 'dd'.
    const auto [rows_a, rows_d] = dwt(approx, wavelet, -2, mode);
    const auto [aa, ad] = dwt(rows_a, wavelet, -1, mode);
    const auto [da, dd] = dwt(rows_d, wavelet, -1, mode);
    finest_first.push_back({da, ad, dd});  // (cH, cV, cD)
    approx = aa;
  }
  out.approx = approx;
  out.details.assign(finest_first.rbegin(), finest_first.rend());
  return out;
}

at::Tensor waverec2(const WaveletCoeffs2& coeffs, const Wavelet& wavelet, BoundaryMode mode) {
  TORCH_CHECK(coeffs.approx.defined() && coeffs.approx.dim() >= 2,
              "gwt: waverec2 needs an approximation with at least two dimensions");
  at::Tensor a = coeffs.approx;
  for (size_t k = 0; k < coeffs.details.size(); ++k) {
    const auto& [h, v, d] = coeffs.details[k];
    TORCH_CHECK(h.defined() && v.defined() && d.defined() && h.sizes() == v.sizes() &&
                    h.sizes() == d.sizes(),
                "gwt: waverec2 needs the three detail subbands of level ", k,
                " (coarsest first) to share one shape");
    // PyWavelets: a partial reconstruction one longer than the details loses its last row/column.
    for (int64_t dim : {-2, -1}) {
      const int64_t a_len = a.size(dim), d_len = h.size(dim);
      if (a_len == d_len + 1) a = a.narrow(dim, 0, d_len);
      TORCH_CHECK(a.size(dim) == d_len, "gwt: waverec2 coefficient shapes do not fit at level ", k,
                  ": approximation ", a.sizes(), " against details ", h.sizes());
    }
    // pywt.idwtn: columns first ('aa'+'ad' -> 'a', 'da'+'dd' -> 'd'), then rows.
    const at::Tensor low = idwt(a, v, wavelet, -1, mode), high = idwt(h, d, wavelet, -1, mode);
    a = idwt(low, high, wavelet, -2, mode);
  }
  return a;
}

at::Tensor threshold(const at::Tensor& x, double value, const std::string& mode) {
  TORCH_CHECK(std::isfinite(value) && value >= 0,
              "gwt: threshold value must be finite and >= 0, got ", value);
  check_transform_input(x);
  if (mode == "hard") return at::where(x.abs() < value, at::zeros_like(x), x);
  TORCH_CHECK(mode == "soft", "gwt: unknown threshold mode '", mode,
              "'; valid modes are soft, hard");
  // PyWavelets' formula, x * max(1 - value / |x|, 0), with 0 kept 0 where |x| = 0.
  const at::Tensor magnitude = x.abs();
  const at::Tensor factor = at::clamp_min(1 - value / magnitude, 0);
  return at::where(magnitude == 0, at::zeros_like(x), x * factor);
}

}  // namespace gwt
