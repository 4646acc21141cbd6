// Soak run (issue 12, item 6): trains the small LM of examples/train_lm for many steps with each
// optimizer named, twice in lockstep from the same seed and the same batches:
//
//   run A saves its optimizer with torch::save every --every steps and replaces it by a fresh
//         optimizer over the same parameters, loaded with torch::load;
//   run B never reloads.
//
// At every mark (and at the end) it compares the parameters of A and B with at::equal and the
// bytes of the two optimizers' saved states, and checks the parameters are finite. It reports, per
// optimizer: validation loss at the first mark and at the end, non-finite losses, skipped steps
// (WaveletAdam / GaLoreAdam skipped_steps(), summed over every optimizer object of both runs), and
// whether the reloaded run stayed bit-identical. Exit status 0 only when every check holds: no NaN,
// no skipped step, final loss below the first mark's, reload identical.
//
//   soak [--steps N] [--every N] [--batch N] [--seq N] [--optimizers a,b] [--corpus PATH]
//        [--dir DIR] [--lr X] [--scale X] [--skip-load]
//
// --skip-load is the comparison's self-test: run A's fresh optimizer is not loaded from the file,
// so A and B must diverge at the first mark and the soak must fail (exit status 1).
//
// The model is the tiny preset's (dim 128, 4 layers, 4 heads); --batch/--seq default to the tiny
// preset's 16 x 128. The learning rates are the main job's (3e-3, scale 0.25, cosine with warm-up).

#include <ATen/ATen.h>
#include <gwt/gwt.h>
#include <torch/serialize.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"
#include "lm.h"

namespace {

struct Args {
  int64_t steps = 10000, every = 1000, batch = 16, seq = 128;
  std::vector<std::string> optimizers = {"wavelet-haar-l2", "galore"};
  std::string corpus, dir = "/tmp/gwt-soak";
  double lr = 3e-3, scale = 0.25;
  bool skip_load = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw lm::InputError(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--steps")
      a.steps = lm::parse_whole(flag, value(), 1, INT64_MAX, "a positive integer");
    else if (flag == "--every")
      a.every = lm::parse_whole(flag, value(), 1, INT64_MAX, "a positive integer");
    else if (flag == "--batch")
      a.batch = lm::parse_whole(flag, value(), 1, INT64_MAX, "a positive integer");
    else if (flag == "--seq")
      a.seq = lm::parse_whole(flag, value(), 1, INT64_MAX, "a positive integer");
    else if (flag == "--corpus")
      a.corpus = value();
    else if (flag == "--dir")
      a.dir = value();
    else if (flag == "--lr")
      a.lr = lm::parse_positive(flag, value());
    else if (flag == "--scale")
      a.scale = lm::parse_positive(flag, value());
    else if (flag == "--skip-load")
      a.skip_load = true;
    else if (flag == "--optimizers")
      a.optimizers = lm::split_list(value());
    else
      throw lm::InputError("unknown argument '" + flag +
                           "' (see the comment at the top of soak.cpp)");
  }
  if (a.optimizers.empty()) throw lm::InputError("--optimizers needs at least one name");
  if (a.every > a.steps) throw lm::InputError("--every must be at most --steps");
  return a;
}

int64_t skipped(const torch::optim::Optimizer& opt) {
  if (const auto* w = dynamic_cast<const gwt::WaveletAdam*>(&opt)) return w->skipped_steps();
  if (const auto* g = dynamic_cast<const gwt::GaLoreAdam*>(&opt)) return g->skipped_steps();
  return 0;
}

int64_t svd_fallbacks(const torch::optim::Optimizer& opt) {
  if (const auto* g = dynamic_cast<const gwt::GaLoreAdam*>(&opt)) return g->svd_fallbacks();
  return 0;
}

std::string saved_bytes(const torch::optim::Optimizer& opt) {
  std::ostringstream out;
  torch::save(opt, out);
  return out.str();
}

bool same_parameters(lm::Decoder& a, lm::Decoder& b) {
  const auto pa = a->parameters(), pb = b->parameters();
  if (pa.size() != pb.size()) return false;
  for (size_t i = 0; i < pa.size(); ++i)
    if (!at::equal(pa[i], pb[i])) return false;
  return true;
}

bool finite_parameters(lm::Decoder& m) {
  for (const auto& p : m->parameters())
    if (!at::isfinite(p).all().item<bool>()) return false;
  return true;
}

struct Result {
  std::string label;
  int64_t steps = 0;
  double loss_first = 0, loss_final = 0;    // validation, nats per byte
  double train_first = 0, train_final = 0;  // training loss, mean of the last `every` steps
  int64_t nonfinite = 0, skipped = 0, fallbacks = 0;
  int64_t marks = 0, marks_identical = 0, states_identical = 0;
  double minutes = 0, ms_per_step = 0;
  bool pass() const {
    return nonfinite == 0 && skipped == 0 && loss_final < loss_first && marks_identical == marks;
  }
};

Result soak(const Args& args, const lm::Preset& preset, const lm::Corpus& corpus,
            lm::OptimizerSpec spec) {
  spec.lr = args.lr;
  spec.scale = args.scale;
  at::manual_seed(1234);
  lm::Decoder a(preset.model);
  at::manual_seed(1234);
  lm::Decoder b(preset.model);
  if (!same_parameters(a, b)) throw std::runtime_error("the two models start differently");
  auto opt_a = lm::make_optimizer(spec, a);
  auto opt_b = lm::make_optimizer(spec, b);
  lm::Batches batches(corpus.train, args.batch, args.seq, 42);
  const at::Tensor val = lm::validation_windows(corpus.val, args.seq, preset.eval_windows);
  const int64_t warmup = std::max<int64_t>(1, std::min(preset.warmup, args.steps / 10));
  const std::string path = args.dir + "/" + spec.name + ".pt";

  Result r;
  r.label = spec.label;
  r.steps = args.steps;
  // Skips and SVD fallbacks of A's optimizer objects: a loaded object starts from the counters in
  // the checkpoint (save() writes them), so each object adds what it counted after its load.
  int64_t skipped_a = 0, fallbacks_a = 0, skipped_at_load = 0, fallbacks_at_load = 0;
  double window_loss = 0;
  const auto start = std::chrono::steady_clock::now();
  auto minutes = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 60;
  };
  for (int64_t step = 0; step < args.steps; ++step) {
    const double lr = lm::cosine_lr(spec.lr, step, warmup, args.steps);
    const at::Tensor batch = batches.next();
    const at::Tensor input = batch.narrow(1, 0, args.seq);
    const at::Tensor target = batch.narrow(1, 1, args.seq).reshape({-1});
    for (auto* pair : {&a, &b}) {
      auto& model = *pair;
      auto& opt = pair == &a ? *opt_a : *opt_b;
      for (auto& group : opt.param_groups()) group.options().set_lr(lr);
      opt.zero_grad();
      const at::Tensor logits = model->forward(input);
      const at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), target);
      loss.backward();
      opt.step();
      const double value = loss.item<double>();
      if (!std::isfinite(value)) ++r.nonfinite;
      if (pair == &a) window_loss += value;
    }
    if ((step + 1) % args.every == 0 || step + 1 == args.steps) {
      const bool first = r.marks == 0;
      ++r.marks;
      const bool identical = same_parameters(a, b);
      r.marks_identical += identical;
      r.states_identical += saved_bytes(*opt_a) == saved_bytes(*opt_b);
      if (!finite_parameters(a) || !finite_parameters(b)) ++r.nonfinite;
      const int64_t in_window = (step % args.every) + 1;
      const double train = window_loss / static_cast<double>(in_window);
      window_loss = 0;
      const double v = lm::evaluate(a, val, args.batch);
      if (first) r.loss_first = v, r.train_first = train;
      r.loss_final = v, r.train_final = train;
      std::fprintf(
          stderr, "\r%-22s step %6lld/%lld  train %.4f  val %.4f  identical %s  %.1f min\n",
          spec.label.c_str(), static_cast<long long>(step + 1), static_cast<long long>(args.steps),
          train, v, identical ? "yes" : "NO", minutes());
      if (step + 1 < args.steps) {  // save A's optimizer and continue with a fresh loaded one
        torch::save(*opt_a, path);
        skipped_a += skipped(*opt_a) - skipped_at_load;
        fallbacks_a += svd_fallbacks(*opt_a) - fallbacks_at_load;
        opt_a = lm::make_optimizer(spec, a);
        if (!args.skip_load) torch::load(*opt_a, path);
        skipped_at_load = skipped(*opt_a);
        fallbacks_at_load = svd_fallbacks(*opt_a);
      }
    } else if ((step + 1) % 20 == 0) {
      const double m = minutes();
      std::fprintf(stderr, "\r%-22s step %6lld/%lld  %.1f min, ETA %.1f min ", spec.label.c_str(),
                   static_cast<long long>(step + 1), static_cast<long long>(args.steps), m,
                   m / static_cast<double>(step + 1) * static_cast<double>(args.steps - step - 1));
    }
  }
  std::filesystem::remove(path);
  r.skipped = skipped_a + skipped(*opt_a) - skipped_at_load + skipped(*opt_b);
  r.fallbacks = fallbacks_a + svd_fallbacks(*opt_a) - fallbacks_at_load + svd_fallbacks(*opt_b);
  r.minutes = minutes();
  r.ms_per_step = 60000.0 * r.minutes / static_cast<double>(2 * args.steps);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  lm::Preset preset;
  lm::Corpus corpus;
  std::vector<lm::OptimizerSpec> specs;
  try {
    args = parse(argc, argv);
    preset = lm::preset("tiny");
    preset.model.seq_len = args.seq;
    for (const auto& name : args.optimizers) {
      specs.push_back(lm::optimizer_spec(name));
      if (specs.back().wavelet.empty() && !specs.back().galore)
        throw lm::InputError("--optimizers: the soak covers gwt's optimizers, not '" + name + "'");
    }
    lm::ensure_writable_dir(args.dir);
    corpus = lm::load_corpus(args.corpus, args.seq);
  } catch (const lm::InputError& e) {
    std::fprintf(stderr, "soak: error: %s\n", e.what());
    return 2;
  }
  std::fprintf(stderr,
               "soak: tiny model, %lld steps of %lld x %lld bytes, reload every %lld, %d threads, "
               "corpus %s\n",
               static_cast<long long>(args.steps), static_cast<long long>(args.batch),
               static_cast<long long>(args.seq), static_cast<long long>(args.every),
               at::get_num_threads(), corpus.source.c_str());

  std::vector<Result> results;
  for (const auto& spec : specs) results.push_back(soak(args, preset, corpus, spec));

  std::ostringstream t;
  t << "Tiny model (dim 128, 4 layers), " << args.steps << " steps of " << args.batch << " x "
    << args.seq << " bytes, lr " << args.lr << " (cosine, warm-up "
    << std::max<int64_t>(1, std::min(preset.warmup, args.steps / 10)) << "), scale " << args.scale
    << "; optimizer saved and reloaded into a fresh object every " << args.every
    << " steps, compared with a run that never reloads; validation loss in nats per byte; "
    << at::get_num_threads() << (at::get_num_threads() == 1 ? " thread" : " threads") << ".\n\n"
    << "| optimizer | steps | val loss at " << args.every << " | final val loss | train loss at "
    << args.every << " | final train loss | NaNs | skipped | SVD fallbacks | reload identical"
    << " | state identical | ms / step | minutes | pass |\n"
    << "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---|\n";
  bool all = true;
  char line[512];
  for (const auto& r : results) {
    std::snprintf(
        line, sizeof line,
        "| %s | %lld | %.4f | %.4f | %.4f | %.4f | %lld | %lld | %lld | %s (%lld/%lld) | "
        "%s (%lld/%lld) | %.1f | %.1f | %s |\n",
        r.label.c_str(), static_cast<long long>(r.steps), r.loss_first, r.loss_final, r.train_first,
        r.train_final, static_cast<long long>(r.nonfinite), static_cast<long long>(r.skipped),
        static_cast<long long>(r.fallbacks), r.marks_identical == r.marks ? "yes" : "NO",
        static_cast<long long>(r.marks_identical), static_cast<long long>(r.marks),
        r.states_identical == r.marks ? "yes" : "NO", static_cast<long long>(r.states_identical),
        static_cast<long long>(r.marks), r.ms_per_step, r.minutes, r.pass() ? "yes" : "NO");
    t << line;
    all = all && r.pass();
  }
  std::cout << t.str() << std::flush;
  return all ? 0 : 1;
}
