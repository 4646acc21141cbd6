// Fine-tuning comparison (issue 13): the tiny LM of train_lm, pre-trained on the fortunes text,
// adapted to a different real text (Debian's licences) by full fine-tuning (AdamW, WaveletAdam)
// and by gwt::nn::DeltaLinear adapters (LoRA, delta with an orthogonal core, HRA, HRA + delta).
// Every method runs at each learning rate of its sweep from the same pre-trained weights, with
// the same batches; the best lr by validation loss on the new text is reported, with the loss
// on the original text after adapting (forgetting), trainable parameters, optimizer-state bytes
// and ms/step. Writes <out>/<method>.csv (the best lr's curve), <out>/sweep.csv, results.md;
// scripts/plot_finetune.py draws finetune.png.
//
//   train_finetune [--out DIR] [--methods a,b,...] [--pretrain-steps N] [--steps N]
//                  [--corpus PATH] [--new-corpus DIR] [--quiet]
//
// The pre-trained model is kept as <out>/pretrained.pt and reused when <out>/pretrained.txt
// records the same pre-training settings.

#include <ATen/ATen.h>
#include <torch/serialize.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"
#include "lm.h"

namespace {

struct Args {
  std::string out = "results/finetune", corpus, new_corpus = lm::default_new_corpus_dir();
  std::vector<std::string> methods = lm::finetune_method_names();
  int64_t pretrain_steps = 500, steps = 150;
  bool quiet = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw lm::InputError(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--out")
      a.out = value();
    else if (flag == "--methods")
      a.methods = lm::split_list(value());
    else if (flag == "--pretrain-steps")
      a.pretrain_steps =
          lm::parse_whole(flag, value(), 1, 1000000000LL, "a whole number from 1 to 10^9");
    else if (flag == "--steps")
      a.steps = lm::parse_whole(flag, value(), 1, 1000000000LL, "a whole number from 1 to 10^9");
    else if (flag == "--corpus")
      a.corpus = value();
    else if (flag == "--new-corpus")
      a.new_corpus = value();
    else if (flag == "--quiet")
      a.quiet = true;
    else
      throw lm::InputError("unknown argument '" + flag +
                           "' (see the comment at the top of finetune.cpp)");
  }
  if (a.methods.empty()) throw lm::InputError("--methods needs at least one name");
  return a;
}

struct Point {
  int64_t step;
  double train_loss, new_val, old_val;
};

struct Run {
  std::string name, label;
  double lr = 0;
  int64_t trainable = 0, state_bytes = 0;
  double ms_per_step = 0;
  std::vector<Point> points;
  double new_val() const { return points.back().new_val; }
  double old_val() const { return points.back().old_val; }
};

struct Data {
  lm::Corpus old_text, new_text;
  at::Tensor old_val, new_val;
};

// Trains `model` on `text` for `steps` with a cosine schedule (warm-up 10%) scaling every group's
// own lr; evaluates both validation sets every `eval_every` steps and at the end.
Run train(lm::Decoder& model, torch::optim::Optimizer& opt, const std::string& text,
          const Data& data, const lm::Preset& preset, int64_t steps, const std::string& label,
          bool quiet) {
  std::vector<double> peak;
  for (auto& group : opt.param_groups()) peak.push_back(group.options().get_lr());
  lm::Batches batches(text, preset.batch, preset.model.seq_len, 42);
  const int64_t warmup = std::max<int64_t>(1, steps / 10);
  const int64_t eval_every = std::max<int64_t>(1, steps / 8);
  Run run;
  run.label = label;
  double seconds = 0, recent = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < steps; ++step) {
    const double factor = lm::cosine_lr(1.0, step, warmup, steps);
    for (size_t g = 0; g < peak.size(); ++g)
      opt.param_groups()[g].options().set_lr(peak[g] * factor);
    const auto t0 = std::chrono::steady_clock::now();
    const at::Tensor batch = batches.next();
    opt.zero_grad();
    const at::Tensor logits = model->forward(batch.narrow(1, 0, preset.model.seq_len));
    const at::Tensor loss =
        at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}),
                               batch.narrow(1, 1, preset.model.seq_len).reshape({-1}));
    loss.backward();
    opt.step();
    const double value = loss.item<double>();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    recent = step == 0 ? value : 0.9 * recent + 0.1 * value;
    if (!std::isfinite(value)) throw std::runtime_error(label + ": the loss is not finite");
    if ((step + 1) % eval_every == 0 || step + 1 == steps)
      run.points.push_back({step + 1, recent, lm::evaluate(model, data.new_val, preset.batch),
                            lm::evaluate(model, data.old_val, preset.batch)});
    if (!quiet && ((step + 1) % 5 == 0 || step + 1 == steps))
      lm::progress_bar(
          label, 44, step, steps, recent,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  run.ms_per_step = 1000.0 * seconds / static_cast<double>(steps);
  return run;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The pre-trained model: <out>/pretrained.pt when pretrained.txt matches `key`, else trained now
// (AdamW at train_lm's tuned lr 1e-3) and saved.
void pretrain(lm::Decoder& model, const Args& args, const Data& data, const lm::Preset& preset) {
  std::ostringstream key;
  key << "preset=" << preset.name << "\nsteps=" << args.pretrain_steps
      << "\ncorpus=" << data.old_text.source << "\nseed=1234\n";
  const std::string weights = args.out + "/pretrained.pt", meta = args.out + "/pretrained.txt";
  if (slurp(meta) == key.str()) {
    try {
      torch::load(model, weights);
      std::fprintf(stderr, "train_finetune: reusing %s\n", weights.c_str());
      return;
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "train_finetune: %s unreadable, pre-training again\n", weights.c_str());
    }
  }
  lm::OptimizerSpec spec = lm::optimizer_spec("adamw");
  spec.lr = 1e-3;
  auto opt = lm::make_optimizer(spec, model);
  const Run run = train(model, *opt, data.old_text.train, data, preset, args.pretrain_steps,
                        "pre-training (fortunes), AdamW", args.quiet);
  std::fprintf(stderr,
               "train_finetune: pre-trained, validation loss %.4f (fortunes), %.4f (new), %.1f "
               "ms/step\n",
               run.old_val(), run.new_val(), run.ms_per_step);
  torch::save(model, weights);
  std::ofstream(meta) << key.str();
}

void write_curve(const std::string& path, const Run& run) {
  std::ofstream out(path);
  if (!out) throw lm::InputError("cannot write '" + path + "'");
  out << "# " << run.label << ", lr " << run.lr << "\nstep,train_loss,new_val_loss,old_val_loss\n";
  out.precision(9);
  for (const auto& p : run.points)
    out << p.step << ',' << p.train_loss << ',' << p.new_val << ',' << p.old_val << '\n';
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  lm::Preset preset = lm::preset("tiny");
  Data data;
  std::vector<lm::FinetuneSpec> specs;
  try {
    args = parse(argc, argv);
    for (const auto& name : args.methods) specs.push_back(lm::finetune_spec(name));
    lm::ensure_writable_dir(args.out);
    data.old_text = lm::load_corpus(args.corpus, preset.model.seq_len);
    data.new_text = lm::load_paragraph_corpus(args.new_corpus, preset.model.seq_len);
  } catch (const lm::InputError& e) {
    std::fprintf(stderr, "train_finetune: error: %s\n", e.what());
    return 2;
  }
  data.old_val =
      lm::validation_windows(data.old_text.val, preset.model.seq_len, preset.eval_windows);
  data.new_val =
      lm::validation_windows(data.new_text.val, preset.model.seq_len, preset.eval_windows);
  std::fprintf(stderr,
               "train_finetune: preset tiny; original text %s (%zu train / %zu validation bytes), "
               "new text %s (%lld paragraphs, %zu / %zu bytes); %lld pre-training and %lld "
               "fine-tuning steps per run\n",
               data.old_text.source.c_str(), data.old_text.train.size(), data.old_text.val.size(),
               data.new_text.source.c_str(), static_cast<long long>(data.new_text.documents),
               data.new_text.train.size(), data.new_text.val.size(),
               static_cast<long long>(args.pretrain_steps), static_cast<long long>(args.steps));

  try {
    at::manual_seed(1234);
    lm::Decoder base(preset.model);
    pretrain(base, args, data, preset);
    const std::string weights = args.out + "/pretrained.pt";
    const double base_new = lm::evaluate(base, data.new_val, preset.batch);
    const double base_old = lm::evaluate(base, data.old_val, preset.batch);

    std::vector<Run> best;
    std::ofstream sweep(args.out + "/sweep.csv");
    sweep << "method,lr,new_val_loss,old_val_loss,ms_per_step\n";
    for (const auto& spec : specs) {
      Run chosen;
      for (const double lr : spec.lrs) {
        lm::Decoder model(preset.model);
        torch::load(model, weights);
        lm::add_adapters(model, spec);
        auto opt = lm::make_finetune_optimizer(spec, model, lr);
        char label[96];
        std::snprintf(label, sizeof(label), "%s, lr %g", spec.label.c_str(), lr);
        Run run =
            train(model, *opt, data.new_text.train, data, preset, args.steps, label, args.quiet);
        run.name = spec.name, run.label = spec.label, run.lr = lr;
        run.trainable = lm::trainable_parameters(model);
        run.state_bytes = lm::state_bytes(*opt).first;
        sweep << spec.name << ',' << lr << ',' << run.new_val() << ',' << run.old_val() << ','
              << run.ms_per_step << '\n';
        if (chosen.points.empty() || run.new_val() < chosen.new_val()) chosen = run;
      }
      write_curve(args.out + "/" + spec.name + ".csv", chosen);
      best.push_back(chosen);
    }

    std::ostringstream report;
    report << "Preset `tiny` pre-trained " << args.pretrain_steps << " steps on "
           << data.old_text.source << " (AdamW, lr 0.001), then " << args.steps << " steps of "
           << preset.batch << " x " << preset.model.seq_len << " bytes on " << data.new_text.source
           << " per run; each method at the best peak lr of its sweep "
           << "(by validation loss on the new text); validation loss in nats per byte. Before "
           << "adapting: " << std::fixed;
    report.precision(4);
    report << base_new << " on the new text, " << base_old << " on the original.\n\n"
           << "| method | best lr | lrs tried | trainable params | optimizer state bytes | "
              "val loss, new text | val loss, original text | forgetting | ms / step |\n"
           << "|---|---:|---|---:|---:|---:|---:|---:|---:|\n";
    for (size_t i = 0; i < best.size(); ++i) {
      const Run& r = best[i];
      std::string lrs;
      for (const double lr : specs[i].lrs) {
        char b[32];
        std::snprintf(b, sizeof(b), "%s%g", lrs.empty() ? "" : ", ", lr);
        lrs += b;
      }
      char row[512];
      std::snprintf(row, sizeof(row),
                    "| %s | %g | %s | %lld | %lld | %.4f | %.4f | %+.4f | %.1f |\n",
                    r.label.c_str(), r.lr, lrs.c_str(), static_cast<long long>(r.trainable),
                    static_cast<long long>(r.state_bytes), r.new_val(), r.old_val(),
                    r.old_val() - base_old, r.ms_per_step);
      report << row;
    }
    std::cout << report.str();
    std::ofstream(args.out + "/results.md") << report.str();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\ntrain_finetune: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
