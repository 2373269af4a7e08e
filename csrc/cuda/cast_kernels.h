// Device-side widening casts used when unpacking a received bucket on GPU.
#pragma once

#include <cstdint>

namespace streamload {
namespace cuda {

// Launches dst[i] = float(src[i]) for n elements of bf16 (is_bf16) or f16,
// on `stream` (a cudaStream_t as an integer). Returns a cudaError_t.
int launch_widen_to_f32(uintptr_t src, uintptr_t dst, int64_t n, bool is_bf16, uintptr_t stream);
int device_count();

}  // namespace cuda
}  // namespace streamload
