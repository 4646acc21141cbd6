#pragma once

/// \file
/// gwt::nn::DeltaLinear: a frozen linear layer adapted by Householder reflections on its input side
/// (HRA, "Householder Reflection Adaptation", NeurIPS 2024) and by a low-rank delta with an
/// optional orthogonal core (LoRA when the core is the identity):
///
///     y = x (W H_1 ... H_r)^T + (alpha / k0) x (U Q V^T)^T + b
///
/// with H_i = I - 2 u_i u_i^T / (u_i^T u_i) (u_i = column i of `reflections` [in, r]; H_1 first),
/// Q = H'_1 ... H'_k (column j of `core` [k, k] is the j-th Householder vector) or Q = I, U [out,
/// k], V [in, k], and k0 the rank the layer was made with, or the one it grew to on each growth
/// from rank 0 (there is no delta to keep then: the scale is reset to alpha / k_new). Any other
/// resize keeps the scale alpha / k0, so that it never rescales the delta. The base's `weight`
/// [out, in] and `bias` [out] are frozen unless train_base(true).
///
/// Products of reflections are applied in the compact WY form I - Y T Y^T (Schreiber and Van Loan),
/// built from the normalised vectors (T by one triangular solve, the inverse of
/// striu(Y^T Y) + I / 2): two matrix products with [in, r] factors per application, never an
/// [in, in] matrix. The forward applies H_1 ... H_r to x's rows when there are at most
/// out_features of them (tokens: x's elements / in), else to W's rows (cost O(out in r) whatever
/// the tokens): benchmarks/bench_reflections.cpp (docs/adapters.md) found WY faster than r
/// rank-1 updates, and each side the faster one where its cost is lower. With gram_schmidt(true)
/// the vectors are orthonormalised in order first (modified Gram-Schmidt), and the product is
/// HRA's I - 2 Q Q^T.
///
/// Start: V is random and U zero, so the delta starts at exactly zero and a layer without
/// reflections computes what its base computes, bit for bit. Reflections start in equal pairs
/// (u_{2j} = u_{2j+1}, so H_{2j} H_{2j+1} = I): with an even r the layer starts equal to its base
/// to rounding. An odd r cannot start at the identity (a single reflection never is one): the
/// first r - 1 vectors are paired and the last is random, so the layer starts as W H_r, an
/// orthogonal change of the base that keeps its singular values (PEFT's HRA warns likewise).
/// gram_schmidt(true) needs independent vectors (a pair orthonormalises to a zero vector), so all r
/// are random: such a layer starts as W (I - 2 Q Q^T), never as its base. The core starts in pairs
/// too (Q = I for even k; for odd k one reflection, which the zero U hides). Reflection vectors are
/// uniform in [-1/sqrt(in), 1/sqrt(in)] (norm ~0.58 whatever in and r); PEFT's HRA starts them at
/// norm ~sqrt(2 in / (3 r)) (~18 at in = 4096, r = 8). A reflection depends on its vector's
/// direction only, and the gradient scales as 1 / norm: an Adam step of lr turns gwt's vectors
/// sqrt(2 in / r) times (32 at in = 4096, r = 8) as far as PEFT's, an SGD step 2 in / r times. So
/// divide a PEFT HRA learning rate by that factor (docs/adapters.md).
///
/// State: the module's parameters (weight, bias, U, V, reflections, core) and the scale, whose
/// saved value is the one buffer, `delta_scale` (float64): load() and resize_rank() set it together
/// with the host copy of the scale that the forward reads (writing the buffer directly does not
/// change the forward). So a module archive (torch::save / torch::load) restores the layer exactly,
/// rank changes included; load() refuses an archive with a bias, reflection vectors or a core that
/// the layer lacks, or without one it has. U and V are always registered ([out, 0] and [in, 0] at
/// rank 0, the core [0, 0]), so a growth from rank 0 keeps their identity. The computation itself
/// is the stateless delta_linear_* functions below, which gwt.nn.DeltaLinear (Python) calls too.
///
/// bfloat16/float16 bases: the adapter's own parameters are float32 (to(dtype) keeps them so) and
/// the whole adapted product is computed in float32, then rounded to the input's dtype.

#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace gwt {
namespace nn {

struct DeltaLinearOptions {
  DeltaLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  /// k: the low-rank delta's rank, in [0, min(in, out)] (0: no delta).
  TORCH_ARG(int64_t, rank) = 0;
  /// r: Householder reflections on the input side, in [0, in] (0: none).
  TORCH_ARG(int64_t, reflections) = 0;
  /// Q = H'_1 ... H'_k between U and V^T; false: Q = I (LoRA).
  TORCH_ARG(bool, orthogonal_core) = false;
  /// The delta's scale is alpha / k at construction; 0 means alpha = k (scale 1).
  TORCH_ARG(double, alpha) = 0;
  /// HRA's Gram-Schmidt form W (I - 2 Q Q^T), Q the orthonormalised reflection vectors.
  TORCH_ARG(bool, gram_schmidt) = false;
  /// Train the base weight and bias as well (they are frozen by default).
  TORCH_ARG(bool, train_base) = false;
};

/// orthogonality_error(): ||P^T P - I||_F of the reflection product and of the core (0 when
/// absent).
struct OrthogonalityError {
  double reflections = 0;
  double core = 0;
};

/// Everything that defines one adapted layer's output: the base's tensors, the adapter's
/// (undefined when not used: reflections without reflections, core without orthogonal_core; U and
/// V may be [out, 0] and [in, 0]) and the delta's scale.
struct DeltaLinearState {
  at::Tensor weight, bias;             // the base's [out, in] and [out] (bias may be undefined)
  at::Tensor U, V, reflections, core;  // [out, k], [in, k], [in, r], [k, k]
  double scaling = 1;                  // alpha / k0
};

/// The stateless functions behind DeltaLinear (and gwt.nn.DeltaLinear in Python): each takes the
/// tensors it needs and returns new ones, changing nothing, so that any number of threads may call
/// them at once. Every tensor must be a plain CPU or CUDA tensor (no meta tensor, no tensor
/// subclass) of the shapes above, on the weight's device; else a c10::Error.
///
/// The start values for `options` over the base `weight` and `bias` (undefined: no bias), checked
/// as the DeltaLinear constructor checks them; draws from the default generator of the weight's
/// device.
DeltaLinearState delta_linear_init(const at::Tensor& weight, const at::Tensor& bias,
                                   const DeltaLinearOptions& options);
/// x [..., in] -> [..., out], in x's dtype.
at::Tensor delta_linear_forward(const at::Tensor& x, const DeltaLinearState& state,
                                bool gram_schmidt);
/// scaling U Q V^T [out, in] (zeros when the rank is 0), in the adapter's math dtype.
at::Tensor delta_linear_delta_weight(const DeltaLinearState& state);
/// W H_1 ... H_r + scaling U Q V^T in the base's dtype, without autograd history.
at::Tensor delta_linear_merged_weight(const DeltaLinearState& state, bool gram_schmidt);
OrthogonalityError delta_linear_orthogonality_error(const DeltaLinearState& state,
                                                    bool gram_schmidt);
at::Tensor delta_linear_orthogonality_penalty(const DeltaLinearState& state, double lambda);
/// The state at rank k_new in [0, min(in, out)] (see DeltaLinearImpl::resize_rank) and the
/// relative reconstruction error; `options` gives in, out, alpha and orthogonal_core.
struct DeltaLinearResized {
  DeltaLinearState state;
  double error = 0;
};
DeltaLinearResized delta_linear_resize_rank(const DeltaLinearState& state,
                                            const DeltaLinearOptions& options, int64_t k_new);

class DeltaLinearImpl : public torch::nn::Module {
 public:
  /// Adapts `base` (its weight and bias are shared, not copied, and frozen unless train_base).
  DeltaLinearImpl(torch::nn::Linear base, DeltaLinearOptions options);

  /// x [..., in] -> [..., out], in x's dtype.
  at::Tensor forward(const at::Tensor& x);

  /// A plain torch::nn::Linear with W H_1 ... H_r + (alpha / k0) U Q V^T as its weight (in the
  /// base's dtype) and a copy of the base's bias: the same output to rounding. Built without a
  /// random initialisation (no random numbers drawn).
  torch::nn::Linear merge() const;

  /// The dense [out, in] change merge() adds to W H (zeros when rank is 0), float64 if W is.
  at::Tensor delta_weight() const;

  OrthogonalityError orthogonality_error() const;
  /// HRA's regulariser lambda * ||I - N^T N||_F^2, N the reflection vectors normalised to unit
  /// length (0 without reflections): a tensor to add to the loss.
  at::Tensor orthogonality_penalty(double lambda) const;

  /// Changes the delta's rank to k_new in [0, min(in, out)] and returns the relative
  /// reconstruction error ||delta - delta'||_F / ||delta||_F (0 when growing or unchanged, and for
  /// a zero delta). Growing appends zero columns to U (random ones to V; the core gains paired
  /// vectors on the new coordinates only): the function is unchanged, and the output equals the
  /// one before to rounding (the new columns add exact zeros, but the kept ones now go through
  /// products of another size, which may round differently; keeping the bits would need a check
  /// of U's values at every forward, a host synchronisation on CUDA). Shrinking keeps the best
  /// rank-k_new approximation (truncated SVD of U Q V^T, in float64): U and V are replaced and the
  /// core restarts at its paired start. The parameters keep their identity (their tensors are
  /// resized in place, from rank 0 too), so an optimizer still holds them; their gradients are
  /// reset. gwt::nn::resize_rank (rank_schedule.h) makes an optimizer's state fit as well.
  double resize_rank(int64_t k_new);

  /// Converts the base to `dtype` and keeps the adapter's parameters in its math dtype (float32
  /// for a bfloat16/float16 base) and the scale in float64. dtype must be Float, Double, Half or
  /// BFloat16.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  /// Module::load, with the values converted to this module's devices and dtypes, and the rank and
  /// scale taken from the archive. An archive with a bias, reflection vectors or a core that this
  /// layer lacks (or without one it has) is an error. Shapes, parts and scale are checked first: on
  /// an error nothing changes.
  void load(torch::serialize::InputArchive& archive) override;

  const DeltaLinearOptions& options() const { return options_; }
  int64_t rank() const { return options_.rank(); }
  /// alpha / k0, the scale the forward reads (`delta_scale` holds its saved value).
  double scaling() const { return scaling_; }
  /// Parameters that train (the adapter's, and the base's with train_base).
  int64_t trainable_parameter_count() const;
  /// The tensors and scale, for the delta_linear_* functions.
  DeltaLinearState state() const;

  at::Tensor weight, bias;       // the base's (bias undefined without one)
  at::Tensor U, V;               // [out, k], [in, k]; [out, 0] and [in, 0] at rank 0
  at::Tensor reflections, core;  // undefined when not used

 private:
  friend struct DeltaLinearAccess;
  void set_scaling(double scaling);
  void convert(const std::optional<at::Device>& device, const std::optional<at::ScalarType>& dtype,
               bool non_blocking);
  DeltaLinearOptions options_;
  // The scale, read at every forward: kept on the host so that reading it never waits for a
  // device. delta_scale_ is its copy in the module's state (saved and loaded with it).
  double scaling_ = 1;
  at::Tensor delta_scale_;
};
TORCH_MODULE(DeltaLinear);

/// Which Linear submodules add_delta_adapters replaces: sees the qualified name ("blocks.0.q").
using NameFilter = std::function<bool(const std::string& name)>;

/// Replaces every torch::nn::Linear submodule of `module` whose qualified name passes `filter`
/// by a DeltaLinear over it (in/out features taken from each layer; the rest from `options`), in
/// place (Module::replace_module). Returns the new adapters by qualified name. Holders that keep
/// their own reference to a replaced submodule (a member torch::nn::Linear) keep the base: the
/// module's forward must look its layers up by name (child_forward), or use the returned adapters.
/// Linear layers inside a torch::nn::Sequential, ModuleList or ModuleDict are refused with a
/// c10::Error (those containers run their own list of modules, which replace_module does not
/// change). Every matching
/// layer is checked before any is replaced (everything the DeltaLinear constructor checks), and
/// `filter` is called once per Linear layer.
std::vector<std::pair<std::string, DeltaLinear>> add_delta_adapters(
    torch::nn::Module& module, const DeltaLinearOptions& options, const NameFilter& filter);

/// The forward of a linear layer, whatever add_delta_adapters or merge_delta_adapters made of it:
/// a torch::nn::Linear, a DeltaLinear or a gwt::nn::LowRankLinear (anything else is a c10::Error).
at::Tensor linear_forward(torch::nn::Module& layer, const at::Tensor& x);

/// linear_forward of `parent`'s registered child `name`, looked up at each call: a model whose
/// forward calls its layers so sees the adapters add_delta_adapters puts in (a member
/// torch::nn::Linear holder keeps pointing to the base).
at::Tensor child_forward(torch::nn::Module& parent, const std::string& name, const at::Tensor& x);

/// Replaces every DeltaLinear submodule by its merge(); returns how many were merged. A DeltaLinear
/// inside a torch::nn::Sequential, ModuleList or ModuleDict (containers that run their own list of
/// modules, which replace_module does not change) is a c10::Error, with nothing merged.
int64_t merge_delta_adapters(torch::nn::Module& module);

/// Learning-rate multipliers of delta_param_groups (the source's ranges: U and V at 3-5x the base
/// lr, reflection vectors at 0.1-0.5x).
struct DeltaLrMultipliers {
  double base = 1.0;
  double low_rank = 3.0;
  double reflections = 0.25;
  double core = 0.25;
};

/// Parameter groups of `module`: trainable base weights (and every other trainable parameter) at
/// lr, U and V at low_rank x lr, reflection vectors at reflections x lr, core vectors at core x lr
/// (the adapter parameters of its DeltaLinear submodules, whatever other parameters are named).
/// `make_options(lr)` builds each group's options (e.g. torch::optim::AdamWOptions or
/// gwt::WaveletAdamOptions); empty groups are left out; frozen parameters are not included.
std::vector<torch::optim::OptimizerParamGroup> delta_param_groups(
    const torch::nn::Module& module, double lr,
    const std::function<std::unique_ptr<torch::optim::OptimizerOptions>(double lr)>& make_options,
    const DeltaLrMultipliers& multipliers = {});

/// The adapters alone: every DeltaLinear of `module` by qualified name, with its options, rank,
/// scale and its U, V, reflection and core vectors; the base's weight and bias only where they
/// were trained (train_base), since the adapters are only right with the base they trained with.
/// A few percent of the model's bytes (frozen bases); format "gwt.DeltaAdapters.v1".
void save_delta_adapters(const torch::nn::Module& module, torch::serialize::OutputArchive& archive);
void save_delta_adapters(const torch::nn::Module& module, const std::string& path);

/// Puts saved adapters onto `module`: each named layer must be a torch::nn::Linear (a fresh base)
/// or a DeltaLinear with the saved in/out features. A DeltaLinear with the saved options (rank,
/// reflections, core, alpha, gram_schmidt, train_base) takes the saved values in place: its
/// parameters keep their identity, so an optimizer built over the model keeps training them (their
/// gradients are reset). Any
/// other layer is replaced by a new DeltaLinear over its base; where that layer sits in a container
/// that runs its own list of modules (torch::nn::Sequential, ModuleList, ModuleDict), which
/// replace_module does not change, it is a c10::Error. Everything is checked first (names, shapes,
/// dtypes, finite values, options, a name at most once, reflection and core vectors that define
/// reflections: none zero or with a norm that under- or overflows, and with gram_schmidt none that
/// is zero once the ones before it are projected out); on any error nothing is changed. A saved
/// trained base (train_base) is put into the layer's base. The default generators of the devices
/// the replacements are built on are left as they were (building a replacement draws start values
/// that the saved ones overwrite). Returns the adapters by name.
std::vector<std::pair<std::string, DeltaLinear>> load_delta_adapters(
    torch::nn::Module& module, torch::serialize::InputArchive& archive);
/// `device`: where the file's tensors are read to (its map location) before they are copied to
/// each layer's device; the CPU default reads adapters saved from CUDA layers on any machine.
std::vector<std::pair<std::string, DeltaLinear>> load_delta_adapters(
    torch::nn::Module& module, const std::string& path,
    std::optional<at::Device> device = at::Device(at::kCPU));

/// The trouble-shooting figures of one training step (see delta_diagnostics).
struct DeltaDiagnostics {
  struct Layer {
    std::string name;
    OrthogonalityError orthogonality;
    double grad_u = 0, grad_v = 0;  // ||grad U||_F, ||grad V||_F
    double grad_w = 0;              // ||grad W||_F, the would-be gradient when W is frozen
    /// ||grad U|| / ||grad W||: the source's healthy range is 0.1 .. 10 (NaN without U or when
    /// grad W is zero).
    double ratio = 0;
  };
  std::vector<Layer> layers;
  double max_orthogonality_error = 0;
  double grad_norm = 0;  // of every trainable parameter's gradient, before clipping
  double clip_norm = 0;
  bool clipped = false;  // grad_norm > clip_norm: clipping to clip_norm fired
  /// One line: layers, worst orthogonality error, ratio range (and how many fall outside
  /// 0.1 .. 10), gradient norm and whether clipping fired.
  std::string summary() const;
};

/// Runs `loss()` and its backward pass with the adapters' frozen base weights temporarily
/// trainable (so their would-be gradients can be measured; they are cleared again and their
/// requires_grad restored), then clips the trainable parameters' gradients to `clip_norm`
/// (torch::nn::utils::clip_grad_norm_) and reports. The gradients it leaves are the clipped ones of
/// the trainable parameters: an optimizer step may follow. clip_norm <= 0: measure, never clip.
DeltaDiagnostics delta_diagnostics(torch::nn::Module& module,
                                   const std::function<at::Tensor()>& loss, double clip_norm = 1.0);

}  // namespace nn
}  // namespace gwt
