// gwt._C: the Python binding of gwt. The module is made here; each area binds its functions in
// a translation unit of its own (transforms.cpp, delta_linear.cpp, optimizers.cpp; binding.h has
// what they share).

#include <torch/csrc/Exceptions.h>

#include <exception>

#include "binding.h"
#include "gwt/cuda.h"
#include "gwt/version.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "gwt's C++ library (wavelet-compressed Adam for LibTorch), bound for Python";
  m.attr("__version__") = gwt::version;
  m.attr("_torch_version") = GWT_PY_TORCH_VERSION;

  // c10::Error and its kinds become the Python exceptions torch raises for them (RuntimeError,
  // ValueError, TypeError, IndexError, torch.linalg.LinAlgError, torch.OutOfMemoryError, ...) with
  // the same message, as for torch's own functions.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::Error&) {
      torch::translate_exception_to_python(std::current_exception());
    }
  });

  m.def("built_with_cuda", &gwt::kernels::built_with_cuda,
        "Whether this build of gwt has its CUDA kernels (else CUDA parameters take the reference)");
  m.def("cuda_kernels_run_on", &gwt::kernels::cuda_kernels_run_on, py::arg("device_index"),
        "Whether the CUDA kernels run on that device (an image for its architecture)");

  gwt_python::bind_transforms(m);
  gwt_python::bind_delta_linear(m);
  gwt_python::bind_optimizers(m);
}
