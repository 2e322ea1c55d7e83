// The CUDA runtime that the kernel headers' host code (attend_kernels.cuh,
// paged_kernels.cuh, update_kernels.cuh: run_attend, run_paged_*,
// run_update, run_quant_update) takes:
// the tensors' device (a device guard: the dispatcher sets none for custom
// ops), the current stream (ordered with the caller's work and capturable in
// a CUDA graph), stream-ordered scratch from the caching allocator, checked
// launches; and the attention kernels' dynamic shared-memory opt-in and
// cached device queries. The CPU emulator of the host tests is the other
// runtime.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <vector>

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

namespace cuda {

class CudaRuntime {
 public:
  explicit CudaRuntime(int device)
      : guard_(static_cast<c10::DeviceIndex>(device)),
        stream_(c10::cuda::getCurrentCUDAStream()),
        device_(device) {}

  attn_cuda::DeviceLimits limits() const { return attn_cuda::device_limits(device_); }

  // Freed when the runtime goes (after the launches are queued): the caching
  // allocator reuses it only for work ordered after them on this stream.
  void* scratch(size_t bytes) {
    held_.push_back(c10::cuda::CUDACachingAllocator::get()->allocate(bytes));
    return held_.back().get();
  }

  void memset(void* p, int byte, size_t bytes) {
    C10_CUDA_CHECK(cudaMemsetAsync(p, byte, bytes, stream_));
  }

  template <typename Kernel, typename... Args>
  void launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, const Args&... args) {
    attn_cuda::allow_dynamic_smem(kernel, static_cast<int64_t>(smem));
    kernel<<<grid, block, smem, stream_>>>(args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

 private:
  c10::cuda::CUDAGuard guard_;
  cudaStream_t stream_;
  int device_;
  std::vector<c10::DataPtr> held_;
};

}  // namespace cuda
}  // namespace kvcache
