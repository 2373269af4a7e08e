#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "bind_errors.h"
#include "copy_engine.h"

namespace py = pybind11;

namespace streamload {

void bind_copy(py::module_& m) {
  m.attr("OP_FIELDS") = kOpFields;
  m.attr("MAX_DIMS") = kMaxDims;
  py::dict codes;
  for (int32_t i = 0; i < static_cast<int32_t>(DType::COUNT); ++i)
    codes[py::str(dtype_name(static_cast<DType>(i)))] = i;
  m.attr("DTYPE_CODES") = codes;
  m.def("default_threads", &default_threads);

  py::class_<CopyEngine, std::shared_ptr<CopyEngine>>(m, "CopyEngine")
      .def(py::init<size_t>(), py::arg("threads") = 0)
      .def_property_readonly("threads", &CopyEngine::threads)
      .def_property_readonly("peak_bounce_bytes", &CopyEngine::peak_bounce_bytes)
      .def_property("populate", &CopyEngine::populate, &CopyEngine::set_populate)
      .def(
          "execute",
          // ops: address and byte length of a C-contiguous int64 (n, OP_FIELDS) array.
          [](CopyEngine& e, const std::vector<std::shared_ptr<MappedFile>>& files, uintptr_t ops,
             uint64_t ops_nbytes) {
            if (ops_nbytes % sizeof(CopyOp) != 0)
              throw py::value_error("ops buffer is not a whole number of op records");
            std::vector<const MappedFile*> raw;
            for (const auto& f : files) raw.push_back(f.get());
            py::gil_scoped_release nogil;
            return e.execute(raw, reinterpret_cast<const CopyOp*>(ops), ops_nbytes / sizeof(CopyOp));
          },
          py::arg("files"), py::arg("ops"), py::arg("ops_nbytes"))
      .def(
          "parallel_memcpy",
          [](CopyEngine& e, uintptr_t dst, uintptr_t src, size_t n) {
            e.parallel_memcpy(reinterpret_cast<char*>(dst), reinterpret_cast<const char*>(src), n);
          },
          py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace streamload
