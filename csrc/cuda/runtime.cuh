// The CUDA runtime that the kernel headers' host code (attend_kernels.cuh,
// paged_kernels.cuh: run_attend, run_paged_write, run_paged_attend) takes:
// the tensors' device (a device guard: the dispatcher sets none for custom
// ops), the current stream (ordered with the caller's work and capturable in
// a CUDA graph), stream-ordered scratch from the caching allocator, checked
// launches. The CPU emulator of the host tests is the other runtime.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

#include "attend_launch.cuh"

namespace kvcache {
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
