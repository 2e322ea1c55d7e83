// The CUDA runtime side of the attention kernels (attend.cu, paged.cu):
// the dynamic shared-memory opt-in and the cached device queries.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "attend_common.cuh"

namespace kvcache {
namespace attn_cuda {

// Lets `kernel` launch with `smem` bytes of dynamic shared memory. Past the
// default 48 KiB (static included) that takes the opt-in, set to the most
// the device allows beside the kernel's static size: the same value on every
// call, so two host threads launching the kernel with different sizes cannot
// lower each other's limit. A static size above kStaticSmemBytes (which the
// plan assumed) is a clear error, not a failed launch.
template <typename Kernel>
inline void allow_dynamic_smem(Kernel kernel, int64_t smem) {
  if (smem + kStaticSmemBytes <= 48 * 1024) return;
  cudaFuncAttributes attr;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  int device = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int64_t static_bytes = static_cast<int64_t>(attr.sharedSizeBytes);
  TORCH_CHECK(static_bytes <= kStaticSmemBytes && static_bytes + smem <= optin,
              "kvcache CUDA: a kernel with ", static_bytes, " bytes of static shared memory (planned for at most ",
              kStaticSmemBytes, ") cannot take ", smem, " bytes of dynamic shared memory on this GPU (",
              optin, " bytes per block)");
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(optin - static_bytes)));
}

// Two attribute queries (no sync, legal during graph capture); cheap, but
// cached per device since every call needs them.
inline DeviceLimits device_limits(int device) {
  constexpr int kDevices = 64;
  static std::atomic<int64_t> cached[kDevices][2];  // zero-initialized
  if (device >= 0 && device < kDevices && cached[device][0].load() > 0) {
    return {cached[device][0].load(), cached[device][1].load()};
  }
  int smem = 0, sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(
      &smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (device >= 0 && device < kDevices) {
    cached[device][1].store(sms);
    cached[device][0].store(smem);
  }
  return {smem, sms};
}

}  // namespace attn_cuda
}  // namespace kvcache
