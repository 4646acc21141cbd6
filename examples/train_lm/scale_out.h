#pragma once

// The main job's scale-out runs (issue 14): WaveletAdam haar L=2 on several processes, with the
// full gradient all-reduce, with the wavelet-compressed one, and ShardedWaveletAdam. Each rank
// takes its slice of the same global batch that a single-process run trains on.

#include <cstdint>
#include <string>
#include <vector>

#include "lm.h"

namespace lm {

/// "dp-full", "dp-wavelet", "dp-sharded".
std::vector<std::string> scale_out_names();
bool is_scale_out(const std::string& name);
/// Whether gwt was built with gwt::distributed (Gloo's headers found at configure time).
bool scale_out_available();

struct ScaleOutConfig {
  Preset preset;
  std::string out, device = "cpu";
  double lr = 3e-3, scale = 0.25;  // WaveletAdam's, as in the single-process table
  bool quiet = false;
};

struct ScaleOutSummary {
  std::string name, label;
  int64_t ranks = 0, steps = 0;
  double val_loss = 0;
  int64_t state_bytes_per_rank = 0;  // the largest over the ranks
  double bytes_sent_per_step = 0;    // this rank's all-reduce payload, and broadcasts it owns
  double bytes_full_per_step = 0;    // the full all-reduce's payload
  double ms_per_step = 0;
};

/// Runs `name` in this process, one rank of the group made from the environment (torchrun's
/// RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Rank 0's summaries hold the validation loss
/// (it evaluates) and rank 0 writes <out>/<name>.csv. Throws InputError when the global batch does
/// not split.
std::vector<ScaleOutSummary> run_scale_out_in_process(const ScaleOutConfig& config,
                                                      const Corpus& corpus,
                                                      const std::vector<std::string>& names);

/// Spawns `nproc` copies of this process's work (fork; ranks meet on a TCPStore at 127.0.0.1)
/// for each run of `names`, one after another, and returns rank 0's summaries.
std::vector<ScaleOutSummary> spawn_scale_out(const ScaleOutConfig& config, const Corpus& corpus,
                                             const std::vector<std::string>& names, int64_t nproc);

/// The Markdown table of the scale-out runs; `single` (may be null) is the single-process
/// WaveletAdam haar L=2 run, the reference of the ratio columns.
std::string scale_out_table(const std::vector<ScaleOutSummary>& runs, const RunSummary* single);

}  // namespace lm
