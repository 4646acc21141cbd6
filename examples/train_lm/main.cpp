// Language-model pre-training comparison: the same LLaMA-style decoder trained on real text with
// AdamW and with gwt::WaveletAdam at several settings. Each run is a child process (so its peak
// resident memory is its own) writing <out>/<run>.csv and <run>.summary; the parent prints the
// Markdown table and writes <out>/results.md. scripts/plot_lm.py draws the PNG.
//
// The runs take turns, one training step each (a token passed around a ring of pipes, TurnRing):
// one process computes at any moment, and every run's ms / step is measured over the same minutes.
// Run one after the other, each later run measured slower than the one before it whatever its
// optimizer (the machine's drift, 5-6% over the job), and the column compared nothing.
//
//   train_lm [--preset tiny|llama-20m|llama-60m] [--optimizers a,b,...] [--corpus PATH]
//            [--out DIR] [--steps N] [--device cpu|cuda] [--lr-adamw X] [--lr-wavelet X]
//            [--lr-foam X] [--scale X] [--nproc N] [--quiet]
//
// Scale-out (scale_out.h): --nproc N (N >= 2) adds the runs dp-full, dp-wavelet and dp-sharded,
// each on N processes this program spawns (ranks meet on 127.0.0.1), to the table. Launched by
// torchrun (WORLD_SIZE > 1 in the environment), every process is one rank and only the scale-out
// runs are made; rank 0 prints and writes the results.

#include <ATen/ATen.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli.h"
#include "lm.h"
#include "scale_out.h"

namespace {

struct Args {
  std::string preset = "tiny", corpus, out = "results/lm", device = "cpu";
  std::vector<std::string> optimizers = lm::optimizer_names();
  int64_t steps = -1, nproc = 1;
  bool optimizers_given = false;
  // Tuned on the tiny preset (300-step sweep in docs/results.md): each optimizer its best setting.
  double lr_adamw = 1e-3, lr_wavelet = 3e-3, lr_foam = 3e-2, scale = 0.25;
  bool quiet = false;
};

// torchrun's WORLD_SIZE, 1 when this process was not launched by it.
int64_t torchrun_world() {
  const char* w = std::getenv("WORLD_SIZE");
  return w == nullptr ? 1 : std::max<long long>(1, std::atoll(w));
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw lm::InputError(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--preset")
      a.preset = value();
    else if (flag == "--optimizers")
      a.optimizers = lm::split_list(value()), a.optimizers_given = true;
    else if (flag == "--nproc")
      a.nproc = lm::parse_whole(flag, value(), 1, 64, "a whole number of processes from 1 to 64");
    else if (flag == "--corpus")
      a.corpus = value();
    else if (flag == "--out")
      a.out = value();
    else if (flag == "--steps")
      a.steps =
          lm::parse_whole(flag, value(), 1, 1000000000000LL, "a whole number from 1 to 10^12");
    else if (flag == "--device")
      a.device = value();
    else if (flag == "--lr-adamw")
      a.lr_adamw = lm::parse_positive(flag, value());
    else if (flag == "--lr-wavelet")
      a.lr_wavelet = lm::parse_positive(flag, value());
    else if (flag == "--lr-foam")
      a.lr_foam = lm::parse_positive(flag, value());
    else if (flag == "--scale")
      a.scale = lm::parse_positive(flag, value());
    else if (flag == "--quiet")
      a.quiet = true;
    else
      throw lm::InputError("unknown argument '" + flag +
                           "' (see the comment at the top of main.cpp)");
  }
  if (a.device != "cpu" && a.device != "cuda")
    throw lm::InputError("--device must be cpu or cuda, got '" + a.device + "'");
  if (a.optimizers.empty()) throw lm::InputError("--optimizers needs at least one name");
  return a;
}

// The ring of turns of `count` runs: run i waits for the token on pipe i, trains one step, and
// passes the token on to pipe i + 1 (the last to pipe 0). The parent makes the pipes before
// it forks and closes its ends after it has put the first token in; each child keeps only its two
// ends. A run that fails closes its write end by exiting, so the next run's wait sees end of file
// and stops too, and so on around the ring: a failure ends every run, never a hang.
class TurnRing {
 public:
  explicit TurnRing(size_t count) : fds_(count) {
    for (auto& fd : fds_)
      if (pipe(fd.data()) != 0) throw std::runtime_error("train_lm: pipe failed");
  }
  // In child `index`: close every end but its own read end and the next run's write end.
  void join(size_t index) {
    signal(SIGPIPE, SIG_IGN);  // passing to a run that has finished is not an error
    in_ = fds_[index][0], out_ = fds_[(index + 1) % fds_.size()][1];
    for (auto& fd : fds_)
      for (int end : fd)
        if (end != in_ && end != out_) close(end);
  }
  // In the parent, after every fork: the first turn is run 0's.
  void start() {
    const char token = 't';
    if (write(fds_[0][1], &token, 1) != 1) throw std::runtime_error("train_lm: write failed");
    for (auto& fd : fds_)
      for (int end : fd) close(end);
  }
  void wait() const {
    char token = 0;
    ssize_t got = 0;
    do got = read(in_, &token, 1);
    while (got < 0 && errno == EINTR);
    if (got != 1) throw std::runtime_error("another run stopped, so this one stops too");
  }
  void pass() const {
    const char token = 't';
    ssize_t put = 0;
    do put = write(out_, &token, 1);
    while (put < 0 && errno == EINTR);
  }

 private:
  std::vector<std::array<int, 2>> fds_;
  int in_ = -1, out_ = -1;
};

// One run, in the child process; `progress` prints the bar (one run of the ring does: the last,
// whose step ends each round).
lm::RunSummary train(const Args& args, const lm::Preset& preset, const lm::Corpus& corpus,
                     lm::OptimizerSpec spec, const TurnRing& turns, const std::string& progress) {
  const at::Device device = args.device == "cuda" ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  at::manual_seed(1234);  // the same initial model for every optimizer
  lm::Decoder model(preset.model);
  model->to(device);
  auto opt = lm::make_optimizer(spec, model);
  lm::Batches batches(corpus.train, preset.batch, preset.model.seq_len, 42);
  const at::Tensor val =
      lm::validation_windows(corpus.val, preset.model.seq_len, preset.eval_windows).to(device);
  const std::string csv = args.out + "/" + spec.name + ".csv";

  std::vector<lm::EvalPoint> points;
  // train_seconds: the timed training steps; own_seconds: this run's turns, evaluations included
  // (the CSV's seconds: time the run itself took, not the other runs' turns).
  double train_seconds = 0, own_seconds = 0, recent_loss = 0;
  using clock = std::chrono::steady_clock;
  const auto since = [](clock::time_point t) {
    return std::chrono::duration<double>(clock::now() - t).count();
  };
  const auto start = clock::now();
  for (int64_t step = 0; step < preset.steps; ++step) {
    turns.wait();
    const auto turn_start = clock::now();
    const double lr = lm::cosine_lr(spec.lr, step, preset.warmup, preset.steps);
    for (auto& group : opt->param_groups()) group.options().set_lr(lr);
    const at::Tensor batch = batches.next().to(device);
    opt->zero_grad();
    const at::Tensor loss = lm::next_byte_loss(model, batch);
    loss.backward();
    opt->step();
    const double loss_value = loss.item<double>();
    train_seconds += since(turn_start);
    recent_loss = step == 0 ? loss_value : 0.9 * recent_loss + 0.1 * loss_value;
    if ((step + 1) % preset.eval_every == 0 || step + 1 == preset.steps) {
      const double val_loss = lm::evaluate(model, val, preset.batch);
      points.push_back({step + 1, lr, recent_loss, val_loss, own_seconds + since(turn_start)});
      lm::write_csv(csv, points);
    }
    if (!args.quiet && !progress.empty() && ((step + 1) % 5 == 0 || step + 1 == preset.steps))
      lm::progress_bar(progress, 34, step, preset.steps, recent_loss, since(start));
    own_seconds += since(turn_start);
    turns.pass();
  }
  lm::RunSummary s;
  s.name = spec.name, s.label = spec.label, s.lr = spec.lr, s.scale = spec.scale;
  s.val_loss = points.back().val_loss, s.val_ppl = std::exp(s.val_loss);
  std::tie(s.state_bytes, s.wavelet_state_bytes) = lm::state_bytes(*opt);
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  s.peak_rss_bytes = static_cast<int64_t>(usage.ru_maxrss) * 1024;
  s.ms_per_step = 1000.0 * train_seconds / static_cast<double>(preset.steps);
  s.steps = preset.steps;
  return s;
}

// The job the command line and the environment ask for: the single-process runs (specs), which
// take turns, and the scale-out runs, with the preset and the corpus they all train on.
struct Job {
  Args args;
  lm::Preset preset;
  lm::Corpus corpus;
  std::vector<lm::OptimizerSpec> specs;
  std::vector<std::string> scale_out;
};

// The job of this command line, under torchrun's `launched` processes (1 without it); a
// lm::InputError names what is wrong with the input.
Job plan(int argc, char** argv, int64_t launched) {
  Job job;
  Args& args = job.args;
  lm::Preset& preset = job.preset;
  lm::Corpus& corpus = job.corpus;
  std::vector<lm::OptimizerSpec>& specs = job.specs;
  std::vector<std::string>& scale_out = job.scale_out;
  args = parse(argc, argv);
  if (launched > 1 && args.nproc > 1)
    throw lm::InputError("--nproc " + std::to_string(args.nproc) +
                         " under torchrun (WORLD_SIZE=" + std::to_string(launched) +
                         "): torchrun already made the processes; drop --nproc");
  const int64_t world = launched > 1 ? launched : args.nproc;
  if (world > 1 && !args.optimizers_given) {
    if (launched > 1) args.optimizers.clear();  // each rank would repeat the single runs
    for (const auto& n : lm::scale_out_names()) args.optimizers.push_back(n);
  }
  preset = lm::preset(args.preset);
  if (args.steps > 0) {
    preset.steps = args.steps;
    preset.warmup = std::max<int64_t>(1, std::min(preset.warmup, args.steps / 10));
    preset.eval_every = std::max<int64_t>(1, std::min(preset.eval_every, args.steps / 4));
  }
  for (const auto& name : args.optimizers) {
    if (lm::is_scale_out(name)) {
      if (world < 2)
        throw lm::InputError(name +
                             " is a scale-out run: give --nproc N (N >= 2) or launch "
                             "with torchrun");
      if (!lm::scale_out_available())
        throw lm::InputError(name +
                             " needs gwt::distributed, and gwt was built without it "
                             "(Gloo's headers were not found; apt install libgloo-dev)");
      scale_out.push_back(name);
      continue;
    }
    if (launched > 1)
      throw lm::InputError("under torchrun only the scale-out runs are made (" + name +
                           " is a single-process run; run it without torchrun)");
    lm::OptimizerSpec spec = lm::optimizer_spec(name);
    const bool adamw = spec.wavelet.empty() && !spec.galore && !spec.foam;
    // GaLore takes WaveletAdam's settings: the GaLore recipe (higher lr, scale 0.25) they match.
    // FOAM has its own lr, with the same scale 0.25 (the authors' too).
    spec.lr = adamw ? args.lr_adamw : spec.foam ? args.lr_foam : args.lr_wavelet;
    if (!adamw) spec.scale = args.scale;
    specs.push_back(spec);
  }
  lm::ensure_writable_dir(args.out);
  corpus = lm::load_corpus(args.corpus, preset.model.seq_len);
  if (args.device == "cuda" && !torch::cuda::is_available())
    throw lm::InputError("--device cuda: no CUDA device visible");
  if (!scale_out.empty() && preset.batch % world != 0)
    throw lm::InputError("the global batch of " + std::to_string(preset.batch) +
                         " sequences does not split over " + std::to_string(world) +
                         " ranks; use a number of ranks that divides it");
  return job;
}

// The single-process runs, each in a child process of its own, taking turns (TurnRing); their
// summaries go to `runs`. Returns main's exit code: 0, or 1 when a run did not start or finish.
int run_in_turn(const Job& job, std::vector<lm::RunSummary>& runs) {
  const Args& args = job.args;
  const lm::Preset& preset = job.preset;
  const lm::Corpus& corpus = job.corpus;
  const std::vector<lm::OptimizerSpec>& specs = job.specs;
  std::unique_ptr<TurnRing> ring;
  try {
    ring = std::make_unique<TurnRing>(specs.size());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  TurnRing& turns = *ring;
  std::vector<pid_t> pids;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& spec = specs[i];
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      try {
        turns.join(i);
        const std::string progress =
            i + 1 < specs.size() ? std::string()
            : specs.size() == 1
                ? spec.label
                : spec.label + " (+" + std::to_string(specs.size() - 1) + " in turn)";
        lm::write_summary(args.out + "/" + spec.name + ".summary",
                          train(args, preset, corpus, spec, turns, progress));
        std::fflush(nullptr);
        _exit(0);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "\ntrain_lm: run %s failed: %s\n", spec.name.c_str(), e.what());
        std::fflush(nullptr);
        _exit(1);
      }
    }
    if (pid < 0) {
      std::fprintf(stderr, "train_lm: error: fork failed for run %s\n", spec.name.c_str());
      for (pid_t p : pids) kill(p, SIGKILL), waitpid(p, nullptr, 0);
      return 1;
    }
    pids.push_back(pid);
  }
  turns.start();
  bool failed = false;
  for (size_t i = 0; i < specs.size(); ++i) {
    int status = 0;
    const bool waited = waitpid(pids[i], &status, 0) >= 0;
    if (waited && WIFSIGNALED(status)) {
      std::fprintf(stderr, "train_lm: error: run %s was killed (signal %d)\n",
                   specs[i].name.c_str(), WTERMSIG(status));
      failed = true;
    } else if (!waited || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "train_lm: error: run %s did not finish\n", specs[i].name.c_str());
      failed = true;
    }
  }
  if (failed) return 1;
  for (const auto& spec : specs)
    runs.push_back(lm::read_summary(args.out + "/" + spec.name + ".summary"));
  return 0;
}

// The scale-out runs: this process is one of their ranks under torchrun (`launched` > 1), else it
// spawns --nproc ranks.
std::vector<lm::ScaleOutSummary> run_scale_out(const Job& job, int64_t launched) {
  const Args& args = job.args;
  const lm::Preset& preset = job.preset;
  const lm::Corpus& corpus = job.corpus;
  const std::vector<std::string>& scale_out = job.scale_out;
  lm::ScaleOutConfig config;
  config.preset = preset, config.out = args.out, config.device = args.device;
  config.lr = args.lr_wavelet, config.scale = args.scale, config.quiet = args.quiet;
  std::vector<lm::ScaleOutSummary> scaled;
  if (launched > 1)
    scaled = lm::run_scale_out_in_process(config, corpus, scale_out);
  else if (!scale_out.empty())
    scaled = lm::spawn_scale_out(config, corpus, scale_out, args.nproc);
  return scaled;
}

// The table of every run, printed and written to <out>/results.md.
void write_report(const Job& job, const std::vector<lm::RunSummary>& runs,
                  const std::vector<lm::ScaleOutSummary>& scaled) {
  const Args& args = job.args;
  const lm::Preset& preset = job.preset;
  const lm::Corpus& corpus = job.corpus;
  std::ostringstream report;
  report << "Preset `" << preset.name << "`, " << preset.steps << " steps of " << preset.batch
         << " x " << preset.model.seq_len << " bytes, corpus " << corpus.source
         << "; validation loss in nats per byte.\n\n"
         << (runs.empty() ? std::string() : lm::results_table(runs));
  if (!scaled.empty()) {
    const lm::RunSummary* single = nullptr;
    for (const auto& r : runs)
      if (r.name == "wavelet-haar-l2") single = &r;
    report << (runs.empty() ? "" : "\n") << "Scale-out, " << scaled.front().ranks
           << " ranks, each on its slice of the same global batch"
           << (single ? "; ratios against the single-process WaveletAdam haar L=2 run" : "")
           << ":\n\n"
           << lm::scale_out_table(scaled, single);
  }
  std::cout << report.str();
  std::ofstream(args.out + "/results.md") << report.str();
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t launched = torchrun_world();
  const bool rank0 =
      launched == 1 || std::getenv("RANK") == nullptr || std::string(std::getenv("RANK")) == "0";
  Job job;
  try {
    job = plan(argc, argv, launched);
  } catch (const lm::InputError& e) {
    std::fprintf(stderr, "train_lm: error: %s\n", e.what());
    return 2;
  }
  if (rank0)
    std::fprintf(
        stderr,
        "train_lm: preset %s, corpus %s (%lld documents, %zu train / %zu validation bytes), "
        "%lld steps\n",
        job.preset.name.c_str(), job.corpus.source.c_str(),
        static_cast<long long>(job.corpus.documents), job.corpus.train.size(),
        job.corpus.val.size(), static_cast<long long>(job.preset.steps));

  std::vector<lm::RunSummary> runs;
  if (!job.specs.empty()) {
    const int code = run_in_turn(job, runs);
    if (code != 0) return code;
  }
  std::vector<lm::ScaleOutSummary> scaled;
  try {
    scaled = run_scale_out(job, launched);
  } catch (const lm::InputError& e) {
    std::fprintf(stderr, "train_lm: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_lm: error: %s\n", e.what());
    return 1;
  }
  if (!rank0) return 0;
  write_report(job, runs, scaled);
  return 0;
}
