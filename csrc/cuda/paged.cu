// The CUDA stubs of paged_write_ and paged_attend: the kernels and their
// plans live in paged_kernels.cuh (framework-free, also run on the CPU by
// the emulated host tests); this file gives them the CUDA runtime: the
// tensors' device, the current stream (ordered with the caller's work and
// capturable in a CUDA graph), stream-ordered scratch from the caching
// allocator, checked launches.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

#include "attend_launch.cuh"
#include "paged_kernels.cuh"

namespace kvcache {
namespace {

using attn_cuda::DeviceLimits;

// The runtime paged_kernels.cuh's run_paged_write / run_paged_attend take.
class CudaRuntime {
 public:
  explicit CudaRuntime(int device)
      : guard_(static_cast<c10::DeviceIndex>(device)),
        stream_(c10::cuda::getCurrentCUDAStream()),
        device_(device) {}

  DeviceLimits limits() const { return attn_cuda::device_limits(device_); }

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

void paged_write_cuda(const detail::PagedWriteParams& p) {
  CudaRuntime rt(p.device_index);
  paged_cuda::run_paged_write(p, rt);
}

void paged_attend_cuda(const detail::AttendParams& p) {
  CudaRuntime rt(p.device_index);
  paged_cuda::run_paged_attend(p, rt);
}

}  // namespace
}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(paged_write_stub, cuda, &kvcache::paged_write_cuda);
KVCACHE_REGISTER_KERNEL(paged_attend_stub, cuda, &kvcache::paged_attend_cuda);
