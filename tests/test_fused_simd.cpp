// The fused CPU kernels' AVX2 bodies: the carried approximations, reduced precision as the
// float32 step rounded, bfloat16 and float16 conversions against c10's, and the finiteness check
// (the kernels against the reference: test_fused.cpp).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "fused_test_util.h"
#include "gwt/gwt.h"
#include "kernels/kernels.h"

#ifdef GWT_TEST_BF16_AVX2_PROBE
namespace gwt_test {
void bf16_round_avx2(const float* in, uint16_t* out, size_t n);  // tests/bf16_avx2_probe.cpp
void bf16_widen_avx2(const uint16_t* in, float* out, size_t n);
void f16_round_avx2(const float* in, uint16_t* out, size_t n);
void f16_widen_avx2(const uint16_t* in, float* out, size_t n);
}  // namespace gwt_test
#endif

namespace {

using gwt::WaveletAdamOptions;
using namespace gwt_test::fused;

// Whether environment variable `name` is set and not "0" (GWT_NO_AVX2, GWT_NO_ROWS8).
bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

#if defined(__x86_64__)
// Whether the CPU has F16C (CPUID leaf 1, ECX bit 29), which the kernels' float16 conversions use.
bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

// Whether the kernels run their AVX2 bodies here, as gwt::kernels decides (dispatch.h).
bool avx2_bodies_run() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c() &&
         !env_set("GWT_NO_AVX2");
#else
  return false;
#endif
}

// HaarAdamArgs::carry: the norm pass leaves each coefficient's approximation and denominator, and
// the update pass takes them instead of computing them again. Both are the same computation, so
// the step must be the same bits with and without it: float32, bfloat16 and float16 parameters
// (bfloat16 state for one), levels 1 to 3, 1-D and 2-D, shapes whose tiles end in the plain
// loops' tail. Where the AVX2 bodies run, a carry changed between the passes must change the
// step, or the update would not be reading it and the comparison would prove nothing.
TEST(Fused, CarriedApproximationsGiveTheSameBits) {
  namespace k = gwt::kernels;
  struct Case {
    at::ScalarType param, state;
  };
  auto kind_of = [](at::ScalarType t) {
    return t == at::kFloat  ? k::ScalarKind::f32
           : t == at::kHalf ? k::ScalarKind::f16
                            : k::ScalarKind::bf16;
  };
  int changed = 0, cases = 0;
  for (const Case c : {Case{at::kFloat, at::kFloat}, Case{at::kBFloat16, at::kFloat},
                       Case{at::kHalf, at::kFloat}, Case{at::kFloat, at::kBFloat16}})
    for (const int64_t level : {1, 2, 3})
      for (const bool two_d : {false, true})
        for (const std::vector<int64_t>& shape :
             {std::vector<int64_t>{16, 512}, {13, 1000}, {3, 4100}}) {
          const int64_t block = int64_t{1} << level, rows = shape[0], n = shape[1];
          const int64_t approx_len = (n + block - 1) / block;
          const int64_t state_rows = two_d ? (rows + block - 1) / block : rows;
          const at::Tensor g = at::randn(shape).to(c.param);
          // Three runs: no carry, a carry, a carry changed between the passes.
          std::vector<at::Tensor> p, m, v;
          std::vector<std::vector<float>> carry(3);
          std::vector<k::HaarAdamArgs> args(3);
          const at::Tensor p0 = at::randn(shape).to(c.param);
          const at::Tensor m0 = (at::randn({state_rows, approx_len}) * 0.1).to(c.state);
          const at::Tensor v0 = at::rand({state_rows, approx_len}).to(c.state);
          for (size_t r = 0; r < 3; ++r) {
            p.push_back(p0.clone()), m.push_back(m0.clone()), v.push_back(v0.clone());
            k::HaarAdamArgs& a = args[r];
            a.param = p[r].data_ptr(), a.grad = g.data_ptr();
            a.exp_avg = m[r].data_ptr(), a.exp_avg_sq = v[r].data_ptr();
            a.param_kind = kind_of(c.param), a.state_kind = kind_of(c.state);
            a.rows = rows, a.n = n, a.approx_len = approx_len, a.level = level;
            a.step_size = 1e-3, a.decay = 1e-4, a.two_d = two_d, a.height = two_d ? rows : 1;
            if (r > 0) {
              carry[r].assign(static_cast<size_t>(2 * state_rows * approx_len), 0.0f);
              a.carry = carry[r].data();
            }
          }
          const std::string what = c10::str(c.param, " params, ", c.state, " state, level ", level,
                                            two_d ? " 2-D " : " 1-D ", at::IntArrayRef(shape));
          for (int step = 0; step < 3; ++step) {
            double norms[3];
            for (size_t r = 0; r < 3; ++r) norms[r] = k::haar_adam_norm_sq_cpu(args[r]);
            EXPECT_EQ(norms[0], norms[1]) << what;
            for (float& x : carry[2]) x *= 1.5f;
            for (size_t r = 0; r < 3; ++r) k::haar_adam_update_cpu(args[r], 1.25);
          }
          EXPECT_TRUE(at::equal(p[0], p[1])) << what;
          EXPECT_TRUE(at::equal(m[0], m[1])) << what;
          EXPECT_TRUE(at::equal(v[0], v[1])) << what;
          changed += !at::equal(p[0], p[2]);
          ++cases;
        }
  // Every case has whole vector groups of coefficients, so the AVX2 bodies use the carry in all.
  if (avx2_bodies_run()) {
    EXPECT_EQ(changed, cases);
  } else {
    EXPECT_EQ(changed, 0);
  }
}

// The eight-lane body reads bfloat16 parameters, gradients and moments by widening them exactly and
// stores them by rounding the float it computed: its float operations are those of a float32 step
// on the same values, instruction for instruction. So one step from bfloat16 values (moments zero)
// must give the float32 step's result rounded, bit for bit: the parameters for bfloat16
// parameters, the moments for bfloat16 state (whose parameters must equal the float32 run's, the
// update using the moments before they are stored). Row counts are multiples of 8, so every row
// takes that body; a machine without it (no AVX2, or GWT_NO_AVX2 / GWT_NO_ROWS8 set) skips.
TEST(Fused, GeneralKernelRowGroupsInBFloat16AreTheFloat32StepRounded) {
  if (!avx2_bodies_run() || env_set("GWT_NO_ROWS8"))
    GTEST_SKIP() << "the eight-lane body does not run";
  for (const std::string wavelet : {"db2", "sym5"})
    for (const std::string boundary : {"zero", "symmetric", "periodization"})
      for (const std::vector<int64_t>& shape :
           {std::vector<int64_t>{8, 37}, {16, 100}, {24, 130}}) {
        const std::string what = wavelet + " " + boundary + " " + c10::str(at::IntArrayRef(shape));
        const auto o = base_options().wavelet(wavelet).boundary(boundary).level(2);
        // Values a bfloat16 holds exactly, of one magnitude (no flush to zero anywhere).
        const at::Tensor init = at::randn(shape, at::kDouble).to(at::kBFloat16).to(at::kDouble);
        const at::Tensor g = at::randn(shape, at::kDouble).to(at::kBFloat16).to(at::kDouble);
        OptRun f32 = make_run(init, at::kFloat, WaveletAdamOptions(o).fused(true));
        OptRun bf16 = make_run(init, at::kBFloat16, WaveletAdamOptions(o).fused(true));
        OptRun bf16_state =
            make_run(init, at::kFloat, WaveletAdamOptions(o).fused(true).state_dtype("bfloat16"));
        step(f32, g), step(bf16, g), step(bf16_state, g);
        EXPECT_TRUE(at::equal(bf16.param.detach(), f32.param.detach().to(at::kBFloat16))) << what;
        EXPECT_TRUE(at::equal(state_of(bf16).exp_avg(), state_of(f32).exp_avg())) << what;
        EXPECT_TRUE(at::equal(bf16_state.param.detach(), f32.param.detach())) << what;
        EXPECT_TRUE(
            at::equal(state_of(bf16_state).exp_avg(), state_of(f32).exp_avg().to(at::kBFloat16)))
            << what;
        EXPECT_TRUE(at::equal(state_of(bf16_state).exp_avg_sq(),
                              state_of(f32).exp_avg_sq().to(at::kBFloat16)))
            << what;
      }
}

// float16 as bfloat16 above: the AVX2 bodies widen float16 values exactly and round on store as
// c10::Half does (KernelSimd.HalfConversionsAreC10s), with float math, so one step from float16
// values (moments float32, zero) gives the float32 step's parameters rounded and the same moments,
// bit for bit, and so does the same gradient given in float32 (read as float32, exactly the same
// values): the Haar body (levels 1-3, 1-D and 2-D; lengths and heights multiples of 8 blocks,
// so no element takes the plain loops' tail) and the eight-row body (rows a multiple of 8). ATen's
// float-to-half cast rounds to nearest, ties to even, subnormals included, on every instruction
// set.
TEST(Fused, AvxBodiesInFloat16GiveTheFloat32StepRounded) {
  if (!avx2_bodies_run()) GTEST_SKIP() << "the AVX2 bodies do not run";
  struct Case {
    WaveletAdamOptions options;
    std::vector<int64_t> shape;
  };
  std::vector<Case> cases;
  for (int64_t level : {1, 2, 3}) {
    const int64_t span = 8 << level;  // 8 blocks of 2^level
    cases.push_back({base_options().level(level), {5, 2 * span}});
    cases.push_back({base_options().level(level).transform("2d"), {span, 2 * span}});
  }
  if (!env_set("GWT_NO_ROWS8"))
    for (const std::string wavelet : {"db2", "sym5"})
      for (const std::string boundary : {"zero", "symmetric", "periodization"})
        cases.push_back({base_options().wavelet(wavelet).boundary(boundary).level(2), {16, 100}});
  for (const auto& c : cases) {
    const std::string what = c.options.wavelet() + " L=" + std::to_string(c.options.level()) + " " +
                             c.options.transform() + " " + c.options.boundary();
    const at::Tensor init = at::randn(c.shape, at::kDouble).to(at::kHalf).to(at::kDouble);
    const at::Tensor g = at::randn(c.shape, at::kDouble).to(at::kHalf).to(at::kDouble);
    OptRun f32 = make_run(init, at::kFloat, WaveletAdamOptions(c.options).fused(true));
    OptRun f16 = make_run(init, at::kHalf, WaveletAdamOptions(c.options).fused(true));
    // The same float16 parameter with the same gradient in float32 (read as it is: grad_f32).
    OptRun f16_g32 = make_run(init, at::kHalf, WaveletAdamOptions(c.options).fused(true));
    ASSERT_TRUE(f16.opt->is_fused_param(f16.param)) << what;
    step(f32, g), step(f16, g);
    f16_g32.param.mutable_grad() = g.to(at::kFloat);
    f16_g32.opt->step();
    EXPECT_TRUE(at::equal(f16.param.detach(), f32.param.detach().to(at::kHalf))) << what;
    EXPECT_TRUE(at::equal(state_of(f16).exp_avg(), state_of(f32).exp_avg())) << what;
    EXPECT_TRUE(at::equal(state_of(f16).exp_avg_sq(), state_of(f32).exp_avg_sq())) << what;
    EXPECT_TRUE(at::equal(f16_g32.param.detach(), f16.param.detach())) << what << " grad_f32";
    EXPECT_TRUE(at::equal(state_of(f16_g32).exp_avg(), state_of(f16).exp_avg())) << what;
  }
}

#ifdef GWT_TEST_BF16_AVX2_PROBE
// Every 16-bit pattern, 0 to 0xFFFF: every bfloat16 or float16.
std::vector<uint16_t> every_16_bit_pattern() {
  std::vector<uint16_t> every(65536);
  for (uint32_t u = 0; u < 65536; ++u) every[u] = static_cast<uint16_t>(u);
  return every;
}

// The floats the conversion tests round: every upper half of a float's bits, each with the given
// lower halves and `random` pseudo-random ones (a fixed linear congruential sequence from seed).
std::vector<float> floats_by_upper_half(const std::vector<uint32_t>& lows, int random,
                                        uint32_t seed) {
  std::vector<float> floats;
  floats.reserve(65536 * (lows.size() + static_cast<size_t>(random)));
  auto push = [&floats](uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    floats.push_back(f);
  };
  for (uint32_t high = 0; high < 65536; ++high) {
    for (uint32_t low : lows) push(high << 16 | low);
    for (int k = 0; k < random; ++k) {
      seed = seed * 1664525u + 1013904223u;
      push(high << 16 | seed >> 16);
    }
  }
  return floats;
}
#endif

// The AVX2 Haar loops store bfloat16 parameters and moments through bf16_avx2.h's rounding, the
// plain loops (and the reference) through c10::BFloat16(float): the two must agree bit for bit on
// every float, or the same step would round differently by CPU. Every bfloat16 widens; every upper
// half of a float rounds with the lower halves that decide it (0, 1, just below the tie, the tie,
// just above, the largest) and 58 pseudo-random ones: 4.2M floats, every NaN and infinity pattern's
// upper half included.
TEST(KernelSimd, BFloat16ConversionsAreC10s) {
#ifndef GWT_TEST_BF16_AVX2_PROBE
  GTEST_SKIP() << "not an x86-64 build: no AVX2 conversions to check";
#else
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "this CPU has no AVX2";
  const std::vector<uint16_t> every = every_16_bit_pattern();
  std::vector<float> widened(every.size());
  gwt_test::bf16_widen_avx2(every.data(), widened.data(), every.size());
  int64_t widen_mismatches = 0;
  for (uint32_t u = 0; u < 65536; ++u) {
    const float expected = c10::BFloat16(every[u], c10::BFloat16::from_bits());
    widen_mismatches += std::memcmp(&expected, &widened[u], sizeof(float)) != 0;
  }
  EXPECT_EQ(widen_mismatches, 0);

  const std::vector<float> floats =
      floats_by_upper_half({0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF}, 58, 20261205);
  std::vector<uint16_t> rounded(floats.size());
  gwt_test::bf16_round_avx2(floats.data(), rounded.data(), floats.size());
  int64_t round_mismatches = 0;
  uint32_t first_mismatch = 0;
  for (size_t i = 0; i < floats.size(); ++i) {
    if (c10::BFloat16(floats[i]).x == rounded[i]) continue;
    if (round_mismatches++ == 0) std::memcpy(&first_mismatch, &floats[i], sizeof first_mismatch);
  }
  EXPECT_EQ(round_mismatches, 0) << "first at float bits 0x" << std::hex << first_mismatch;
#endif
}

// The same for float16 (f16_avx2.h: F16C's instructions, with c10's NaN), against c10::Half's
// conversions, which are software in this file's build. Every float16 widens. Floats:
// every upper half, each with the lower halves around every multiple of 0x1000 (below, at, above)
// and 16 pseudo-random ones. The rounding points (and ties) of normal-range results are multiples
// of 0x2000 in the lower half; those of subnormal results are multiples of 0x4000 or 0x8000 there,
// or lie in the upper half, which is enumerated with the lower halves 0, 1 and 0xFFFF among them.
// 4.2M floats. Where this file is compiled with F16C (-mf16c, -march=native), c10 converts with
// it, and a NaN keeps its payload there and becomes 0x7E00 in the kernels: NaNs then compare by
// being NaN with the same sign. Both round in the default rounding mode (to nearest), which
// nothing in torch or gwt changes.
TEST(KernelSimd, HalfConversionsAreC10s) {
#ifndef GWT_TEST_BF16_AVX2_PROBE
  GTEST_SKIP() << "not an x86-64 build: no AVX2 conversions to check";
#else
  if (!__builtin_cpu_supports("avx2") || !cpu_has_f16c())
    GTEST_SKIP() << "this CPU has no AVX2 or no F16C";
#ifdef __F16C__  // (c10's own C10_X86_F16 is undefined again at the end of its Half.h)
  constexpr bool c10_keeps_nan_payloads = true;
#else
  constexpr bool c10_keeps_nan_payloads = false;
#endif
  auto same_nan = [](uint32_t a, uint32_t b, uint32_t sign_bit, bool a_nan, bool b_nan) {
    return a_nan && b_nan && (a & sign_bit) == (b & sign_bit);
  };
  const std::vector<uint16_t> every = every_16_bit_pattern();
  std::vector<float> widened(every.size());
  gwt_test::f16_widen_avx2(every.data(), widened.data(), every.size());
  int64_t widen_mismatches = 0;
  for (uint32_t u = 0; u < 65536; ++u) {
    const float expected = c10::Half(every[u], c10::Half::from_bits());
    uint32_t e, w;
    std::memcpy(&e, &expected, sizeof e), std::memcpy(&w, &widened[u], sizeof w);
    if (e == w) continue;
    widen_mismatches +=
        !(c10_keeps_nan_payloads &&
          same_nan(e, w, 0x80000000u, std::isnan(expected), std::isnan(widened[u])));
  }
  EXPECT_EQ(widen_mismatches, 0);

  std::vector<uint32_t> around_points;  // below, at and above every multiple of 0x1000
  for (uint32_t point = 0; point < 0x10000; point += 0x1000)
    for (uint32_t low : {point - 1, point, point + 1}) around_points.push_back(low & 0xFFFF);
  const std::vector<float> floats = floats_by_upper_half(around_points, 16, 20261206);
  std::vector<uint16_t> rounded(floats.size());
  gwt_test::f16_round_avx2(floats.data(), rounded.data(), floats.size());
  int64_t round_mismatches = 0;
  uint32_t first_mismatch = 0;
  for (size_t i = 0; i < floats.size(); ++i) {
    const c10::Half expected(floats[i]);
    if (expected.x == rounded[i]) continue;
    const bool result_nan = (rounded[i] & 0x7C00) == 0x7C00 && (rounded[i] & 0x03FF) != 0;
    if (c10_keeps_nan_payloads && same_nan(expected.x, rounded[i], 0x8000u,
                                           std::isnan(static_cast<float>(expected)), result_nan))
      continue;
    if (round_mismatches++ == 0) std::memcpy(&first_mismatch, &floats[i], sizeof first_mismatch);
  }
  EXPECT_EQ(round_mismatches, 0) << "first at float bits 0x" << std::hex << first_mismatch;
#endif
}

// The finiteness check of the CPU kernels (gwt::kernels::all_finite_cpu: the step's check of the
// reference path's gradients and of GaLore's) against ATen's isfinite, in every dtype it reads:
// all finite (the most negative finite value, the smallest subnormal and -0 among them), then
// NaN of either sign, +Inf and -Inf alone at the first and last element, on both sides of the
// first chunk boundary and inside the third chunk (chunks of 65536 values are checked in
// parallel), in each of the 4 streams a chunk is read as (16384 values each in a whole chunk, 768
// in the last chunk of 200003) and in the tail after them, in lengths with and without a partial
// chunk or vector tail.
TEST(WaveletAdamKernels, AllFiniteFindsEveryNonFiniteValueInEveryDtype) {
  for (const auto dtype : {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16}) {
    const auto kind = dtype == at::kDouble  ? gwt::kernels::ScalarKind::f64
                      : dtype == at::kFloat ? gwt::kernels::ScalarKind::f32
                      : dtype == at::kHalf  ? gwt::kernels::ScalarKind::f16
                                            : gwt::kernels::ScalarKind::bf16;
    // The dtype's largest finite value and its smallest subnormal.
    const std::pair<double, double> extremes =
        dtype == at::kDouble  ? std::make_pair(std::numeric_limits<double>::max(),
                                               std::numeric_limits<double>::denorm_min())
        : dtype == at::kFloat ? std::make_pair(double{std::numeric_limits<float>::max()},
                                               double{std::numeric_limits<float>::denorm_min()})
        : dtype == at::kHalf
            ? std::make_pair(static_cast<double>(std::numeric_limits<c10::Half>::max()),
                             static_cast<double>(std::numeric_limits<c10::Half>::denorm_min()))
            : std::make_pair(static_cast<double>(std::numeric_limits<c10::BFloat16>::max()),
                             static_cast<double>(std::numeric_limits<c10::BFloat16>::denorm_min()));
    for (const int64_t n :
         {int64_t{1}, int64_t{7}, int64_t{65536}, int64_t{65537}, int64_t{200003}}) {
      at::Tensor x = at::randn({n}, at::kDouble).to(dtype);
      x[0] = -extremes.first;
      if (n > 2) x[1] = -0.0, x[2] = extremes.second;
      ASSERT_TRUE(at::isfinite(x).all().item<bool>());
      EXPECT_TRUE(gwt::kernels::all_finite_cpu(x.data_ptr(), n, kind)) << dtype << " n " << n;
      for (const double bad :
           {std::numeric_limits<double>::quiet_NaN(), -std::numeric_limits<double>::quiet_NaN(),
            std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()})
        for (const int64_t pos :
             {int64_t{0}, n - 1, int64_t{65535}, int64_t{65536}, int64_t{150001}, int64_t{163845},
              int64_t{180324}, int64_t{198922}}) {
          if (pos >= n) continue;
          at::Tensor y = x.clone();
          y[pos] = bad;
          ASSERT_FALSE(at::isfinite(y).all().item<bool>());
          EXPECT_FALSE(gwt::kernels::all_finite_cpu(y.data_ptr(), n, kind))
              << dtype << " n " << n << " " << bad << " at " << pos;
        }
    }
  }
}

}  // namespace
