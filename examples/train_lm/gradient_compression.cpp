// Size against reconstruction error of gwt::compress_gradient on real gradients: the tiny LM of
// train_lm after a few AdamW steps on the fortunes corpus; thresholds in units of each tensor's
// detail-coefficient standard deviation.
//
//   lm_gradient_compression [steps]      (default 50)

#include <ATen/ATen.h>
#include <gwt/gwt.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "lm.h"

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 50;
  lm::Corpus corpus;
  const lm::Preset preset = lm::preset("tiny");
  try {
    corpus = lm::load_corpus("", preset.model.seq_len);
  } catch (const lm::InputError& e) {
    std::fprintf(stderr, "lm_gradient_compression: error: %s\n", e.what());
    return 2;
  }
  at::manual_seed(1234);
  lm::Decoder model(preset.model);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  lm::Batches batches(corpus.train, preset.batch, preset.model.seq_len, 42);
  auto backward = [&] {
    const at::Tensor batch = batches.next();
    opt.zero_grad();
    const at::Tensor logits = model->forward(batch.narrow(1, 0, preset.model.seq_len));
    at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}),
                           batch.narrow(1, 1, preset.model.seq_len).reshape({-1}))
        .backward();
  };
  for (int t = 0; t < steps; ++t) backward(), opt.step();
  backward();  // the gradients examined: after `steps` steps, not yet applied

  std::printf(
      "Gradients of the tiny LM after %d AdamW steps; threshold = k x std of the tensor's detail "
      "coefficients, hard.\n\n",
      steps);
  std::printf("| tensor | wavelet | k | kept details | bytes | of dense | relative error |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|\n");
  for (const auto& item : model->named_parameters()) {
    const std::string name = item.key();
    if (name != "blocks.0.attn.q_proj.weight" && name != "blocks.3.mlp.down_proj.weight") continue;
    const at::Tensor g = item.value().grad().detach();
    for (const std::string wavelet : {"haar", "db2"}) {
      const auto c = gwt::wavedec(g, wavelet, 2);
      const double sigma =
          at::cat({c.details[0].flatten(), c.details[1].flatten()}).std().item<double>();
      int64_t total = 0;
      for (const auto& d : c.details) total += d.numel();
      for (double k : {0.0, 0.5, 1.0, 2.0, 3.0}) {
        const auto compressed = gwt::compress_gradient(g, wavelet, 2, k * sigma, "hard");
        int64_t kept = 0;
        for (const auto& v : compressed.detail_values) kept += v.numel();
        std::printf("| %s | %s L=2 | %.1f | %.1f%% | %lld | %.1f%% | %.4f |\n", name.c_str(),
                    wavelet.c_str(), k,
                    100.0 * static_cast<double>(kept) / static_cast<double>(total),
                    static_cast<long long>(compressed.bytes()),
                    100.0 * static_cast<double>(compressed.bytes()) /
                        static_cast<double>(compressed.dense_bytes()),
                    compressed.relative_error);
      }
    }
  }
  return 0;
}
