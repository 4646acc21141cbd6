// Memory on a real model (issue 15, item 4): forward, backward and step of the LM with AdamW and
// with WaveletAdam haar L=2, each in a child process of its own. Reports the peak resident memory,
// the peak of LibTorch's CPU allocator (counted by an allocator wrapped around it), and what each
// optimizer step allocates. The difference between the two runs' allocator peaks must match the
// difference of their state_bytes() within 10%, and WaveletAdam's steady-state step must allocate
// nothing but 0-dim tensors: exit code 1 when either does not hold.
//
//   lm_memory [--preset llama-60m] [--batch 2] [--steps 4]

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "counting_allocator.h"
#include "lm.h"

namespace {

lm::CountingAllocator* counting = nullptr;

struct Result {
  std::string label;
  int64_t state_bytes = 0, allocator_peak = 0, rss_peak = 0;
  int64_t step_calls = 0, step_bytes = 0, step_large = 0;  // allocations inside the last step()
};

Result run(const std::string& name, const lm::Preset& preset, const lm::Corpus& corpus,
           int64_t steps) {
  at::manual_seed(1234);
  lm::Decoder model(preset.model);
  lm::OptimizerSpec spec = lm::optimizer_spec(name);
  if (name != "adamw") spec.lr = 3e-3, spec.scale = 0.25;
  auto opt = lm::make_optimizer(spec, model);
  lm::Batches batches(corpus.train, preset.batch, preset.model.seq_len, 42);
  Result r;
  r.label = spec.label;
  for (int64_t s = 0; s < steps; ++s) {
    opt->zero_grad();
    lm::next_byte_loss(model, batches.next()).backward();
    const int64_t calls = counting->calls(), bytes = counting->allocated(),
                  large = counting->large_calls();
    opt->step();
    r.step_calls = counting->calls() - calls, r.step_bytes = counting->allocated() - bytes;
    r.step_large = counting->large_calls() - large;
  }
  r.state_bytes = lm::state_bytes(*opt).first;
  r.allocator_peak = counting->peak();
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  r.rss_peak = static_cast<int64_t>(usage.ru_maxrss) * 1024;
  return r;
}

int64_t whole(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    const long long x = std::stoll(v, &used);
    if (used == v.size() && x >= 1 && x <= 100000) return x;
  } catch (const std::exception&) {
  }
  throw lm::InputError(flag + " needs a whole number from 1 to 100000, got '" + v + "'");
}

std::string mib(double bytes) {
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(1);
  s << bytes / (1024.0 * 1024.0);
  return s.str();
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset_name = "llama-60m";
  int64_t batch = 2, steps = 4;
  lm::Preset preset;
  lm::Corpus corpus;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string flag = argv[i];
      if (i + 1 >= argc) throw lm::InputError(flag + " needs a value");
      const std::string value = argv[++i];
      if (flag == "--preset")
        preset_name = value;
      else if (flag == "--batch")
        batch = whole(flag, value);
      else if (flag == "--steps")
        steps = whole(flag, value);
      else
        throw lm::InputError("unknown argument '" + flag + "'");
    }
    if (steps < 2)
      throw lm::InputError("--steps must be at least 2 (the first step allocates the state)");
    preset = lm::preset(preset_name);
    preset.batch = batch;
    corpus = lm::load_corpus("", preset.model.seq_len);
  } catch (const lm::InputError& e) {
    std::fprintf(stderr, "lm_memory: error: %s\n", e.what());
    return 2;
  }
  static lm::CountingAllocator allocator(c10::GetCPUAllocator());
  counting = &allocator;
  c10::SetCPUAllocator(&allocator, /*priority=*/100);

  std::vector<Result> results;
  for (const std::string name : {"adamw", "wavelet-haar-l2"}) {
    const std::string file = "/tmp/lm_memory." + std::to_string(getpid()) + "." + name;
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      try {
        const Result r = run(name, preset, corpus, steps);
        std::ofstream(file) << r.state_bytes << " " << r.allocator_peak << " " << r.rss_peak << " "
                            << r.step_calls << " " << r.step_bytes << " " << r.step_large << "\n"
                            << r.label << "\n";
        _exit(0);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "lm_memory: %s failed: %s\n", name.c_str(), e.what());
        _exit(1);
      }
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "lm_memory: error: run %s did not finish\n", name.c_str());
      return 1;
    }
    Result r;
    std::ifstream in(file);
    in >> r.state_bytes >> r.allocator_peak >> r.rss_peak >> r.step_calls >> r.step_bytes >>
        r.step_large;
    in.ignore();
    std::getline(in, r.label);
    std::remove(file.c_str());
    results.push_back(r);
  }

  const Result &a = results[0], &w = results[1];
  const double state_diff = static_cast<double>(a.state_bytes - w.state_bytes);
  const double peak_diff = static_cast<double>(a.allocator_peak - w.allocator_peak);
  const double rss_diff = static_cast<double>(a.rss_peak - w.rss_peak);
  std::cout
      << "Preset `" << preset.name << "` (" << preset.model.dim << " wide, " << preset.model.layers
      << " layers), batch " << preset.batch << " x " << preset.model.seq_len << ", " << steps
      << " steps of forward, backward and step; "
      << "one process per optimizer.\n\n"
      << "| optimizer | state MiB | allocator peak MiB | peak RSS MiB | allocations in a step "
         "| of more than 16 bytes | bytes allocated in a step |\n"
         "|---|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& r : results)
    std::cout << "| " << r.label << " | " << mib(static_cast<double>(r.state_bytes)) << " | "
              << mib(static_cast<double>(r.allocator_peak)) << " | "
              << mib(static_cast<double>(r.rss_peak)) << " | " << r.step_calls << " | "
              << r.step_large << " | " << r.step_bytes << " |\n";
  const double ratio = peak_diff / state_diff;
  std::cout << "\nAdamW minus WaveletAdam: state " << mib(state_diff) << " MiB, allocator peak "
            << mib(peak_diff) << " MiB (" << std::fixed << std::setprecision(3) << ratio
            << "x the state's), peak RSS " << mib(rss_diff) << " MiB (" << rss_diff / state_diff
            << "x).\n";
  const bool ok = std::abs(ratio - 1.0) <= 0.10;
  std::cout << (ok ? "PASS" : "FAIL")
            << ": the allocator peaks differ by the state's difference within 10%\n";
  const bool quiet_step = w.step_large == 0;
  std::cout << (quiet_step ? "PASS" : "FAIL") << ": WaveletAdam's steady-state step allocates "
            << "nothing larger than a 0-dim tensor (" << w.step_calls << " of those, "
            << w.step_bytes << " bytes: the limiter's norm and norm-pass result of each wavelet "
            << "tensor)\n";
  return ok && quiet_step ? 0 : 1;
}
