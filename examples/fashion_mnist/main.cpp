// Fashion-MNIST: an MLP and a small CNN trained with torch::optim::AdamW and with gwt::WaveletAdam;
// prints test accuracy and optimizer-state bytes side by side.
//
//   fashion_mnist DATA_DIR [epochs]
//
// DATA_DIR holds the four uncompressed IDX files (train-images-idx3-ubyte, ...), as
// scripts/fashion_mnist.sh prepares them from Debian's dataset-fashion-mnist package.

#include <gwt/gwt.h>
#include <torch/data.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

namespace {

namespace F = torch::nn::functional;

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(784, 256))),
        fc2(register_module("fc2", torch::nn::Linear(256, 128))),
        head(register_module("head", torch::nn::Linear(128, 10))) {}
  at::Tensor forward(const at::Tensor& x) {
    return head(F::relu(fc2(F::relu(fc1(x.view({x.size(0), 784}))))));
  }
  torch::nn::Linear fc1, fc2, head;
};
TORCH_MODULE(Mlp);

struct CnnImpl : torch::nn::Module {
  CnnImpl()
      : conv1(register_module("conv1",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)))),
        conv2(register_module("conv2",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)))),
        fc(register_module("fc", torch::nn::Linear(32 * 7 * 7, 128))),
        head(register_module("head", torch::nn::Linear(128, 10))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = F::max_pool2d(F::relu(conv1(x)), F::MaxPool2dFuncOptions(2));
    h = F::max_pool2d(F::relu(conv2(h)), F::MaxPool2dFuncOptions(2));
    return head(F::relu(fc(h.view({h.size(0), -1}))));
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc, head;
};
TORCH_MODULE(Cnn);

int64_t adamw_state_bytes(torch::optim::AdamW& opt) {
  int64_t bytes = 0;
  for (const auto& item : opt.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*item.second);
    for (const at::Tensor* t : {&s.exp_avg(), &s.exp_avg_sq()})
      if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  }
  return bytes;
}

struct Result {
  double accuracy;
  int64_t state_bytes;
};

template <typename Net>
Result run(const std::string& data, int epochs, bool wavelet) {
  torch::manual_seed(0);
  Net net;
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (wavelet)
    opt = std::make_unique<gwt::WaveletAdam>(
        gwt::paper_param_groups(*net, gwt::WaveletAdamOptions(1e-3).level(2)));
  else
    opt = std::make_unique<torch::optim::AdamW>(net->parameters(),
                                                torch::optim::AdamWOptions(1e-3).weight_decay(0));
  auto train = torch::data::make_data_loader(
      torch::data::datasets::MNIST(data, torch::data::datasets::MNIST::Mode::kTrain)
          .map(torch::data::transforms::Normalize<>(0.2860, 0.3530))
          .map(torch::data::transforms::Stack<>()),
      torch::data::DataLoaderOptions().batch_size(128));
  for (int epoch = 0; epoch < epochs; ++epoch)
    for (auto& batch : *train) {
      opt->zero_grad();
      at::cross_entropy_loss(net->forward(batch.data), batch.target).backward();
      opt->step();
    }
  auto test = torch::data::make_data_loader(
      torch::data::datasets::MNIST(data, torch::data::datasets::MNIST::Mode::kTest)
          .map(torch::data::transforms::Normalize<>(0.2860, 0.3530))
          .map(torch::data::transforms::Stack<>()),
      torch::data::DataLoaderOptions().batch_size(1000));
  at::NoGradGuard no_grad;
  int64_t correct = 0, total = 0;
  for (auto& batch : *test) {
    correct += net->forward(batch.data).argmax(1).eq(batch.target).sum().template item<int64_t>();
    total += batch.target.size(0);
  }
  const int64_t bytes = wavelet ? static_cast<gwt::WaveletAdam&>(*opt).state_bytes()
                                : adamw_state_bytes(static_cast<torch::optim::AdamW&>(*opt));
  return {static_cast<double>(correct) / static_cast<double>(total), bytes};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: fashion_mnist DATA_DIR [epochs]\n");
    return 2;
  }
  const std::string data = argv[1];
  const int epochs = argc > 2 ? std::atoi(argv[2]) : 1;
  if (!std::filesystem::exists(data + "/train-images-idx3-ubyte")) {
    std::fprintf(
        stderr,
        "fashion_mnist: error: no train-images-idx3-ubyte in '%s' (run scripts/fashion_mnist.sh)\n",
        data.c_str());
    return 2;
  }
  if (epochs < 1) {
    std::fprintf(stderr, "fashion_mnist: error: epochs must be >= 1, got '%s'\n", argv[2]);
    return 2;
  }
  std::printf("Fashion-MNIST, %d epoch(s), batch 128, lr 1e-3\n\n", epochs);
  std::printf("| model | optimizer | test accuracy | state bytes | state vs AdamW |\n");
  std::printf("|---|---|---:|---:|---:|\n");
  auto row = [](const char* model, const char* optimizer, const Result& r, const Result& base) {
    std::printf("| %s | %s | %.2f%% | %lld | %.1f%% |\n", model, optimizer, 100 * r.accuracy,
                static_cast<long long>(r.state_bytes),
                100.0 * static_cast<double>(r.state_bytes) / static_cast<double>(base.state_bytes));
    std::fflush(stdout);
  };
  const Result mlp_adamw = run<Mlp>(data, epochs, false);
  row("MLP 784-256-128-10", "AdamW", mlp_adamw, mlp_adamw);
  row("MLP 784-256-128-10", "WaveletAdam haar L=2", run<Mlp>(data, epochs, true), mlp_adamw);
  const Result cnn_adamw = run<Cnn>(data, epochs, false);
  row("CNN 2 conv + 2 fc", "AdamW", cnn_adamw, cnn_adamw);
  row("CNN 2 conv + 2 fc", "WaveletAdam haar L=2", run<Cnn>(data, epochs, true), cnn_adamw);
  return 0;
}
