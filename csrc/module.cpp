// The extension module: one bind_* per concept, nothing else.
#include <pybind11/pybind11.h>

#include "bind_errors.h"

PYBIND11_MODULE(_streamload, m) {
  m.doc() = "streamload native engine: safetensors files, header validation, copy ops, dequantization, cold reads";
  streamload::bind_errors(m);
  streamload::bind_file(m);
  streamload::bind_copy(m);
  streamload::bind_quant(m);
  streamload::bind_cold(m);
}
