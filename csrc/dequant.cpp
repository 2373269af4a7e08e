#include "dequant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "dtype.h"

namespace streamload {
namespace {

bool overflow_mul(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct Lut {
  float e4m3[256], e5m2[256], e2m1[16], pow2[256], e8m0[256];
  Lut() {
    for (int i = 0; i < 256; ++i) {
      e4m3[i] = f8e4m3_to_f32(static_cast<uint8_t>(i));
      e5m2[i] = f8e5m2_to_f32(static_cast<uint8_t>(i));
      // torch.ldexp(x, e) is x * pow(2, e) with the power formed in float32:
      // 2^-127 is a float32 subnormal, 2^128 overflows to inf.
      pow2[i] = std::ldexp(1.0f, i - 127);
      e8m0[i] = pow2[i];
    }
    // torch widens float8_e8m0fnu 0xFF to the NaN 0x7F800001 (exponent bits
    // shifted in, mantissa 1), not to nanf(""): products carry its payload.
    const uint32_t kE8m0Nan = 0x7F800001u;
    std::memcpy(&e8m0[255], &kE8m0Nan, 4);
    static const float kE2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    std::memcpy(e2m1, kE2m1, sizeof(e2m1));
  }
};

const Lut& lut() {
  static const Lut t;
  return t;
}

size_t scale_itemsize(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: case DType::F16: return 2;
    case DType::F8_E8M0: case DType::U8: return 1;
    default: return 0;
  }
}

// The scale as transformers turns it into float32: fp32 as is, bf16/f16
// widened, uint8 exponents as exp2(b - 127), float8_e8m0fnu likewise with
// 0xFF a NaN.
inline float load_scale(DType t, const char* p) {
  switch (t) {
    case DType::F32: { float f; std::memcpy(&f, p, 4); return f; }
    case DType::BF16: { uint16_t h; std::memcpy(&h, p, 2); return bf16_to_f32(h); }
    case DType::F16: { uint16_t h; std::memcpy(&h, p, 2); return f16_to_f32(h); }
    case DType::F8_E8M0: return lut().e8m0[static_cast<uint8_t>(*p)];
    default: return lut().pow2[static_cast<uint8_t>(*p)];
  }
}

bool dst_supported(DType d) { return is_float_family(d); }

struct Geometry {
  int64_t sr, sc;       // scale grid per batch item
  int64_t w_row_bytes;  // weight bytes per logical row
  int64_t s_isz, d_isz;
};

Geometry geometry(const DequantOp& op) {
  Geometry g{};
  g.sr = cdiv(op.rows, op.block_r);
  g.sc = cdiv(op.cols, op.block_c);
  g.w_row_bytes = static_cast<DequantKind>(op.kind) == DequantKind::MXFP4 ? op.cols / 2 : op.cols;
  g.s_isz = static_cast<int64_t>(scale_itemsize(static_cast<DType>(op.s_dtype)));
  g.d_isz = static_cast<int64_t>(dtype_itemsize(static_cast<DType>(op.dst_dtype)));
  return g;
}

void check_source(const DequantOp& op, bool weight, size_t idx, const std::vector<const MappedFile*>& files,
                  int64_t need) {
  auto bad = [&](const std::string& why) {
    return CopyError("dequant op " + std::to_string(idx) + ": " + (weight ? "weight" : "scale") + " " + why,
                     static_cast<int64_t>(idx));
  };
  int64_t file = weight ? op.w_file : op.s_file, src = weight ? op.w_src : op.s_src;
  int64_t nbytes = weight ? op.w_nbytes : op.s_nbytes;
  if (nbytes < 0) throw bad("has a negative length");
  if (nbytes < need)
    throw bad("tensor has " + std::to_string(nbytes) + " bytes, the shape needs " + std::to_string(need));
  if (file >= 0) {
    if (static_cast<size_t>(file) >= files.size()) throw bad("file index out of range");
    const Header& h = files[static_cast<size_t>(file)]->header();
    if (src < 0 || static_cast<uint64_t>(src) > h.data_size ||
        static_cast<uint64_t>(nbytes) > h.data_size - static_cast<uint64_t>(src))
      throw bad("tensor is outside the file's data section");
  } else if (file != -1) {
    throw bad("has a bad file index");
  } else if (src == 0) {
    throw bad("address is null");
  }
}

void validate(const DequantOp& op, size_t idx, const std::vector<const MappedFile*>& files) {
  auto bad = [&](const std::string& why) {
    return CopyError("dequant op " + std::to_string(idx) + ": " + why, static_cast<int64_t>(idx));
  };
  auto kind = static_cast<DequantKind>(op.kind);
  if (kind != DequantKind::FP8_BLOCK && kind != DequantKind::MXFP4) throw bad("unknown kind");
  auto known = [](int64_t d) { return d >= 0 && d < static_cast<int64_t>(DType::COUNT); };
  if (!known(op.w_dtype) || !known(op.s_dtype) || !known(op.dst_dtype)) throw bad("unknown dtype");
  DType wd = static_cast<DType>(op.w_dtype), sd = static_cast<DType>(op.s_dtype);
  DType dd = static_cast<DType>(op.dst_dtype);
  if (kind == DequantKind::FP8_BLOCK && wd != DType::F8_E4M3 && wd != DType::F8_E5M2)
    throw bad(std::string("FP8 weights must be F8_E4M3 or F8_E5M2, not ") + dtype_name(wd));
  if (kind == DequantKind::MXFP4 && wd != DType::U8 && wd != DType::F4)
    throw bad(std::string("MXFP4 blocks must be U8 (or F4) packed pairs, not ") + dtype_name(wd));
  if (kind == DequantKind::FP8_BLOCK && scale_itemsize(sd) == 0)
    throw bad(std::string("no FP8 scale dtype ") + dtype_name(sd));
  if (kind == DequantKind::MXFP4 && sd != DType::U8 && sd != DType::F8_E8M0)
    throw bad(std::string("MXFP4 scales must be U8 or F8_E8M0 exponents, not ") + dtype_name(sd));
  if (!dst_supported(dd)) throw bad(std::string("cannot dequantize into ") + dtype_name(dd));
  if (op.batch < 0 || op.rows < 0 || op.cols < 0) throw bad("negative shape");
  if (op.block_r <= 0 || op.block_c <= 0) throw bad("block sizes must be positive");
  if (kind == DequantKind::MXFP4 && op.cols % 2 != 0) throw bad("MXFP4 rows must hold whole bytes");
  if (op.b0 < 0 || op.nb < 0 || op.r0 < 0 || op.nr < 0 || op.c0 < 0 || op.nc < 0 ||
      op.b0 + op.nb > op.batch || op.r0 + op.nr > op.rows || op.c0 + op.nc > op.cols)
    throw bad("box [" + std::to_string(op.b0) + "+" + std::to_string(op.nb) + ", " + std::to_string(op.r0) + "+" +
              std::to_string(op.nr) + ", " + std::to_string(op.c0) + "+" + std::to_string(op.nc) +
              "] is outside the tensor [" + std::to_string(op.batch) + ", " + std::to_string(op.rows) + ", " +
              std::to_string(op.cols) + "]");
  Geometry g = geometry(op);
  int64_t w_need, s_need, br, bg;
  if (overflow_mul(op.batch, op.rows, &br) || overflow_mul(br, g.w_row_bytes, &w_need) ||
      overflow_mul(op.batch, g.sr, &bg) || overflow_mul(bg, g.sc, &bg) || overflow_mul(bg, g.s_isz, &s_need))
    throw bad("shape overflows");
  check_source(op, true, idx, files, w_need);
  check_source(op, false, idx, files, s_need);
  if (op.nb == 0 || op.nr == 0 || op.nc == 0) return;
  if (op.dst == 0) throw bad("null destination");
  if (op.dst_nbytes < 0) throw bad("negative destination length");
  int64_t lo = op.dst_offset, hi = op.dst_offset;
  const int64_t ext[3] = {op.nb, op.nr, op.nc};
  const int64_t st[3] = {op.dst_stride_b, op.dst_stride_r, op.dst_stride_c};
  for (int i = 0; i < 3; ++i) {
    int64_t span = (ext[i] - 1) * st[i];
    if (span < 0) lo += span; else hi += span;
  }
  if (lo < 0 || (hi + 1) * g.d_isz > op.dst_nbytes) throw bad("box writes outside the destination buffer");
}

struct Piece {
  size_t op;
  int64_t b, ra, rb;  // batch item, rows [ra, rb)
};

// Byte spans [lo, hi) of the weight and scale tensors a piece reads.
void spans(const DequantOp& op, const Geometry& g, const Piece& p, int64_t* wlo, int64_t* whi, int64_t* slo,
           int64_t* shi) {
  int64_t c1 = op.c0 + op.nc;
  bool fp4 = static_cast<DequantKind>(op.kind) == DequantKind::MXFP4;
  int64_t wc0 = fp4 ? op.c0 / 2 : op.c0, wc1 = fp4 ? (c1 - 1) / 2 + 1 : c1;
  *wlo = (p.b * op.rows + p.ra) * g.w_row_bytes + wc0;
  *whi = (p.b * op.rows + p.rb - 1) * g.w_row_bytes + wc1;
  *slo = ((p.b * g.sr + p.ra / op.block_r) * g.sc + op.c0 / op.block_c) * g.s_isz;
  *shi = ((p.b * g.sr + (p.rb - 1) / op.block_r) * g.sc + (c1 - 1) / op.block_c + 1) * g.s_isz;
}

// One FP8 output before rounding. A NaN scale: torch's product is the scale's NaN,
// quieted, even when the value is a NaN too (its kernel puts the scale first); C++'s
// x * sc may keep x's payload instead, so it is not left to the compiler.
inline float fp8_product(const float* wl, uint8_t x, float sc) {
  if (!std::isnan(sc)) return wl[x] * sc;
  uint32_t bits;
  std::memcpy(&bits, &sc, 4);
  bits |= 0x00400000u;
  float q;
  std::memcpy(&q, &bits, 4);
  return q;
}

// An FP8 block's outputs are one of 256 values, one per weight byte: a table of
// them, each rounded as `store` rounds it, turns each element into one lookup
// (kDequantTableMin, dequant.h: the block region that pays for one).
template <typename Store>
void fp8_table(const float* wl, float sc, Store store, int64_t d_isz, unsigned char* table) {
  for (int x = 0; x < 256; ++x)
    store(reinterpret_cast<char*>(table + x * d_isz), fp8_product(wl, static_cast<uint8_t>(x), sc));
}

// Row [ca, cz) of a block: each weight byte's table entry, d_isz bytes, at `out` (stride_c items).
inline void fp8_row_from_table(const unsigned char* table, int64_t d_isz, const uint8_t* w, int64_t n, char* out,
                               int64_t stride_c) {
  if (stride_c == 1 && d_isz == 2) {
    for (int64_t i = 0; i < n; ++i) std::memcpy(out + 2 * i, table + 2 * w[i], 2);
  } else if (stride_c == 1 && d_isz == 4) {
    for (int64_t i = 0; i < n; ++i) std::memcpy(out + 4 * i, table + 4 * w[i], 4);
  } else {
    for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * stride_c * d_isz, table + d_isz * w[i], d_isz);
  }
}

template <typename Store>
void run_piece(const DequantOp& op, const Geometry& g, const Piece& p, const char* w, const char* s, char* dst,
               Store store) {
  const Lut& t = lut();
  const DType sd = static_cast<DType>(op.s_dtype);
  const bool fp4 = static_cast<DequantKind>(op.kind) == DequantKind::MXFP4;
  const float* wl = static_cast<DType>(op.w_dtype) == DType::F8_E5M2 ? t.e5m2 : t.e4m3;
  const int64_t c1 = op.c0 + op.nc;
  if (!fp4) {
    // Row block by row block (one scale row each): where the piece covers enough of the
    // row block to pay for them, a table of each column block's 256 possible outputs, then
    // the rows in order, one lookup per element; else each element computed.
    const int64_t cb0 = op.c0 / op.block_c, cb1 = (c1 - 1) / op.block_c + 1;
    thread_local std::vector<unsigned char> tables;
    for (int64_t ra = p.ra; ra < p.rb;) {
      const int64_t rblk = ra / op.block_r;
      const int64_t rb = std::min(p.rb, (rblk + 1) * op.block_r);
      const char* srow = s + (p.b * g.sr + rblk) * g.sc * g.s_isz;
      const bool tabled = (rb - ra) * std::min(op.block_c, op.nc) >= kDequantTableMin;
      if (tabled) {
        tables.resize(static_cast<size_t>((cb1 - cb0) * 256 * g.d_isz));
        for (int64_t cb = cb0; cb < cb1; ++cb)
          fp8_table(wl, load_scale(sd, srow + cb * g.s_isz), store, g.d_isz,
                    tables.data() + (cb - cb0) * 256 * g.d_isz);
      }
      for (int64_t r = ra; r < rb; ++r) {
        const uint8_t* wrow = reinterpret_cast<const uint8_t*>(w) + (p.b * op.rows + r) * g.w_row_bytes;
        const int64_t drow = op.dst_offset + (p.b - op.b0) * op.dst_stride_b + (r - op.r0) * op.dst_stride_r;
        for (int64_t cb = cb0; cb < cb1; ++cb) {
          const int64_t ca = std::max(op.c0, cb * op.block_c), cz = std::min(c1, (cb + 1) * op.block_c);
          char* out = dst + (drow + (ca - op.c0) * op.dst_stride_c) * g.d_isz;
          if (tabled) {
            fp8_row_from_table(tables.data() + (cb - cb0) * 256 * g.d_isz, g.d_isz, wrow + ca, cz - ca, out,
                               op.dst_stride_c);
            continue;
          }
          const float sc = load_scale(sd, srow + cb * g.s_isz);
          for (int64_t c = ca; c < cz; ++c)
            store(out + (c - ca) * op.dst_stride_c * g.d_isz, fp8_product(wl, wrow[c], sc));
        }
      }
      ra = rb;
    }
    return;
  }
  // MXFP4. torch.ldexp rounds x * 2^e once. Multiplying by the power of two does the same
  // whenever 2^e is a float32 (e <= 127); e = 128 (byte 255) needs the real ldexp: 0.5 * 2^128
  // is finite.
  auto value = [&t](uint8_t byte, bool high, uint8_t eb) {
    const float v = t.e2m1[high ? (byte >> 4) : (byte & 0x0F)];
    return eb == 0xFF ? std::ldexp(v, 128) : v * t.pow2[eb];
  };
  auto wrow_of = [&](int64_t r) { return reinterpret_cast<const uint8_t*>(w) + (p.b * op.rows + r) * g.w_row_bytes; };
  auto srow_of = [&](int64_t r) {
    return reinterpret_cast<const uint8_t*>(s) + (p.b * g.sr + r / op.block_r) * g.sc * g.s_isz;
  };
  const int64_t base = op.dst_offset + (p.b - op.b0) * op.dst_stride_b;
  if (op.dst_stride_r == 1 && op.dst_stride_c != 1) {
    // A transposed destination (transformers' [E, H, 2I] experts): a tile of rows at a time,
    // column by column, so that the writes of one column run along the destination's rows
    // instead of one element per destination row.
    constexpr int64_t kTile = 64;
    const uint8_t* wrows[kTile];
    const uint8_t* srows[kTile];
    for (int64_t r0 = p.ra; r0 < p.rb; r0 += kTile) {
      const int64_t n = std::min(p.rb - r0, kTile);
      for (int64_t i = 0; i < n; ++i) {
        wrows[i] = wrow_of(r0 + i);
        srows[i] = srow_of(r0 + i);
      }
      for (int64_t c = op.c0; c < c1; ++c) {
        const int64_t half = c >> 1, so = (c / op.block_c) * g.s_isz;
        const bool high = (c & 1) != 0;
        char* out = dst + (base + (r0 - op.r0) + (c - op.c0) * op.dst_stride_c) * g.d_isz;
        for (int64_t i = 0; i < n; ++i) store(out + i * g.d_isz, value(wrows[i][half], high, srows[i][so]));
      }
    }
    return;
  }
  for (int64_t r = p.ra; r < p.rb; ++r) {
    const uint8_t* wrow = wrow_of(r);
    const uint8_t* srow = srow_of(r);
    const int64_t drow = base + (r - op.r0) * op.dst_stride_r;
    for (int64_t c = op.c0; c < c1;) {
      const int64_t blk = c / op.block_c;
      const int64_t cend = std::min(c1, (blk + 1) * op.block_c);
      const uint8_t eb = srow[blk * g.s_isz];
      for (; c < cend; ++c)
        store(dst + (drow + (c - op.c0) * op.dst_stride_c) * g.d_isz, value(wrow[c >> 1], (c & 1) != 0, eb));
    }
  }
}

// The product is a float32; it is rounded once to the destination dtype.
void dispatch(const DequantOp& op, const Geometry& g, const Piece& p, const char* w, const char* s) {
  char* dst = reinterpret_cast<char*>(op.dst);
  switch (static_cast<DType>(op.dst_dtype)) {
    case DType::BF16:
      return run_piece(op, g, p, w, s, dst, [](char* d, float v) {
        // torch's vectorised f32 -> bf16 cast writes every NaN as 0xFFFF.
        uint16_t h = std::isnan(v) ? static_cast<uint16_t>(0xFFFF) : f32_to_bf16(v);
        std::memcpy(d, &h, 2);
      });
    case DType::F16:
      return run_piece(op, g, p, w, s, dst, [](char* d, float v) { uint16_t h = f32_to_f16_keep_nan(v); std::memcpy(d, &h, 2); });
    case DType::F32:
      return run_piece(op, g, p, w, s, dst, [](char* d, float v) { std::memcpy(d, &v, 4); });
    default:
      return run_piece(op, g, p, w, s, dst, [](char* d, float v) { double x = v; std::memcpy(d, &x, 8); });
  }
}

// Points at the tensor's first byte such that [lo, hi) is readable: the
// mapping or the caller's address directly, or a pread into `buf`.
const char* source(const std::vector<const MappedFile*>& files, int64_t file, int64_t src, int64_t lo, int64_t hi,
                   std::vector<char>* buf) {
  if (file < 0) return reinterpret_cast<const char*>(src);
  const MappedFile* f = files[static_cast<size_t>(file)];
  if (f->mapped()) return f->data() + src;
  size_t len = static_cast<size_t>(hi - lo);
  if (buf->size() < len) buf->resize(len);
  f->read_data(static_cast<uint64_t>(src + lo), len, buf->data());
  return buf->data() - lo;
}

// Faults in the destination pages of the piece's rows at once (populate_dense).
void populate_rows(const DequantOp& op, const Geometry& g, const Piece& p) {
  if (op.dst_stride_b < 0 || op.dst_stride_r < 0 || op.dst_stride_c < 0) return;
  const int64_t first = op.dst_offset + (p.b - op.b0) * op.dst_stride_b + (p.ra - op.r0) * op.dst_stride_r;
  const int64_t span = (p.rb - p.ra - 1) * op.dst_stride_r + (op.nc - 1) * op.dst_stride_c + 1;
  populate_dense(reinterpret_cast<char*>(op.dst) + first * g.d_isz, span * g.d_isz,
                 (p.rb - p.ra) * op.nc * g.d_isz);
}

}  // namespace

float e2m1_to_f32(uint8_t nibble) { return lut().e2m1[nibble & 0x0F]; }

uint64_t dequantize(ThreadPool& pool, const std::vector<const MappedFile*>& files, const DequantOp* ops, size_t n,
                    bool populate) {
  for (size_t i = 0; i < n; ++i) validate(ops[i], i, files);
  (void)lut();  // built once, before the workers race for it
  std::vector<Piece> pieces;
  std::vector<Geometry> geos(n);
  bool any_mapped = false;
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const DequantOp& op = ops[i];
    geos[i] = geometry(op);
    if (op.nb == 0 || op.nr == 0 || op.nc == 0) continue;
    for (int64_t f : {op.w_file, op.s_file})
      if (f >= 0 && files[static_cast<size_t>(f)]->mapped()) any_mapped = true;
    int64_t step = piece_rows(op.nc * geos[i].d_isz);
    // Pieces start on scale-block rows where they can, so no scale row is read twice.
    if (step > op.block_r) step -= step % op.block_r;
    for (int64_t b = op.b0; b < op.b0 + op.nb; ++b) {
      for (int64_t ra = op.r0; ra < op.r0 + op.nr;) {
        int64_t rb = std::min(op.r0 + op.nr, ra + step);
        pieces.push_back(Piece{i, b, ra, rb});
        int64_t wlo, whi, slo, shi;
        spans(op, geos[i], pieces.back(), &wlo, &whi, &slo, &shi);
        total += static_cast<uint64_t>((whi - wlo) + (shi - slo));
        ra = rb;
      }
    }
  }
  if (any_mapped) install_bus_handler();
  pool.run(pieces.size(), [&](size_t k) {
    const Piece& p = pieces[k];
    const DequantOp& op = ops[p.op];
    const Geometry& g = geos[p.op];
    int64_t wlo, whi, slo, shi;
    spans(op, g, p, &wlo, &whi, &slo, &shi);
    if (populate) populate_rows(op, g, p);
    thread_local std::vector<char> wbuf, sbuf;
    const MappedFile* mapped = nullptr;
    for (int64_t f : {op.w_file, op.s_file})
      if (f >= 0 && files[static_cast<size_t>(f)]->mapped()) mapped = files[static_cast<size_t>(f)];
    auto body = [&] {
      const char* w = source(files, op.w_file, op.w_src, wlo, whi, &wbuf);
      const char* s = source(files, op.s_file, op.s_src, slo, shi, &sbuf);
      dispatch(op, g, p, w, s);
    };
    if (mapped) run_guarded(mapped, body); else body();
  });
  return total;
}

}  // namespace streamload
