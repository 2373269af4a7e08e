// A small strict JSON reader, enough for safetensors headers. Header JSON is
// attacker-controlled input, so depth and size are bounded and every error
// reports the byte offset where parsing stopped.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace streamload {

struct JsonValue {
  enum class Kind { Null, Bool, Number, String, Array, Object } kind = Kind::Null;
  bool boolean = false;
  // Numbers keep their text so integers up to 2^64-1 are exact.
  std::string text;
  std::vector<JsonValue> array;
  // Object members in file order; duplicate keys are rejected by the parser.
  std::vector<std::pair<std::string, JsonValue>> object;
};

class JsonError : public std::runtime_error {
 public:
  JsonError(const std::string& what, size_t offset)
      : std::runtime_error(what + " at byte " + std::to_string(offset)), offset_(offset) {}
  size_t offset() const { return offset_; }

 private:
  size_t offset_;
};

// Parses one JSON document; trailing whitespace (safetensors pads headers
// with spaces) is allowed, anything else after the value is an error.
JsonValue parse_json(const char* data, size_t size);

// Parses an unsigned decimal integer value; throws std::invalid_argument.
uint64_t json_to_u64(const JsonValue& v);

}  // namespace streamload
