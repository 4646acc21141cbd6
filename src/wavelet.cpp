#include "gwt/wavelet.h"

#include <c10/util/Exception.h>

#include "gwt/filters.h"

namespace gwt {
namespace {

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) {
    if (!out.empty()) out += ", ";
    out += n;
  }
  return out;
}

}  // namespace

std::vector<std::string> boundary_mode_names() {
  return {"zero", "periodization", "symmetric"};
}

BoundaryMode boundary_mode_from_string(const std::string& name) {
  if (name == "zero") return BoundaryMode::zero;
  if (name == "periodization") return BoundaryMode::periodization;
  if (name == "symmetric") return BoundaryMode::symmetric;
  TORCH_CHECK(false, "gwt: unknown boundary mode '", name, "'; valid modes are ",
              join(boundary_mode_names()));
}

std::string to_string(BoundaryMode mode) {
  switch (mode) {
    case BoundaryMode::zero:
      return "zero";
    case BoundaryMode::periodization:
      return "periodization";
    case BoundaryMode::symmetric:
      return "symmetric";
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled BoundaryMode");
}

std::vector<std::string> Wavelet::available() {
  std::vector<std::string> names;
  for (const auto& bank : filters::k_filter_banks) names.emplace_back(bank.name);
  return names;
}

Wavelet::Wavelet(const char* name) : Wavelet(std::string(name == nullptr ? "" : name)) {}

Wavelet::Wavelet(const std::string& name) : name_(name) {
  const filters::FilterBank* found = nullptr;
  for (const auto& bank : filters::k_filter_banks) {
    if (name == bank.name) found = &bank;
  }
  TORCH_CHECK(found != nullptr, "gwt: unknown wavelet '", name, "'; valid wavelets are ",
              join(available()));
  const auto f = static_cast<int64_t>(found->length);
  dec_lo_.assign(found->dec_lo, found->dec_lo + f);
  rec_lo_.assign(dec_lo_.rbegin(), dec_lo_.rend());
  // PyWavelets builds the high-pass pair as the quadrature mirror of the low-pass one.
  rec_hi_.resize(f);
  for (int64_t k = 0; k < f; ++k) rec_hi_[k] = (k % 2 == 0) ? dec_lo_[k] : -dec_lo_[k];
  dec_hi_.assign(rec_hi_.rbegin(), rec_hi_.rend());
}

int64_t dwt_coeff_len(int64_t n, int64_t filter_length, BoundaryMode mode) {
  TORCH_CHECK(n >= 1, "gwt: a signal to transform needs at least one sample, got length ", n);
  if (mode == BoundaryMode::periodization) return (n + 1) / 2;
  return (n + filter_length - 1) / 2;
}

int64_t approx_len(int64_t n, const Wavelet& wavelet, int64_t level, BoundaryMode mode) {
  TORCH_CHECK(level >= 0, "gwt: level must be >= 0, got ", level);
  for (int64_t l = 0; l < level; ++l) n = dwt_coeff_len(n, wavelet.length(), mode);
  return n;
}

}  // namespace gwt
