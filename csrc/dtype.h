// Element types of the safetensors format and the conversions between them.
// Torch-free: conversions reproduce c10's scalar rounding (round to nearest
// even, NaN kept a NaN, Inf kept Inf) without linking libtorch.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace streamload {

// Codes are part of the Python contract (DTYPE_CODES): new dtypes go at the
// end, before COUNT. Every dtype the safetensors format defines is listed.
enum class DType : int32_t {
  BOOL = 0, U8, I8, U16, I16, F16, BF16, U32, I32, F32, U64, I64, F64,
  F8_E4M3, F8_E5M2, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, F4, F6_E2M3, F6_E3M2, C64,
  COUNT
};

inline const char* dtype_name(DType d) {
  static const char* names[] = {"BOOL", "U8",  "I8",  "U16", "I16",
                                "F16",  "BF16", "U32", "I32", "F32",
                                "U64",  "I64", "F64", "F8_E4M3", "F8_E5M2",
                                "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F4",
                                "F6_E2M3", "F6_E3M2", "C64"};
  static_assert(sizeof(names) / sizeof(names[0]) == static_cast<size_t>(DType::COUNT),
                "one name per dtype");
  auto i = static_cast<int32_t>(d);
  return (i >= 0 && i < static_cast<int32_t>(DType::COUNT)) ? names[i] : "?";
}

// Bits per element: safetensors sizes tensors in bits (F4 = 4, F6_* = 6) and
// requires a whole number of bytes per tensor.
inline size_t dtype_bits(DType d) {
  switch (d) {
    case DType::F4: return 4;
    case DType::F6_E2M3: case DType::F6_E3M2: return 6;
    case DType::BOOL: case DType::U8: case DType::I8: case DType::F8_E4M3: case DType::F8_E5M2:
    case DType::F8_E8M0: case DType::F8_E4M3FNUZ: case DType::F8_E5M2FNUZ: return 8;
    case DType::U16: case DType::I16: case DType::F16: case DType::BF16: return 16;
    case DType::U32: case DType::I32: case DType::F32: return 32;
    case DType::U64: case DType::I64: case DType::F64: case DType::C64: return 64;
    default: return 0;
  }
}

// Bytes per element, or 0 for sub-byte dtypes (which are copied as bytes).
inline size_t dtype_itemsize(DType d) {
  size_t b = dtype_bits(d);
  return b % 8 == 0 ? b / 8 : 0;
}

inline bool dtype_sub_byte(DType d) { return dtype_bits(d) % 8 != 0; }

// Returns false when the name is not a dtype this engine knows.
inline bool dtype_from_name(const std::string& s, DType* out) {
  for (int32_t i = 0; i < static_cast<int32_t>(DType::COUNT); ++i) {
    if (s == dtype_name(static_cast<DType>(i))) {
      *out = static_cast<DType>(i);
      return true;
    }
  }
  return false;
}

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float f32_from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// c10::detail::round_to_nearest_even for numbers; a NaN becomes 0xFFFF, as in
// torch's vectorised f32 -> bf16 cast (the one a contiguous `.to(torch.bfloat16)`
// takes on x86: every NaN, whatever its sign and payload). c10's scalar formula
// gives 0x7FC0 instead: casts torch runs through it say so (f8_to_bf16, f16_to_bf16).
inline uint16_t f32_to_bf16(float f) {
  if (std::isnan(f)) return 0xFFFF;
  uint32_t u = f32_bits(f);
  uint32_t bias = ((u >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>((u + bias) >> 16);
}

// c10::detail::fp16_ieee_to_fp32_value.
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = f32_from_bits(0x7800000u);  // 0x1.0p-112f
  const float normalized = f32_from_bits((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized = f32_from_bits((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? f32_bits(denormalized) : f32_bits(normalized));
  return f32_from_bits(result);
}

// c10::detail::fp16_ieee_from_fp32_value.
inline uint16_t f32_to_f16(float f) {
  const float scale_to_inf = f32_from_bits(0x77800000u);   // 0x1.0p+112f
  const float scale_to_zero = f32_from_bits(0x08800000u);  // 0x1.0p-110f
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// c10::detail::fp8e4m3fn_to_fp32_value (exact; 0x7F/0xFF are NaN, no Inf).
inline float f8e4m3_to_f32(uint8_t input) {
  const uint32_t w = static_cast<uint32_t>(input) << 24;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t nonsign = w & 0x7FFFFFFFu;
  if (nonsign == 0) return f32_from_bits(sign);  // clz(0) is undefined; c10's mask yields +-0
  uint32_t renorm_shift = static_cast<uint32_t>(__builtin_clz(nonsign));
  renorm_shift = renorm_shift > 4 ? renorm_shift - 4 : 0;
  const int32_t inf_nan_mask = (static_cast<int32_t>(nonsign + 0x01000000u) >> 8) & 0x7F800000;
  const uint32_t result =
      sign | ((((nonsign << renorm_shift) >> 4) + ((0x78u - renorm_shift) << 23)) |
              static_cast<uint32_t>(inf_nan_mask));
  return f32_from_bits(result);
}

// c10::detail::fp8e5m2_to_fp32_value: e5m2 is the top byte of an f16.
inline float f8e5m2_to_f32(uint8_t input) { return f16_to_f32(static_cast<uint16_t>(input) << 8); }

// fp8 -> bf16 as torch's CPU cast does it: through c10's scalar
// round_to_nearest_even, where every NaN becomes 0x7FC0 (sign dropped).
inline uint16_t f8_to_bf16(float widened) {
  return std::isnan(widened) ? static_cast<uint16_t>(0x7FC0) : f32_to_bf16(widened);
}

// f16 -> bf16 as torch's CPU cast does it: every NaN becomes 0x7FC0 (sign dropped).
inline uint16_t f16_to_bf16(uint16_t h) {
  const float f = f16_to_f32(h);
  return std::isnan(f) ? static_cast<uint16_t>(0x7FC0) : f32_to_bf16(f);
}

// f32 -> f16 keeping a NaN's sign and top payload bits, quieted, as the x86
// F16C conversion torch's vectorised casts use (c10's scalar formula makes
// every NaN 0x7E00). Non-NaN values round as f32_to_f16.
inline uint16_t f32_to_f16_keep_nan(float f) {
  if (!std::isnan(f)) return f32_to_f16(f);
  uint32_t u = f32_bits(f);
  return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7E00u | ((u >> 13) & 0x03FFu));
}

// True when `from -> to` is a conversion the copy engine performs exactly as
// torch does: between float-family dtypes, and widening fp8 (e4m3fn, e5m2)
// to them. Everything else only copies as bytes into the same dtype.
inline bool is_float_family(DType d) {
  return d == DType::F16 || d == DType::BF16 || d == DType::F32 || d == DType::F64;
}

inline bool is_fp8_cast_source(DType d) { return d == DType::F8_E4M3 || d == DType::F8_E5M2; }

inline bool conversion_supported(DType from, DType to) {
  return from == to || (is_float_family(to) && (is_float_family(from) || is_fp8_cast_source(from)));
}

}  // namespace streamload
