#pragma once

// The model the delta-adapter loading target (fuzz_adapters.cpp) loads into, shared with the seed
// generator (gwt_fuzz_seed) so that the seed archives fit it. Its layers cover what
// load_delta_adapters must tell apart: Linear layers at the top level and nested in a plain module
// (one without bias, one in float64), a DeltaLinear whose adapter a load replaces or sets in place,
// a DeltaLinear and a Linear inside a torch::nn::Sequential (whose forward runs its own list of
// modules: the first can only be set in place, the second not adapted), and a layer that is not
// linear at all.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <memory>

#include "gwt/nn/delta_linear.h"

namespace gwt_fuzz {

/// Deterministic values in [-1, 1] for every parameter of `module` (the same model every time).
/// Not affine in the index, as a linspace would be: the columns of a linspace matrix span two
/// dimensions, so three Gram-Schmidt reflection vectors from one would be dependent.
inline void fill_deterministic(torch::nn::Module& module) {
  at::NoGradGuard no_grad;
  for (auto& p : module.parameters())
    p.copy_(at::sin(at::arange(p.numel(), at::kDouble) * 0.7 + 0.3)
                .view(p.sizes())
                .to(p.scalar_type()));
}

struct AdapterModelImpl : torch::nn::Module {
  AdapterModelImpl() {
    register_module("fc1", torch::nn::Linear(6, 5));
    auto block = register_module("block", std::make_shared<torch::nn::Module>());
    block->register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(5, 4).bias(false)));
    auto fc3 = register_module("fc3", torch::nn::Linear(4, 3));
    fc3->to(at::kDouble);
    register_module("delta",
                    gwt::nn::DeltaLinear(torch::nn::Linear(3, 4),
                                         gwt::nn::DeltaLinearOptions(3, 4).rank(2).reflections(2)));
    register_module(
        "seq", torch::nn::Sequential(
                   gwt::nn::DeltaLinear(torch::nn::Linear(4, 4),
                                        gwt::nn::DeltaLinearOptions(4, 4).rank(1).reflections(2)),
                   torch::nn::Linear(4, 4)));
    register_module("emb", torch::nn::Embedding(10, 4));
    fill_deterministic(*this);
  }
};
TORCH_MODULE(AdapterModel);

}  // namespace gwt_fuzz
