#pragma once

/// \file
/// Multilevel 1-D discrete wavelet transform along one dimension, exactly as PyWavelets'
/// `pywt.wavedec` / `pywt.waverec` (filters, boundary modes, coefficient order and lengths).
///
/// This is the readable ATen implementation: it runs on any device and is the reference that the
/// fast kernels are tested against.

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gwt/wavelet.h"

namespace gwt {

/// Result of wavedec: the coarsest approximation and the details, coarsest first
/// (PyWavelets' list `[cA_L, cD_L, ..., cD_1]` is `{approx, details}`).
struct WaveletCoeffs {
  at::Tensor approx;
  std::vector<at::Tensor> details;
};

/// One level: PyWavelets' `pywt.dwt(x, wavelet, mode, axis=dim)`, returns {approx, detail}.
std::pair<at::Tensor, at::Tensor> dwt(const at::Tensor& x, const Wavelet& wavelet, int64_t dim = -1,
                                      BoundaryMode mode = BoundaryMode::zero);

/// One inverse level: PyWavelets' `pywt.idwt(approx, detail, wavelet, mode, axis=dim)`.
/// With K coefficients each it returns 2K - F + 2 samples (zero, symmetric) or 2K (periodization).
at::Tensor idwt(const at::Tensor& approx, const at::Tensor& detail, const Wavelet& wavelet,
                int64_t dim = -1, BoundaryMode mode = BoundaryMode::zero);

/// PyWavelets' `pywt.wavedec(x, wavelet, mode, level, axis=dim)`.
///
/// Any number of leading and trailing dimensions; every other dimension is a batch dimension.
/// float32 and float64 are computed in their own precision; float16 and bfloat16 are computed in
/// float32 and returned in their own dtype. level 0 returns the input as the approximation.
WaveletCoeffs wavedec(const at::Tensor& x, const Wavelet& wavelet, int64_t level, int64_t dim = -1,
                      BoundaryMode mode = BoundaryMode::zero);

/// PyWavelets' `pywt.waverec(coeffs, wavelet, mode, axis=dim)`. Between levels the partial
/// reconstruction loses its last sample when it is one longer than the next detail, as in
/// PyWavelets. When `length` is given the result is cropped to it (it may not exceed the length
/// PyWavelets would return).
at::Tensor waverec(const WaveletCoeffs& coeffs, const Wavelet& wavelet, int64_t dim = -1,
                   BoundaryMode mode = BoundaryMode::zero,
                   std::optional<int64_t> length = std::nullopt);

/// Result of wavedec2: the coarsest approximation (LL) and, coarsest level first, the three detail
/// subbands of each level in PyWavelets' order (cH, cV, cD): detail along rows / approximation
/// along columns, approximation along rows / detail along columns, detail along both.
struct WaveletCoeffs2 {
  at::Tensor approx;
  std::vector<std::array<at::Tensor, 3>> details;
};

/// PyWavelets' `pywt.wavedec2(x, wavelet, mode, level)` over the last two dimensions (the others
/// are batch dimensions): a separable multilevel 2-D DWT, rows (dim -2) then columns (dim -1).
WaveletCoeffs2 wavedec2(const at::Tensor& x, const Wavelet& wavelet, int64_t level,
                        BoundaryMode mode = BoundaryMode::zero);

/// PyWavelets' `pywt.waverec2(coeffs, wavelet, mode)`: per level the partial reconstruction loses
/// a trailing row / column where it is one longer than the details, then columns, then rows.
at::Tensor waverec2(const WaveletCoeffs2& coeffs, const Wavelet& wavelet,
                    BoundaryMode mode = BoundaryMode::zero);

/// PyWavelets' `pywt.threshold(x, value, mode)` for mode "soft" (x * max(1 - value / |x|, 0)) or
/// "hard" (0 where |x| < value, x elsewhere). One deliberate difference: soft thresholding at
/// value 0 keeps a zero as 0, where PyWavelets computes 0 * (1 - 0/0) = NaN.
at::Tensor threshold(const at::Tensor& x, double value, const std::string& mode = "soft");

namespace detail {
/// dtype the transform computes in for an input dtype (float64 stays, everything else float32);
/// an error for integer, bool and complex dtypes.
at::ScalarType transform_compute_dtype(at::ScalarType dtype);
}  // namespace detail

}  // namespace gwt
