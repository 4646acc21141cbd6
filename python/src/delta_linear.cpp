// gwt._C: gwt::nn::DeltaLinear's stateless delta_linear_* functions behind gwt.nn.DeltaLinear
// (python/gwt/nn.py). The Python module's parameters and buffer are all its state; each call takes
// them (weight, bias, U, V, reflections, core: None where absent) and returns new tensors, so the
// module copies, pickles and runs in several threads as any torch module.

#include <optional>
#include <tuple>
#include <utility>

#include "binding.h"
#include "gwt/nn/delta_linear.h"

namespace gwt_python {
namespace {

using OptTensor = std::optional<at::Tensor>;

gwt::nn::DeltaLinearState delta_state(const at::Tensor& weight, const OptTensor& bias,
                                      const OptTensor& U, const OptTensor& V,
                                      const OptTensor& reflections, const OptTensor& core,
                                      double scaling) {
  return {weight,
          bias.value_or(at::Tensor()),
          U.value_or(at::Tensor()),
          V.value_or(at::Tensor()),
          reflections.value_or(at::Tensor()),
          core.value_or(at::Tensor()),
          scaling};
}

OptTensor defined_or_none(const at::Tensor& t) {
  return t.defined() ? OptTensor(t) : std::nullopt;
}

gwt::nn::DeltaLinearOptions delta_options(const at::Tensor& weight, int64_t rank,
                                          int64_t reflections, bool orthogonal_core, double alpha,
                                          bool gram_schmidt) {
  TORCH_CHECK(weight.dim() == 2,
              "gwt::nn::DeltaLinear: the base weight must be 2-D [out, in], got ", weight.sizes());
  return gwt::nn::DeltaLinearOptions(weight.size(1), weight.size(0))
      .rank(rank)
      .reflections(reflections)
      .orthogonal_core(orthogonal_core)
      .alpha(alpha)
      .gram_schmidt(gram_schmidt);
}

}  // namespace

void bind_delta_linear(py::module_& m) {
  m.def(
      "_delta_init",
      [](const at::Tensor& weight, const OptTensor& bias, int64_t rank, int64_t reflections,
         bool orthogonal_core, double alpha, bool gram_schmidt) {
        const auto s = as_value_error([&] {
          return gwt::nn::delta_linear_init(
              weight, bias.value_or(at::Tensor()),
              delta_options(weight, rank, reflections, orthogonal_core, alpha, gram_schmidt));
        });
        return std::make_tuple(s.U, s.V, defined_or_none(s.reflections), defined_or_none(s.core),
                               s.scaling);
      },
      py::arg("weight"), py::arg("bias"), py::arg("rank"), py::arg("reflections"),
      py::arg("orthogonal_core"), py::arg("alpha"), py::arg("gram_schmidt"));
  m.def(
      "_delta_forward",
      [](const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, const OptTensor& U,
         const OptTensor& V, const OptTensor& reflections, const OptTensor& core, double scaling,
         bool gram_schmidt) {
        return gwt::nn::delta_linear_forward(
            x, delta_state(weight, bias, U, V, reflections, core, scaling), gram_schmidt);
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("U"), py::arg("V"),
      py::arg("reflections"), py::arg("core"), py::arg("scaling"), py::arg("gram_schmidt"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "_delta_weight",
      [](const at::Tensor& weight, const OptTensor& bias, const OptTensor& U, const OptTensor& V,
         const OptTensor& reflections, const OptTensor& core, double scaling) {
        return gwt::nn::delta_linear_delta_weight(
            delta_state(weight, bias, U, V, reflections, core, scaling));
      },
      py::arg("weight"), py::arg("bias"), py::arg("U"), py::arg("V"), py::arg("reflections"),
      py::arg("core"), py::arg("scaling"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "_delta_merged_weight",
      [](const at::Tensor& weight, const OptTensor& bias, const OptTensor& U, const OptTensor& V,
         const OptTensor& reflections, const OptTensor& core, double scaling, bool gram_schmidt) {
        return gwt::nn::delta_linear_merged_weight(
            delta_state(weight, bias, U, V, reflections, core, scaling), gram_schmidt);
      },
      py::arg("weight"), py::arg("bias"), py::arg("U"), py::arg("V"), py::arg("reflections"),
      py::arg("core"), py::arg("scaling"), py::arg("gram_schmidt"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "_delta_orthogonality_error",
      [](const at::Tensor& weight, const OptTensor& bias, const OptTensor& U, const OptTensor& V,
         const OptTensor& reflections, const OptTensor& core, bool gram_schmidt) {
        const auto e = gwt::nn::delta_linear_orthogonality_error(
            delta_state(weight, bias, U, V, reflections, core, 1.0), gram_schmidt);
        return std::make_pair(e.reflections, e.core);
      },
      py::arg("weight"), py::arg("bias"), py::arg("U"), py::arg("V"), py::arg("reflections"),
      py::arg("core"), py::arg("gram_schmidt"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "_delta_orthogonality_penalty",
      [](const at::Tensor& weight, const OptTensor& bias, const OptTensor& U, const OptTensor& V,
         const OptTensor& reflections, const OptTensor& core, double lambda) {
        const auto s = delta_state(weight, bias, U, V, reflections, core, 1.0);
        return as_value_error(
            [&] { return gwt::nn::delta_linear_orthogonality_penalty(s, lambda); });
      },
      py::arg("weight"), py::arg("bias"), py::arg("U"), py::arg("V"), py::arg("reflections"),
      py::arg("core"), py::arg("lambda_"));
  m.def(
      "_delta_resize_rank",
      [](const at::Tensor& weight, const OptTensor& bias, const OptTensor& U, const OptTensor& V,
         const OptTensor& reflections, const OptTensor& core, double scaling, double alpha,
         int64_t k) {
        const auto r = as_value_error([&] {
          const int64_t rank = U ? U->size(-1) : 0;
          return gwt::nn::delta_linear_resize_rank(
              delta_state(weight, bias, U, V, reflections, core, scaling),
              delta_options(weight, rank, reflections ? reflections->size(-1) : 0, core.has_value(),
                            alpha, false),
              k);
        });
        return std::make_tuple(r.state.U, r.state.V, defined_or_none(r.state.core), r.state.scaling,
                               r.error);
      },
      py::arg("weight"), py::arg("bias"), py::arg("U"), py::arg("V"), py::arg("reflections"),
      py::arg("core"), py::arg("scaling"), py::arg("alpha"), py::arg("k"));
}

}  // namespace gwt_python
