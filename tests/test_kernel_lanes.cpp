// The CUDA kernels' shared bodies (src/kernels/shared/wavelet_row.h, src/kernels/shared/haar_block.h) run on the
// host with several lanes: one std::thread per lane and a barrier for Lanes::sync(), so the
// barriers and the lanes' shares of the work are exercised, not only the arithmetic
// (tests/test_fused.cpp's KernelRows tests run one lane). Everything is float64 and compared with
// the ATen reference (fused(false)) to 1e-10, on gradients of one sign per matrix (below); each
// case runs twice and must give the same bits, since a race (a lane reading scratch another lane
// has not finished writing, or has already overwritten) shows as a wrong or a varying result.
//
// Also here: the fixed-order sum of the CUDA norm passes' per-block partials (row::tree_sum), the
// run-time check that a CUDA device has a kernel image (kernels::cuda_kernels_run_on), and, where
// a GPU is present, the CUDA norm pass's bit-reproducibility with hundreds of blocks.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/shared/haar_block.h"
#include "kernels/shared/wavelet_row.h"
#include "gwt/gwt.h"
#include "kernels/kernels.h"
#include "test_util.h"

namespace {

namespace k = gwt::kernels;
using gwt::WaveletAdam;
using gwt::WaveletAdamOptions;

// ---------------------------------------------------------------------------------------------
// Lanes on threads
// ---------------------------------------------------------------------------------------------

// A reusable barrier for `count` threads (C++17 has no std::barrier). A wait that lasts more than
// a minute means the lanes disagree on the number of barriers (a body's bug): the barrier then
// breaks, every wait returns at once, and the test fails instead of hanging.
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (broken_) return;
    const int64_t generation = generation_;
    if (++waiting_ == count_) {
      waiting_ = 0;
      ++generation_;
      changed_.notify_all();
      return;
    }
    if (!changed_.wait_for(lock, std::chrono::seconds(60),
                           [&] { return generation_ != generation || broken_; })) {
      broken_ = true;
      changed_.notify_all();
    }
  }
  bool broken() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return broken_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  const int count_;
  int waiting_ = 0;
  int64_t generation_ = 0;
  bool broken_ = false;
};

// The Lanes of the bodies, one per thread. Every few calls of lanes() (each loop step of a body
// asks it) the thread yields, so that the lanes interleave at many more points than the
// scheduler alone would make them; a missing barrier then shows far more often.
class ThreadLanes {
 public:
  ThreadLanes(int64_t lane, int64_t lanes, Barrier& barrier)
      : lane_(lane), lanes_(lanes), barrier_(&barrier) {}
  int64_t lane() const { return lane_; }
  int64_t lanes() const {
    if (++calls_ % 3 == lane_ % 3) std::this_thread::yield();
    return lanes_;
  }
  void sync() const { barrier_->wait(); }

 private:
  int64_t lane_, lanes_;
  Barrier* barrier_;
  mutable int64_t calls_ = 0;
};

// Runs body(block, lanes) on blocks x lanes threads: the lanes of one block share a barrier, as a
// CUDA block's threads share __syncthreads(). Fails the test if a barrier broke.
void run_blocks(int blocks, int lanes, const std::function<void(int, const ThreadLanes&)>& body) {
  std::vector<std::unique_ptr<Barrier>> barriers;
  for (int b = 0; b < blocks; ++b) barriers.push_back(std::make_unique<Barrier>(lanes));
  std::vector<std::thread> threads;
  for (int b = 0; b < blocks; ++b)
    for (int l = 0; l < lanes; ++l)
      threads.emplace_back([&, b, l] { body(b, ThreadLanes(l, lanes, *barriers[b])); });
  for (auto& t : threads) t.join();
  for (const auto& barrier : barriers)
    EXPECT_FALSE(barrier->broken()) << "a barrier timed out: the lanes disagree on the barriers";
}

// ---------------------------------------------------------------------------------------------
// The fixed-order sum of per-block partials
// ---------------------------------------------------------------------------------------------

// The pairwise sum written the other way round, recursively from the top: the sum of a range of
// `size` (a power of two) from lo is the sum of its two halves, a half past the end is absent.
double pairwise(const std::vector<double>& x, int64_t lo, int64_t size) {
  if (size == 1) return x[lo];
  const int64_t half = size / 2;
  if (lo + half >= static_cast<int64_t>(x.size())) return pairwise(x, lo, half);
  return pairwise(x, lo, half) + pairwise(x, lo + half, half);
}

double pairwise(const std::vector<double>& x) {
  if (x.empty()) return 0;
  int64_t size = 1;
  while (size < static_cast<int64_t>(x.size())) size *= 2;
  return pairwise(x, 0, size);
}

bool same_bits(double a, double b) {
  return std::memcmp(&a, &b, sizeof(double)) == 0;
}

TEST(KernelLanes, TreeSumAddsInOneOrderWhateverTheNumberOfLanes) {
  // Values of magnitudes from 1e-8 to 1e8 and both signs: the order of the additions changes the
  // rounded sum, so a different order cannot give the same bits by chance (checked below).
  at::manual_seed(40);
  int order_sensitive = 0;
  for (int64_t count : {1, 2, 3, 5, 8, 9, 31, 255, 256, 257, 1000, 4099}) {
    const at::Tensor values =
        at::randn({count}, at::kDouble) * at::pow(10.0, at::rand({count}, at::kDouble) * 16 - 8);
    const std::vector<double> x(values.data_ptr<double>(), values.data_ptr<double>() + count);
    const double expected = pairwise(x);
    double in_order = 0;
    for (double value : x) in_order += value;
    order_sensitive += !same_bits(in_order, expected);
    // Within the pairwise sum's error bound of the exact sum (long double is exact enough here).
    long double exact = 0, magnitude = 0;
    for (double value : x) exact += value, magnitude += std::fabs(value);
    EXPECT_LE(std::fabs(static_cast<double>(exact - expected)),
              static_cast<double>(magnitude) * 1e-15 * std::ceil(std::log2(count + 1.0)));
    for (int lanes : {1, 2, 3, 8, 32}) {
      SCOPED_TRACE("count " + std::to_string(count) + " lanes " + std::to_string(lanes));
      std::vector<double> scratch = x;
      std::vector<double> got(lanes);
      run_blocks(1, lanes, [&](int, const ThreadLanes& l) {
        got[l.lane()] = k::row::tree_sum(l, scratch.data(), count);
      });
      for (int l = 0; l < lanes; ++l)
        EXPECT_TRUE(same_bits(got[l], expected))
            << "lane " << l << ": " << got[l] << " against " << expected;
    }
  }
  // The data tells orders apart: adding in index order gives other bits for most counts.
  EXPECT_GE(order_sensitive, 6);
  std::vector<double> none;
  EXPECT_EQ(k::row::tree_sum(k::row::HostLanes{}, none.data(), 0), 0.0);
}

// ---------------------------------------------------------------------------------------------
// Emulated fused steps, float64, with several lanes
// ---------------------------------------------------------------------------------------------

WaveletAdamOptions base_options() {
  return WaveletAdamOptions(0.02).weight_decay(0.1).scale(0.5).wavelet("haar");
}

// Gradients that keep their direction (a fixed part plus noise) and grow: the Adam-normalised
// moments then grow from step to step (m accumulates faster than sqrt(v)), so the norm-growth
// limiter acts and its value depends on the norm pass's sum. Every matrix has one sign (the fixed
// part's magnitudes lie in [0.5, 1.5), the noise within +-0.15): on random signs a block or
// filter sum can nearly cancel, the step divides by it, and 1e-10 would rest on how the emulated
// body and the ATen reference round that sum (the reference's rounding differs between
// instruction sets). With one sign only zero mode's edge coefficients take partial tap sums of
// both signs.
std::vector<at::Tensor> gradients(at::IntArrayRef shape, int steps, int64_t seed) {
  at::manual_seed(seed);
  std::vector<int64_t> sign_shape = shape.vec();
  sign_shape.back() = 1;
  if (sign_shape.size() >= 2) sign_shape[sign_shape.size() - 2] = 1;
  const at::Tensor sign = at::where(at::rand(sign_shape, at::kDouble) < 0.5, -1.0, 1.0);
  const at::Tensor direction = sign * (at::rand(shape, at::kDouble) + 0.5);
  std::vector<at::Tensor> out;
  for (int t = 0; t < steps; ++t)
    out.push_back((direction + sign * 0.3 * (at::rand(shape, at::kDouble) - 0.5)) * (1 + 2 * t));
  return out;
}

double rel_error(const at::Tensor& a, const at::Tensor& b) {
  return gwt_test::max_abs_diff(a, b) / b.abs().max().item<double>();
}

// One parameter's trajectory through the reference optimizer (float64, fused(false)).
struct Reference {
  std::vector<at::Tensor> params;  // after each step
  std::vector<int64_t> kept;       // kept details after each step (threshold only)
};

Reference reference_run(const at::Tensor& init, const WaveletAdamOptions& o,
                        const std::vector<at::Tensor>& grads) {
  at::Tensor p = init.clone().requires_grad_(true);
  WaveletAdam opt({p}, WaveletAdamOptions(o).fused(false));
  Reference r;
  for (const auto& g : grads) {
    p.mutable_grad() = g;
    opt.step();
    r.params.push_back(p.detach().clone());
    r.kept.push_back(opt.kept_details().first);
  }
  return r;
}

// The emulated optimizer state of one parameter, float64.
struct Emulated {
  at::Tensor p, m, v;
  bool have_norm = false;
  double norm = 0;
  int64_t kept = 0;
  bool limited = false;  // the limiter's value was above 1 at some step

  // The limiter (docs/algorithm.md#the-norm-growth-limiter) from this step's sum of squares.
  double limiter(double norm_sq, const WaveletAdamOptions& o) {
    const double now = std::sqrt(norm_sq), gamma = o.norm_growth_limit();
    if (gamma <= 0) return 1;
    if (!have_norm) {
      have_norm = true, norm = now;
      return 1;
    }
    const double lim = std::max(now / (norm + 1e-8), gamma) / gamma;
    norm = now / lim;
    limited = limited || lim > 1;
    return lim;
  }

  static void fill_args(k::HaarAdamArgs& a, int64_t rows, int64_t n, int64_t approx_len,
                        const WaveletAdamOptions& o, int64_t t) {
    a.param_kind = a.state_kind = k::ScalarKind::f64;
    a.math_f64 = true;
    a.n = n, a.rows = rows, a.approx_len = approx_len, a.level = o.level();
    std::tie(a.beta1, a.beta2) = o.betas();
    a.eps = o.eps();
    a.step_size =
        o.lr() * std::sqrt(1 - std::pow(a.beta2, t)) / (1 - std::pow(a.beta1, t)) * o.scale();
    a.decay = o.lr() * o.weight_decay();
  }

  // One step of the general kernel as cuda/wavelet_adam.cu runs it: `blocks` blocks of `lanes`
  // lanes, block b taking rows b, b + blocks, ..., each block with its own scratch (its shared
  // memory). The norm: each lane's rows in order, then the lanes' sums and the blocks' sums in a
  // fixed order; then the limiter and the update pass.
  void general_step(const at::Tensor& g, const WaveletAdamOptions& o, int64_t t, int blocks,
                    int lanes) {
    const gwt::Wavelet wavelet(o.wavelet());
    const auto mode = gwt::boundary_mode_from_string(o.boundary());
    const int64_t n = p.size(-1), rows = p.numel() / n;
    const int64_t approx_len = gwt::approx_len(n, wavelet, o.level(), mode);
    if (!m.defined()) m = at::zeros({rows, approx_len}, at::kDouble), v = at::zeros_like(m);
    k::WaveletAdamArgs a;
    fill_args(a, rows, n, approx_len, o, t);
    a.dec_lo = wavelet.dec_lo().data(), a.dec_hi = wavelet.dec_hi().data();
    a.filter_length = wavelet.length(), a.boundary = mode;
    a.coeff_len = k::wavelet_workspace_len(n, wavelet.length(), o.level(), mode);
    a.threshold = o.threshold(), a.threshold_soft = o.threshold_mode() == "soft";
    const auto f = k::row::make_row_plan<double>(a);
    struct Shared {
      std::vector<double> w, buf0, buf1, den;
    };
    std::vector<Shared> shared(blocks);
    for (auto& s : shared)
      s.w.resize(a.coeff_len), s.buf0.resize(f.buffer_len), s.buf1.resize(f.buffer_len),
          s.den.resize(approx_len);
    const double* gp = g.data_ptr<double>();
    double *pp = p.data_ptr<double>(), *mp = m.data_ptr<double>(), *vp = v.data_ptr<double>();
    std::vector<double> sums(blocks * lanes);
    run_blocks(blocks, lanes, [&](int b, const ThreadLanes& l) {
      Shared& s = shared[b];
      double sum = 0;
      for (int64_t r = b; r < rows; r += blocks)
        sum += k::row::row_norm_sq<double, double, double>(l, f, gp + r * n, mp + r * approx_len,
                                                           vp + r * approx_len, s.w.data(),
                                                           s.buf0.data(), s.buf1.data());
      sums[b * lanes + l.lane()] = sum;
    });
    const double lim =
        limiter(k::row::tree_sum(k::row::HostLanes{}, sums.data(), blocks * lanes), o);
    std::vector<int64_t> kept_by(blocks * lanes);
    run_blocks(blocks, lanes, [&](int b, const ThreadLanes& l) {
      Shared& s = shared[b];
      int64_t kept_here = 0;
      for (int64_t r = b; r < rows; r += blocks) {
        k::row::row_dwt<double, double>(l, f, gp + r * n, s.w.data(), s.buf0.data(), s.buf1.data());
        kept_here += k::row::row_update<double, double, double>(
            l, f, lim, pp + r * n, mp + r * approx_len, vp + r * approx_len, s.w.data(),
            s.buf0.data(), s.buf1.data(), s.den.data());
      }
      kept_by[b * lanes + l.lane()] = kept_here;
    });
    kept = 0;
    for (int64_t c : kept_by) kept += c;
  }

  // One step of the Haar kernel as cuda/haar_adam.cu runs it, on `threads` threads in all: thread
  // i takes coefficients i, i + threads, ... (the grid-stride loop); every coefficient's update
  // writes only its own block, so the threads share nothing but the inputs.
  template <int B>
  void haar_step(const at::Tensor& g, const WaveletAdamOptions& o, int64_t t, int threads) {
    namespace hb = k::haar_block;
    const int64_t n = p.size(-1), rows = p.numel() / n, approx_len = (n + B - 1) / B;
    k::HaarAdamArgs a;
    fill_args(a, rows, n, approx_len, o, t);
    a.two_d = o.transform() == "2d";
    if (a.two_d) a.height = p.size(-2);
    const hb::Scalars s = hb::scalars_of(a);
    if (!m.defined()) m = at::zeros({s.state_rows, approx_len}, at::kDouble), v = at::zeros_like(m);
    const double* gp = g.data_ptr<double>();
    double *pp = p.data_ptr<double>(), *mp = m.data_ptr<double>(), *vp = v.data_ptr<double>();
    const int64_t total = hb::coefficients(s);
    std::vector<double> partials(threads);
    run_blocks(1, threads, [&](int, const ThreadLanes& l) {
      double sum = 0;
      for (int64_t c = l.lane(); c < total; c += l.lanes())
        sum += hb::norm_term<double, double, double, B>(gp, mp, vp, s, c, false);
      partials[l.lane()] = sum;
    });
    const double lim = limiter(k::row::tree_sum(k::row::HostLanes{}, partials.data(), threads), o);
    run_blocks(1, threads, [&](int, const ThreadLanes& l) {
      for (int64_t c = l.lane(); c < total; c += l.lanes())
        hb::update<double, double, double, B>(pp, gp, mp, vp, s, lim, c, false);
    });
  }
};

// Runs `steps` emulated steps from init with step_fn, checking every step against the reference;
// returns the final state (p, m, v) for the run-twice comparison.
std::vector<at::Tensor> emulate_and_check(
    const at::Tensor& init, const Reference& reference, const std::vector<at::Tensor>& grads,
    const std::function<void(Emulated&, const at::Tensor&, int64_t)>& step_fn, bool check_kept) {
  Emulated e;
  e.p = init.clone();
  for (size_t t = 0; t < grads.size(); ++t) {
    step_fn(e, grads[t], static_cast<int64_t>(t) + 1);
    EXPECT_LE(rel_error(e.p, reference.params[t]), 1e-10) << "step " << t + 1;
    if (check_kept) {
      EXPECT_EQ(e.kept, reference.kept[t]) << "step " << t + 1;
    }
  }
  // The limiter acted, so the lanes' sum of squares went into the result.
  EXPECT_TRUE(e.limited);
  return {e.p, e.m, e.v};
}

void expect_same_bits(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(at::equal(a[i], b[i])) << "tensor " << i << " differs between two runs";
}

TEST(KernelLanes, RowBodiesWithSeveralLanesMatchTheReferenceInFloat64) {
  // Rows of 41 (fewer outputs per level than 32 lanes at deeper levels, so some lanes idle) and
  // of 150; 3 rows on one or two blocks (two: each block's rows, scratch and barrier its own).
  for (const std::string wavelet : {"db2", "sym3", "coif1", "haar"})
    for (const std::string boundary : {"zero", "periodization", "symmetric"})
      for (int64_t level : {1, 2, 3})
        for (double threshold : {0.0, 0.4}) {
          const std::vector<int64_t> shape = {3, level == 2 ? 150 : 41};
          const auto o = base_options()
                             .wavelet(wavelet)
                             .boundary(boundary)
                             .level(level)
                             .threshold(threshold)
                             .threshold_mode(level == 2 ? "hard" : "soft");
          at::manual_seed(41);
          const at::Tensor init = at::randn(shape, at::kDouble);
          const auto grads = gradients(shape, 4, 42);
          const Reference reference = reference_run(init, o, grads);
          // 32 lanes (the slowest on a small machine: a barrier wakes 31 threads) for one wavelet,
          // in every mode, level and threshold.
          std::vector<int> lane_counts = {2, 3, 8};
          if (wavelet == "sym3") lane_counts.push_back(32);
          for (int lanes : lane_counts) {
            const int blocks = lanes == 3 ? 2 : 1;
            SCOPED_TRACE(wavelet + " " + boundary + " level " + std::to_string(level) +
                         " threshold " + std::to_string(threshold) + " " + std::to_string(blocks) +
                         " block(s) of " + std::to_string(lanes) + " lanes");
            auto step_fn = [&](Emulated& e, const at::Tensor& g, int64_t t) {
              e.general_step(g, o, t, blocks, lanes);
            };
            const auto first = emulate_and_check(init, reference, grads, step_fn, threshold > 0);
            const auto second = emulate_and_check(init, reference, grads, step_fn, threshold > 0);
            expect_same_bits(first, second);
          }
        }
}

TEST(KernelLanes, HaarBlockBodiesOnSeveralThreadsMatchTheReferenceInFloat64) {
  for (const std::string transform : {"1d", "2d"})
    for (const auto& shape : std::vector<std::vector<int64_t>>{{5, 37}, {3, 11, 33}, {16, 64}})
      for (int64_t level : {1, 2, 3}) {
        const auto o = base_options().level(level).transform(transform);
        at::manual_seed(43);
        const at::Tensor init = at::randn(shape, at::kDouble);
        {
          at::Tensor probe = init.clone().requires_grad_(true);
          if (!WaveletAdam({probe}, o).is_wavelet_param(probe)) continue;  // 2-D, 5 rows < 2^3
        }
        const auto grads = gradients(shape, 4, 44);
        const Reference reference = reference_run(init, o, grads);
        for (int threads : {2, 3, 8, 32}) {
          SCOPED_TRACE(transform + " shape " + c10::str(at::IntArrayRef(shape)) + " level " +
                       std::to_string(level) + " threads " + std::to_string(threads));
          auto step_fn = [&](Emulated& e, const at::Tensor& g, int64_t t) {
            if (level == 1) e.haar_step<2>(g, o, t, threads);
            if (level == 2) e.haar_step<4>(g, o, t, threads);
            if (level == 3) e.haar_step<8>(g, o, t, threads);
          };
          const auto first = emulate_and_check(init, reference, grads, step_fn, false);
          const auto second = emulate_and_check(init, reference, grads, step_fn, false);
          expect_same_bits(first, second);
        }
      }
}

// ---------------------------------------------------------------------------------------------
// The run-time check for a kernel image
// ---------------------------------------------------------------------------------------------

TEST(KernelImage, NoDeviceMeansNoAndCpuParametersNeverAsk) {
  EXPECT_FALSE(k::cuda_kernels_run_on(-1));
  EXPECT_FALSE(k::cuda_kernels_run_on(1 << 20));
  if (!k::built_with_cuda()) {
    EXPECT_FALSE(k::cuda_kernels_run_on(0));
  }
  if (!at::hasCUDA()) {
    // Asked twice (the second answer comes from the cache): still no, and no error left behind.
    EXPECT_FALSE(k::cuda_kernels_run_on(0));
    EXPECT_FALSE(k::cuda_kernels_run_on(0));
    // Here the answer is no for every device, so a CPU parameter that asked would lose the fused
    // path: it keeps it.
    at::Tensor p = at::randn({8, 64}, at::kFloat).requires_grad_(true);
    WaveletAdam opt({p}, base_options());
    EXPECT_TRUE(opt.is_fused_param(p));
    p.mutable_grad() = at::randn({8, 64});
    opt.step();
    EXPECT_TRUE(opt.is_fused_param(p));
  }
}

TEST(CudaDeterminism, TheDeviceTheTestsRunOnHasAKernelImage) {
  if (!at::hasCUDA())
    GTEST_SKIP() << "no CUDA device on this machine: the CUDA kernels were only compiled";
  ASSERT_TRUE(k::built_with_cuda());
  EXPECT_TRUE(k::cuda_kernels_run_on(0));
  at::Tensor p = at::randn({8, 64}, at::TensorOptions().device(at::kCUDA)).requires_grad_(true);
  EXPECT_TRUE(WaveletAdam({p}, base_options()).is_fused_param(p));
}

// ---------------------------------------------------------------------------------------------
// CUDA: the norm pass with many blocks gives the same bits on every run, and on resume
// ---------------------------------------------------------------------------------------------

TEST(CudaDeterminism, ManyBlocksWithTheLimiterActingGiveTheSameBitsOnEveryRunAndOnResume) {
  if (!at::hasCUDA())
    GTEST_SKIP() << "no CUDA device on this machine: the CUDA kernels were only compiled";
  // [2048, 1024] float32: the Haar kernel's norm pass has 2048 blocks (256 coefficients each at
  // level 2), the general kernel's one block per row, 2048. A float atomicAdd of the block sums
  // (the old norm pass) adds them in the order the blocks finish, which varies from run to run.
  const std::vector<int64_t> shape = {2048, 1024};
  at::manual_seed(45);
  const at::Tensor init = at::randn(shape, at::kDouble).to(at::kFloat);
  const auto grads = gradients(shape, 6, 46);
  for (const std::string wavelet : {"haar", "db2"})
    for (double gamma : {1.01, 0.0}) {
      SCOPED_TRACE(wavelet + " gamma " + std::to_string(gamma));
      const auto o = base_options().wavelet(wavelet).level(2).norm_growth_limit(gamma);
      auto run = [&](bool resume) {
        at::Tensor p = init.cuda().requires_grad_(true);
        auto opt = std::make_unique<WaveletAdam>(std::vector<at::Tensor>{p}, o);
        EXPECT_TRUE(opt->is_fused_param(p));
        for (size_t t = 0; t < grads.size(); ++t) {
          if (resume && t == 3) {
            const std::string path =
                ::testing::TempDir() + "gwt_lanes_" + std::to_string(::getpid()) + ".pt";
            torch::save(*opt, path);
            opt = std::make_unique<WaveletAdam>(std::vector<at::Tensor>{p}, o);
            torch::load(*opt, path);
            std::remove(path.c_str());
          }
          p.mutable_grad() = grads[t].to(at::kFloat).cuda();
          opt->step();
        }
        return p.detach().cpu();
      };
      const at::Tensor first = run(false);
      EXPECT_TRUE(at::equal(first, run(false))) << "two runs differ";
      EXPECT_TRUE(at::equal(first, run(true))) << "resume differs from the straight run";
      EXPECT_TRUE(first.isfinite().all().item<bool>());
    }
  // The limiter acted in these runs (else the check above would not involve the norm's bits).
  auto final_param = [&](double gamma) {
    at::Tensor p = init.cuda().requires_grad_(true);
    WaveletAdam opt({p}, base_options().level(2).norm_growth_limit(gamma));
    for (const auto& g : grads) {
      p.mutable_grad() = g.to(at::kFloat).cuda();
      opt.step();
    }
    return p.detach().cpu();
  };
  EXPECT_FALSE(at::equal(final_param(1.01), final_param(0.0)));
}

}  // namespace
