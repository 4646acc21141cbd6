#pragma once

/// \file
/// Compression helpers around WaveletAdam's thresholding: a scheduler for each group's threshold,
/// per-layer strength by depth, and a sparse wavelet-domain representation of a gradient for
/// storage or communication.

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "gwt/optim/wavelet_adam.h"
#include "gwt/wavelet.h"

namespace gwt {

/// Sets each group's `threshold` like the torch::optim LR schedulers set lr: call step() once per
/// epoch or per optimizer step. The rule sees the number of step() calls so far and the group's
/// threshold when the scheduler was made (a group added later: its threshold at the first step()
/// that sees it). The value lives in the group options, so torch::save/torch::load of the
/// optimizer keep it. A rule value that is negative or not finite is a c10::Error that changes no
/// group and does not advance step_count().
class ThresholdScheduler {
 public:
  using Rule = std::function<double(int64_t step, double base_threshold)>;
  ThresholdScheduler(WaveletAdam& optimizer, Rule rule);

  /// From `start` to `end` linearly over `steps` calls, then `end`; clamped to [floor, ceiling].
  static ThresholdScheduler linear_ramp(WaveletAdam& optimizer, double start, double end,
                                        int64_t steps, double floor = 0.0,
                                        double ceiling = std::numeric_limits<double>::infinity());

  void step();
  int64_t step_count() const { return step_count_; }

 private:
  void apply(int64_t step);
  WaveletAdam& optimizer_;
  Rule rule_;
  std::vector<double> base_;
  int64_t step_count_ = 0;
};

/// Parameter groups by depth: the paper's grouping (gwt::assign_param_groups), with the wavelet
/// parameters of layer i of `layers` (the first integer in the parameter's name, e.g.
/// "blocks.3.attn.q_proj.weight") given strength(i, layers, options); wavelet parameters without
/// a layer number keep `options`, dense ones get level 0.
std::vector<torch::optim::OptimizerParamGroup> depth_param_groups(
    const torch::nn::Module& module, const WaveletAdamOptions& options,
    const std::function<WaveletAdamOptions(int64_t layer, int64_t layers,
                                           WaveletAdamOptions options)>& strength);

/// A gradient in the wavelet domain with only the detail coefficients that survive a threshold:
/// the approximation dense, each detail level as its non-zero values in order plus where they
/// are: flat int32 indices (detail_indices[k]) or a bitmask of the whole subband, one bit per
/// coefficient, least significant bit first (detail_masks[k], uint8). Exactly one of the two is
/// defined per level.
struct CompressedGradient {
  std::vector<int64_t> shape;
  std::string wavelet = "haar", boundary = "zero", threshold_mode = "hard";
  int64_t level = 2, dim = -1;
  double threshold = 0;
  at::Tensor approx;
  std::vector<at::Tensor> detail_indices, detail_masks, detail_values;
  std::vector<std::vector<int64_t>> detail_shapes;
  /// ||G - decompress(c)|| / ||G|| at compression (0 when nothing is thresholded, up to rounding).
  double relative_error = 0;

  /// Bytes held (approximation, kept values, their indices or masks) and those of the dense
  /// gradient.
  int64_t bytes() const;
  int64_t dense_bytes() const;
};

/// Transforms along `dim` (gwt::wavedec), thresholds the details (PyWavelets' semantics, "hard"
/// or "soft") and keeps the non-zero ones. `positions`: "auto" (per level, whichever of indices
/// and bitmask is smaller: indices while fewer than 1 in 32 details survive), "indices" or
/// "bitmask".
CompressedGradient compress_gradient(const at::Tensor& grad, const Wavelet& wavelet, int64_t level,
                                     double threshold, const std::string& threshold_mode = "hard",
                                     int64_t dim = -1, BoundaryMode boundary = BoundaryMode::zero,
                                     const std::string& positions = "auto");
at::Tensor decompress_gradient(const CompressedGradient& compressed);

/// torch::save(compressed, path) / torch::load(compressed, path).
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const CompressedGradient& compressed);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           CompressedGradient& compressed);

}  // namespace gwt
