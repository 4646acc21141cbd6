// gwt::distributed on loopback Gloo (issue 14). Each test spawns its ranks as processes of this
// executable (fork + exec of /proc/self/exe with RANK, WORLD_SIZE and a scenario name in the
// environment); the ranks meet through a FileStore in a fresh directory, or a TCPStore on
// 127.0.0.1, and write what they computed there. The parent compares with one process stepping
// on the whole batch. Every rank's wait is bounded (GWT_DIST_TIMEOUT_S), and the parent kills any
// rank still alive after its deadline, so a test fails instead of hanging.
//
// Tolerances. The model is float64. A rank's gradient is the sum over its rows; the average over
// ranks adds those sums in another order than one process does, so the averaged gradient differs
// from the single-process one by a few ulps (relative ~1e-15). How far that carries is the
// problem's conditioning, so the problem is chosen well-conditioned: GWT divides the detail
// coefficients by sqrt(v) + eps of the approximation band, and with eps = 1e-6 an approximation
// coefficient near zero gives a gain of ~1e9 over 20 steps (measured: perturbing every gradient by
// a relative 1e-15 moved the result by 4.5e-7, and the parameters by 19 from their start). With
// eps = 1e-3 (the gradients are up to 7e-3, so Adam's normalisation still acts) the same
// perturbation moved the result by 2e-16, the parameters moving 0.11. 1e-9 therefore leaves six
// orders of magnitude, and a real error (a missed rank, a wrong divisor, a skipped or doubled
// update) moves values by at least lr * 1e-3 = 1e-5.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <gwt/distributed.h>
#include <gwt/optim/wavelet_adam.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dist_test_util.h"

using namespace gwt_test::dist;

namespace {

// ------------------------------------------------------------------------------------------------
// The parent's side
// ------------------------------------------------------------------------------------------------

struct Spawn {
  std::string scenario;
  int64_t world = 2;
  bool tcp = false;         // a TCPStore on 127.0.0.1 (else a FileStore in the directory)
  double timeout_s = 60;    // every collective's bound (GWT_DIST_TIMEOUT_S)
  double deadline_s = 240;  // the parent kills what is still running after this
};

int free_port() {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  const bool ok = s >= 0 && bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  if (s >= 0) close(s);
  return ok ? ntohs(a.sin_port) : 0;
}

// Runs the ranks and returns their exit codes (-1: killed at the deadline, or a signal).
std::vector<int> spawn(const Spawn& sp, const std::string& d) {
  std::vector<std::string> common;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string v = *e;
    bool ours = false;
    for (const char* k : {"RANK=", "WORLD_SIZE=", "MASTER_ADDR=", "MASTER_PORT=", "GWT_STORE_FILE=",
                          "GWT_DIST_", "OMP_NUM_THREADS="})
      ours = ours || v.rfind(k, 0) == 0;
    if (!ours) common.push_back(v);
  }
  common.push_back("WORLD_SIZE=" + std::to_string(sp.world));
  common.push_back("GWT_DIST_SCENARIO=" + sp.scenario);
  common.push_back("GWT_DIST_DIR=" + d);
  common.push_back("GWT_DIST_TIMEOUT_S=" + std::to_string(sp.timeout_s));
  common.push_back("OMP_NUM_THREADS=1");
  if (sp.tcp) {
    const int port = free_port();
    EXPECT_GT(port, 0) << "no free port on 127.0.0.1";
    common.push_back("MASTER_ADDR=127.0.0.1");
    common.push_back("MASTER_PORT=" + std::to_string(port));
  } else {
    common.push_back("GWT_STORE_FILE=" + d + "/store");
  }
  std::vector<pid_t> pids;
  for (int64_t r = 0; r < sp.world; ++r) {
    std::vector<std::string> env = common;
    env.push_back("RANK=" + std::to_string(r));
    std::vector<char*> envp;
    for (auto& v : env) envp.push_back(v.data());
    envp.push_back(nullptr);
    char self[] = "/proc/self/exe";
    char* argv[] = {self, nullptr};
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      execve(self, argv, envp.data());
      _exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<int> codes(pids.size(), -1);
  std::vector<bool> done(pids.size(), false);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(sp.deadline_s * 1000));
  size_t left = pids.size();
  while (left > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      const pid_t r = waitpid(pids[i], &status, WNOHANG);
      if (r == pids[i] || r < 0) {
        done[i] = true, --left;
        codes[i] = r > 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << sp.scenario << ": ranks still running after " << sp.deadline_s
                    << " s; killed";
      for (size_t i = 0; i < pids.size(); ++i)
        if (!done[i]) kill(pids[i], SIGKILL), waitpid(pids[i], nullptr, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return codes;
}

void expect_all_zero(const std::vector<int>& codes, const std::string& what) {
  for (size_t r = 0; r < codes.size(); ++r)
    EXPECT_EQ(codes[r], 0) << what << ": rank " << r << " failed (its message is above)";
}

// Runs `scenario` on `world` ranks in a fresh directory; returns the directory, or "" when a rank
// failed (a test failure is recorded then).
std::string run_in_fresh_dir(const std::string& scenario, int64_t world) {
  const std::string d = fresh_dir(scenario);
  Spawn sp;
  sp.scenario = scenario, sp.world = world;
  const auto codes = spawn(sp, d);
  expect_all_zero(codes, scenario);
  for (const int code : codes)
    if (code != 0) return "";
  return d;
}

// The single-process run on the whole batch.
std::vector<at::Tensor> single(int64_t nan_step = -1, const std::string& kind = "") {
  Problem p = make_problem();
  gwt::WaveletAdam opt(p.params, options(kind));
  TrainingRun run;
  run.nan_step = nan_step, run.nan_rank = 0;
  train(p, opt, run, 0, kSteps);
  return values(p);
}

void check_against_single(const std::string& scenario, int64_t world, bool tcp) {
  const std::string d = fresh_dir(scenario + std::to_string(world));
  Spawn sp;
  sp.scenario = scenario, sp.world = world, sp.tcp = tcp;
  const auto codes = spawn(sp, d);
  expect_all_zero(codes, scenario);
  if (::testing::Test::HasFailure()) return;
  const bool nonfinite = scenario.rfind("nonfinite", 0) == 0 || scenario.rfind("skipparam", 0) == 0;
  const std::vector<at::Tensor> want = single(nonfinite ? 2 : -1, scenario);
  Problem p = make_problem();
  gwt::WaveletAdam whole(p.params, options());
  const std::vector<at::Tensor> first = load_values(d, rank_file("params", 0));
  int64_t state_sum = 0;
  for (int64_t r = 0; r < world; ++r) {
    const auto got = load_values(d, rank_file("params", r));
    EXPECT_LT(max_diff(got, want), 1e-9) << scenario << " rank " << r << " vs one process";
    // The averaged gradient is the same on every rank, so is each update (the sharded optimizer
    // broadcasts its owners' values: bit-identical by construction).
    if (scenario.find("sharded") != std::string::npos)
      EXPECT_TRUE(bit_equal(got, first)) << "rank " << r << " differs from rank 0";
    else
      EXPECT_LT(max_diff(got, first), 1e-12) << "rank " << r << " differs from rank 0";
    std::istringstream counts(read_text(d, rank_file("counts", r)));
    int64_t skipped = -1, state = -1;
    counts >> skipped >> state;
    EXPECT_EQ(skipped, nonfinite ? 1 : 0) << scenario << " rank " << r << " skipped steps";
    state_sum += state;
    if (scenario.find("sharded") != std::string::npos) {
      // The single run's state bytes, counted after one step of the whole problem.
      static int64_t total = [] {
        Problem q = make_problem();
        gwt::WaveletAdam o(q.params, options());
        train(q, o, TrainingRun{}, 0, 1);
        return o.state_bytes();
      }();
      EXPECT_LE(state, total / world + total / 20)
          << "rank " << r << " holds " << state << " of " << total << " state bytes";
      EXPECT_GT(state, 0);
      if (r + 1 == world) {
        EXPECT_EQ(state_sum, total) << "the shards do not add up to the whole";
      }
    }
  }
  fs::remove_all(d);
}

TEST(Distributed, AllReduceTwoRanksTcpMatchesOneProcess) {
  check_against_single("allreduce", 2, true);
}
TEST(Distributed, AllReduceThreeRanksMatchesOneProcess) {
  check_against_single("allreduce", 3, false);
}
TEST(Distributed, ShardedTwoRanksMatchesOneProcess) {
  check_against_single("sharded", 2, true);
}
TEST(Distributed, ShardedThreeRanksMatchesOneProcess) {
  check_against_single("sharded", 3, false);
}
TEST(Distributed, NonFiniteGradientOnOneRankSkipsEveryRank) {
  check_against_single("nonfinite_allreduce", 2, false);
  check_against_single("nonfinite_sharded", 3, false);
}

// nonfinite("skip_param") is honoured: the parameter with the NaN keeps its value and state on its
// owner, the others step (a whole-step skip would differ from one process by every other update).
TEST(Distributed, ShardedSkipParamSkipsOnlyThatParameter) {
  check_against_single("skipparam_sharded", 3, false);
}

TEST(Distributed, ShardedErrorOnOneRankChangesNothingOnAnyRank) {
  const std::string d = run_in_fresh_dir("bad_grad", 2);
  if (d.empty()) return;
  const std::vector<at::Tensor> want = single();
  for (int64_t r = 0; r < 2; ++r) {
    const std::string message = read_text(d, rank_file("error", r));
    EXPECT_NE(message.find(r == 1 ? "of shape [16, 64] belongs to a parameter of shape [32, 32]"
                                  : "failed on rank 1"),
              std::string::npos)
        << "rank " << r << ": " << message;
    EXPECT_EQ(read_text(d, rank_file("unchanged", r)), "yes")
        << "rank " << r << " changed its parameters or state in the step that raised";
    EXPECT_LT(max_diff(load_values(d, rank_file("params", r)), want), 1e-9)
        << "rank " << r << ": the good steps after the error vs one process";
  }
  fs::remove_all(d);
}

TEST(Distributed, AnErrorOnlyTheOwnerSeesChangesNothingOnAnyRank) {
  const std::string d = run_in_fresh_dir("owner_only", 2);
  if (d.empty()) return;
  const std::string owner = read_text(d, rank_file("owner", 0));
  for (int64_t r = 0; r < 2; ++r) {
    const std::string message = read_text(d, rank_file("error", r));
    EXPECT_NE(message.find(std::to_string(r) == owner ? "does not fit float32"
                                                      : "failed on rank " + owner),
              std::string::npos)
        << "rank " << r << " (the float32 parameter's owner is rank " << owner << "): " << message;
    EXPECT_EQ(read_text(d, rank_file("unchanged", r)), "yes")
        << "rank " << r << " changed its parameters or state in the step that raised";
  }
  fs::remove_all(d);
}

TEST(Distributed, OptionsThatDifferBetweenTheRanksAreAnErrorOnEveryRank) {
  const std::string d = run_in_fresh_dir("options_differ", 2);
  if (d.empty()) return;
  for (int64_t r = 0; r < 2; ++r) {
    for (const char* when : {"construction", "step"}) {
      const std::string message = read_text(d, rank_file(when, r));
      EXPECT_NE(message.find("differ between the ranks"), std::string::npos)
          << "rank " << r << " at " << when << ": " << message;
      EXPECT_NE(message.find("options"), std::string::npos) << message;
    }
    EXPECT_EQ(read_text(d, rank_file("unchanged", r)), "yes") << "rank " << r;
  }
  fs::remove_all(d);
}

TEST(Distributed, AveragedGradientsInAnotherOrderAreNotAveragedAgain) {
  const std::string d = run_in_fresh_dir("groups", 2);
  if (d.empty()) return;
  std::vector<at::Tensor> want;
  {
    Problem p = make_problem();
    gwt::WaveletAdam opt(groups(p), options());
    train(p, opt, TrainingRun{}, 0, kSteps);
    want = values(p);
  }
  const auto first = load_values(d, rank_file("compressed", 0));
  for (int64_t r = 0; r < 2; ++r) {
    EXPECT_EQ(read_text(d, rank_file("sent", r)), "ok")
        << "rank " << r << " all-reduced gradients that all_reduce_gradients had averaged";
    // The same averaged gradients, the same update per parameter: the same bits.
    EXPECT_TRUE(bit_equal(load_values(d, rank_file("compressed_sharded", r)),
                          load_values(d, rank_file("compressed", r))))
        << "rank " << r << ": sharded after the compressed all-reduce vs WaveletAdam after it";
    EXPECT_LT(max_diff(load_values(d, rank_file("compressed", r)), first), 1e-12);
    EXPECT_LT(max_diff(load_values(d, rank_file("params", r)), want), 1e-9)
        << "rank " << r << ": sharded with two groups vs one process";
  }
  fs::remove_all(d);
}

TEST(Distributed, FullCheckpointsHoldNoMoreThanTheOwnShardOffRankZero) {
  const std::string d = run_in_fresh_dir("ckpt_memory", 2);
  if (d.empty()) return;
  std::istringstream in(read_text(d, rank_file("memory", 1)));
  int64_t own = -1, save_peak = -1, load_peak = -1, own_after = -1;
  in >> own >> save_peak >> load_peak >> own_after;
  std::cout << "rank 1 owns " << own << " state bytes; extra at the peak: save_full " << save_peak
            << ", load_full " << load_peak << "\n";
  // Rank 1's shard is half the state (768 KiB of 1.5 MiB; before this bound, save_full gathered
  // every shard to every rank and load_full held the whole checkpoint twice). Beyond the shard:
  // the headers (8 int64 per parameter) and the options archive, a few KiB. 64 KiB holds them
  // with room, and lies far below the other shard a rank must never hold.
  EXPECT_GT(own, 0);
  EXPECT_LE(save_peak, own + 65536) << "save_full on rank 1";
  EXPECT_LE(load_peak, own + 65536) << "load_full on rank 1";
  EXPECT_EQ(own_after, own) << "load_full restored rank 1's shard";
  fs::remove_all(d);
}

TEST(Distributed, DeadRankIsAnErrorWithinTheTimeout) {
  const std::string d = fresh_dir("dead");
  Spawn sp;
  sp.scenario = "dead", sp.world = 2, sp.tcp = true, sp.timeout_s = 10, sp.deadline_s = 120;
  const auto t0 = std::chrono::steady_clock::now();
  const auto codes = spawn(sp, d);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(codes.at(0), 0) << "rank 0 did not report the dead peer as a c10::Error";
  EXPECT_EQ(codes.at(1), 3) << "rank 1 was to die with code 3";
  const std::string message = read_text(d, "error-0");
  EXPECT_NE(message.find("all_reduce_gradients failed on rank 0 of 2"), std::string::npos)
      << message;
  // Within the 10 s timeout of the collective, plus start-up: not the 5-minute default.
  EXPECT_LT(std::stod(read_text(d, "seconds-0").empty() ? "1e9" : read_text(d, "seconds-0")), 30.0);
  EXPECT_LT(took, 100.0);
  fs::remove_all(d);
}

TEST(Distributed, CheckpointsShardFullAndSingleProcess) {
  const std::string d = fresh_dir("ckpt");
  const int64_t half = kSteps / 2;
  // The single-process checkpoint for load_full, and the reference runs (step 1 skipped, as the
  // sharded run's NaN on rank 1 skips it there).
  std::vector<at::Tensor> single_mid, single_end;
  TrainingRun skip_one;
  skip_one.nan_step = 1, skip_one.nan_rank = 0;
  {
    Problem p = make_problem();
    gwt::WaveletAdam opt(p.params, options());
    train(p, opt, skip_one, 0, half);
    single_mid = values(p);
    torch::save(single_mid, d + "/single_mid.pt");
    torch::save(opt, d + "/single.pt");
    train(p, opt, TrainingRun{}, half, kSteps);
    single_end = values(p);
  }
  Spawn sp;
  sp.scenario = "checkpoint", sp.world = 2;
  expect_all_zero(spawn(sp, d), "checkpoint");
  if (HasFailure()) return;
  for (int64_t r = 0; r < 2; ++r) {
    const auto end = load_values(d, rank_file("params", r));
    EXPECT_TRUE(bit_equal(load_values(d, rank_file("reloaded", r)), end))
        << "rank " << r << ": the shard round trip changed the continuation";
    EXPECT_LT(max_diff(load_values(d, rank_file("from_single", r)), single_end), 1e-9)
        << "rank " << r << ": continuing from a single-process checkpoint";
    EXPECT_LT(max_diff(end, single_end), 1e-9);
    EXPECT_EQ(read_text(d, rank_file("skipped", r)), "1") << "the shard keeps the skip count";
  }
  {
    // The gathered checkpoint continues in one process as the sharded run did.
    Problem p = make_problem();
    set_values(p, load_values(d, rank_file("mid", 0)));
    gwt::WaveletAdam opt(p.params, options());
    torch::load(opt, d + "/full.pt");
    EXPECT_EQ(opt.skipped_steps(), 1) << "save_full carries the skip count";
    train(p, opt, TrainingRun{}, half, kSteps);
    EXPECT_LT(max_diff(values(p), load_values(d, rank_file("params", 0))), 1e-9)
        << "a single WaveletAdam loading save_full's checkpoint";
  }
  // The same shards in a run of 3: a clear error on every rank.
  sp.scenario = "mismatch", sp.world = 3;
  fs::remove(d + "/store");
  expect_all_zero(spawn(sp, d), "mismatch");
  for (int64_t r = 0; r < 2; ++r)
    EXPECT_NE(
        read_text(d, rank_file("error", r)).find("saved by a run of 2 ranks and this run has 3"),
        std::string::npos)
        << read_text(d, rank_file("error", r));
  EXPECT_NE(read_text(d, "error-2").find("was the checkpoint saved with another world size?"),
            std::string::npos)
      << read_text(d, "error-2");
  fs::remove_all(d);
}

#ifdef GWT_DIST_TEST_LM
TEST(Distributed, CompressedAllReduceTrainsTheTinyLmLikeTheFullOne) {
  const std::string d = fresh_dir("lm");
  Spawn sp;
  sp.scenario = "lm", sp.world = 2, sp.deadline_s = 600;
  expect_all_zero(spawn(sp, d), "lm");
  if (HasFailure()) return;
  std::istringstream in(read_text(d, "lm.txt"));
  std::map<std::string, std::vector<double>> rows;
  std::string name;
  double val = 0, sent = 0, full = 0;
  while (in >> name >> val >> sent >> full) rows[name] = {val, sent, full};
  ASSERT_EQ(rows.size(), 2u);
  const double full_loss = rows["none"][0], compressed = rows["wavelet"][0];
  std::cout << "tiny LM, " << kLmSteps << " steps on 2 ranks: validation loss " << full_loss
            << " (full all-reduce), " << compressed << " (wavelet L=2, error feedback); bytes "
            << rows["wavelet"][1] / rows["none"][1] << "x\n";
  // Measured here: +0.20% (2.6144 against 2.6091). Both runs are float32 with fixed seeds. Another
  // CPU rounds differently, and rounding differences grow along a training run, so how far can
  // the ratio move? About as far as a new seed moves it, a far larger perturbation (another
  // initial model and other batches): over 8 seeds (1234 + k for the model, 42 + k for the
  // batches, k = 0..7) it was +0.13% to +1.34%, mean +0.59%. So 2% lies
  // 1.5x above the worst seed and about 3.4 standard deviations above the mean, while the schemes
  // that send the band alone or in pieces were 3.4% and 5.4% off (seed 0).
  EXPECT_LT(std::abs(compressed / full_loss - 1.0), 0.02);
  EXPECT_LT(compressed, 3.0);  // and it trains: the initial loss is ln 256 = 5.5
  EXPECT_EQ(rows["none"][1], rows["none"][2]);
  EXPECT_LE(rows["wavelet"][1], 0.3 * rows["none"][1]);
  fs::remove_all(d);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  if (const char* s = std::getenv("GWT_DIST_SCENARIO")) return worker(s);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
