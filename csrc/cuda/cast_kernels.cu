#include "cast_kernels.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace streamload {
namespace cuda {
namespace {

// Exact widening: bf16 is the top half of an f32.
__global__ void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (; i < n; i += step) dst[i] = __uint_as_float(static_cast<uint32_t>(src[i]) << 16);
}

__global__ void widen_f16(const __half_raw* src, float* dst, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (; i < n; i += step) dst[i] = __half2float(__half(src[i]));
}

}  // namespace

int launch_widen_to_f32(uintptr_t src, uintptr_t dst, int64_t n, bool is_bf16, uintptr_t stream) {
  if (n <= 0) return 0;
  const int threads = 256;
  int64_t blocks64 = (n + threads - 1) / threads;
  int blocks = static_cast<int>(blocks64 < 65535 ? blocks64 : 65535);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (is_bf16) {
    widen_bf16<<<blocks, threads, 0, s>>>(reinterpret_cast<const uint16_t*>(src), reinterpret_cast<float*>(dst), n);
  } else {
    widen_f16<<<blocks, threads, 0, s>>>(reinterpret_cast<const __half_raw*>(src), reinterpret_cast<float*>(dst), n);
  }
  return static_cast<int>(cudaGetLastError());
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

}  // namespace cuda
}  // namespace streamload
