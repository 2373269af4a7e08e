// Safetensors header: parsing and validation. Every violation throws
// HeaderError naming the file and, where there is one, the tensor.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "dtype.h"

namespace streamload {

// Largest header accepted, as in the reference implementation (100 MB).
constexpr uint64_t kMaxHeaderBytes = 100000000;

class HeaderError : public std::runtime_error {
 public:
  HeaderError(std::string reason, std::string file, std::string tensor)
      : std::runtime_error(file + (tensor.empty() ? "" : (": tensor '" + tensor + "'")) + ": " + reason),
        reason(std::move(reason)), file(std::move(file)), tensor(std::move(tensor)) {}
  std::string reason, file, tensor;
};

struct TensorEntry {
  std::string name;
  DType dtype = DType::U8;
  std::vector<uint64_t> shape;
  // Byte range relative to the start of the data section.
  uint64_t begin = 0, end = 0;
};

struct Header {
  uint64_t header_len = 0;   // the JSON length from the 8-byte prefix
  uint64_t data_start = 0;   // 8 + header_len
  uint64_t data_size = 0;    // file size - data_start
  std::vector<TensorEntry> tensors;  // in header order
  std::vector<std::pair<std::string, std::string>> metadata;
};

// Reads the little-endian length prefix and checks it against the file size.
uint64_t parse_header_len(const unsigned char prefix[8], uint64_t file_size, const std::string& file);

// Parses and validates the JSON header of a file of `file_size` bytes.
Header parse_header(const char* json, uint64_t header_len, uint64_t file_size, const std::string& file);

}  // namespace streamload
