// Optional CUDA module; streamload imports and runs without it.
#include <pybind11/pybind11.h>

#include "cast_kernels.h"

namespace py = pybind11;

PYBIND11_MODULE(_streamload_cuda, m) {
  m.doc() = "streamload optional CUDA kernels";
  m.def("device_count", &streamload::cuda::device_count);
  m.def(
      "widen_to_f32",
      [](uintptr_t src, uintptr_t dst, int64_t n, bool is_bf16, uintptr_t stream) {
        int err = streamload::cuda::launch_widen_to_f32(src, dst, n, is_bf16, stream);
        if (err != 0) throw std::runtime_error("CUDA launch failed with error " + std::to_string(err));
      },
      py::arg("src"), py::arg("dst"), py::arg("n"), py::arg("is_bf16"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());
}
