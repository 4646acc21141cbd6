#pragma once

/// \file
/// Rank adaptation for gwt::nn::DeltaLinear: resizing an adapter together with its optimizer
/// state, and gwt::nn::RankSchedule, the rule that grows or shrinks each adapter's rank from the
/// energy in its last components.

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gwt/nn/delta_linear.h"

namespace gwt {
namespace nn {

/// What happened to an optimizer's state for one resized parameter.
enum class StateFollow {
  none,      // the optimizer held no state for it
  kept,      // grown: the kept components' moments carried over, the new ones start at zero
  restarted  // the state was dropped: the next step starts it afresh (moments 0, step 0)
};

struct ResizeReport {
  int64_t from = 0, to = 0;
  double error = 0;  // resize_rank's relative reconstruction error
  std::vector<std::pair<std::string, StateFollow>> state;  // "U", "V", "core"
};

/// layer->resize_rank(k_new), and the optimizer's state of U, V and core made to fit.
///
/// Growing keeps every component: torch::optim::Adam/AdamW moments (and max_exp_avg_sq) are
/// padded with zeros, step counts kept. gwt::WaveletAdam: dense-path state likewise; wavelet-path
/// state when the new columns only append approximation coefficients (a 1-D transform along the
/// last dimension with haar/db1 and the old rank a multiple of 2^level: each coefficient then
/// covers its own block), else restarted. Shrinking keeps the best rank-k approximation, whose
/// components are rotations of the old ones (an SVD): there are no kept components to carry, so
/// the state of U, V and core restarts. Any other optimizer's state for them restarts.
ResizeReport resize_rank(DeltaLinear& layer, int64_t k_new, torch::optim::Optimizer& optimizer);

struct RankScheduleOptions {
  TORCH_ARG(int64_t, every) = 200;      // evaluate every N calls of step()
  TORCH_ARG(int64_t, step) = 8;         // grow or shrink by this many components
  TORCH_ARG(double, threshold) = 0.05;  // grow when the last `step` components hold more than this
  TORCH_ARG(int64_t, min_rank) = 8;     // >= 1
  TORCH_ARG(int64_t, max_rank) = 256;   // also bounded by each layer's min(in, out)
};

/// Every `every` calls: for each adapter, e = ||last `step` components of U Q V^T||_F / ||U Q
/// V^T||_F (from its singular values, float64). e > threshold: the rank is used to its end, grow by
/// `step`; e < threshold / 2: shrink by `step`; within [min_rank, max_rank]. A layer below min_rank
/// (built at rank 0, say) grows to min_rank. min_rank must be >= 1: a layer at rank 0 has no delta
/// to measure, so it could never grow again. Resizes go through resize_rank(layer, k, optimizer),
/// so the optimizer's state follows.
class RankSchedule {
 public:
  struct Change {
    std::string name;
    int64_t from = 0, to = 0;
    double tail_energy = 0;  // e at the evaluation
    double error = 0;        // the reconstruction error of a shrink (0 for a growth)
  };
  RankSchedule(std::vector<std::pair<std::string, DeltaLinear>> adapters,
               torch::optim::Optimizer& optimizer, RankScheduleOptions options = {});
  /// Call once per optimizer step; returns the changes made (empty between evaluations).
  std::vector<Change> step();
  int64_t step_count() const { return step_count_; }
  /// e for one adapter now: 0 for a zero delta, 1 when its rank is at most `step` (dropping them
  /// would drop everything).
  static double tail_energy(const DeltaLinear& layer, int64_t step);

 private:
  std::vector<std::pair<std::string, DeltaLinear>> adapters_;
  torch::optim::Optimizer& optimizer_;
  RankScheduleOptions options_;
  int64_t step_count_ = 0;
};

}  // namespace nn
}  // namespace gwt
