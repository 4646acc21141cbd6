#pragma once

// The language-model comparison behind examples/train_lm: a LLaMA-style decoder written with
// torch::nn, byte-level data with a deterministic split, the optimizers compared, and the report
// writers. A library so that tests/test_lm.cpp can test the pieces.

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/optimizer.h>

#include <gwt/nn/delta_linear.h>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace lm {

/// A user error (bad argument, missing corpus, ...): main prints its one-line message and exits 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---------------------------------------------------------------------------------------------
// Model
// ---------------------------------------------------------------------------------------------

struct ModelConfig {
  int64_t vocab = 256;  // bytes
  int64_t dim = 128;
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t hidden = 344;  // SwiGLU inner size
  int64_t seq_len = 128;
};

struct RMSNormImpl : torch::nn::Module {
  explicit RMSNormImpl(int64_t dim, double eps = 1e-6);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

/// Causal multi-head attention with rotary position embeddings (rotate-half form). The forward
/// looks its projections up by name (gwt::nn::child_forward): adapters that add_adapters puts in
/// their place are used, although the member holders keep pointing to the base layers.
struct AttentionImpl : torch::nn::Module {
  AttentionImpl(int64_t dim, int64_t heads);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  int64_t heads;
  torch::nn::Linear q_proj, k_proj, v_proj, o_proj;
};
TORCH_MODULE(Attention);

/// SwiGLU: down(silu(gate(x)) * up(x)); projections looked up by name like Attention's.
struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t dim, int64_t hidden);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear gate_proj, up_proj, down_proj;
};
TORCH_MODULE(Mlp);

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t dim, int64_t heads, int64_t hidden);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  RMSNorm attn_norm, mlp_norm;
  Attention attn;
  Mlp mlp;
};
TORCH_MODULE(Block);

/// Decoder: embedding, blocks (pre-norm, residual), final RMSNorm, untied output head.
struct DecoderImpl : torch::nn::Module {
  explicit DecoderImpl(const ModelConfig& config);
  /// tokens [batch, time] (int64) -> logits [batch, time, vocab].
  at::Tensor forward(const at::Tensor& tokens);
  ModelConfig config;
  torch::nn::Embedding embed;
  torch::nn::ModuleList blocks;
  RMSNorm norm;
  torch::nn::Linear lm_head;
  at::Tensor rope_cos, rope_sin;  // [seq_len, head_dim / 2], buffers
};
TORCH_MODULE(Decoder);

// ---------------------------------------------------------------------------------------------
// Data
// ---------------------------------------------------------------------------------------------

/// Train and validation text. Documents (fortunes separated by "%" lines; other files by blank
/// lines, or 1 KiB pieces when there are none) go to validation when their index is a multiple of
/// 20 and to training otherwise: deterministic, disjoint, and spread over the whole corpus.
struct Corpus {
  std::string train, val;
  int64_t documents = 0;
  std::string source;
};

/// The English text of Debian's fortunes package (every file of /usr/share/games/fortunes without
/// an extension, in name order).
std::string default_corpus_dir();
/// Reads `path` (a file, or a directory of fortune files; empty = default_corpus_dir()) and splits
/// it. InputError when it is missing, empty, or too small for seq_len.
Corpus load_corpus(const std::string& path, int64_t seq_len);
/// Splits text into documents and those into train/validation as described above.
Corpus split_corpus(const std::string& text);

/// Debian's licence texts, the fine-tuning job's new text: /usr/share/common-licenses.
std::string default_new_corpus_dir();
/// Every regular file of `dir` in name order (symbolic links skipped: Debian's GPL -> GPL-3 and
/// the like are the same text), split into paragraphs at blank lines. A paragraph that repeats one
/// seen before (after collapsing white space; the licence versions share many) is dropped, so no
/// validation paragraph is also a training one; then every 20th goes to validation. Paragraphs
/// stay separated by a blank line. InputError as load_corpus.
Corpus load_paragraph_corpus(const std::string& dir, int64_t seq_len);

/// Random training windows ([batch, seq_len + 1] int64 of bytes), from a seeded generator.
class Batches {
 public:
  Batches(const std::string& text, int64_t batch, int64_t seq_len, uint64_t seed);
  at::Tensor next();

 private:
  const std::string& text_;
  int64_t batch_, seq_len_;
  uint64_t state_;
};

/// Evenly spaced validation windows ([count, seq_len + 1]), the same for every run.
at::Tensor validation_windows(const std::string& text, int64_t seq_len, int64_t count);

// ---------------------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------------------

struct Preset {
  std::string name;
  ModelConfig model;
  int64_t batch = 16, steps = 300, warmup = 30, eval_every = 50, eval_windows = 32;
};
/// "tiny" (CPU, minutes), "llama-20m", "llama-60m" (the paper's shapes, for GPUs).
Preset preset(const std::string& name);
std::vector<std::string> preset_names();

/// One optimizer setting of the comparison; lr and scale are stated in the report.
struct OptimizerSpec {
  std::string name;   // e.g. "wavelet-haar-l2"
  std::string label;  // e.g. "WaveletAdam haar L=2"
  double lr = 3e-3;
  double weight_decay = 0.0;
  std::string wavelet;  // empty for AdamW, GaLore and FOAM
  bool galore = false;
  bool foam = false;  // gwt::FoamAdam at `level` (the authors' grouping)
  int64_t level = 0;
  double scale = 1.0;
};
OptimizerSpec optimizer_spec(const std::string& name);
std::vector<std::string> optimizer_names();

/// Builds the optimizer for a model (WaveletAdam with gwt::paper_param_groups, FoamAdam with
/// gwt::foam_param_groups).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerSpec& spec, Decoder& model);
/// Optimizer-state bytes: {whole model, compressed (wavelet, projected or folded) parameters
/// only}.
std::pair<int64_t, int64_t> state_bytes(torch::optim::Optimizer& opt);

/// Cosine schedule with linear warm-up and a floor at 0.1 of the peak.
double cosine_lr(double peak, int64_t step, int64_t warmup, int64_t total);

/// The training loss on windows [b, T + 1]: mean next-byte cross-entropy of the first T bytes'
/// predictions against the last T bytes.
at::Tensor next_byte_loss(Decoder& model, const at::Tensor& windows);

/// Mean cross-entropy (nats per byte) of the model on windows [n, T + 1].
double evaluate(Decoder& model, const at::Tensor& windows, int64_t batch);

// ---------------------------------------------------------------------------------------------
// Fine-tuning (examples/train_lm/finetune.cpp)
// ---------------------------------------------------------------------------------------------

/// One way of adapting the pre-trained model to a new text.
struct FinetuneSpec {
  std::string name;   // e.g. "lora-k8"
  std::string label;  // e.g. "LoRA k=8"
  /// Every parameter trains, no adapters: AdamW, or WaveletAdam (haar, level 2, scale 0.25, the
  /// paper's grouping) when `wavelet`.
  bool full = false, wavelet = false;
  /// The adapters' DeltaLinearOptions on every attention and MLP projection (not on the
  /// embedding or the output head); the rest of the model is frozen.
  int64_t rank = 0, reflections = 0;
  bool orthogonal_core = false;
  /// Peak learning rates tried (the base lr of gwt::nn::delta_param_groups for adapters: U and V
  /// train at 3x it, reflection and core vectors at 0.25x).
  std::vector<double> lrs;
};
std::vector<std::string> finetune_method_names();
FinetuneSpec finetune_spec(const std::string& name);

/// Prepares `model` for `spec`: full fine-tuning leaves it as it is; otherwise every parameter
/// is frozen and DeltaLinear adapters replace the attention and MLP projections. Returns the
/// adapters by qualified name (none for full fine-tuning).
std::vector<std::pair<std::string, gwt::nn::DeltaLinear>> add_adapters(Decoder& model,
                                                                       const FinetuneSpec& spec);
/// The optimizer of a fine-tuning run at peak lr: make_optimizer's AdamW or WaveletAdam for full
/// fine-tuning, AdamW (eps 1e-6, no weight decay) over delta_param_groups for adapters.
std::unique_ptr<torch::optim::Optimizer> make_finetune_optimizer(const FinetuneSpec& spec,
                                                                 Decoder& model, double lr);
/// Parameters that train (requires_grad) in `model`.
int64_t trainable_parameters(Decoder& model);

// ---------------------------------------------------------------------------------------------
// Reports
// ---------------------------------------------------------------------------------------------

struct EvalPoint {
  int64_t step;
  double lr, train_loss, val_loss, seconds;
};

struct RunSummary {
  std::string name, label;
  double lr = 0, scale = 1;
  double val_loss = 0, val_ppl = 0;
  int64_t state_bytes = 0, wavelet_state_bytes = 0;
  int64_t peak_rss_bytes = 0;
  double ms_per_step = 0;
  int64_t steps = 0;
};

/// Writes step,lr,train_loss,val_loss,val_ppl,seconds.
void write_csv(const std::string& path, const std::vector<EvalPoint>& points);
std::vector<EvalPoint> read_csv(const std::string& path);
void write_summary(const std::string& path, const RunSummary& s);
/// The key=value lines of a file (read_summary's format); InputError when it cannot be read.
std::map<std::string, std::string> read_key_values(const std::string& path);
/// kv[key], or an InputError saying that `path` has no `key`.
const std::string& value_of(const std::map<std::string, std::string>& kv, const std::string& key,
                            const std::string& path);
RunSummary read_summary(const std::string& path);
/// The Markdown results table; the first run (AdamW) is the baseline of the ratio columns.
std::string results_table(const std::vector<RunSummary>& runs);

/// Creates dir (and parents) and checks that a file can be written in it; InputError otherwise.
void ensure_writable_dir(const std::string& dir);

}  // namespace lm
