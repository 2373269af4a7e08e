// A safetensors file opened read-only: header validated, data section either
// mapped (mmap) or read on demand (pread, for file systems where mapping is
// slow or unsupported). Nothing here ever writes to the file.
#pragma once

#include <cstdint>
#include <string>

#include "header.h"

namespace streamload {

enum class ReadMode { Auto = 0, Mmap = 1, Pread = 2 };

class FileError : public std::runtime_error {
 public:
  FileError(std::string reason, std::string file)
      : std::runtime_error(file + ": " + reason), reason(std::move(reason)), file(std::move(file)) {}
  std::string reason, file;
};

class MappedFile {
 public:
  // Opens and validates; throws HeaderError or FileError. Auto maps the file
  // and falls back to pread when mmap fails.
  MappedFile(const std::string& path, ReadMode mode);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const Header& header() const { return header_; }
  uint64_t file_size() const { return file_size_; }
  bool mapped() const { return map_ != nullptr; }
  // The open read-only descriptor (valid while this object lives).
  int fileno() const { return fd_; }
  // Start of the data section in the mapping, or nullptr in pread mode.
  const char* data() const { return map_ ? static_cast<const char*>(map_) + header_.data_start : nullptr; }

  // Copies [offset, offset + n) of the data section into dst (pread or memcpy).
  void read_data(uint64_t offset, uint64_t n, char* dst) const;

  // Throws FileError if the file on disk is now shorter than when opened
  // (a mapped page past the new end would raise SIGBUS).
  void check_unchanged() const;

 private:
  std::string path_;
  int fd_ = -1;
  void* map_ = nullptr;
  uint64_t file_size_ = 0;
  Header header_;
};

}  // namespace streamload
