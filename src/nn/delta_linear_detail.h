#pragma once

// What delta_linear.cpp, delta_adapters.cpp and delta_adapters_io.cpp share beyond the public
// header.

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <string>

#include "gwt/nn/delta_linear.h"

namespace gwt {
namespace nn {
namespace detail {

bool is_reduced(at::ScalarType t);
/// The dtype the adapter's parameters and arithmetic use for a base of dtype `t`.
at::ScalarType math_dtype(at::ScalarType t);
/// Float, Double, Half or BFloat16: the dtypes a DeltaLinear's base may have.
bool is_base_dtype(at::ScalarType t);

/// Everything the DeltaLinear constructor checks of its base and options (add_delta_adapters
/// checks every layer so before it replaces any); `who` starts the message.
void check_base(const std::string& who, const at::Tensor& weight, const at::Tensor& bias,
                const DeltaLinearOptions& options);

/// Whether `module` is a container that runs its own list of modules (torch::nn::Sequential,
/// ModuleList, ModuleDict): Module::replace_module changes its registered child but not that list,
/// so a layer replaced inside it would be silently left out of its forward.
bool runs_own_list(const torch::nn::Module& module);

/// The error add_delta_adapters, load_delta_adapters and merge_delta_adapters give for a layer
/// they would have to replace inside such a container; `who` names the function, `instead` what
/// the user can do.
[[noreturn]] void refuse_layer_in_container(const char* who, const std::string& layer,
                                            const torch::nn::Module& container,
                                            const char* instead);

/// Whether the reflections of the columns of `vectors` [n, m] are defined as the forward computes
/// them (in `vectors`' dtype and device): their factors are finite and no normalised column is
/// zero. So no column is zero or has a norm that under- or overflows the dtype, and with
/// gram_schmidt none is zero once the ones before it are projected out.
bool reflections_defined(const at::Tensor& vectors, bool gram_schmidt);

}  // namespace detail
}  // namespace nn
}  // namespace gwt
