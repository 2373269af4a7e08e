#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "bind_errors.h"
#include "cold_reader.h"

namespace py = pybind11;

namespace streamload {
namespace {

// A read range as it crosses the boundary: a row of a C-contiguous int64
// (n, kRangeFields) array: file offset, bytes, destination address, bytes
// writable at the destination.
constexpr size_t kRangeFields = 4;

py::dict stats_dict(const ReadStats& s) {
  py::dict d;
  d["bytes_requested"] = s.bytes_requested;
  d["bytes_read"] = s.bytes_read;
  d["windows"] = s.windows;
  d["direct_windows"] = s.direct_windows;
  d["direct_refused"] = s.direct_refused;
  d["seconds"] = s.seconds;
  return d;
}

DirectMode direct_arg(const std::string& s) {
  try {
    return parse_direct_mode(s);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
}

}  // namespace

void bind_cold(py::module_& m) {
  m.attr("DIRECT_ALIGN") = kDirectAlign;
  m.attr("RANGE_FIELDS") = kRangeFields;
  m.def(
      "residency",
      [](const std::string& path, uint64_t offset, uint64_t length, uint64_t sample_pages) {
        return residency(path, offset, length, sample_pages);
      },
      py::arg("path"), py::arg("offset") = 0, py::arg("length") = 0, py::arg("sample_pages") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "(resident pages, pages probed) of [offset, offset + length) of the file; length 0: to the end. "
      "sample_pages > 0: about that many pages, in windows spread evenly over a longer range.");
  m.def("evict", &evict, py::arg("path"), py::arg("offset") = 0, py::arg("length") = 0, py::arg("sync") = true,
        py::call_guard<py::gil_scoped_release>(),
        "Drops the file's pages from the page cache (POSIX_FADV_DONTNEED), after writing back dirty ones.");

  py::class_<ColdReader, std::shared_ptr<ColdReader>>(m, "ColdReader")
      // refuse_direct_for_test: every O_DIRECT read fails with EINVAL (the buffered fallback, in tests).
      .def(py::init([](size_t threads, uint64_t block_bytes, const std::string& direct, bool drop_behind,
                       bool refuse_direct_for_test) {
             return std::make_shared<ColdReader>(threads, block_bytes, direct_arg(direct), drop_behind,
                                                 refuse_direct_for_test);
           }),
           py::arg("threads") = 0, py::arg("block_bytes") = 8 << 20, py::arg("direct") = "auto",
           py::arg("drop_behind") = false, py::arg("refuse_direct_for_test") = false)
      .def_property_readonly("threads", &ColdReader::threads)
      .def_property_readonly("block_bytes", &ColdReader::block_bytes)
      .def(
          "read",
          // ranges: address and byte length of a C-contiguous int64 (n, RANGE_FIELDS) array.
          // fd: a descriptor of the file as it was opened (its header read from it), or -1.
          [](ColdReader& r, const std::string& path, uintptr_t ranges, uint64_t ranges_nbytes, int fd) {
            constexpr uint64_t row = kRangeFields * sizeof(int64_t);
            if (ranges_nbytes % row != 0) throw py::value_error("ranges buffer is not a whole number of range records");
            if (ranges_nbytes > 0 && ranges == 0) throw py::value_error("null ranges buffer");
            const int64_t* p = reinterpret_cast<const int64_t*>(ranges);
            std::vector<ReadRange> rs(ranges_nbytes / row);
            for (size_t i = 0; i < rs.size(); ++i) {
              const int64_t* f = p + i * kRangeFields;
              if (f[0] < 0 || f[1] < 0 || f[3] < 0)
                throw py::value_error("read range " + std::to_string(i) + ": negative offset or length");
              rs[i] = {static_cast<uint64_t>(f[0]), static_cast<uint64_t>(f[1]), reinterpret_cast<char*>(f[2]),
                       static_cast<uint64_t>(f[3])};
            }
            ReadStats s;
            {
              py::gil_scoped_release nogil;
              s = r.read(path, rs, fd);
            }
            return stats_dict(s);
          },
          py::arg("path"), py::arg("ranges"), py::arg("ranges_nbytes"), py::arg("fd") = -1)
      .def(
          "prefetch",
          // ranges: address and byte length of a C-contiguous int64 (n, 2) array: offset, bytes.
          [](ColdReader& r, const std::string& path, uintptr_t ranges, uint64_t ranges_nbytes) {
            if (ranges_nbytes % (2 * sizeof(int64_t)) != 0)
              throw py::value_error("ranges buffer is not a whole number of (offset, bytes) records");
            if (ranges_nbytes > 0 && ranges == 0) throw py::value_error("null ranges buffer");
            const int64_t* p = reinterpret_cast<const int64_t*>(ranges);
            std::vector<std::pair<uint64_t, uint64_t>> rs(ranges_nbytes / (2 * sizeof(int64_t)));
            for (size_t i = 0; i < rs.size(); ++i) {
              if (p[2 * i] < 0 || p[2 * i + 1] < 0) throw py::value_error("negative prefetch range");
              rs[i] = {static_cast<uint64_t>(p[2 * i]), static_cast<uint64_t>(p[2 * i + 1])};
            }
            ReadStats s;
            {
              py::gil_scoped_release nogil;
              s = r.prefetch(path, std::move(rs));
            }
            return stats_dict(s);
          },
          py::arg("path"), py::arg("ranges"), py::arg("ranges_nbytes"))
      .def(
          "probe",
          [](ColdReader& r, const std::vector<std::string>& paths) {
            ReadStats s;
            {
              py::gil_scoped_release nogil;
              s = r.probe(paths);
            }
            return stats_dict(s);
          },
          py::arg("paths"));
}

}  // namespace streamload
