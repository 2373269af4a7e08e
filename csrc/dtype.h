// Element types of the safetensors format and the conversions between them.
// Torch-free: conversions reproduce c10's scalar rounding (round to nearest
// even, NaN kept a NaN, Inf kept Inf) without linking libtorch.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace streamload {

enum class DType : int32_t {
  BOOL = 0, U8, I8, U16, I16, F16, BF16, U32, I32, F32, U64, I64, F64,
  F8_E4M3, F8_E5M2, COUNT
};

inline const char* dtype_name(DType d) {
  static const char* names[] = {"BOOL", "U8",  "I8",  "U16", "I16",
                                "F16",  "BF16", "U32", "I32", "F32",
                                "U64",  "I64", "F64", "F8_E4M3", "F8_E5M2"};
  auto i = static_cast<int32_t>(d);
  return (i >= 0 && i < static_cast<int32_t>(DType::COUNT)) ? names[i] : "?";
}

inline size_t dtype_itemsize(DType d) {
  switch (d) {
    case DType::BOOL: case DType::U8: case DType::I8:
    case DType::F8_E4M3: case DType::F8_E5M2: return 1;
    case DType::U16: case DType::I16: case DType::F16: case DType::BF16: return 2;
    case DType::U32: case DType::I32: case DType::F32: return 4;
    case DType::U64: case DType::I64: case DType::F64: return 8;
    default: return 0;
  }
}

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

// c10::detail::round_to_nearest_even.
inline uint16_t f32_to_bf16(float f) {
  if (std::isnan(f)) return (f32_bits(f) & 0x80000000u) ? 0xFFC0 : 0x7FC0;
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

// True when `from -> to` is a conversion the copy engine performs.
inline bool is_float_family(DType d) {
  return d == DType::F16 || d == DType::BF16 || d == DType::F32 || d == DType::F64;
}

inline bool conversion_supported(DType from, DType to) {
  return from == to || (is_float_family(from) && is_float_family(to));
}

}  // namespace streamload
