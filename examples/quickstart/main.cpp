// Quickstart: trains the same small MLP on synthetic data twice, with torch::optim::AdamW and with
// gwt::WaveletAdam, and prints final loss and optimizer-state bytes side by side.
//
//   quickstart [steps]      (default 400)

#include <gwt/gwt.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(64, 256))),
        fc2(register_module("fc2", torch::nn::Linear(256, 256))),
        head(register_module("head", torch::nn::Linear(256, 16))) {}
  at::Tensor forward(const at::Tensor& x) {
    return head(torch::nn::functional::gelu(fc2(torch::nn::functional::gelu(fc1(x)))));
  }
  torch::nn::Linear fc1, fc2, head;
};
TORCH_MODULE(Mlp);

int64_t adamw_state_bytes(torch::optim::AdamW& opt) {
  int64_t bytes = 0;
  for (const auto& item : opt.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*item.second);
    for (const at::Tensor* t : {&s.exp_avg(), &s.exp_avg_sq(), &s.max_exp_avg_sq()})
      if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  }
  return bytes;
}

struct Result {
  double loss;
  int64_t state_bytes;
};

// Fits a student MLP to a fixed random teacher; returns the mean loss of the last 20 steps.
template <typename MakeOptimizer, typename StateBytes>
Result train(int steps, MakeOptimizer make_optimizer, StateBytes state_bytes) {
  torch::manual_seed(0);
  Mlp teacher;
  const at::Tensor inputs = torch::randn({4096, 64});
  const at::Tensor targets = teacher->forward(inputs).detach();
  torch::manual_seed(1);
  Mlp student;
  auto opt = make_optimizer(*student);
  double tail_loss = 0;
  for (int step = 0; step < steps; ++step) {
    const at::Tensor idx = torch::randint(0, inputs.size(0), {256}, torch::kLong);
    opt->zero_grad();
    const at::Tensor loss =
        (student->forward(inputs.index_select(0, idx)) - targets.index_select(0, idx))
            .pow(2)
            .mean();
    loss.backward();
    opt->step();
    if (step >= steps - 20) tail_loss += loss.item<double>() / 20;
  }
  return {tail_loss, state_bytes(*opt)};
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 400;
  if (steps < 20) {
    std::fprintf(stderr, "quickstart: steps must be >= 20, got '%s'\n", argv[1]);
    return 2;
  }
  const Result adamw = train(
      steps,
      [](MlpImpl& m) {
        return std::make_unique<torch::optim::AdamW>(
            m.parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0));
      },
      [](torch::optim::AdamW& o) { return adamw_state_bytes(o); });
  const Result gwt_result = train(
      steps,
      // The one-line swap, plus the paper's grouping: linear weights wavelet, head/biases dense.
      [](MlpImpl& m) {
        return std::make_unique<gwt::WaveletAdam>(
            gwt::paper_param_groups(m, gwt::WaveletAdamOptions(1e-3).level(2)));
      },
      [](gwt::WaveletAdam& o) { return o.state_bytes(); });

  std::printf("quickstart: %d steps, MLP 64-256-256-16 fitting a random teacher\n\n", steps);
  std::printf("| optimizer                 | final loss | state bytes | state vs AdamW |\n");
  std::printf("|---------------------------|-----------:|------------:|---------------:|\n");
  std::printf("| torch::optim::AdamW       | %10.5f | %11lld | %13.1f%% |\n", adamw.loss,
              static_cast<long long>(adamw.state_bytes), 100.0);
  std::printf(
      "| gwt::WaveletAdam haar L=2 | %10.5f | %11lld | %13.1f%% |\n", gwt_result.loss,
      static_cast<long long>(gwt_result.state_bytes),
      100.0 * static_cast<double>(gwt_result.state_bytes) / static_cast<double>(adamw.state_bytes));
  return 0;
}
