// The optimizers compared, their schedule and loss, fine-tuning and the reports of lm.h (the
// model and the data: lm.cpp).

#include "lm.h"

#include <ATen/ATen.h>
#include <gwt/gwt.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

namespace lm {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------------------

std::vector<std::string> preset_names() {
  return {"tiny", "llama-20m", "llama-60m"};
}

Preset preset(const std::string& name) {
  Preset p;
  p.name = name;
  if (name == "tiny") {
    p.model = {256, 128, 4, 4, 344, 128};
    p.batch = 16, p.steps = 500, p.warmup = 50, p.eval_every = 50, p.eval_windows = 64;
  } else if (name == "llama-20m") {  // GaLore's 20M shape (byte vocabulary)
    p.model = {256, 256, 4, 4, 688, 256};
    p.batch = 64, p.steps = 5000, p.warmup = 500, p.eval_every = 250, p.eval_windows = 256;
  } else if (name == "llama-60m") {  // the paper's 60M shape (byte vocabulary)
    p.model = {256, 512, 8, 8, 1376, 256};
    p.batch = 64, p.steps = 10000, p.warmup = 1000, p.eval_every = 500, p.eval_windows = 256;
  } else {
    std::string valid;
    for (const auto& n : preset_names()) valid += (valid.empty() ? "" : ", ") + n;
    throw InputError("unknown preset '" + name + "'; valid presets are " + valid);
  }
  return p;
}

std::vector<std::string> optimizer_names() {
  return {"adamw",          "wavelet-haar-l1", "wavelet-haar-l2", "wavelet-haar-l3",
          "wavelet-db2-l2", "galore",          "foam-l2"};
}

OptimizerSpec optimizer_spec(const std::string& name) {
  OptimizerSpec s;
  s.name = name;
  if (name == "adamw") {
    s.label = "AdamW";
    return s;
  }
  if (name == "galore") {  // rank set by make_optimizer: dim / 4, the moments of WaveletAdam L=2
    s.label = "GaLoreAdam r=dim/4";
    s.galore = true;
    return s;
  }
  if (name == "foam-l2") {
    s.label = "FoamAdam L=2";
    s.foam = true, s.level = 2;
    return s;
  }
  const std::vector<std::tuple<std::string, std::string, int64_t>> wavelets = {
      {"wavelet-haar-l1", "haar", 1},
      {"wavelet-haar-l2", "haar", 2},
      {"wavelet-haar-l3", "haar", 3},
      {"wavelet-db2-l2", "db2", 2}};
  for (const auto& [n, w, l] : wavelets)
    if (n == name) {
      s.wavelet = w, s.level = l;
      s.label = "WaveletAdam " + w + " L=" + std::to_string(l);
      return s;
    }
  std::string valid;
  for (const auto& n : optimizer_names()) valid += (valid.empty() ? "" : ", ") + n;
  throw InputError("unknown optimizer '" + name + "'; valid optimizers are " + valid);
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerSpec& spec, Decoder& model) {
  if (spec.galore) {
    // The paper's grouping, with GaLore options: projection for the linear weights, dense others.
    const auto options = gwt::GaLoreAdamOptions(spec.lr)
                             .weight_decay(spec.weight_decay)
                             .rank(model->config.dim / 4)
                             .scale(spec.scale);
    std::vector<at::Tensor> projected, dense;
    for (const auto& a : gwt::assign_param_groups(*model))
      (a.wavelet ? projected : dense).push_back(a.param);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(projected, std::make_unique<gwt::GaLoreAdamOptions>(options));
    groups.emplace_back(
        dense, std::make_unique<gwt::GaLoreAdamOptions>(gwt::GaLoreAdamOptions(options).rank(0)));
    return std::make_unique<gwt::GaLoreAdam>(std::move(groups), options);
  }
  if (spec.foam) {
    const auto options = gwt::FoamAdamOptions(spec.lr)
                             .weight_decay(spec.weight_decay)
                             .level(spec.level)
                             .scale(spec.scale);
    return std::make_unique<gwt::FoamAdam>(gwt::foam_param_groups(*model, options));
  }
  if (spec.wavelet.empty())
    return std::make_unique<torch::optim::AdamW>(
        model->parameters(),
        torch::optim::AdamWOptions(spec.lr).weight_decay(spec.weight_decay).eps(1e-6));
  const auto options = gwt::WaveletAdamOptions(spec.lr)
                           .weight_decay(spec.weight_decay)
                           .wavelet(spec.wavelet)
                           .level(spec.level)
                           .scale(spec.scale);
  return std::make_unique<gwt::WaveletAdam>(gwt::paper_param_groups(*model, options));
}

std::pair<int64_t, int64_t> state_bytes(torch::optim::Optimizer& opt) {
  if (auto* g = dynamic_cast<gwt::GaLoreAdam*>(&opt)) {
    int64_t projected = 0;
    for (const auto& group : g->param_groups())
      for (const auto& p : group.params())
        if (g->is_projected_param(p)) projected += g->state_bytes(p);
    return {g->state_bytes(), projected};
  }
  if (auto* f = dynamic_cast<gwt::FoamAdam*>(&opt)) {
    int64_t folded = 0;
    for (const auto& group : f->param_groups())
      for (const auto& p : group.params())
        if (f->is_folded_param(p)) folded += f->state_bytes(p);
    return {f->state_bytes(), folded};
  }
  if (auto* w = dynamic_cast<gwt::WaveletAdam*>(&opt)) {
    int64_t wavelet = 0;
    for (const auto& group : w->param_groups())
      for (const auto& p : group.params())
        if (w->is_wavelet_param(p)) wavelet += w->state_bytes(p);
    return {w->state_bytes(), wavelet};
  }
  int64_t bytes = 0;
  for (const auto& item : opt.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*item.second);
    for (const at::Tensor* t : {&s.exp_avg(), &s.exp_avg_sq(), &s.max_exp_avg_sq()})
      if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  }
  return {bytes, 0};
}

double cosine_lr(double peak, int64_t step, int64_t warmup, int64_t total) {
  if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double progress =
      std::min(1.0, static_cast<double>(step - warmup) / std::max<int64_t>(1, total - warmup));
  return peak * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * progress)));
}

at::Tensor next_byte_loss(Decoder& model, const at::Tensor& windows) {
  const int64_t t = windows.size(1) - 1;
  const at::Tensor logits = model->forward(windows.narrow(1, 0, t));
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}),
                                windows.narrow(1, 1, t).reshape({-1}));
}

double evaluate(Decoder& model, const at::Tensor& windows, int64_t batch) {
  at::NoGradGuard no_grad;
  model->eval();
  double total = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < windows.size(0); i += batch) {
    const at::Tensor w = windows.narrow(0, i, std::min(batch, windows.size(0) - i));
    const at::Tensor logits = model->forward(w.narrow(1, 0, w.size(1) - 1));
    const at::Tensor target = w.narrow(1, 1, w.size(1) - 1);
    total += at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}), {},
                                    at::Reduction::Sum)
                 .item<double>();
    count += target.numel();
  }
  model->train();
  return total / static_cast<double>(count);
}

// ---------------------------------------------------------------------------------------------
// Fine-tuning
// ---------------------------------------------------------------------------------------------

std::vector<std::string> finetune_method_names() {
  return {"full-adamw", "full-wavelet", "lora-k8", "delta-core-k8", "hra-r8", "hra-delta"};
}

FinetuneSpec finetune_spec(const std::string& name) {
  FinetuneSpec s;
  s.name = name;
  const std::vector<double> adapter_lrs = {1e-3, 3e-3, 1e-2};
  if (name == "full-adamw") {
    s.label = "full fine-tuning, AdamW", s.full = true, s.lrs = {1e-3, 3e-3, 1e-2};
  } else if (name == "full-wavelet") {
    s.label = "full fine-tuning, WaveletAdam haar L=2", s.full = true, s.wavelet = true;
    s.lrs = {1e-3, 3e-3, 1e-2};
  } else if (name == "lora-k8") {
    s.label = "LoRA k=8", s.rank = 8, s.lrs = adapter_lrs;
  } else if (name == "delta-core-k8") {
    s.label = "delta + orthogonal core k=8", s.rank = 8, s.orthogonal_core = true;
    s.lrs = adapter_lrs;
  } else if (name == "hra-r8") {
    s.label = "HRA r=8", s.reflections = 8, s.lrs = {1e-2, 3e-2, 1e-1};
  } else if (name == "hra-delta") {
    s.label = "HRA r=8 + delta k=8", s.reflections = 8, s.rank = 8, s.lrs = adapter_lrs;
  } else {
    std::string valid;
    for (const auto& n : finetune_method_names()) valid += (valid.empty() ? "" : ", ") + n;
    throw InputError("unknown method '" + name + "'; valid methods are " + valid);
  }
  return s;
}

std::vector<std::pair<std::string, gwt::nn::DeltaLinear>> add_adapters(Decoder& model,
                                                                       const FinetuneSpec& spec) {
  if (spec.full) return {};
  for (auto& p : model->parameters()) p.requires_grad_(false);
  const auto options = gwt::nn::DeltaLinearOptions(1, 1)  // in/out taken from each layer
                           .rank(spec.rank)
                           .reflections(spec.reflections)
                           .orthogonal_core(spec.orthogonal_core);
  return gwt::nn::add_delta_adapters(*model, options, [](const std::string& name) {
    return name.find(".attn.") != std::string::npos || name.find(".mlp.") != std::string::npos;
  });
}

std::unique_ptr<torch::optim::Optimizer> make_finetune_optimizer(const FinetuneSpec& spec,
                                                                 Decoder& model, double lr) {
  if (spec.full) {
    OptimizerSpec o = optimizer_spec(spec.wavelet ? "wavelet-haar-l2" : "adamw");
    o.lr = lr;
    if (spec.wavelet) o.scale = 0.25;
    return make_optimizer(o, model);
  }
  auto groups = gwt::nn::delta_param_groups(*model, lr, [](double group_lr) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(group_lr).weight_decay(0).eps(1e-6));
  });
  return std::make_unique<torch::optim::AdamW>(
      std::move(groups), torch::optim::AdamWOptions(lr).weight_decay(0).eps(1e-6));
}

int64_t trainable_parameters(Decoder& model) {
  int64_t n = 0;
  for (const auto& p : model->parameters())
    if (p.requires_grad()) n += p.numel();
  return n;
}

// ---------------------------------------------------------------------------------------------
// Reports
// ---------------------------------------------------------------------------------------------

void ensure_writable_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  const fs::path probe = fs::path(dir) / ".gwt_write_probe";
  std::ofstream out(probe);
  if (ec || !out) throw InputError("output directory '" + dir + "' is not writable");
  out.close();
  fs::remove(probe, ec);
}

void write_csv(const std::string& path, const std::vector<EvalPoint>& points) {
  std::ofstream out(path);
  if (!out) throw InputError("cannot write '" + path + "'");
  out << "step,lr,train_loss,val_loss,val_ppl,seconds\n" << std::setprecision(9);
  for (const auto& p : points)
    out << p.step << ',' << p.lr << ',' << p.train_loss << ',' << p.val_loss << ','
        << std::exp(p.val_loss) << ',' << p.seconds << '\n';
}

std::vector<EvalPoint> read_csv(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InputError("cannot read '" + path + "'");
  std::vector<EvalPoint> out;
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::istringstream row(line);
    std::string cell;
    std::vector<double> v;
    while (std::getline(row, cell, ',')) v.push_back(std::stod(cell));
    if (v.size() != 6) throw InputError("malformed row in '" + path + "': " + line);
    out.push_back({static_cast<int64_t>(v[0]), v[1], v[2], v[3], v[5]});
  }
  return out;
}

void write_summary(const std::string& path, const RunSummary& s) {
  std::ofstream out(path);
  if (!out) throw InputError("cannot write '" + path + "'");
  out << std::setprecision(12) << "name=" << s.name << "\nlabel=" << s.label << "\nlr=" << s.lr
      << "\nscale=" << s.scale << "\nval_loss=" << s.val_loss << "\nval_ppl=" << s.val_ppl
      << "\nstate_bytes=" << s.state_bytes << "\nwavelet_state_bytes=" << s.wavelet_state_bytes
      << "\npeak_rss_bytes=" << s.peak_rss_bytes << "\nms_per_step=" << s.ms_per_step
      << "\nsteps=" << s.steps << "\n";
}

std::map<std::string, std::string> read_key_values(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InputError("cannot read '" + path + "'");
  std::map<std::string, std::string> kv;
  std::string line;
  while (std::getline(in, line)) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) kv[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return kv;
}

const std::string& value_of(const std::map<std::string, std::string>& kv, const std::string& key,
                            const std::string& path) {
  auto it = kv.find(key);
  if (it == kv.end()) throw InputError("'" + path + "' has no " + key);
  return it->second;
}

RunSummary read_summary(const std::string& path) {
  const std::map<std::string, std::string> kv = read_key_values(path);
  auto get = [&](const char* key) { return value_of(kv, key, path); };
  RunSummary s;
  s.name = get("name"), s.label = get("label");
  s.lr = std::stod(get("lr")), s.scale = std::stod(get("scale"));
  s.val_loss = std::stod(get("val_loss")), s.val_ppl = std::stod(get("val_ppl"));
  s.state_bytes = std::stoll(get("state_bytes")),
  s.wavelet_state_bytes = std::stoll(get("wavelet_state_bytes"));
  s.peak_rss_bytes = std::stoll(get("peak_rss_bytes"));
  s.ms_per_step = std::stod(get("ms_per_step")), s.steps = std::stoll(get("steps"));
  return s;
}

std::string results_table(const std::vector<RunSummary>& runs) {
  std::ostringstream out;
  out << "| run | lr | scale | val loss | val ppl | loss vs AdamW | state bytes | state vs AdamW | "
         "compressed-part state | peak RSS MiB | ms / step |\n";
  out << "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  const RunSummary* base = runs.empty() ? nullptr : &runs.front();
  for (const auto& r : runs) {
    char row[512];
    std::snprintf(row, sizeof(row),
                  "| %s | %g | %g | %.4f | %.3f | %+.2f%% | %lld | %.1f%% | %lld | %.0f | %.1f |\n",
                  r.label.c_str(), r.lr, r.scale, r.val_loss, r.val_ppl,
                  base ? 100.0 * (r.val_loss / base->val_loss - 1.0) : 0.0,
                  static_cast<long long>(r.state_bytes),
                  base && base->state_bytes > 0 ? 100.0 * static_cast<double>(r.state_bytes) /
                                                      static_cast<double>(base->state_bytes)
                                                : 100.0,
                  static_cast<long long>(r.wavelet_state_bytes),
                  static_cast<double>(r.peak_rss_bytes) / (1024.0 * 1024.0), r.ms_per_step);
    out << row;
  }
  return out.str();
}

}  // namespace lm
