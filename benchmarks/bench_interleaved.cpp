// Optimizer steps interleaved in one process: every round times one step of every variant, in
// turn, so that a machine whose speed drifts (other tenants, clock changes) slows all variants of
// a round alike. The ratio to at::_fused_adam_ is taken within each round, and the table reports
// the median over rounds with the range.
//
//   gwt_bench_interleaved [--rounds N] [--workloads 0,1,2,4,5,6] [--floors 0|1] [--phases 0|1]
//
// (the default workloads; 7 is on request).
//
// --floors 1 (the default) adds memory floors to workloads 0-2 and 7: loops that move a step's
// bytes with next to no arithmetic (see FloorBuffers).
//
// --phases 1 (not the default) adds, on workloads 0, 1 and 7, each pass of the fused Haar step at
// L=2 (1-D and 2-D) alone, called through src/kernels/kernels.h on its own copy of the tensors: the
// norm pass next to its read-only floor, the update pass next to its one-pass floor.
//
// Workloads as in gwt_bench_step (benchmarks/workloads.h): 0 llama60m, 1 4096x4096,
// 2 500x(64x64+64), 4 the main job's model (tiny preset), 5 llama60m in bfloat16 (parameters and
// gradients; at::_fused_adam_ keeps its moments in bfloat16 too, WaveletAdam in float32 unless
// state_dtype says bfloat16), 6 llama60m in float16 (likewise; WaveletAdam's moments are float32,
// as state_dtype offers no float16), 7 one 4096x11008 matrix (rows wider than a 2-D tile's
// budget at L=2). On workload 4 the variants are those of
// the main job's table: torch::optim::AdamW against WaveletAdam with the paper's groups (linear
// weights of the blocks on the wavelet path, everything else dense), so that the optimizers' share
// of its ms / step is measured without the forward and backward passes' run-to-run noise.

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "gwt/gwt.h"
#include "kernels/kernels.h"
#include "memory_floors.h"
#include "workloads.h"

namespace {

struct Variant {
  std::string name;
  std::function<void()> step;
  std::vector<double> ms;
};

std::unique_ptr<torch::optim::Optimizer> wavelet(std::vector<at::Tensor> params,
                                                 const std::string& w, int64_t level,
                                                 const std::string& transform,
                                                 const std::string& nonfinite) {
  return std::make_unique<gwt::WaveletAdam>(
      std::move(params),
      gwt::WaveletAdamOptions(1e-3).wavelet(w).level(level).transform(transform).nonfinite(
          nonfinite));
}

// FoamAdam at level 2 (every tensor folded along its last dimension), the fused one-pass kernel.
std::unique_ptr<torch::optim::Optimizer> foam(std::vector<at::Tensor> params,
                                              const std::string& nonfinite) {
  return std::make_unique<gwt::FoamAdam>(std::move(params),
                                         gwt::FoamAdamOptions(1e-3).level(2).nonfinite(nonfinite));
}

volatile double floor_sink = 0;  // keeps floor_read's sums (and the norm passes') alive

// One pass of the fused Haar step (float32, L=2) over a copy of a workload's tensors.
struct PassBuffers {
  std::vector<at::Tensor> keep;  // p, g, m, v of every tensor: the args point into them
  std::vector<gwt::kernels::HaarAdamArgs> args;
};

std::shared_ptr<PassBuffers> pass_buffers(const std::vector<at::Tensor>& params, bool two_d) {
  constexpr int64_t level = 2, block = int64_t{1} << level;
  auto b = std::make_shared<PassBuffers>();
  for (const auto& x : params) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "pass_buffers: float32 matrices");
    const int64_t rows = x.size(0), n = x.size(1), approx_len = (n + block - 1) / block;
    const int64_t state_rows = two_d ? (rows + block - 1) / block : rows;
    const at::Tensor p = x.detach().clone(), g = x.grad().clone();
    const at::Tensor m = at::zeros({state_rows, approx_len}), v = at::zeros_like(m);
    b->keep.insert(b->keep.end(), {p, g, m, v});
    gwt::kernels::HaarAdamArgs a;
    a.param = p.data_ptr(), a.grad = g.data_ptr();
    a.exp_avg = m.data_ptr(), a.exp_avg_sq = v.data_ptr();
    a.rows = rows, a.n = n, a.approx_len = approx_len, a.level = level;
    a.step_size = 1e-9;  // the passes repeat on the same values: keep p where it is
    a.two_d = two_d, a.height = two_d ? rows : 1;
    b->args.push_back(a);
  }
  return b;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The command line: gwt_bench_interleaved [--rounds N] [--workloads 0,1,2,4,5,6] [--floors 0|1]
// [--phases 0|1].
struct Options {
  int64_t rounds = 30;
  std::vector<int> workloads = {0, 1, 2, 4, 5, 6};
  bool floors = true, phases = false;
};

// The options of this command line, or none after printing what is wrong with it.
std::optional<Options> parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--rounds") {
      o.rounds = std::max<int64_t>(3, std::stoll(value));
    } else if (flag == "--floors") {
      o.floors = value != "0";
    } else if (flag == "--phases") {
      o.phases = value != "0";
    } else if (flag == "--workloads") {
      o.workloads.clear();
      std::stringstream in(value);
      std::string item;
      while (std::getline(in, item, ',')) o.workloads.push_back(std::stoi(item));
      for (const int w : o.workloads) {
        if (w < 0 || w > 7 || w == 3) {
          std::fprintf(stderr,
                       "gwt_bench_interleaved: workload %d: expected 0, 1, 2, 4, 5, 6 or 7\n", w);
          return std::nullopt;
        }
      }
    } else {
      std::fprintf(stderr, "gwt_bench_interleaved: unknown argument '%s'\n", flag.c_str());
      return std::nullopt;
    }
  }
  return o;
}

// at::_fused_adam_, the kernel behind torch.optim.Adam(fused=True): the first variant, which the
// others are compared with.
void add_fused_adam(int which, std::vector<Variant>& variants) {
  auto params = gwt_bench::make_workload(which);
  std::vector<at::Tensor> p, g, m, v, steps;
  for (const auto& x : params) {
    p.push_back(x.detach()), g.push_back(x.grad());
    m.push_back(at::zeros_like(x)), v.push_back(at::zeros_like(x));
    steps.push_back(at::zeros({}, x.options().dtype(at::kFloat)));  // float steps, as torch
  }
  variants.push_back({"`at::_fused_adam_`",
                      [p, g, m, v, steps]() mutable {
                        for (auto& s : steps) s.add_(1);
                        at::_fused_adam_(p, g, m, v, {}, steps, 1e-3, 0.9, 0.999, 0.0, 1e-8, false,
                                         false);
                      },
                      {}});
}

// Adds an optimizer's step as a variant, and keeps the optimizer.
struct AddOptimizer {
  std::vector<std::unique_ptr<torch::optim::Optimizer>>& keep;
  std::vector<Variant>& variants;
  void operator()(const std::string& name, std::unique_ptr<torch::optim::Optimizer> opt) const {
    torch::optim::Optimizer* o = opt.get();
    keep.push_back(std::move(opt));
    variants.push_back({name, [o] { o->step(); }, {}});
  }
};

// The main job's optimizers (examples/train_lm), on its model (workload 4).
void add_train_lm_optimizers(int which, const AddOptimizer& add) {
  add("`torch::optim::AdamW`",
      std::make_unique<torch::optim::AdamW>(gwt_bench::make_workload(which),
                                            torch::optim::AdamWOptions(1e-3)));
  for (const auto& [wavelet, level] : std::vector<std::pair<std::string, int64_t>>{
           {"haar", 1}, {"haar", 2}, {"haar", 3}, {"db2", 2}}) {
    const auto params = gwt_bench::make_workload(which);
    std::vector<at::Tensor> wavelet_params, dense_params;
    for (size_t i = 0; i < params.size(); ++i)
      (gwt_bench::tiny_lm_wavelet_param(params, i) ? wavelet_params : dense_params)
          .push_back(params[i]);
    const auto options = gwt::WaveletAdamOptions(3e-3).wavelet(wavelet).level(level);
    auto opt = std::make_unique<gwt::WaveletAdam>(
        std::vector<torch::optim::OptimizerParamGroup>{
            torch::optim::OptimizerParamGroup(wavelet_params,
                                              std::make_unique<gwt::WaveletAdamOptions>(options)),
            torch::optim::OptimizerParamGroup(dense_params,
                                              std::make_unique<gwt::WaveletAdamOptions>(
                                                  gwt::WaveletAdamOptions(options).level(0)))},
        options);
    TORCH_CHECK(opt->group_options(1).level() == 0, "the dense group lost its options");
    add("WaveletAdam " + wavelet + " L=" + std::to_string(level) + ", paper groups",
        std::move(opt));
  }
}

// torch::optim::Adam and WaveletAdam's variants, on every other workload.
void add_optimizers(int which, const AddOptimizer& add) {
  add("`torch::optim::Adam`",
      std::make_unique<torch::optim::Adam>(gwt_bench::make_workload(which),
                                           torch::optim::AdamOptions(1e-3)));
  add("WaveletAdam haar L=2",
      wavelet(gwt_bench::make_workload(which), "haar", 2, "1d", "skip_step"));
  add("WaveletAdam haar L=2, skip_param",
      wavelet(gwt_bench::make_workload(which), "haar", 2, "1d", "skip_param"));
  if (which == 5)  // bfloat16 parameters: the moments in bfloat16 too, as at::_fused_adam_'s
    add("WaveletAdam haar L=2, state bfloat16",
        std::make_unique<gwt::WaveletAdam>(
            gwt_bench::make_workload(which),
            gwt::WaveletAdamOptions(1e-3).wavelet("haar").level(2).state_dtype("bfloat16")));
  else {
    add("WaveletAdam haar 2-D L=2",
        wavelet(gwt_bench::make_workload(which), "haar", 2, "2d", "skip_step"));
    // Issue 15 bounds the 2-D step too, with "skip_param" where the default stays skip_step.
    add("WaveletAdam haar 2-D L=2, skip_param",
        wavelet(gwt_bench::make_workload(which), "haar", 2, "2d", "skip_param"));
  }
  add("WaveletAdam db2 L=2", wavelet(gwt_bench::make_workload(which), "db2", 2, "1d", "skip_step"));
  add("FoamAdam L=2", foam(gwt_bench::make_workload(which), "skip_step"));
  add("FoamAdam L=2, skip_param", foam(gwt_bench::make_workload(which), "skip_param"));
}

// The memory floors of workloads 0-2 and 7: loops that move a step's bytes with next to no
// arithmetic (see FloorBuffers).
void add_floors(int which, std::vector<Variant>& variants) {
  const auto shapes = gwt_bench::make_workload(which);  // each floor copies its own buffers
  // A floor that reads and writes (update) or only reads (a norm pass), with moments of
  // numel / state_div values: 4 for L=2, 16 for the 2-D step at L=2 (4x4 blocks), 1 for Adam.
  auto floor = [&](const char* name, int64_t state_div, bool update) {
    auto b = std::make_shared<gwt_bench::FloorBuffers>(gwt_bench::floor_buffers(shapes, state_div));
    variants.push_back({name,
                        [b, state_div, update] {
                          if (update)
                            gwt_bench::floor_update(*b, state_div);
                          else
                            floor_sink = floor_sink + gwt_bench::floor_read(*b, state_div);
                        },
                        {}});
  };
  floor("floor: read 10 B, write 6 B (one pass, L=2)", 4, true);
  floor("floor: read 6 B (a norm pass, L=2)", 4, false);
  floor("floor: read 8.5 B, write 4.5 B (one pass, 2-D L=2)", 16, true);
  floor("floor: read 4.5 B (a norm pass, 2-D L=2)", 16, false);
  floor("floor: read 16 B, write 12 B (Adam's bytes)", 1, true);
}

// Each pass of the fused Haar step at L=2 (1-D and 2-D) alone, on workloads 0, 1 and 7 (--phases
// 1): the norm pass next to its read-only floor, the update pass next to its one-pass floor.
void add_passes(int which, std::vector<Variant>& variants) {
  for (const bool two_d : {false, true}) {
    auto b = pass_buffers(gwt_bench::make_workload(which), two_d);
    const std::string what = two_d ? "2-D L=2" : "L=2";
    variants.push_back({"pass: the norm pass alone, haar " + what,
                        [b] {
                          double sum = 0;
                          for (const auto& a : b->args)
                            sum += gwt::kernels::haar_adam_norm_sq_cpu(a);
                          floor_sink = floor_sink + sum;
                        },
                        {}});
    variants.push_back({"pass: the update pass alone, haar " + what,
                        [b] {
                          for (const auto& a : b->args) gwt::kernels::haar_adam_update_cpu(a, 1.0);
                        },
                        {}});
  }
}

// The variants of workload `which`, at::_fused_adam_ first; `keep` holds the optimizers they step.
std::vector<Variant> variants_of(int which, const Options& o,
                                 std::vector<std::unique_ptr<torch::optim::Optimizer>>& keep) {
  std::vector<Variant> variants;
  add_fused_adam(which, variants);
  const AddOptimizer add{keep, variants};
  if (which == 4) {  // the main job's optimizers (examples/train_lm)
    add_train_lm_optimizers(which, add);
  } else {
    add_optimizers(which, add);
    if (o.floors && (which < 5 || which == 7))  // (the floors move float32 values)
      add_floors(which, variants);
    if (o.phases && (which < 2 || which == 7)) add_passes(which, variants);
  }
  return variants;
}

// One step of every variant (state created, caches warm), then `rounds` rounds that time one step
// of each, in turn.
void time_rounds(std::vector<Variant>& variants, int64_t rounds, const char* name) {
  for (auto& v : variants) v.step();
  for (int64_t r = 0; r < rounds; ++r) {
    for (auto& v : variants) {
      const auto t0 = std::chrono::steady_clock::now();
      v.step();
      v.ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::fprintf(stderr, "\r%s: round %lld/%lld ", name, static_cast<long long>(r + 1),
                 static_cast<long long>(rounds));
  }
  std::fprintf(stderr, "\n");
}

// The table's row of each variant: its median time, and its ratio to at::_fused_adam_'s within
// each round (median and range over the rounds).
void print_rows(const std::vector<Variant>& variants, int64_t rounds, const char* name) {
  for (const auto& v : variants) {
    std::vector<double> ratio;
    for (int64_t r = 0; r < rounds; ++r) ratio.push_back(v.ms[r] / variants[0].ms[r]);
    std::printf("| %s | %s | %.2f | %.2fx | %.2fx-%.2fx |\n", name, v.name.c_str(), median(v.ms),
                median(ratio), *std::min_element(ratio.begin(), ratio.end()),
                *std::max_element(ratio.begin(), ratio.end()));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::optional<Options> options = parse(argc, argv);
  if (!options) return 2;
  const char* names[] = {"llama60m",      "4096x4096",     "500x(64x64+64)", "",
                         "train_lm tiny", "llama60m bf16", "llama60m fp16",  "4096x11008"};
  std::printf(
      "| workload | variant | median ms / step | vs `at::_fused_adam_` (median of rounds) | "
      "range over rounds |\n|---|---|---:|---:|---:|\n");
  for (const int which : options->workloads) {
    std::vector<std::unique_ptr<torch::optim::Optimizer>> keep;
    std::vector<Variant> variants = variants_of(which, *options, keep);
    time_rounds(variants, options->rounds, names[which]);
    print_rows(variants, options->rounds, names[which]);
  }
  return 0;
}
