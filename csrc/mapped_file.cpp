#include "mapped_file.h"

#include <cerrno>
#include <cstring>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace streamload {
namespace {

void pread_all(int fd, char* dst, uint64_t n, uint64_t offset, const std::string& path) {
  while (n > 0) {
    ssize_t got = ::pread(fd, dst, n, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw FileError(std::string("read failed: ") + std::strerror(errno), path);
    }
    if (got == 0) throw FileError("unexpected end of file (was it truncated?)", path);
    dst += got;
    n -= static_cast<uint64_t>(got);
    offset += static_cast<uint64_t>(got);
  }
}

}  // namespace

MappedFile::MappedFile(const std::string& path, ReadMode mode) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw FileError(std::string("cannot open: ") + std::strerror(errno), path);
  try {
    struct stat st;
    if (::fstat(fd_, &st) != 0) throw FileError(std::string("cannot stat: ") + std::strerror(errno), path);
    if (!S_ISREG(st.st_mode)) throw FileError("not a regular file", path);
    file_size_ = static_cast<uint64_t>(st.st_size);
    unsigned char prefix[8] = {0};
    if (file_size_ >= 8) pread_all(fd_, reinterpret_cast<char*>(prefix), 8, 0, path);
    uint64_t len = parse_header_len(prefix, file_size_, path);
    std::vector<char> json(len);
    pread_all(fd_, json.data(), len, 8, path);
    header_ = parse_header(json.data(), len, file_size_, path);
    if (mode != ReadMode::Pread && file_size_ > 0) {
      void* p = ::mmap(nullptr, file_size_, PROT_READ, MAP_SHARED, fd_, 0);
      if (p == MAP_FAILED) {
        if (mode == ReadMode::Mmap) throw FileError(std::string("mmap failed: ") + std::strerror(errno), path);
      } else {
        map_ = p;
        // Loads walk each tensor front to back; let the kernel read ahead.
        ::madvise(map_, file_size_, MADV_SEQUENTIAL);
      }
    }
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

MappedFile::~MappedFile() {
  if (map_) ::munmap(map_, file_size_);
  if (fd_ >= 0) ::close(fd_);
}

void MappedFile::read_data(uint64_t offset, uint64_t n, char* dst) const {
  if (offset > header_.data_size || n > header_.data_size - offset)
    throw FileError("read of " + std::to_string(n) + " bytes at " + std::to_string(offset) +
                    " is past the data section", path_);
  if (map_) {
    std::memcpy(dst, data() + offset, n);
  } else {
    pread_all(fd_, dst, n, header_.data_start + offset, path_);
  }
}

void MappedFile::check_unchanged() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) throw FileError(std::string("cannot stat: ") + std::strerror(errno), path_);
  if (static_cast<uint64_t>(st.st_size) < file_size_)
    throw FileError("file shrank from " + std::to_string(file_size_) + " to " +
                    std::to_string(st.st_size) + " bytes while open (truncated?)", path_);
}

}  // namespace streamload
