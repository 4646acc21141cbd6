// Transforms against PyWavelets (tests/data/pywt_wavedec.txt, written by PyWavelets 1.1.1).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "gwt/transform.h"
#include "gwt/wavelet.h"
#include "test_util.h"

namespace {

using gwt_test::max_abs_diff;
using gwt_test::to_tensor;

// PyWavelets' sym filters are orthonormal only to ~5e-12 (sum(dec_lo^2) - 1), so even PyWavelets'
// own waverec(wavedec(x)) misses x by ~3e-11 for them. Round trips are held to 1e-12 plus that.
double round_trip_tolerance(const gwt::Wavelet& w) {
  const at::Tensor lo = to_tensor(w.dec_lo());
  return 1e-12 + 100 * std::abs(lo.dot(lo).item<double>() - 1.0);
}

void check_mode(const std::string& mode_name) {
  const auto records = gwt_test::read_records("pywt_wavedec.txt", "case");
  int checked = 0;
  for (const auto& rec : records) {
    const std::string& wavelet = rec.header.at(0);
    if (rec.header.at(1) != mode_name) continue;
    const int64_t n = std::stoll(rec.header.at(2));
    const int64_t level = std::stoll(rec.header.at(3));
    const auto mode = gwt::boundary_mode_from_string(mode_name);
    SCOPED_TRACE(wavelet + " " + mode_name + " n=" + std::to_string(n) +
                 " level=" + std::to_string(level));
    const at::Tensor x = to_tensor(rec.rows.at("x"));
    ASSERT_EQ(x.numel(), n);
    const gwt::WaveletCoeffs c = gwt::wavedec(x, wavelet, level, -1, mode);
    const at::Tensor expected_a = to_tensor(rec.rows.at("a" + std::to_string(level)));
    ASSERT_EQ(c.approx.sizes(), expected_a.sizes());
    EXPECT_LE(max_abs_diff(c.approx, expected_a), 1e-12);
    ASSERT_EQ(c.details.size(), static_cast<size_t>(level));
    for (int64_t k = 0; k < level; ++k) {
      const at::Tensor expected_d = to_tensor(rec.rows.at("d" + std::to_string(level - k)));
      ASSERT_EQ(c.details[k].sizes(), expected_d.sizes()) << "detail d" << level - k;
      EXPECT_LE(max_abs_diff(c.details[k], expected_d), 1e-12) << "detail d" << level - k;
    }
    // waverec returns the input (PyWavelets' waverec may be one sample longer for odd n).
    const at::Tensor back = gwt::waverec(c, wavelet, -1, mode);
    ASSERT_GE(back.numel(), n);
    const double tol = round_trip_tolerance(wavelet);
    EXPECT_LE(max_abs_diff(back.narrow(0, 0, n), x), tol);
    EXPECT_LE(max_abs_diff(gwt::waverec(c, wavelet, -1, mode, n), x), tol);
    ++checked;
  }
  EXPECT_GE(checked, 100) << "too few golden cases for mode " << mode_name;
}

TEST(Transform, WavedecMatchesPyWaveletsZeroMode) {
  check_mode("zero");
}
TEST(Transform, WavedecMatchesPyWaveletsPeriodization) {
  check_mode("periodization");
}
TEST(Transform, WavedecMatchesPyWaveletsSymmetric) {
  check_mode("symmetric");
}

TEST(Transform, FiltersAreOrthonormalForEveryWavelet) {
  for (const auto& name : gwt::Wavelet::available()) {
    const gwt::Wavelet w(name);
    const at::Tensor lo = to_tensor(w.dec_lo()), hi = to_tensor(w.dec_hi());
    EXPECT_NEAR(lo.dot(lo).item<double>(), 1.0, 1e-10) << name;  // sym: ~5e-12 in PyWavelets
    EXPECT_NEAR(lo.dot(hi).item<double>(), 0.0, 1e-12) << name;
    EXPECT_NEAR(lo.sum().item<double>(), std::sqrt(2.0), 1e-12) << name;
  }
}

TEST(Transform, PerfectReconstructionForEveryWaveletAndMode) {
  at::manual_seed(0);
  for (const auto& name : gwt::Wavelet::available())
    for (const auto& mode_name : gwt::boundary_mode_names())
      for (int64_t n : {1, 2, 7, 33, 64}) {
        const auto mode = gwt::boundary_mode_from_string(mode_name);
        const at::Tensor x = at::randn({3, n}, at::kDouble);
        const auto c = gwt::wavedec(x, name, 3, -1, mode);
        EXPECT_LE(max_abs_diff(gwt::waverec(c, name, -1, mode, n), x), round_trip_tolerance(name))
            << name << " " << mode_name << " n=" << n;
      }
}

TEST(Transform, AnyDimAndLeadingDimensionsAreBatch) {
  at::manual_seed(1);
  const at::Tensor x = at::randn({4, 19, 3, 2}, at::kDouble);
  for (int64_t dim : {0, 1, -2, -1}) {
    const auto c = gwt::wavedec(x, "db2", 2, dim);
    // Same as transforming each 1-D slice on its own.
    const at::Tensor moved = x.movedim(dim, -1).reshape({-1, x.size(dim)});
    const at::Tensor approx_moved = c.approx.movedim(dim, -1).reshape({moved.size(0), -1});
    for (int64_t r = 0; r < moved.size(0); r += 5) {
      const auto single = gwt::wavedec(moved[r], "db2", 2);
      EXPECT_LE(max_abs_diff(approx_moved[r], single.approx), 1e-14) << "dim " << dim;
    }
    EXPECT_LE(max_abs_diff(gwt::waverec(c, "db2", dim, gwt::BoundaryMode::zero, x.size(dim)), x),
              1e-12);
  }
}

TEST(Transform, NonContiguousInputGivesTheSameResult) {
  at::manual_seed(2);
  const at::Tensor x = at::randn({16, 10}, at::kDouble).t();  // [10, 16], non-contiguous
  const auto a = gwt::wavedec(x, "sym3", 2);
  const auto b = gwt::wavedec(x.contiguous(), "sym3", 2);
  EXPECT_TRUE(at::equal(a.approx, b.approx));
}

TEST(Transform, HalfPrecisionInputsAreComputedInFloat) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({8, 32}, at::kFloat);
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    const at::Tensor xh = x.to(dtype);
    const auto c = gwt::wavedec(xh, "haar", 2);
    EXPECT_EQ(c.approx.scalar_type(), dtype);
    const auto ref = gwt::wavedec(xh.to(at::kFloat), "haar", 2);
    EXPECT_TRUE(at::equal(c.approx, ref.approx.to(dtype)));
  }
  const auto c32 = gwt::wavedec(x, "db2", 2);
  const auto c64 = gwt::wavedec(x.to(at::kDouble), "db2", 2);
  EXPECT_EQ(c32.approx.scalar_type(), at::kFloat);
  // A bound that holds for any summation order: each level-2 coefficient is a sum of at most
  // F^2 products of taps and samples, computed through 2 * F roundings of float32 at most, and
  // its terms sum in magnitude to at most (sum |h|)^2 * max |x|.
  double taps_abs = 0;
  const gwt::Wavelet db2("db2");  // (a temporary's dec_lo() would dangle: ASan found it)
  for (double h : db2.dec_lo()) taps_abs += std::abs(h);
  const double bound =
      2 * 4 * 2 * std::ldexp(1.0, -24) * taps_abs * taps_abs * x.abs().max().item<double>();
  EXPECT_LE(max_abs_diff(c32.approx, c64.approx), bound);
}

TEST(Transform, Wavedec2RejectsNonFloatInputsAtEveryLevel) {
  // Level 0 returns the input as the approximation: it was returned unchecked (fuzz_transform).
  const at::Tensor x = at::ones({4, 4}, at::kLong);
  for (int64_t level : {0, 1}) {
    EXPECT_THROW(gwt::wavedec2(x, "haar", level), c10::Error) << "level " << level;
    EXPECT_THROW(gwt::wavedec(x, "haar", level), c10::Error) << "level " << level;
  }
}

TEST(Transform, HaarIsBlockLocal) {
  // docs/algorithm.md#transforms-pywavelets-conventions: with L levels on a length divisible by 2^L
  // each block of 2^L samples owns one approximation coefficient, which is the block sum / 2^(L/2).
  const at::Tensor x = at::arange(32, at::kDouble).view({1, 32});
  const auto c = gwt::wavedec(x, "haar", 3);
  const at::Tensor block_sums = x.view({1, 4, 8}).sum(-1) / std::pow(2.0, 1.5);
  EXPECT_LE(max_abs_diff(c.approx, block_sums), 1e-12);
}

TEST(Transform, LevelZeroReturnsTheInput) {
  const at::Tensor x = at::randn({5, 6}, at::kDouble);
  const auto c = gwt::wavedec(x, "db3", 0);
  EXPECT_TRUE(c.details.empty());
  EXPECT_TRUE(at::equal(c.approx, x));
  EXPECT_TRUE(at::equal(gwt::waverec(c, "db3"), x));
}

TEST(Transform, CoefficientLengthsFollowPyWavelets) {
  EXPECT_EQ(gwt::dwt_coeff_len(17, 2, gwt::BoundaryMode::zero), 9);
  EXPECT_EQ(gwt::dwt_coeff_len(17, 4, gwt::BoundaryMode::zero), 10);
  EXPECT_EQ(gwt::dwt_coeff_len(17, 4, gwt::BoundaryMode::periodization), 9);
  EXPECT_EQ(gwt::approx_len(512, "haar", 2, gwt::BoundaryMode::zero), 128);
}

TEST(TransformErrors, UnknownWaveletListsValidNames) {
  try {
    gwt::Wavelet w("db99");
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("db99"), std::string::npos);
    EXPECT_NE(msg.find("haar"), std::string::npos);
    EXPECT_NE(msg.find("coif1"), std::string::npos);
  }
}

TEST(TransformErrors, UnknownModeListsValidModes) {
  try {
    gwt::boundary_mode_from_string("reflect-ish");
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("reflect-ish"), std::string::npos);
    EXPECT_NE(msg.find("periodization"), std::string::npos);
  }
}

TEST(TransformErrors, BadArgumentsAreRejected) {
  const at::Tensor x = at::randn({4, 8});
  EXPECT_THROW(gwt::wavedec(x, "haar", -1), c10::Error);
  EXPECT_THROW(gwt::wavedec(x, "haar", 1, 2), c10::Error);
  EXPECT_THROW(gwt::wavedec(at::ones({4, 8}, at::kLong), "haar", 1), c10::Error);
  EXPECT_THROW(gwt::wavedec(at::ones({4, 8}, at::kComplexFloat), "haar", 1), c10::Error);
  auto c = gwt::wavedec(x, "haar", 2);
  c.details[1] = c.details[1].narrow(-1, 0, 2);
  EXPECT_THROW(gwt::waverec(c, "haar"), c10::Error);
  EXPECT_THROW(gwt::waverec(gwt::wavedec(x, "haar", 1), "haar", -1, gwt::BoundaryMode::zero, 9),
               c10::Error);
}

}  // namespace

namespace {

// "name rows cols values..." rows of tests/data/pywt_wavedec2.txt as tensors.
at::Tensor matrix(const std::vector<double>& row) {
  const auto rows = static_cast<int64_t>(row.at(0)), cols = static_cast<int64_t>(row.at(1));
  return gwt_test::to_tensor(std::vector<double>(row.begin() + 2, row.end())).view({rows, cols});
}

TEST(Transform2d, Wavedec2AndWaverec2MatchPyWavelets) {
  const auto records = gwt_test::read_records("pywt_wavedec2.txt", "case");
  ASSERT_GE(records.size(), 90u);
  for (const auto& rec : records) {
    const std::string& wavelet = rec.header.at(0);
    const auto mode = gwt::boundary_mode_from_string(rec.header.at(1));
    const int64_t level = std::stoll(rec.header.at(4));
    SCOPED_TRACE(wavelet + " " + rec.header.at(1) + " " + rec.header.at(2) + "x" +
                 rec.header.at(3) + " level " + std::to_string(level));
    const at::Tensor x = matrix(rec.rows.at("x"));
    const gwt::WaveletCoeffs2 c = gwt::wavedec2(x, wavelet, level, mode);
    EXPECT_LE(gwt_test::max_abs_diff(c.approx, matrix(rec.rows.at("a"))), 1e-12);
    ASSERT_EQ(c.details.size(), static_cast<size_t>(level));
    for (int64_t k = 0; k < level; ++k) {
      const std::string suffix = std::to_string(level - k);
      for (int s = 0; s < 3; ++s) {
        const at::Tensor expected = matrix(rec.rows.at(std::string(1, "hvd"[s]) + suffix));
        ASSERT_EQ(c.details[k][s].sizes(), expected.sizes()) << "hvd"[s] << suffix;
        EXPECT_LE(gwt_test::max_abs_diff(c.details[k][s], expected), 1e-12) << "hvd"[s] << suffix;
      }
    }
    const at::Tensor back = gwt::waverec2(c, wavelet, mode);
    EXPECT_LE(gwt_test::max_abs_diff(back.narrow(0, 0, x.size(0)).narrow(1, 0, x.size(1)), x),
              round_trip_tolerance(wavelet));
  }
}

TEST(Transform2d, LeadingDimensionsAreBatch) {
  const at::Tensor x = at::randn({3, 2, 12, 10}, at::kDouble);
  const auto c = gwt::wavedec2(x, "db2", 2);
  const auto single = gwt::wavedec2(x[2][1], "db2", 2);
  EXPECT_TRUE(at::allclose(c.approx[2][1], single.approx, 0, 1e-14));
  EXPECT_TRUE(at::allclose(c.details[0][2][2][1], single.details[0][2], 0, 1e-14));
}

TEST(Threshold, MatchesPyWavelets) {
  const auto records = gwt_test::read_records("pywt_threshold.txt", "case");
  ASSERT_EQ(records.size(), 10u);
  for (const auto& rec : records) {
    const std::string& mode = rec.header.at(0);
    const double value = std::stod(rec.header.at(1));
    const at::Tensor x = gwt_test::to_tensor(rec.rows.at("x"));
    at::Tensor expected = gwt_test::to_tensor(rec.rows.at("y"));
    // PyWavelets' soft rule turns 0 into 0 * (1 - 0/0) = NaN at threshold 0; gwt keeps it 0.
    expected = at::where(at::isnan(expected) & (x == 0), at::zeros_like(expected), expected);
    ASSERT_FALSE(at::isnan(expected).any().item<bool>());
    EXPECT_LE(gwt_test::max_abs_diff(gwt::threshold(x, value, mode), expected), 1e-15)
        << mode << " " << value;
  }
  EXPECT_THROW(gwt::threshold(at::ones({3}), -1.0), c10::Error);
  EXPECT_THROW(gwt::threshold(at::ones({3}), 1.0, "garrote-ish"), c10::Error);
}

}  // namespace
