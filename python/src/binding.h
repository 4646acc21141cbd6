#pragma once

// What the translation units of gwt._C share: argument conversion with the errors Python code
// expects, and the functions that bind each area (gwt_python.cpp makes the module).

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>

#include "gwt/wavelet.h"

namespace gwt_python {

namespace py = pybind11;

// A c10::Error raised by checking a caller's argument, as the ValueError Python code expects from
// bad arguments (torch.optim raises ValueError for a bad lr), with the same message.
template <typename F>
auto as_value_error(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    throw py::value_error(e.what_without_backtrace());
  }
}

inline gwt::Wavelet wavelet_of(const std::string& name) {
  return as_value_error([&] { return gwt::Wavelet(name); });
}

inline gwt::BoundaryMode mode_of(const std::string& name) {
  return as_value_error([&] { return gwt::boundary_mode_from_string(name); });
}

// An option of a parameter group, with a TypeError naming it when it has the wrong type.
template <typename T>
T option(const py::dict& group, const char* key, const char* type_name) {
  if (!group.contains(key))
    throw py::key_error(std::string("gwt: a parameter group has no '") + key + "' option");
  py::object value = group[key];
  // bool is an int to Python: refuse it where a number is meant, and numbers where a bool is.
  constexpr bool want_bool = std::is_same_v<T, bool>;
  if (!want_bool && PyBool_Check(value.ptr()))
    throw py::type_error(std::string("gwt: option '") + key + "' must be " + type_name +
                         ", got a bool");
  if (want_bool && !PyBool_Check(value.ptr()))
    throw py::type_error(std::string("gwt: option '") + key + "' must be " + type_name + ", got " +
                         std::string(py::str(py::type::of(value).attr("__name__"))));
  try {
    return value.cast<T>();
  } catch (const py::cast_error&) {
    throw py::type_error(std::string("gwt: option '") + key + "' must be " + type_name + ", got " +
                         std::string(py::str(py::type::of(value).attr("__name__"))));
  }
}

inline std::tuple<double, double> betas_option(const py::dict& group) {
  if (!group.contains("betas")) throw py::key_error("gwt: a parameter group has no 'betas' option");
  py::object value = group["betas"];
  if (!py::isinstance<py::sequence>(value) || py::isinstance<py::str>(value) || py::len(value) != 2)
    throw py::type_error("gwt: option 'betas' must be a pair of floats (beta1, beta2)");
  py::sequence s = value;
  try {
    return {s[0].cast<double>(), s[1].cast<double>()};
  } catch (const py::cast_error&) {
    throw py::type_error("gwt: option 'betas' must be a pair of floats (beta1, beta2)");
  }
}

inline int64_t int_value(const py::handle& value, const char* what) {
  if (PyBool_Check(value.ptr()) || !(PyLong_Check(value.ptr()) || PyIndex_Check(value.ptr())))
    throw py::type_error(std::string("gwt: ") + what + " must be an int");
  return py::cast<int64_t>(value);
}

inline at::Tensor tensor_value(const py::handle& value, const char* what) {
  if (!THPVariable_Check(value.ptr()))
    throw py::type_error(std::string("gwt: ") + what + " must be a torch.Tensor");
  return THPVariable_Unpack(value.ptr());
}

void bind_transforms(py::module_& m);    // transforms.cpp
void bind_delta_linear(py::module_& m);  // delta_linear.cpp
void bind_optimizers(py::module_& m);    // optimizers.cpp

}  // namespace gwt_python
