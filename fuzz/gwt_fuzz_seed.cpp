// Writes the seed corpus of the fuzz targets: gwt_fuzz_seed <corpus dir>.
//
// - load/: checkpoints of WaveletAdam and GaLoreAdam (the models of load_setup.h) saved after 0, 1
//   and 3 steps under many options, some with a parameter that never had a gradient;
// - compression/: CompressedGradient encodings of 1-D to 3-D gradients (every position format,
//   several wavelets, modes, levels, dims, thresholds and dtypes);
// - adapters/: delta-adapter archives (gwt::nn::save_delta_adapters) for the model of
//   adapter_setup.h under several options, its own adapters, and one for a Linear in its
//   torch::nn::Sequential;
// - transform/, step/, galore/: byte strings from a fixed pseudo-random sequence (the targets
//   decode any bytes into a case).
//
// Deterministic: the same files on every run and machine (given the same LibTorch), so the
// committed corpus can be regenerated and compared.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/serialize/output-archive.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "adapter_setup.h"
#include "gwt/compression.h"
#include "load_setup.h"

namespace {

std::string root;
int failures = 0;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) {
    std::fprintf(stderr, "gwt_fuzz_seed: cannot write %s\n", path.c_str());
    ++failures;
  }
}

void save(torch::serialize::OutputArchive& archive, const std::string& name) {
  archive.save_to(root + "/" + name);
}

template <typename Model, typename Options>
void checkpoint(const std::string& name, const Options& group0, const Options& group1, int steps,
                const std::vector<bool>& with_grad = {}) {
  Model m(group0, group1);
  for (int t = 0; t < steps; ++t) {
    gwt_fuzz::set_grads(m.params, t, with_grad);
    m.opt->step();
  }
  torch::serialize::OutputArchive archive;
  m.opt->save(archive);
  save(archive, "load/" + name);
}

void load_seeds() {
  using gwt::GaLoreAdamOptions;
  using gwt::WaveletAdamOptions;
  using Wa = gwt_fuzz::WaveletAdamModel;
  using Ga = gwt_fuzz::GaLoreAdamModel;
  const WaveletAdamOptions w0 = Wa::default_options(0), w1 = Wa::default_options(1);
  const std::vector<std::pair<std::string, WaveletAdamOptions>> wavelet_variants = {
      {"haar2", w0},
      {"db3_sym", WaveletAdamOptions(1e-2).wavelet("db3").level(1).boundary("symmetric")},
      {"2d", WaveletAdamOptions(1e-2).level(3).transform("2d")},
      {"bf16", WaveletAdamOptions(1e-2).state_dtype("bfloat16")},
      {"threshold", WaveletAdamOptions(1e-2).threshold(0.1).threshold_mode("hard")},
      {"dense", WaveletAdamOptions(1e-2).level(0)},
      {"sym4_per", WaveletAdamOptions(1e-2)
                       .wavelet("sym4")
                       .level(2)
                       .boundary("periodization")
                       .norm_growth_limit(0)},
      {"dim0_ref", WaveletAdamOptions(1e-2).dim(0).fused(false)},
  };
  for (const auto& [name, o] : wavelet_variants)
    for (int steps : {1, 3})
      checkpoint<Wa>("wavelet_adam_" + name + "_" + std::to_string(steps), o, w1, steps);
  checkpoint<Wa>("wavelet_adam_fresh", w0, w1, 0);
  checkpoint<Wa>("wavelet_adam_coif1", w0, WaveletAdamOptions(1e-3).wavelet("coif1").level(1),
                 2);
  checkpoint<Wa>("wavelet_adam_g1_2d", w0, WaveletAdamOptions(1e-3).level(2).transform("2d"),
                 2);
  checkpoint<Wa>("wavelet_adam_partial", w0, w1, 2, {true, false, true});

  const GaLoreAdamOptions g0 = Ga::default_options(0), g1 = Ga::default_options(1);
  const std::vector<std::pair<std::string, GaLoreAdamOptions>> galore_variants = {
      {"rank2", g0},
      {"rank1", GaLoreAdamOptions(1e-2).rank(1)},
      {"dense", GaLoreAdamOptions(1e-2).rank(0)},
      {"right", GaLoreAdamOptions(1e-2).rank(3).proj_type("right").update_proj_gap(1)},
      {"reverse", GaLoreAdamOptions(1e-2).rank(2).proj_type("reverse_std")},
      {"randomized", GaLoreAdamOptions(1e-2).rank(2).svd("randomized").oversample(2)},
      {"nobias", GaLoreAdamOptions(1e-2).rank(2).correct_bias(false).weight_decay(0.1)},
  };
  for (const auto& [name, o] : galore_variants)
    for (int steps : {1, 3})
      checkpoint<Ga>("galore_adam_" + name + "_" + std::to_string(steps), o, g1, steps);
  checkpoint<Ga>("galore_adam_fresh", g0, g1, 0);
  checkpoint<Ga>("galore_adam_partial", g0, g1, 2, {false, true, true});
}

void adapter_seeds() {
  using gwt::nn::DeltaLinearOptions;
  const std::vector<std::pair<std::string, DeltaLinearOptions>> variants = {
      {"lora2", DeltaLinearOptions(0, 0).rank(2)},
      {"hra2", DeltaLinearOptions(0, 0).reflections(2)},
      {"hra3_gs", DeltaLinearOptions(0, 0).reflections(3).gram_schmidt(true)},
      {"core2", DeltaLinearOptions(0, 0).rank(2).orthogonal_core(true).alpha(4)},
      {"both", DeltaLinearOptions(0, 0).rank(1).reflections(1).train_base(true)},
  };
  for (const auto& [name, o] : variants) {
    gwt_fuzz::AdapterModel model;
    gwt::nn::add_delta_adapters(*model, o, [](const std::string& layer) {
      return layer == "fc1" || layer == "block.fc2" || layer == "fc3";
    });
    gwt_fuzz::fill_deterministic(*model);  // a trained-looking U (it starts at zero)
    torch::serialize::OutputArchive archive;
    gwt::nn::save_delta_adapters(*model, archive);
    save(archive, "adapters/" + name);
  }
  {
    // The model's own adapters ("delta", and "seq.0" in its Sequential), which load in place, and
    // one for "seq.1", a Linear in that Sequential, which cannot be replaced there.
    gwt_fuzz::AdapterModel model;
    torch::serialize::OutputArchive archive;
    gwt::nn::save_delta_adapters(*model, archive);
    save(archive, "adapters/own");
    torch::nn::Module holder;
    holder.register_module(
        "seq", torch::nn::Sequential(torch::nn::Linear(4, 4),
                                     gwt::nn::DeltaLinear(torch::nn::Linear(4, 4),
                                                          DeltaLinearOptions(4, 4).rank(2))));
    gwt_fuzz::fill_deterministic(holder);
    torch::serialize::OutputArchive in_sequential;
    gwt::nn::save_delta_adapters(holder, in_sequential);
    save(in_sequential, "adapters/in_sequential");
  }
}

void compression_seeds() {
  struct Seed {
    std::string name;
    std::vector<int64_t> shape;
    at::ScalarType dtype;
    std::string wavelet;
    int64_t level;
    double threshold;
    std::string mode;
    int64_t dim;
    gwt::BoundaryMode boundary;
    std::string positions;
  };
  using B = gwt::BoundaryMode;
  const std::vector<Seed> seeds = {
      {"haar_auto", {16, 32}, at::kFloat, "haar", 2, 0.0, "hard", -1, B::zero, "auto"},
      {"db2_indices", {16, 32}, at::kDouble, "db2", 3, 0.5, "hard", -1, B::zero, "indices"},
      {"db4_bitmask", {40}, at::kFloat, "db4", 2, 0.1, "soft", -1, B::symmetric, "bitmask"},
      {"sym3_dim1", {4, 6, 10}, at::kFloat, "sym3", 1, 0.2, "soft", 1, B::periodization, "auto"},
      {"coif1_half", {3, 5}, at::kHalf, "coif1", 1, 0.0, "hard", -1, B::zero, "indices"},
      {"bf16", {8, 64}, at::kBFloat16, "haar", 3, 0.05, "hard", -1, B::zero, "auto"},
      {"dim0", {33, 4}, at::kDouble, "db1", 4, 0.3, "soft", 0, B::symmetric, "bitmask"},
      {"sparse", {2, 200}, at::kFloat, "db3", 2, 2.0, "hard", -1, B::zero, "auto"},
      {"sym8_per", {5, 7}, at::kDouble, "sym8", 2, 0.0, "soft", -2, B::periodization, "indices"},
  };
  for (const auto& s : seeds) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    const at::Tensor grad =
        at::sin(at::arange(n, at::kDouble) * 0.7).mul(1.5).view(s.shape).to(s.dtype);
    const gwt::CompressedGradient c = gwt::compress_gradient(
        grad, s.wavelet, s.level, s.threshold, s.mode, s.dim, s.boundary, s.positions);
    torch::serialize::OutputArchive archive;
    archive << c;
    save(archive, "compression/" + s.name);
  }
}

void byte_seeds(const std::string& target, int count, uint32_t seed) {
  std::mt19937 rng(seed);
  for (int i = 0; i < count; ++i) {
    const size_t size = 8 + rng() % (i % 2 == 0 ? 64 : 600);
    std::string bytes(size, '\0');
    for (auto& b : bytes) b = static_cast<char>(rng() & 0xff);
    char name[32];
    std::snprintf(name, sizeof(name), "seed_%02d", i);
    write_bytes(root + "/" + target + "/" + name, bytes);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr,
                 "usage: gwt_fuzz_seed <corpus dir with load/ compression/ adapters/ transform/ "
                 "step/ galore/>\n");
    return 2;
  }
  root = argv[1];
  for (const char* sub : {"load", "compression", "adapters", "transform", "step", "galore"})
    std::filesystem::create_directories(root + "/" + sub);
  at::set_num_threads(1);
  load_seeds();
  compression_seeds();
  adapter_seeds();
  byte_seeds("transform", 24, 12345);
  byte_seeds("step", 24, 54321);
  byte_seeds("galore", 24, 24680);
  return failures == 0 ? 0 : 1;
}
