#include "header.h"

#include <algorithm>

#include "json.h"

namespace streamload {
namespace {

bool mul_overflows(uint64_t a, uint64_t b, uint64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

TensorEntry parse_entry(const std::string& name, const JsonValue& v, uint64_t data_size,
                        const std::string& file) {
  auto bad = [&](const std::string& why) { return HeaderError(why, file, name); };
  if (v.kind != JsonValue::Kind::Object) throw bad("entry is not a JSON object");
  const JsonValue *dtype = nullptr, *shape = nullptr, *offsets = nullptr;
  for (const auto& kv : v.object) {
    if (kv.first == "dtype") dtype = &kv.second;
    else if (kv.first == "shape") shape = &kv.second;
    else if (kv.first == "data_offsets") offsets = &kv.second;
    else throw bad("unknown field '" + kv.first + "'");
  }
  if (!dtype || !shape || !offsets) throw bad("entry needs dtype, shape and data_offsets");
  TensorEntry e;
  e.name = name;
  if (dtype->kind != JsonValue::Kind::String || !dtype_from_name(dtype->text, &e.dtype))
    throw bad("unknown dtype '" + dtype->text + "'");
  if (shape->kind != JsonValue::Kind::Array) throw bad("shape is not an array");
  uint64_t numel = 1;
  for (const auto& d : shape->array) {
    uint64_t n;
    try { n = json_to_u64(d); } catch (const std::exception& ex) { throw bad(std::string("bad shape: ") + ex.what()); }
    if (mul_overflows(numel, n, &numel)) throw bad("shape overflows");
    e.shape.push_back(n);
  }
  if (offsets->kind != JsonValue::Kind::Array || offsets->array.size() != 2)
    throw bad("data_offsets must be [begin, end]");
  try {
    e.begin = json_to_u64(offsets->array[0]);
    e.end = json_to_u64(offsets->array[1]);
  } catch (const std::exception& ex) {
    throw bad(std::string("bad data_offsets: ") + ex.what());
  }
  if (e.begin > e.end) throw bad("data_offsets begin > end");
  if (e.end > data_size)
    throw bad("data_offsets end " + std::to_string(e.end) + " is past the data section (" +
              std::to_string(data_size) + " bytes)");
  // Sized in bits, as safetensors does, so sub-byte dtypes (F4, F6_*) fit;
  // a tensor must still fill a whole number of bytes.
  uint64_t nbits;
  if (mul_overflows(numel, dtype_bits(e.dtype), &nbits)) throw bad("byte size overflows");
  if (nbits % 8 != 0)
    throw bad(std::to_string(numel) + " elements of " + dtype_name(e.dtype) + " are " +
              std::to_string(nbits) + " bits, not a whole number of bytes");
  uint64_t nbytes = nbits / 8;
  if (nbytes != e.end - e.begin)
    throw bad("shape x itemsize = " + std::to_string(nbytes) + " bytes but data_offsets span " +
              std::to_string(e.end - e.begin));
  return e;
}

}  // namespace

uint64_t parse_header_len(const unsigned char prefix[8], uint64_t file_size, const std::string& file) {
  if (file_size < 8) throw HeaderError("file is shorter than the 8-byte header length", file, "");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (n > kMaxHeaderBytes)
    throw HeaderError("header length " + std::to_string(n) + " exceeds the 100 MB limit", file, "");
  if (n > file_size - 8)
    throw HeaderError("header length " + std::to_string(n) + " is past the end of the file (" +
                      std::to_string(file_size) + " bytes)", file, "");
  return n;
}

Header parse_header(const char* json, uint64_t header_len, uint64_t file_size, const std::string& file) {
  Header h;
  h.header_len = header_len;
  h.data_start = 8 + header_len;
  h.data_size = file_size - h.data_start;
  JsonValue root;
  try {
    root = parse_json(json, header_len);
  } catch (const JsonError& e) {
    throw HeaderError(std::string("invalid header JSON: ") + e.what(), file, "");
  }
  if (root.kind != JsonValue::Kind::Object) throw HeaderError("header is not a JSON object", file, "");
  for (const auto& kv : root.object) {
    if (kv.first == "__metadata__") {
      if (kv.second.kind != JsonValue::Kind::Object)
        throw HeaderError("__metadata__ is not an object", file, "");
      for (const auto& m : kv.second.object) {
        if (m.second.kind != JsonValue::Kind::String)
          throw HeaderError("__metadata__ value for '" + m.first + "' is not a string", file, "");
        h.metadata.emplace_back(m.first, m.second.text);
      }
      continue;
    }
    h.tensors.push_back(parse_entry(kv.first, kv.second, h.data_size, file));
  }
  std::vector<const TensorEntry*> order;
  for (const auto& t : h.tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorEntry* a, const TensorEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  // Sorted by start, a non-empty tensor overlaps an earlier one exactly when
  // it starts before the furthest end seen so far.
  const TensorEntry* furthest = nullptr;
  for (const TensorEntry* cur : order) {
    if (cur->begin == cur->end) continue;  // empty tensors occupy no bytes
    if (furthest && cur->begin < furthest->end)
      throw HeaderError("bytes [" + std::to_string(cur->begin) + ", " + std::to_string(cur->end) +
                        ") overlap tensor '" + furthest->name + "'", file, cur->name);
    if (!furthest || cur->end > furthest->end) furthest = cur;
  }
  return h;
}

}  // namespace streamload
