// Native exceptions become streamload.errors classes carrying file and tensor.
#pragma once

#include <pybind11/pybind11.h>

namespace streamload {
void bind_errors(pybind11::module_& m);
void bind_file(pybind11::module_& m);
void bind_copy(pybind11::module_& m);
void bind_quant(pybind11::module_& m);
void bind_cold(pybind11::module_& m);
}  // namespace streamload
