// The ranks' side of the tests of gwt::distributed (test_distributed.cpp): the scenario each rank
// of a spawned group runs, named by GWT_DIST_SCENARIO, writing what it computed to the directory
// the parent compares.

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <gwt/distributed.h>
#include <gwt/optim/wavelet_adam.h>

#include "../examples/train_lm/counting_allocator.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef GWT_DIST_TEST_LM
#include <gwt/optim/param_groups.h>
#include "lm.h"
#endif

#include "dist_test_util.h"

using gwt::distributed::GradSyncOptions;
using gwt::distributed::ShardedWaveletAdam;
using namespace gwt_test::dist;

namespace {

// ------------------------------------------------------------------------------------------------
// The ranks' side
// ------------------------------------------------------------------------------------------------

// Each scenario runs in every rank; it returns normally on success.
void scenario_train(const std::string& kind) {
  auto pg = gwt::distributed::init_from_env("gloo");
  const int64_t rank = pg->getRank();
  Problem p = make_problem();
  TrainingRun run;
  run.pg = pg;
  if (kind == "nonfinite_allreduce" || kind == "nonfinite_sharded" || kind == "skipparam_sharded")
    run.nan_step = 2, run.nan_rank = pg->getSize() - 1;
  int64_t skipped = 0, state = 0;
  if (kind == "allreduce" || kind == "nonfinite_allreduce") {
    run.average = true;
    gwt::WaveletAdam opt(p.params, options());
    train(p, opt, run, 0, kSteps);
    skipped = opt.skipped_steps(), state = opt.state_bytes();
  } else {
    ShardedWaveletAdam opt(pg, p.params, options(kind));
    train(p, opt, run, 0, kSteps);
    skipped = opt.skipped_steps(), state = opt.state_bytes();
  }
  save_values(values(p), rank_file("params", rank));
  write_text(rank_file("counts", rank), std::to_string(skipped) + " " + std::to_string(state));
}

// Bytes of the parameters `rank` owns: what its step broadcasts.
int64_t owned_bytes(const ShardedWaveletAdam& opt, const Problem& p, int64_t rank) {
  int64_t n = 0;
  for (const auto& t : p.params)
    if (opt.owner(t) == rank) n += static_cast<int64_t>(t.nbytes());
  return n;
}

// A gradient of the wrong shape on rank 1 (for a parameter rank 1 owns), at step 3: every rank
// raises, with its parameters and state as they were (all_reduce_gradients finds it, before any
// data moves); the step done again with good gradients continues as one process does.
void scenario_bad_grad() {
  auto pg = gwt::distributed::init_from_env("gloo");
  const int64_t rank = pg->getRank(), world = pg->getSize();
  Problem p = make_problem();
  TrainingRun run;
  run.pg = pg;
  ShardedWaveletAdam opt(pg, p.params, options());
  train(p, opt, run, 0, 3);
  opt.zero_grad();
  loss(p, rank, world).backward();
  size_t bad = 0;
  while (p.params[bad].dim() != 2 || opt.owner(p.params[bad]) != 1) ++bad;
  // The same number of elements: before the check, the averaging's buckets still matched between
  // the ranks, and only the owner's local step refused it.
  if (rank == 1) p.params[bad].mutable_grad() = at::zeros({kWidth / 2, 2 * kWidth}, at::kDouble);
  const std::vector<at::Tensor> before = values(p);
  const int64_t state_before = opt.state_bytes();
  std::string message = "no error";
  try {
    opt.step();
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  write_text(rank_file("error", rank), message);
  write_text(rank_file("unchanged", rank),
             bit_equal(values(p), before) && opt.state_bytes() == state_before ? "yes" : "no");
  train(p, opt, run, 3, kSteps);
  save_values(values(p), rank_file("params", rank));
}

// An error only the owner of a parameter can see (its options do not fit its dtype: lr x
// weight_decay overflows float32, for the one float32 parameter; the float64 ones are fine), found
// by the owner's local checks: every rank raises before any writes.
void scenario_owner_only() {
  auto pg = gwt::distributed::init_from_env("gloo");
  const int64_t rank = pg->getRank(), world = pg->getSize();
  Problem p = make_problem();
  const at::Tensor narrow = at::randn({kWidth, kWidth}).requires_grad_();
  std::vector<at::Tensor> params = p.params;
  params.push_back(narrow);
  ShardedWaveletAdam opt(pg, params, options().weight_decay(1e41));
  loss(p, rank, world).backward();
  narrow.mutable_grad() = at::ones_like(narrow);
  const std::vector<at::Tensor> before = values(p);
  const at::Tensor narrow_before = narrow.detach().clone();
  std::string message = "no error";
  try {
    opt.step();
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  write_text(rank_file("owner", rank), std::to_string(opt.owner(narrow)));
  write_text(rank_file("error", rank), message);
  write_text(rank_file("unchanged", rank), bit_equal(values(p), before) &&
                                                   at::equal(narrow, narrow_before) &&
                                                   opt.state_bytes() == 0
                                               ? "yes"
                                               : "no");
}

// Options that differ between the ranks: at construction, and a learning rate changed on one rank
// only before a step. Each is an error on every rank.
void scenario_options_differ() {
  auto pg = gwt::distributed::init_from_env("gloo");
  const int64_t rank = pg->getRank(), world = pg->getSize();
  Problem p = make_problem();
  std::string construction = "no error", step = "no error";
  try {
    ShardedWaveletAdam opt(pg, p.params, rank == 1 ? options().lr(2e-2) : options());
  } catch (const c10::Error& e) {
    construction = e.what_without_backtrace();
  }
  ShardedWaveletAdam opt(pg, p.params, options());
  loss(p, rank, world).backward();
  if (rank == 1) opt.param_groups()[0].options().set_lr(2e-2);
  const std::vector<at::Tensor> before = values(p);
  try {
    opt.step();
  } catch (const c10::Error& e) {
    step = e.what_without_backtrace();
  }
  write_text(rank_file("construction", rank), construction);
  write_text(rank_file("step", rank), step);
  write_text(rank_file("unchanged", rank), bit_equal(values(p), before) ? "yes" : "no");
}

// Several groups in another order than the gradients were averaged in, compression combined
// with sharding: (a) every rank's WaveletAdam after all_reduce_gradients with the wavelet
// compression, (b) ShardedWaveletAdam after the same call, which must find the gradients averaged
// (it sends only the parameters it owns) and step as (a) does, (c) ShardedWaveletAdam averaging
// itself, as one process steps.
void scenario_groups() {
  auto pg = gwt::distributed::init_from_env("gloo");
  const int64_t rank = pg->getRank(), world = pg->getSize();
  GradSyncOptions sync;
  sync.compression = "wavelet";
  Problem a = make_problem(), b = make_problem(), c = make_problem();
  gwt::WaveletAdam opt_a(groups(a), options());
  ShardedWaveletAdam opt_b(pg, groups(b), options());
  ShardedWaveletAdam opt_c(pg, groups(c), options());
  std::ostringstream sent;
  for (int64_t s = 0; s < kSteps; ++s) {
    for (auto [p, opt] :
         {std::pair<Problem*, torch::optim::Optimizer*>{&a, &opt_a}, {&b, &opt_b}}) {
      opt->zero_grad();
      loss(*p, rank, world).backward();
      gwt::distributed::all_reduce_gradients(pg, p->params, sync);  // in the model's order
      opt->step();
    }
    if (opt_b.last_step_bytes_sent() != owned_bytes(opt_b, b, rank))
      sent << "step " << s << ": sent " << opt_b.last_step_bytes_sent() << " bytes, owns "
           << owned_bytes(opt_b, b, rank) << "; ";
  }
  TrainingRun run;
  run.pg = pg;
  train(c, opt_c, run, 0, kSteps);
  save_values(values(a), rank_file("compressed", rank));
  save_values(values(b), rank_file("compressed_sharded", rank));
  save_values(values(c), rank_file("params", rank));
  write_text(rank_file("sent", rank), sent.str().empty() ? "ok" : sent.str());
}

// ZeRO's promise for full checkpoints: during save_full and load_full a rank other than 0
// allocates at most its own shard (plus headers), not the whole state.
void scenario_ckpt_memory() {
  // Tensor allocations only (std::string buffers are not counted: the code under test moves
  // state in tensors).
  static lm::CountingAllocator counting(c10::GetCPUAllocator());
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  auto pg = gwt::distributed::init_from_env("gloo");
  const int64_t rank = pg->getRank();
  at::manual_seed(11);
  std::vector<at::Tensor> params;
  for (int i = 0; i < 6; ++i) params.push_back(at::randn({256, 512}).requires_grad_());
  ShardedWaveletAdam opt(pg, params, gwt::WaveletAdamOptions(1e-3));
  for (int s = 0; s < 2; ++s) {
    for (auto& t : params) t.mutable_grad() = at::randn_like(t);
    opt.step();
  }
  const int64_t own = opt.state_bytes();
  std::ostringstream out;
  int64_t base = counting.reset_peak();
  opt.save_full(dir() + "/full.pt");
  out << own << " " << counting.peak() - base;
  base = counting.reset_peak();
  opt.load_full(dir() + "/full.pt");
  out << " " << counting.peak() - base << " " << opt.state_bytes();
  write_text(rank_file("memory", rank), out.str());
}

void scenario_dead() {
  auto pg = gwt::distributed::init_from_env("gloo");
  Problem p = make_problem();
  TrainingRun run;
  run.pg = pg, run.average = true, run.exit_step = 3, run.exit_rank = 1;
  gwt::WaveletAdam opt(p.params, options());
  const auto t0 = std::chrono::steady_clock::now();
  try {
    train(p, opt, run, 0, kSteps);
  } catch (const c10::Error& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    write_text(rank_file("error", pg->getRank()), e.what_without_backtrace());
    write_text(rank_file("seconds", pg->getRank()), std::to_string(s));
    std::fflush(nullptr);
    _exit(0);  // the group's destructor would wait for the dead peer once more
  }
  throw std::runtime_error("the peer died and no error came");
}

void scenario_checkpoint() {
  auto pg = gwt::distributed::init_from_env("gloo");
  const int64_t rank = pg->getRank();
  Problem p = make_problem();
  TrainingRun run;
  run.pg = pg;
  const int64_t half = kSteps / 2;
  ShardedWaveletAdam opt(pg, p.params, options());
  run.nan_step = 1, run.nan_rank = 1;  // one skipped step, which the full checkpoint must carry
  train(p, opt, run, 0, half);
  run.nan_step = -1;
  const std::vector<at::Tensor> mid = values(p);
  save_values(mid, rank_file("mid", rank));
  opt.save_full(dir() + "/full.pt");
  opt.save_shard(dir() + "/shard");
  train(p, opt, run, half, kSteps);
  save_values(values(p), rank_file("params", rank));

  // The shard back into a new optimizer: the same continuation, bit for bit.
  set_values(p, mid);
  ShardedWaveletAdam again(pg, p.params, options());
  again.load_shard(dir() + "/shard");
  train(p, again, run, half, kSteps);
  save_values(values(p), rank_file("reloaded", rank));
  write_text(rank_file("skipped", rank), std::to_string(again.skipped_steps()));

  // A single-process checkpoint (the parent wrote it, with its parameters at that step).
  set_values(p, load_values(dir(), "single_mid.pt"));
  ShardedWaveletAdam from_single(pg, p.params, options());
  from_single.load_full(dir() + "/single.pt");
  train(p, from_single, run, half, kSteps);
  save_values(values(p), rank_file("from_single", rank));
}

void scenario_mismatch() {
  auto pg = gwt::distributed::init_from_env("gloo");
  Problem p = make_problem();
  ShardedWaveletAdam opt(pg, p.params, options());
  try {
    opt.load_shard(dir() + "/shard");
  } catch (const c10::Error& e) {
    write_text(rank_file("error", pg->getRank()), e.what_without_backtrace());
    return;
  }
  throw std::runtime_error("a shard of another world size loaded");
}

#ifdef GWT_DIST_TEST_LM
lm::ModelConfig lm_config() {
  lm::ModelConfig c;
  c.dim = 64, c.layers = 2, c.heads = 4, c.hidden = 172, c.seq_len = 64;
  return c;
}

void scenario_lm() {
  auto pg = gwt::distributed::init_from_env("gloo");
  const int64_t rank = pg->getRank(), world = pg->getSize();
  const lm::ModelConfig config = lm_config();
  const lm::Corpus corpus = lm::load_corpus("", config.seq_len);
  const at::Tensor val = lm::validation_windows(corpus.val, config.seq_len, 32);
  std::ostringstream out;
  for (const std::string compression : {"none", "wavelet"}) {
    at::manual_seed(1234);
    lm::Decoder model(config);
    lm::OptimizerSpec spec = lm::optimizer_spec("wavelet-haar-l2");
    spec.lr = 3e-3, spec.scale = 0.25;
    auto opt = lm::make_optimizer(spec, model);
    lm::Batches batches(corpus.train, kLmBatch, config.seq_len, 42);
    GradSyncOptions sync;
    sync.compression = compression, sync.level = 2, sync.error_feedback = true;
    const std::vector<at::Tensor> params = model->parameters();
    gwt::distributed::reset_error_feedback();
    int64_t sent = 0, full = 0;
    for (int64_t step = 0; step < kLmSteps; ++step) {
      for (auto& g : opt->param_groups())
        g.options().set_lr(lm::cosine_lr(spec.lr, step, 15, kLmSteps));
      const at::Tensor mine = batches.next().narrow(0, rank * (kLmBatch / world), kLmBatch / world);
      opt->zero_grad();
      lm::next_byte_loss(model, mine).backward();
      gwt::distributed::all_reduce_gradients(pg, params, sync);
      const auto stats = gwt::distributed::last_grad_sync_stats();
      sent += stats.bytes_sent, full += stats.bytes_full;
      opt->step();
    }
    out << compression << " " << lm::evaluate(model, val, 16) << " " << sent << " " << full << "\n";
  }
  if (rank == 0) write_text("lm.txt", out.str());
}
#endif

}  // namespace

int gwt_test::dist::worker(const std::string& scenario) {
  try {
    if (scenario == "dead")
      scenario_dead();
    else if (scenario == "checkpoint")
      scenario_checkpoint();
    else if (scenario == "mismatch")
      scenario_mismatch();
    else if (scenario == "bad_grad")
      scenario_bad_grad();
    else if (scenario == "groups")
      scenario_groups();
    else if (scenario == "options_differ")
      scenario_options_differ();
    else if (scenario == "owner_only")
      scenario_owner_only();
    else if (scenario == "ckpt_memory")
      scenario_ckpt_memory();
#ifdef GWT_DIST_TEST_LM
    else if (scenario == "lm")
      scenario_lm();
#endif
    else
      scenario_train(scenario);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %s, scenario %s: %s\n", std::getenv("RANK"), scenario.c_str(),
                 e.what());
    std::fflush(nullptr);
    _exit(1);
  }
  std::fflush(nullptr);
  _exit(0);  // skip static destructors in the child
}
