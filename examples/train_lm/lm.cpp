// The model and the data of lm.h (the optimizers, fine-tuning and the reports: lm_training.cpp).

#include "lm.h"

#include <ATen/ATen.h>
#include <gwt/gwt.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
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

}  // namespace lm
