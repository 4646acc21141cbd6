// gwt._C: the wavelet transforms and the filter tables (gwt/transform.h, gwt/wavelet.h). The GIL
// is released while they compute; results are converted after.

#include <array>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "binding.h"
#include "gwt/transform.h"
#include "gwt/wavelet.h"

namespace gwt_python {

void bind_transforms(py::module_& m) {
  m.def("wavelets", &gwt::Wavelet::available, "Every wavelet name gwt knows (PyWavelets' filters)");
  m.def("modes", &gwt::boundary_mode_names, "Every boundary mode gwt knows");
  m.def(
      "wavelet_filters",
      [](const std::string& name) {
        const gwt::Wavelet w = wavelet_of(name);
        return std::make_tuple(w.dec_lo(), w.dec_hi(), w.rec_lo(), w.rec_hi());
      },
      py::arg("name"));
  m.def(
      "approx_len",
      [](int64_t n, const std::string& wavelet, int64_t level, const std::string& mode) {
        return gwt::approx_len(n, wavelet_of(wavelet), level, mode_of(mode));
      },
      py::arg("n"), py::arg("wavelet"), py::arg("level"), py::arg("mode"));

  m.def(
      "dwt",
      [](const at::Tensor& x, const std::string& wavelet, int64_t dim, const std::string& mode) {
        const auto w = wavelet_of(wavelet);
        const auto md = mode_of(mode);
        py::gil_scoped_release no_gil;
        return gwt::dwt(x, w, dim, md);
      },
      py::arg("x"), py::arg("wavelet"), py::arg("dim"), py::arg("mode"));
  m.def(
      "idwt",
      [](const at::Tensor& a, const at::Tensor& d, const std::string& wavelet, int64_t dim,
         const std::string& mode) {
        const auto w = wavelet_of(wavelet);
        const auto md = mode_of(mode);
        py::gil_scoped_release no_gil;
        return gwt::idwt(a, d, w, dim, md);
      },
      py::arg("approx"), py::arg("detail"), py::arg("wavelet"), py::arg("dim"), py::arg("mode"));
  m.def(
      "wavedec",
      [](const at::Tensor& x, const std::string& wavelet, int64_t level, int64_t dim,
         const std::string& mode) {
        const auto w = wavelet_of(wavelet);
        const auto md = mode_of(mode);
        py::gil_scoped_release no_gil;
        gwt::WaveletCoeffs c = gwt::wavedec(x, w, level, dim, md);
        std::vector<at::Tensor> out{c.approx};
        out.insert(out.end(), c.details.begin(), c.details.end());
        return out;
      },
      py::arg("x"), py::arg("wavelet"), py::arg("level"), py::arg("dim"), py::arg("mode"));
  m.def(
      "waverec",
      [](const std::vector<at::Tensor>& coeffs, const std::string& wavelet, int64_t dim,
         const std::string& mode, std::optional<int64_t> length) {
        if (coeffs.empty()) throw py::value_error("gwt: waverec needs at least the approximation");
        const auto w = wavelet_of(wavelet);
        const auto md = mode_of(mode);
        py::gil_scoped_release no_gil;
        gwt::WaveletCoeffs c{coeffs[0], {coeffs.begin() + 1, coeffs.end()}};
        return gwt::waverec(c, w, dim, md, length);
      },
      py::arg("coeffs"), py::arg("wavelet"), py::arg("dim"), py::arg("mode"), py::arg("length"));
  m.def(
      "wavedec2",
      [](const at::Tensor& x, const std::string& wavelet, int64_t level, const std::string& mode) {
        const auto w = wavelet_of(wavelet);
        const auto md = mode_of(mode);
        py::gil_scoped_release no_gil;
        gwt::WaveletCoeffs2 c = gwt::wavedec2(x, w, level, md);
        return std::make_pair(c.approx, c.details);
      },
      py::arg("x"), py::arg("wavelet"), py::arg("level"), py::arg("mode"));
  m.def(
      "waverec2",
      [](const at::Tensor& approx, const std::vector<std::array<at::Tensor, 3>>& details,
         const std::string& wavelet, const std::string& mode) {
        const auto w = wavelet_of(wavelet);
        const auto md = mode_of(mode);
        py::gil_scoped_release no_gil;
        return gwt::waverec2(gwt::WaveletCoeffs2{approx, details}, w, md);
      },
      py::arg("approx"), py::arg("details"), py::arg("wavelet"), py::arg("mode"));
  m.def(
      "threshold",
      [](const at::Tensor& x, double value, const std::string& mode) {
        as_value_error([&] {
          TORCH_CHECK(mode == "soft" || mode == "hard", "gwt: unknown threshold mode '", mode,
                      "'; valid modes are soft, hard");
          return 0;
        });
        py::gil_scoped_release no_gil;
        return gwt::threshold(x, value, mode);
      },
      py::arg("x"), py::arg("value"), py::arg("mode"));
}

}  // namespace gwt_python
