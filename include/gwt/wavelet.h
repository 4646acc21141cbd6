#pragma once

/// \file
/// Wavelet filter banks (PyWavelets' coefficients and conventions) and boundary modes.

#include <cstdint>
#include <string>
#include <vector>

namespace gwt {

/// How a signal is extended past its ends, named as in PyWavelets (`pywt.Modes`).
enum class BoundaryMode {
  zero,           ///< zeros outside; output length floor((N + F - 1) / 2)
  periodization,  ///< periodic, odd N first repeats its last sample; output length ceil(N / 2)
  symmetric,      ///< half-sample symmetric (x[-1] = x[0]); output length floor((N + F - 1) / 2)
};

/// Parses "zero", "periodization" or "symmetric"; anything else is an error listing those names.
BoundaryMode boundary_mode_from_string(const std::string& name);
/// The PyWavelets name of a mode.
std::string to_string(BoundaryMode mode);
/// Names accepted by boundary_mode_from_string.
std::vector<std::string> boundary_mode_names();

/// An orthogonal wavelet's four filters, bit-identical to PyWavelets' `pywt.Wavelet(name)`.
///
/// Implicitly constructible from a name so that options and calls read `wavedec(x, "db2", 2)`.
/// Supported: haar, db1..db8, sym2..sym8, coif1..coif3 (see available()).
class Wavelet {
 public:
  /// Looks the name up; an unknown name is an error that lists the valid names.
  Wavelet(const std::string& name);  // NOLINT(google-explicit-constructor): implicit on purpose
  Wavelet(const char* name);         // NOLINT(google-explicit-constructor)

  const std::string& name() const { return name_; }
  /// Decomposition low-pass filter (PyWavelets' `dec_lo`).
  const std::vector<double>& dec_lo() const { return dec_lo_; }
  /// Decomposition high-pass filter (`dec_hi`).
  const std::vector<double>& dec_hi() const { return dec_hi_; }
  /// Reconstruction low-pass filter (`rec_lo`, the reverse of dec_lo).
  const std::vector<double>& rec_lo() const { return rec_lo_; }
  /// Reconstruction high-pass filter (`rec_hi`).
  const std::vector<double>& rec_hi() const { return rec_hi_; }
  /// Filter length F (2 for haar, 2N for dbN and symN, 6N for coifN).
  int64_t length() const { return static_cast<int64_t>(dec_lo_.size()); }

  /// Every name the constructor accepts.
  static std::vector<std::string> available();

 private:
  std::string name_;
  std::vector<double> dec_lo_, dec_hi_, rec_lo_, rec_hi_;
};

inline bool operator==(const Wavelet& a, const Wavelet& b) {
  return a.name() == b.name();
}
inline bool operator!=(const Wavelet& a, const Wavelet& b) {
  return !(a == b);
}

/// Where sample t (possibly outside [0, n)) of a length-n signal extended by `mode` comes from, as
/// PyWavelets extends it: an index in [0, n), or -1 for a zero (zero mode). Symmetric mode
/// reflects half-sample (x[-1] = x[0]); periodization first repeats the last sample of an
/// odd-length signal, then wraps.
#if defined(__CUDACC__)
#define GWT_HOST_DEVICE __host__ __device__
#else
#define GWT_HOST_DEVICE
#endif
/// (Callable from CUDA device code too: the CUDA kernels extend rows with the same rule. Static:
/// each translation unit keeps its own copy, built for its own instruction set.)
GWT_HOST_DEVICE static inline int64_t extension_index(int64_t t, int64_t n, BoundaryMode mode) {
  if (t >= 0 && t < n) return t;
  switch (mode) {
    case BoundaryMode::zero:
      return -1;
    case BoundaryMode::symmetric: {
      const int64_t r = ((t % (2 * n)) + 2 * n) % (2 * n);
      return r < n ? r : 2 * n - 1 - r;
    }
    case BoundaryMode::periodization: {
      const int64_t period = n + (n % 2);
      const int64_t r = ((t % period) + period) % period;
      return r < n ? r : n - 1;
    }
  }
  return -1;
}

/// PyWavelets' `dwt_coeff_len`: length of each subband after one level on a signal of length n.
int64_t dwt_coeff_len(int64_t n, int64_t filter_length, BoundaryMode mode);

/// Length of the approximation after `level` levels on a signal of length n.
int64_t approx_len(int64_t n, const Wavelet& wavelet, int64_t level, BoundaryMode mode);

}  // namespace gwt
