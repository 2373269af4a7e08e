#include "bind_errors.h"

#include "copy_engine.h"
#include "header.h"
#include "mapped_file.h"

namespace py = pybind11;

namespace streamload {

void bind_errors(py::module_& m) {
  (void)m;
  py::register_exception_translator([](std::exception_ptr p) {
    auto raise = [](const char* cls, py::tuple args) {
      py::object type = py::module_::import("streamload.errors").attr(cls);
      PyErr_SetObject(type.ptr(), args.ptr());
    };
    try {
      if (p) std::rethrow_exception(p);
    } catch (const HeaderError& e) {
      raise("HeaderError", py::make_tuple(e.reason, e.file, e.tensor.empty() ? py::none() : py::cast(e.tensor)));
    } catch (const FileError& e) {
      raise("CheckpointFileError", py::make_tuple(e.reason, e.file, py::none()));
    } catch (const CopyError& e) {
      raise("CopyOpError", py::make_tuple(std::string(e.what()), py::none(), py::none()));
    }
  });
}

}  // namespace streamload
