#include "json.h"

#include <set>

namespace streamload {
namespace {

constexpr int kMaxDepth = 64;

class Parser {
 public:
  Parser(const char* d, size_t n) : d_(d), n_(n) {}

  JsonValue document() {
    check_utf8();
    skip_ws();
    JsonValue v = value(0);
    skip_ws();
    if (i_ != n_) fail("trailing characters after JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) { throw JsonError(what, i_); }

  // Names become Python str: reject byte sequences that are not UTF-8.
  void check_utf8() {
    const auto* u = reinterpret_cast<const unsigned char*>(d_);
    size_t i = 0;
    while (i < n_) {
      unsigned c = u[i];
      size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
      if (len == 0 || i + len > n_) { i_ = i; fail("invalid UTF-8"); }
      unsigned cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
      for (size_t k = 1; k < len; ++k) {
        if ((u[i + k] & 0xC0) != 0x80) { i_ = i; fail("invalid UTF-8"); }
        cp = (cp << 6) | (u[i + k] & 0x3F);
      }
      bool overlong = (len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000);
      if (overlong || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) { i_ = i; fail("invalid UTF-8"); }
      i += len;
    }
  }

  void skip_ws() {
    while (i_ < n_ && (d_[i_] == ' ' || d_[i_] == '\t' || d_[i_] == '\n' || d_[i_] == '\r')) ++i_;
  }

  char peek() {
    if (i_ >= n_) fail("unexpected end of JSON");
    return d_[i_];
  }

  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++i_;
  }

  void literal(const char* word) {
    for (const char* p = word; *p; ++p) {
      if (i_ >= n_ || d_[i_] != *p) fail("invalid literal");
      ++i_;
    }
  }

  JsonValue value(int depth) {
    if (depth > kMaxDepth) fail("JSON nested too deeply");
    JsonValue v;
    char c = peek();
    if (c == '{') {
      v.kind = JsonValue::Kind::Object;
      object(&v, depth);
    } else if (c == '[') {
      v.kind = JsonValue::Kind::Array;
      array(&v, depth);
    } else if (c == '"') {
      v.kind = JsonValue::Kind::String;
      v.text = string();
    } else if (c == 't') {
      literal("true");
      v.kind = JsonValue::Kind::Bool;
      v.boolean = true;
    } else if (c == 'f') {
      literal("false");
      v.kind = JsonValue::Kind::Bool;
    } else if (c == 'n') {
      literal("null");
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = JsonValue::Kind::Number;
      v.text = number();
    } else {
      fail("unexpected character");
    }
    return v;
  }

  void object(JsonValue* v, int depth) {
    expect('{');
    skip_ws();
    std::set<std::string> seen;
    if (peek() == '}') { ++i_; return; }
    for (;;) {
      skip_ws();
      if (peek() != '"') fail("expected object key");
      std::string key = string();
      if (!seen.insert(key).second) fail("duplicate key '" + key + "'");
      skip_ws();
      expect(':');
      skip_ws();
      JsonValue member = value(depth + 1);
      v->object.emplace_back(std::move(key), std::move(member));
      skip_ws();
      if (peek() == ',') { ++i_; continue; }
      expect('}');
      return;
    }
  }

  void array(JsonValue* v, int depth) {
    expect('[');
    skip_ws();
    if (peek() == ']') { ++i_; return; }
    for (;;) {
      skip_ws();
      v->array.push_back(value(depth + 1));
      skip_ws();
      if (peek() == ',') { ++i_; continue; }
      expect(']');
      return;
    }
  }

  std::string number() {
    size_t start = i_;
    if (peek() == '-') ++i_;
    if (peek() == '0') {
      ++i_;
    } else if (peek() >= '1' && peek() <= '9') {
      while (i_ < n_ && d_[i_] >= '0' && d_[i_] <= '9') ++i_;
    } else {
      fail("invalid number");
    }
    if (i_ < n_ && d_[i_] == '.') {
      ++i_;
      if (i_ >= n_ || d_[i_] < '0' || d_[i_] > '9') fail("invalid number");
      while (i_ < n_ && d_[i_] >= '0' && d_[i_] <= '9') ++i_;
    }
    if (i_ < n_ && (d_[i_] == 'e' || d_[i_] == 'E')) {
      ++i_;
      if (i_ < n_ && (d_[i_] == '+' || d_[i_] == '-')) ++i_;
      if (i_ >= n_ || d_[i_] < '0' || d_[i_] > '9') fail("invalid number");
      while (i_ < n_ && d_[i_] >= '0' && d_[i_] <= '9') ++i_;
    }
    return std::string(d_ + start, i_ - start);
  }

  unsigned hex4() {
    unsigned cp = 0;
    for (int k = 0; k < 4; ++k) {
      char c = peek();
      ++i_;
      cp <<= 4;
      if (c >= '0' && c <= '9') cp |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f') cp |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') cp |= static_cast<unsigned>(c - 'A' + 10);
      else fail("invalid \\u escape");
    }
    return cp;
  }

  static void append_utf8(std::string* out, unsigned cp) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  std::string string() {
    expect('"');
    std::string out;
    for (;;) {
      char c = peek();
      ++i_;
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') { out.push_back(c); continue; }
      char e = peek();
      ++i_;
      switch (e) {
        case '"': out.push_back('"'); break;
        case '\\': out.push_back('\\'); break;
        case '/': out.push_back('/'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (peek() != '\\') fail("unpaired surrogate");
            ++i_;
            if (peek() != 'u') fail("unpaired surrogate");
            ++i_;
            unsigned lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("unpaired surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("unpaired surrogate");
          }
          append_utf8(&out, cp);
          break;
        }
        default: fail("invalid escape");
      }
    }
  }

  const char* d_;
  size_t n_;
  size_t i_ = 0;
};

}  // namespace

JsonValue parse_json(const char* data, size_t size) { return Parser(data, size).document(); }

uint64_t json_to_u64(const JsonValue& v) {
  if (v.kind != JsonValue::Kind::Number || v.text.empty() || v.text[0] == '-')
    throw std::invalid_argument("not a non-negative integer");
  uint64_t out = 0;
  for (char c : v.text) {
    if (c < '0' || c > '9') throw std::invalid_argument("not an integer: " + v.text);
    uint64_t d = static_cast<uint64_t>(c - '0');
    if (out > (UINT64_MAX - d) / 10) throw std::invalid_argument("integer overflow: " + v.text);
    out = out * 10 + d;
  }
  return out;
}

}  // namespace streamload
