#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "bind_errors.h"
#include "mapped_file.h"

namespace py = pybind11;

namespace streamload {
namespace {

py::list tensor_table(const Header& h) {
  py::list out;
  for (const auto& t : h.tensors) {
    py::tuple shape(t.shape.size());
    for (size_t i = 0; i < t.shape.size(); ++i) shape[i] = py::int_(t.shape[i]);
    out.append(py::make_tuple(t.name, dtype_name(t.dtype), shape, t.begin, t.end));
  }
  return out;
}

py::dict metadata(const Header& h) {
  py::dict d;
  for (const auto& kv : h.metadata) d[py::str(kv.first)] = py::str(kv.second);
  return d;
}

ReadMode parse_mode(const std::string& mode) {
  if (mode == "auto") return ReadMode::Auto;
  if (mode == "mmap") return ReadMode::Mmap;
  if (mode == "pread") return ReadMode::Pread;
  throw py::value_error("read mode must be 'auto', 'mmap' or 'pread', not '" + mode + "'");
}

}  // namespace

void bind_file(py::module_& m) {
  py::class_<MappedFile, std::shared_ptr<MappedFile>>(m, "SafetensorsFile")
      .def(py::init([](const std::string& path, const std::string& mode) {
             ReadMode rm = parse_mode(mode);
             py::gil_scoped_release nogil;
             return std::make_shared<MappedFile>(path, rm);
           }),
           py::arg("path"), py::arg("mode") = "auto")
      .def_property_readonly("path", &MappedFile::path)
      .def_property_readonly("file_size", &MappedFile::file_size)
      .def_property_readonly("mapped", &MappedFile::mapped)
      .def_property_readonly("fileno", &MappedFile::fileno)
      .def_property_readonly("header_len", [](const MappedFile& f) { return f.header().header_len; })
      .def_property_readonly("data_start", [](const MappedFile& f) { return f.header().data_start; })
      .def_property_readonly("data_size", [](const MappedFile& f) { return f.header().data_size; })
      .def_property_readonly("metadata", [](const MappedFile& f) { return metadata(f.header()); })
      .def_property_readonly("tensors", [](const MappedFile& f) { return tensor_table(f.header()); })
      .def(
          "read_into",
          [](const MappedFile& f, uint64_t offset, uint64_t nbytes, uintptr_t dst, uint64_t dst_len) {
            if (nbytes > dst_len) throw py::value_error("read_into: destination is smaller than the read");
            f.read_data(offset, nbytes, reinterpret_cast<char*>(dst));
          },
          py::arg("offset"), py::arg("nbytes"), py::arg("dst"), py::arg("dst_len"),
          py::call_guard<py::gil_scoped_release>())
      .def("check_unchanged", &MappedFile::check_unchanged, py::call_guard<py::gil_scoped_release>());

  // Validates a header held in memory (the whole file's bytes, or its first
  // part with the real size) without touching disk: used by tools and fuzzing.
  m.def(
      "parse_header",
      [](py::bytes data, py::object file_size, const std::string& name) {
        std::string buf = data;
        uint64_t size = file_size.is_none() ? buf.size() : file_size.cast<uint64_t>();
        py::gil_scoped_release nogil;
        unsigned char prefix[8] = {0};
        for (size_t i = 0; i < 8 && i < buf.size(); ++i) prefix[i] = static_cast<unsigned char>(buf[i]);
        uint64_t len = parse_header_len(prefix, buf.size() < 8 ? buf.size() : size, name);
        if (8 + len > buf.size()) throw HeaderError("header is longer than the bytes given", name, "");
        Header h = parse_header(buf.data() + 8, len, size, name);
        py::gil_scoped_acquire gil;
        return py::make_tuple(tensor_table(h), metadata(h), h.data_start);
      },
      py::arg("data"), py::arg("file_size") = py::none(), py::arg("name") = "<memory>");
}

}  // namespace streamload
