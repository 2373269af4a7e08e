// Dequantizing copy ops: a box of a quantized weight, scaled by its scale
// tensor, written into a destination buffer of a float dtype. Two schemes,
// each bit-exact with the dequantization transformers applies when loading:
//
//  FP8 block-scaled (DeepSeek-V3 style, transformers' Fp8Dequantize):
//    W [B, R, C] float8_e4m3fn (or e5m2), S [B, ceil(R/br), ceil(C/bc)]
//    (float32 `weight_scale_inv`, or bf16/f16/e8m0);
//    out[b,i,j] = round_to_dst(float(W[b,i,j]) * float(S[b, i/br, j/bc]))
//    with the product formed in float32. (transformers derives the block
//    from the grid, rows / ceil(rows / br); for shapes that do not divide
//    the block the configured block is used here, as DeepSeek's own kernel.)
//  MXFP4 (GPT-OSS style, transformers' _convert_moe_packed_tensors):
//    blocks [B, R, C/2] bytes, two e2m1 values each (low nibble first),
//    scales [B, R, C/32] uint8 e8m0;
//    out[b,i,k] = round_to_dst(ldexpf(e2m1(k), scale - 127)): torch.ldexp
//    rounds the exact product once to float32, then .to() rounds to dst.
//
// A box is any sub-range of batch items, rows and columns: only the weight
// bytes and scale entries it needs are read. The destination is strided, so
// a transposed (GPT-OSS [E, H, 2I]) or fused (expert stack, gate/up concat)
// layout is written in place. Every op is bounds-checked before anything is
// written.
#pragma once

#include <cstdint>
#include <vector>

#include "copy_engine.h"
#include "mapped_file.h"
#include "thread_pool.h"

namespace streamload {

enum class DequantKind : int64_t { FP8_BLOCK = 1, MXFP4 = 2 };

// One op as it crosses the boundary: a row of int64 in a (n, kDequantFields) array.
struct DequantOp {
  int64_t kind;
  // The weight tensor: a file index (or -1: `w_src` is an address), its
  // byte offset in the file's data section, its byte length, its dtype
  // (F8_E4M3 / F8_E5M2 for FP8_BLOCK; U8 or F4 packed pairs for MXFP4).
  int64_t w_file, w_src, w_nbytes, w_dtype;
  // The scale tensor, likewise (F32, BF16, F16, F8_E8M0 or U8).
  int64_t s_file, s_src, s_nbytes, s_dtype;
  int64_t dst, dst_nbytes, dst_dtype;  // destination address, writable bytes, dtype
  int64_t batch, rows, cols;           // logical values: [batch, rows, cols]
  int64_t block_r, block_c;            // one scale per block_r x block_c values
  int64_t b0, nb, r0, nr, c0, nc;      // the box
  int64_t dst_offset;                  // element offset of box[0, 0, 0] at dst
  int64_t dst_stride_b, dst_stride_r, dst_stride_c;  // in elements
};
constexpr int kDequantFields = sizeof(DequantOp) / sizeof(int64_t);

// FP8: a piece's rows in one row block times the block's width (at most the box's) from
// which the block's 256 possible outputs are tabled first (one lookup per element after).
constexpr int64_t kDequantTableMin = 2048;
static_assert(kDequantFields == 27, "DequantOp layout is part of the Python contract");

// Validates every op, then dequantizes them all on the pool; returns the
// quantized bytes (weights and scales) read. With `populate`, each piece's
// destination pages are faulted in at once first (populate_pages).
uint64_t dequantize(ThreadPool& pool, const std::vector<const MappedFile*>& files, const DequantOp* ops,
                    size_t n, bool populate = true);

// e2m1 value of a nibble (sign bit 3), as transformers' FP4_VALUES table.
float e2m1_to_f32(uint8_t nibble);

}  // namespace streamload
