// The scale-out runs of the main job (scale_out.h). Without gwt::distributed (gwt built without
// Gloo's headers) only the names exist, and asking for a run is an InputError.

#include "scale_out.h"

#include "cli.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <map>
#include <sstream>
#include <thread>

#ifdef GWT_HAVE_DISTRIBUTED
#include <gwt/distributed.h>
#include <gwt/optim/param_groups.h>
#include <gwt/optim/wavelet_adam.h>
#endif

namespace lm {

std::vector<std::string> scale_out_names() {
  return {"dp-full", "dp-wavelet", "dp-sharded"};
}

bool is_scale_out(const std::string& name) {
  for (const auto& n : scale_out_names())
    if (n == name) return true;
  return false;
}

bool scale_out_available() {
#ifdef GWT_HAVE_DISTRIBUTED
  return true;
#else
  return false;
#endif
}

namespace {

std::string label_of(const std::string& name) {
  if (name == "dp-full") return "WaveletAdam haar L=2, full all-reduce";
  if (name == "dp-wavelet") return "WaveletAdam haar L=2, wavelet all-reduce L=2";
  return "ShardedWaveletAdam haar L=2";
}

void write_scale_out_summary(const std::string& path, const ScaleOutSummary& s) {
  std::ofstream out(path);
  if (!out) throw InputError("cannot write '" + path + "'");
  out << std::setprecision(12) << "name=" << s.name << "\nlabel=" << s.label
      << "\nranks=" << s.ranks << "\nsteps=" << s.steps << "\nval_loss=" << s.val_loss
      << "\nstate_bytes_per_rank=" << s.state_bytes_per_rank
      << "\nbytes_sent_per_step=" << s.bytes_sent_per_step
      << "\nbytes_full_per_step=" << s.bytes_full_per_step << "\nms_per_step=" << s.ms_per_step
      << "\n";
}

ScaleOutSummary read_scale_out_summary(const std::string& path) {
  const std::map<std::string, std::string> kv = read_key_values(path);
  auto get = [&](const char* key) { return value_of(kv, key, path); };
  ScaleOutSummary s;
  s.name = get("name"), s.label = get("label");
  s.ranks = std::stoll(get("ranks")), s.steps = std::stoll(get("steps"));
  s.val_loss = std::stod(get("val_loss"));
  s.state_bytes_per_rank = std::stoll(get("state_bytes_per_rank"));
  s.bytes_sent_per_step = std::stod(get("bytes_sent_per_step"));
  s.bytes_full_per_step = std::stod(get("bytes_full_per_step"));
  s.ms_per_step = std::stod(get("ms_per_step"));
  return s;
}

#ifdef GWT_HAVE_DISTRIBUTED

int64_t max_over_ranks(const c10::intrusive_ptr<c10d::Backend>& pg, int64_t value) {
  std::vector<at::Tensor> t{at::full({1}, value, at::kLong)};
  if (pg->getBackendName() == "nccl") t[0] = t[0].cuda();
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  pg->allreduce(t, o)->wait();
  return t[0].cpu().item<int64_t>();
}

ScaleOutSummary run_one(const ScaleOutConfig& c, const Corpus& corpus, const std::string& name,
                        const c10::intrusive_ptr<c10d::Backend>& pg) {
  const int64_t rank = pg->getRank(), world = pg->getSize();
  const Preset& preset = c.preset;
  if (preset.batch % world != 0)
    throw InputError("the global batch of " + std::to_string(preset.batch) +
                     " sequences does not split over " + std::to_string(world) +
                     " ranks; use a number of ranks that divides it");
  const int64_t rows = preset.batch / world;
  at::Device device(at::kCPU);
  if (c.device == "cuda") {
    const char* local = std::getenv("LOCAL_RANK");
    const auto count = static_cast<int64_t>(torch::cuda::device_count());
    device =
        at::Device(at::kCUDA, static_cast<c10::DeviceIndex>((local ? std::atoll(local) : rank) %
                                                            std::max<int64_t>(1, count)));
  }
  at::manual_seed(1234);  // the initial model of the single-process runs
  Decoder model(preset.model);
  model->to(device);
  const std::vector<at::Tensor> params = model->parameters();
  gwt::distributed::broadcast_parameters(pg, params);

  OptimizerSpec spec = optimizer_spec("wavelet-haar-l2");
  spec.lr = c.lr, spec.scale = c.scale;
  std::unique_ptr<torch::optim::Optimizer> opt;
  gwt::distributed::ShardedWaveletAdam* sharded = nullptr;
  if (name == "dp-sharded") {
    const auto options = gwt::WaveletAdamOptions(spec.lr)
                             .weight_decay(spec.weight_decay)
                             .wavelet(spec.wavelet)
                             .level(spec.level)
                             .scale(spec.scale);
    auto s = std::make_unique<gwt::distributed::ShardedWaveletAdam>(
        pg, gwt::paper_param_groups(*model, options), options);
    sharded = s.get();
    opt = std::move(s);
  } else {
    opt = make_optimizer(spec, model);
  }
  gwt::distributed::GradSyncOptions sync;
  if (name == "dp-wavelet") sync.compression = "wavelet", sync.level = 2;
  gwt::distributed::reset_error_feedback();

  Batches batches(corpus.train, preset.batch, preset.model.seq_len, 42);
  const at::Tensor val =
      validation_windows(corpus.val, preset.model.seq_len, preset.eval_windows).to(device);
  std::vector<EvalPoint> points;
  double train_seconds = 0, recent = 0, sent = 0, full = 0;
  const std::string label = label_of(name);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < preset.steps; ++step) {
    const double lr = cosine_lr(spec.lr, step, preset.warmup, preset.steps);
    for (auto& group : opt->param_groups()) group.options().set_lr(lr);
    const auto t0 = std::chrono::steady_clock::now();
    const at::Tensor batch = batches.next().narrow(0, rank * rows, rows).to(device);
    opt->zero_grad();
    const at::Tensor loss = next_byte_loss(model, batch);
    loss.backward();
    if (sharded == nullptr) {
      gwt::distributed::all_reduce_gradients(pg, params, sync);
      const auto stats = gwt::distributed::last_grad_sync_stats();
      sent += static_cast<double>(stats.bytes_sent), full += static_cast<double>(stats.bytes_full);
      opt->step();
    } else {
      opt->step();  // averages the gradients itself, then each owner broadcasts its parameters
      sent += static_cast<double>(sharded->last_step_bytes_sent());
      full += static_cast<double>(gwt::distributed::last_grad_sync_stats().bytes_full);
    }
    const double value = loss.item<double>();  // this rank's slice
    train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    recent = step == 0 ? value : 0.9 * recent + 0.1 * value;
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (rank == 0 && ((step + 1) % preset.eval_every == 0 || step + 1 == preset.steps)) {
      points.push_back({step + 1, lr, recent, evaluate(model, val, preset.batch), elapsed});
      write_csv(c.out + "/" + name + ".csv", points);
    }
    if (rank == 0 && !c.quiet && ((step + 1) % 5 == 0 || step + 1 == preset.steps))
      progress_bar(name + " x" + std::to_string(world), 22, step, preset.steps, recent, elapsed);
  }
  int64_t state = 0;
  if (sharded != nullptr)
    state = sharded->state_bytes();
  else
    state = static_cast<gwt::WaveletAdam&>(*opt).state_bytes();
  ScaleOutSummary s;
  s.name = name, s.label = label, s.ranks = world, s.steps = preset.steps;
  s.state_bytes_per_rank = max_over_ranks(pg, state);
  s.val_loss = rank == 0 ? points.back().val_loss : 0;
  s.bytes_sent_per_step = sent / static_cast<double>(preset.steps);
  s.bytes_full_per_step = full / static_cast<double>(preset.steps);
  s.ms_per_step = 1000.0 * train_seconds / static_cast<double>(preset.steps);
  return s;
}

#endif  // GWT_HAVE_DISTRIBUTED

int free_port() {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool ok = s >= 0 && bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  if (s >= 0) close(s);
  if (!ok) throw std::runtime_error("no free TCP port on 127.0.0.1");
  return ntohs(a.sin_port);
}

}  // namespace

std::vector<ScaleOutSummary> run_scale_out_in_process(const ScaleOutConfig& config,
                                                      const Corpus& corpus,
                                                      const std::vector<std::string>& names) {
#ifdef GWT_HAVE_DISTRIBUTED
  auto pg = gwt::distributed::init_from_env(config.device == "cuda" ? "nccl" : "gloo");
  std::vector<ScaleOutSummary> out;
  for (const auto& name : names) out.push_back(run_one(config, corpus, name, pg));
  return out;
#else
  (void)config, (void)corpus, (void)names;
  throw InputError(
      "scale-out runs need gwt::distributed, and gwt was built without it (Gloo's "
      "headers were not found; Debian/Ubuntu: apt install libgloo-dev)");
#endif
}

std::vector<ScaleOutSummary> spawn_scale_out(const ScaleOutConfig& config, const Corpus& corpus,
                                             const std::vector<std::string>& names, int64_t nproc) {
  std::vector<ScaleOutSummary> out;
  for (const auto& name : names) {
    const int port = free_port();
    const std::string summary = config.out + "/" + name + ".summary";
    std::remove(summary.c_str());
    std::fflush(nullptr);
    std::vector<pid_t> pids;
    for (int64_t r = 0; r < nproc; ++r) {
      const pid_t pid = fork();
      if (pid == 0) {
        setenv("RANK", std::to_string(r).c_str(), 1);
        setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
        setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
        setenv("MASTER_ADDR", "127.0.0.1", 1);
        setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
        // The cores shared out among the ranks, as torchrun does with OMP_NUM_THREADS.
        if (std::getenv("OMP_NUM_THREADS") == nullptr)
          at::set_num_threads(
              std::max<int>(1, static_cast<int>(std::thread::hardware_concurrency() / nproc)));
        try {
          const auto s = run_scale_out_in_process(config, corpus, {name});
          if (r == 0) write_scale_out_summary(summary, s.front());
          std::fflush(nullptr);
          _exit(0);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "\ntrain_lm: run %s failed on rank %lld: %s\n", name.c_str(),
                       static_cast<long long>(r), e.what());
          std::fflush(nullptr);
          _exit(1);
        }
      }
      if (pid < 0) throw std::runtime_error("fork failed");
      pids.push_back(pid);
    }
    // Wait for every rank; when one fails, the others get an error from their next collective
    // (a dead peer) or its timeout; any still alive a minute after the first failure is killed.
    bool failed = false;
    std::vector<bool> done(pids.size(), false);
    size_t left = pids.size();
    auto kill_after = std::chrono::steady_clock::time_point::max();
    while (left > 0) {
      for (size_t i = 0; i < pids.size(); ++i) {
        if (done[i]) continue;
        int status = 0;
        const pid_t p = waitpid(pids[i], &status, WNOHANG);
        if (p == 0) continue;
        done[i] = true, --left;
        if (p < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
          if (!failed) kill_after = std::chrono::steady_clock::now() + std::chrono::seconds(60);
          failed = true;
        }
      }
      if (left > 0 && std::chrono::steady_clock::now() > kill_after) {
        for (size_t i = 0; i < pids.size(); ++i)
          if (!done[i]) kill(pids[i], SIGKILL), waitpid(pids[i], nullptr, 0), done[i] = true;
        left = 0;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (failed) throw std::runtime_error("run " + name + " did not finish on every rank");
    out.push_back(read_scale_out_summary(summary));
  }
  return out;
}

std::string scale_out_table(const std::vector<ScaleOutSummary>& runs, const RunSummary* single) {
  std::ostringstream out;
  out << "| run | ranks | val loss | loss vs 1 process | state bytes / rank | state vs 1 process | "
         "bytes sent / step / rank | vs full all-reduce | ms / step |\n";
  out << "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& r : runs) {
    char row[512];
    const std::string loss_ratio =
        single ? (std::ostringstream() << std::showpos << std::fixed << std::setprecision(2)
                                       << 100.0 * (r.val_loss / single->val_loss - 1.0) << "%")
                     .str()
               : "n/a";
    const std::string state_ratio =
        single && single->state_bytes > 0
            ? (std::ostringstream() << std::fixed << std::setprecision(1)
                                    << 100.0 * static_cast<double>(r.state_bytes_per_rank) /
                                           static_cast<double>(single->state_bytes)
                                    << "%")
                  .str()
            : "n/a";
    std::snprintf(row, sizeof(row), "| %s | %lld | %.4f | %s | %lld | %s | %.0f | %.2fx | %.1f |\n",
                  r.label.c_str(), static_cast<long long>(r.ranks), r.val_loss, loss_ratio.c_str(),
                  static_cast<long long>(r.state_bytes_per_rank), state_ratio.c_str(),
                  r.bytes_sent_per_step,
                  r.bytes_full_per_step > 0 ? r.bytes_sent_per_step / r.bytes_full_per_step : 0.0,
                  r.ms_per_step);
    out << row;
  }
  return out.str();
}

}  // namespace lm
