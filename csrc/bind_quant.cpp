// Bindings for the dequantizing copy ops (dequant.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "bind_errors.h"
#include "copy_engine.h"
#include "dequant.h"
#include "dtype.h"

namespace py = pybind11;

namespace streamload {

void bind_quant(py::module_& m) {
  m.attr("DEQUANT_FIELDS") = kDequantFields;
  m.attr("DEQUANT_TABLE_MIN") = kDequantTableMin;
  py::dict kinds;
  kinds["fp8_block"] = static_cast<int64_t>(DequantKind::FP8_BLOCK);
  kinds["mxfp4"] = static_cast<int64_t>(DequantKind::MXFP4);
  m.attr("DEQUANT_KINDS") = kinds;
  m.def(
      "dequantize",
      // ops: address and byte length of a C-contiguous int64 (n, DEQUANT_FIELDS) array.
      [](CopyEngine& e, const std::vector<std::shared_ptr<MappedFile>>& files, uintptr_t ops, uint64_t ops_nbytes) {
        if (ops_nbytes % sizeof(DequantOp) != 0)
          throw py::value_error("ops buffer is not a whole number of dequant op records");
        std::vector<const MappedFile*> raw;
        for (const auto& f : files) raw.push_back(f.get());
        py::gil_scoped_release nogil;
        return dequantize(e.pool(), raw, reinterpret_cast<const DequantOp*>(ops), ops_nbytes / sizeof(DequantOp),
                          e.populate());
      },
      py::arg("engine"), py::arg("files"), py::arg("ops"), py::arg("ops_nbytes"),
      "Runs dequantizing copy ops on the engine's threads; returns the quantized bytes read.");
  m.def(
      "fp8_to_float",
      // The exact widening of one fp8 byte, for tests and tools.
      [](uint8_t byte, const std::string& dtype) {
        if (dtype == "F8_E4M3") return f8e4m3_to_f32(byte);
        if (dtype == "F8_E5M2") return f8e5m2_to_f32(byte);
        throw py::value_error("fp8_to_float: dtype must be F8_E4M3 or F8_E5M2");
      },
      py::arg("byte"), py::arg("dtype"));
}

}  // namespace streamload
