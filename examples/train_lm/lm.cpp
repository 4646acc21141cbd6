#include "lm.h"

#include <ATen/ATen.h>
#include <gwt/gwt.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/init.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <set>
#include <sstream>

namespace lm {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// Model
// ---------------------------------------------------------------------------------------------

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_) : eps(eps_) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * weight;
}

namespace {
torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

// Rotary embedding, rotate-half form: (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return at::cat({x1 * cos - x2 * sin, x1 * sin + x2 * cos}, -1);
}
}  // namespace

AttentionImpl::AttentionImpl(int64_t dim, int64_t heads_)
    : heads(heads_),
      q_proj(register_module("q_proj", linear(dim, dim))),
      k_proj(register_module("k_proj", linear(dim, dim))),
      v_proj(register_module("v_proj", linear(dim, dim))),
      o_proj(register_module("o_proj", linear(dim, dim))) {
  TORCH_CHECK(dim % heads == 0 && (dim / heads) % 2 == 0, "dim must split into even-sized heads");
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos,
                                  const at::Tensor& sin) {
  const int64_t b = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads;
  auto split = [&](const at::Tensor& y) { return y.view({b, t, heads, hd}).transpose(1, 2); };
  const at::Tensor c = cos.narrow(0, 0, t), s = sin.narrow(0, 0, t);
  // Layers by name (gwt::nn::child_forward), so that adapters put in by add_adapters are used.
  auto proj = [&](const char* name, const at::Tensor& in) {
    return gwt::nn::child_forward(*this, name, in);
  };
  const at::Tensor q = rope(split(proj("q_proj", x)), c, s);
  const at::Tensor k = rope(split(proj("k_proj", x)), c, s);
  const at::Tensor v = split(proj("v_proj", x));
  const at::Tensor y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
  return proj("o_proj", y.transpose(1, 2).reshape({b, t, d}));
}

MlpImpl::MlpImpl(int64_t dim, int64_t hidden)
    : gate_proj(register_module("gate_proj", linear(dim, hidden))),
      up_proj(register_module("up_proj", linear(dim, hidden))),
      down_proj(register_module("down_proj", linear(hidden, dim))) {}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  auto proj = [&](const char* name, const at::Tensor& in) {
    return gwt::nn::child_forward(*this, name, in);
  };
  return proj("down_proj", torch::nn::functional::silu(proj("gate_proj", x)) * proj("up_proj", x));
}

BlockImpl::BlockImpl(int64_t dim, int64_t heads, int64_t hidden)
    : attn_norm(register_module("attn_norm", RMSNorm(dim))),
      mlp_norm(register_module("mlp_norm", RMSNorm(dim))),
      attn(register_module("attn", Attention(dim, heads))),
      mlp(register_module("mlp", Mlp(dim, hidden))) {}

at::Tensor BlockImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor h = x + attn(attn_norm(x), cos, sin);
  return h + mlp(mlp_norm(h));
}

DecoderImpl::DecoderImpl(const ModelConfig& c)
    : config(c),
      embed(register_module("embed", torch::nn::Embedding(c.vocab, c.dim))),
      blocks(register_module("blocks", torch::nn::ModuleList())),
      norm(register_module("norm", RMSNorm(c.dim))),
      lm_head(register_module("lm_head", linear(c.dim, c.vocab))) {
  for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(Block(c.dim, c.heads, c.hidden));
  // Small init as in LLaMA-style training code.
  // Through torch::nn::init (LibTorch's own code, no grad): GCC 12 with the sanitizers' flags
  // warned that Tensor::normal_'s defaulted std::optional<Generator> "may be used uninitialized"
  // when inlined here (a false positive, an error under -Werror); the same draw either way.
  for (auto& p : parameters())
    if (p.dim() == 2) torch::nn::init::normal_(p, 0.0, 0.02);
  const int64_t half = c.dim / c.heads / 2;
  const at::Tensor inv_freq =
      at::pow(10000.0, -at::arange(half, at::kFloat) / static_cast<double>(half));
  const at::Tensor angles = at::outer(at::arange(c.seq_len, at::kFloat), inv_freq);
  rope_cos = register_buffer("rope_cos", angles.cos());
  rope_sin = register_buffer("rope_sin", angles.sin());
}

at::Tensor DecoderImpl::forward(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) <= config.seq_len,
              "tokens must be [batch, <= seq_len]");
  at::Tensor x = embed(tokens);
  for (const auto& block : *blocks) x = block->as<BlockImpl>()->forward(x, rope_cos, rope_sin);
  return lm_head(norm(x));
}

// ---------------------------------------------------------------------------------------------
// Data
// ---------------------------------------------------------------------------------------------

std::string default_corpus_dir() {
  return "/usr/share/games/fortunes";
}

namespace {

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

std::vector<std::string> split_documents(const std::string& text) {
  std::vector<std::string> docs;
  auto flush = [&](std::string& doc) {
    if (doc.find_first_not_of(" \t\r\n") != std::string::npos) docs.push_back(doc);
    doc.clear();
  };
  std::istringstream lines(text);
  std::string line, doc;
  bool fortune_format = text.find("\n%\n") != std::string::npos;
  while (std::getline(lines, line)) {
    const bool separator =
        fortune_format ? line == "%" : line.find_first_not_of(" \t\r") == std::string::npos;
    if (separator) {
      flush(doc);
    } else {
      doc += line;
      doc += '\n';
    }
  }
  flush(doc);
  if (docs.size() < 20) {  // no structure to speak of: 1 KiB pieces
    docs.clear();
    for (size_t i = 0; i < text.size(); i += 1024) docs.push_back(text.substr(i, 1024));
  }
  return docs;
}

}  // namespace

namespace {
// Every 20th document to validation, the rest to training; each followed by `separator`.
Corpus assign_documents(const std::vector<std::string>& docs, const std::string& separator) {
  Corpus c;
  c.documents = static_cast<int64_t>(docs.size());
  for (size_t i = 0; i < docs.size(); ++i) (i % 20 == 0 ? c.val : c.train) += docs[i] + separator;
  return c;
}

void check_corpus_size(const Corpus& c, const fs::path& path, int64_t seq_len) {
  const auto need = static_cast<size_t>(seq_len + 2);
  if (c.train.size() < need || c.val.size() < need)
    throw InputError("corpus '" + path.string() +
                     "' is too small: " + std::to_string(c.train.size()) + " training and " +
                     std::to_string(c.val.size()) + " validation bytes, need at least " +
                     std::to_string(need) + " of each");
}

std::vector<fs::path> list_directory(const fs::path& path) {
  std::error_code ec;
  std::vector<fs::path> entries;
  fs::directory_iterator it(path, ec), end;
  if (ec)
    throw InputError("corpus directory '" + path.string() + "' cannot be listed: " + ec.message());
  for (; it != end; it.increment(ec)) {
    if (ec)
      throw InputError("corpus directory '" + path.string() +
                       "' cannot be listed: " + ec.message());
    entries.push_back(it->path());
  }
  std::sort(entries.begin(), entries.end());
  return entries;
}
}  // namespace

Corpus split_corpus(const std::string& text) {
  return assign_documents(split_documents(text), "");
}

Corpus load_corpus(const std::string& path_arg, int64_t seq_len) {
  const fs::path path = path_arg.empty() ? fs::path(default_corpus_dir()) : fs::path(path_arg);
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw InputError(
        "corpus '" + path.string() + "' does not exist" +
        (path_arg.empty() ? " (install Debian's fortunes package, or pass --corpus FILE)" : ""));
  std::string text;
  if (fs::is_directory(path, ec)) {
    for (const auto& f : list_directory(path)) {
      std::error_code type_ec;
      if (fs::is_regular_file(f, type_ec) && !f.has_extension()) text += read_file(f) + "%\n";
    }
  } else {
    std::ifstream probe(path, std::ios::binary);
    if (!probe) throw InputError("corpus '" + path.string() + "' cannot be read");
    text = read_file(path);
  }
  if (text.find_first_not_of(" \t\r\n%") == std::string::npos)
    throw InputError("corpus '" + path.string() + "' is empty");
  Corpus c = split_corpus(text);
  c.source = path.string();
  check_corpus_size(c, path, seq_len);
  return c;
}

std::string default_new_corpus_dir() {
  return "/usr/share/common-licenses";
}

Corpus load_paragraph_corpus(const std::string& dir, int64_t seq_len) {
  const fs::path path(dir);
  std::error_code ec;
  if (!fs::is_directory(path, ec))
    throw InputError("corpus directory '" + path.string() + "' does not exist");
  std::vector<std::string> paragraphs;
  std::set<std::string> seen;
  for (const auto& f : list_directory(path)) {
    std::error_code type_ec;
    if (fs::is_symlink(f, type_ec) || !fs::is_regular_file(f, type_ec)) continue;
    std::istringstream lines(read_file(f));
    std::string line, paragraph;
    auto flush = [&] {
      std::string key;  // white space collapsed to single blanks
      std::istringstream words(paragraph);
      for (std::string w; words >> w;) key += (key.empty() ? "" : " ") + w;
      if (!key.empty() && seen.insert(key).second) paragraphs.push_back(paragraph);
      paragraph.clear();
    };
    while (std::getline(lines, line)) {
      if (line.find_first_not_of(" \t\r") == std::string::npos)
        flush();
      else
        paragraph += line + '\n';
    }
    flush();
  }
  if (paragraphs.empty()) throw InputError("corpus directory '" + path.string() + "' is empty");
  Corpus c = assign_documents(paragraphs, "\n");
  c.source = path.string();
  check_corpus_size(c, path, seq_len);
  return c;
}

namespace {
at::Tensor window(const std::string& text, int64_t start, int64_t len) {
  at::Tensor out = at::empty({len}, at::kLong);
  auto* p = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < len; ++i)
    p[i] = static_cast<unsigned char>(text[static_cast<size_t>(start + i)]);
  return out;
}
}  // namespace

Batches::Batches(const std::string& text, int64_t batch, int64_t seq_len, uint64_t seed)
    : text_(text), batch_(batch), seq_len_(seq_len), state_(seed * 0x9E3779B97F4A7C15ull + 1) {}

at::Tensor Batches::next() {
  std::vector<at::Tensor> rows;
  const auto span = static_cast<uint64_t>(static_cast<int64_t>(text_.size()) - seq_len_ - 1);
  for (int64_t i = 0; i < batch_; ++i) {
    // splitmix64: the same sequence on every platform.
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    rows.push_back(window(text_, static_cast<int64_t>(z % (span + 1)), seq_len_ + 1));
  }
  return at::stack(rows);
}

at::Tensor validation_windows(const std::string& text, int64_t seq_len, int64_t count) {
  const int64_t span = static_cast<int64_t>(text.size()) - seq_len - 1;
  std::vector<at::Tensor> rows;
  for (int64_t i = 0; i < count; ++i)
    rows.push_back(window(text, count > 1 ? span * i / (count - 1) : 0, seq_len + 1));
  return at::stack(rows);
}

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
  return {"adamw",           "wavelet-haar-l1", "wavelet-haar-l2",
          "wavelet-haar-l3", "wavelet-db2-l2",  "galore"};
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
