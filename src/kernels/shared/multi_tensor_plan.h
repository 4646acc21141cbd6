#pragma once

// The multi-tensor step's planner, the host's part of multi_tensor.h (which includes it at its end,
// after the per-thread bodies): the groups of a step, their chunks, where their metadata lies in
// one buffer, and the order of the launches.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/shared/multi_tensor.h"
#include "kernels/shared/wavelet_row.h"

namespace gwt {
namespace kernels {
namespace mt {

// ---------------------------------------------------------------------------------------------
// The planner (host)
// ---------------------------------------------------------------------------------------------

/// The types a group's kernels are instantiated for.
struct GroupKey {
  ScalarKind param_kind = ScalarKind::f32;
  ScalarKind state_kind = ScalarKind::f32;
  bool math_f64 = false;
  bool general = false;  ///< rows of a general wavelet: kernels of their own, with shared memory
  bool operator==(const GroupKey& o) const {
    return param_kind == o.param_kind && state_kind == o.state_kind && math_f64 == o.math_f64 &&
           general == o.general;
  }
};

/// One group of a step: its tensors and their chunks.
struct Group {
  GroupKey key;
  std::vector<TensorMeta> tensors;
  std::vector<Chunk> chunks;
  std::vector<unsigned char> plans;  ///< general: the tensors' row::RowPlan<Acc>, back to back
  int64_t shared_bytes = 0;          ///< general: the largest row's scratch
};

/// Work items of a tensor (Haar coefficients or dense values) and how many a chunk takes: chunks
/// of about k_chunk_values gradient values.
inline int64_t work_items(const TensorMeta& t) {
  if (t.kind == Kind::general) return t.rows;
  if (t.kind == Kind::foam) return t.rows * t.approx_len;
  return t.kind == Kind::dense ? t.n : t.state_rows * t.approx_len;
}
inline int64_t items_per_chunk(const TensorMeta& t, int64_t chunk_values) {
  if (t.kind == Kind::general) return 1;  // a row per block
  if (t.kind == Kind::dense) return chunk_values;
  const int64_t values = t.block * (t.kind == Kind::haar && t.two_d ? t.block : 1);
  return chunk_values / values > 0 ? chunk_values / values : 1;
}

/// Fills the Haar geometry of t (block_rows, state_rows, approx_scale) from rows, n, block,
/// two_d, height.
inline void complete_haar_meta(TensorMeta& t, int64_t level) {
  t.kind = Kind::haar;
  t.block = int64_t{1} << level;
  t.approx_len = (t.n + t.block - 1) / t.block;
  t.height = t.two_d ? t.height : 1;
  t.block_rows = t.two_d ? (t.height + t.block - 1) / t.block : 1;
  t.state_rows = t.rows / t.height * t.block_rows;
  t.approx_scale = std::pow(2.0, (t.two_d ? -1.0 : -0.5) * static_cast<double>(level));
}

/// Fills FOAM's geometry of t (kind, block, approx_len, state_rows) from rows and n: blocks of
/// 2^level values along rows of n.
inline void complete_foam_meta(TensorMeta& t, int64_t level) {
  t.kind = Kind::foam;
  t.block = int64_t{1} << level;
  t.approx_len = (t.n + t.block - 1) / t.block;
  t.state_rows = t.rows;
}

/// The step's groups, in the order their keys first appear.
class Planner {
 public:
  /// `chunk_values`: gradient values per chunk (the tests take small chunks to have many).
  explicit Planner(int64_t chunk_values = k_chunk_values) : chunk_values_(chunk_values) {}
  void add(const GroupKey& key, TensorMeta t) {
    Group* group = group_of(key);
    const int64_t index = static_cast<int64_t>(group->tensors.size());
    t.first_chunk = static_cast<int64_t>(group->chunks.size());
    const int64_t items = work_items(t), per = items_per_chunk(t, chunk_values_);
    // Every tensor has a chunk, an empty one when it has no values: its first chunk keeps its
    // counts.
    for (int64_t begin = 0; begin < items || begin == 0; begin += per)
      group->chunks.push_back(Chunk{index, begin, begin + per < items ? begin + per : items});
    t.chunks = static_cast<int64_t>(group->chunks.size()) - t.first_chunk;
    group->tensors.push_back(t);
  }
  const std::vector<Group>& groups() const { return groups_; }
  /// Kernel launches the step makes: three per group, whatever the number of tensors.
  int64_t launches() const { return 3 * static_cast<int64_t>(groups_.size()); }

  /// A tensor of a general wavelet, one row per chunk, with its row plan (`a`: the tensor's
  /// arguments as the per-tensor CUDA kernel takes them; its step size is the finalize's).
  void add_general(GroupKey key, TensorMeta t, const WaveletAdamArgs& a) {
    key.general = true;
    t.kind = Kind::general;
    Group* group = group_of(key);
    auto append = [&](auto plan) {
      using Plan = decltype(plan);
      using Acc = decltype(plan.eps);
      t.plan = static_cast<int64_t>(group->plans.size() / sizeof(Plan));
      const auto* bytes = reinterpret_cast<const unsigned char*>(&plan);
      group->plans.insert(group->plans.end(), bytes, bytes + sizeof(Plan));
      const int64_t scratch = (plan.coeff_len + 2 * plan.buffer_len + plan.approx_len) *
                              static_cast<int64_t>(sizeof(Acc));
      if (scratch > group->shared_bytes) group->shared_bytes = scratch;
    };
    if (key.math_f64)
      append(row::make_row_plan<double>(a));
    else
      append(row::make_row_plan<float>(a));
    add(key, t);
  }

 private:
  Group* group_of(const GroupKey& key) {
    for (Group& g : groups_)
      if (g.key == key) return &g;
    groups_.push_back(Group{key, {}, {}, {}, 0});
    return &groups_.back();
  }
  int64_t chunk_values_;
  std::vector<Group> groups_;
};

/// Where a step's metadata and scratch lie in one buffer (device memory for CUDA, host memory for
/// the emulation): for each group, its tensors, chunks, partials and results, 16-byte aligned.
class StepLayout {
 public:
  explicit StepLayout(const std::vector<Group>& groups) {
    for (const Group& g : groups) {
      Offsets o;
      o.tensors = take(g.tensors.size() * sizeof(TensorMeta));
      o.chunks = take(g.chunks.size() * sizeof(Chunk));
      o.partials = take(g.chunks.size() * sizeof(double));
      o.results = take(g.tensors.size() * sizeof(TensorResult));
      o.plans = take(g.plans.size());
      offsets_.push_back(o);
    }
  }
  size_t bytes() const { return end_; }
  /// Writes the groups' tensors and chunks at `base` (a buffer of bytes()); the scratch parts are
  /// zeroed.
  void write(const std::vector<Group>& groups, unsigned char* base) const {
    std::memset(base, 0, end_);
    for (size_t g = 0; g < groups.size(); ++g) {
      std::memcpy(base + offsets_[g].tensors, groups[g].tensors.data(),
                  groups[g].tensors.size() * sizeof(TensorMeta));
      std::memcpy(base + offsets_[g].chunks, groups[g].chunks.data(),
                  groups[g].chunks.size() * sizeof(Chunk));
      if (!groups[g].plans.empty())
        std::memcpy(base + offsets_[g].plans, groups[g].plans.data(), groups[g].plans.size());
    }
  }
  /// Group g's launch arguments over the buffer at `base` (where write() left the metadata).
  Launch launch(const std::vector<Group>& groups, size_t g, unsigned char* base,
                StepFlags* flags) const {
    Launch l;
    l.tensors = reinterpret_cast<const TensorMeta*>(base + offsets_[g].tensors);
    l.chunks = reinterpret_cast<const Chunk*>(base + offsets_[g].chunks);
    l.num_tensors = static_cast<int64_t>(groups[g].tensors.size());
    l.num_chunks = static_cast<int64_t>(groups[g].chunks.size());
    l.partials = reinterpret_cast<double*>(base + offsets_[g].partials);
    l.results = reinterpret_cast<TensorResult*>(base + offsets_[g].results);
    l.plans = base + offsets_[g].plans;
    l.shared_bytes = groups[g].shared_bytes;
    l.flags = flags;
    l.first_of_step = g == 0;
    l.last_of_step = g + 1 == groups.size();
    return l;
  }

 private:
  struct Offsets {
    size_t tensors, chunks, partials, results, plans;
  };
  size_t take(size_t bytes) {
    const size_t at = (end_ + 15) / 16 * 16;
    end_ = at + bytes;
    return at;
  }
  std::vector<Offsets> offsets_;
  size_t end_ = 0;
};

/// The launches of one step in their order: every group's norm and finalize, then every group's
/// update (the updates read the step-wide found_inf, complete only after the last finalize).
/// `kernels` has norm(key, launch), finalize(key, launch) and update(key, launch).
template <typename Kernels>
void run_step(const std::vector<Group>& groups, const StepLayout& layout, unsigned char* base,
              StepFlags* flags, Kernels&& kernels) {
  for (size_t g = 0; g < groups.size(); ++g) {
    const Launch l = layout.launch(groups, g, base, flags);
    kernels.norm(groups[g].key, l);
    kernels.finalize(groups[g].key, l);
  }
  for (size_t g = 0; g < groups.size(); ++g)
    kernels.update(groups[g].key, layout.launch(groups, g, base, flags));
}

/// Launches one step of `groups` on the current CUDA stream: Planner::launches() kernels over the
/// buffer at `device_base`, device memory of layout.bytes() where StepLayout::write's bytes have
/// been copied. Nothing waits for the device. `flags`: device memory of the optimizer, kept
/// between steps (zeroed before the first). Present when gwt was built with CUDA; elsewhere it
/// throws.
void multi_tensor_step_cuda(const std::vector<Group>& groups, const StepLayout& layout,
                            unsigned char* device_base, StepFlags* flags);

}  // namespace mt
}  // namespace kernels
}  // namespace gwt
