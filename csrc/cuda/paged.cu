// The CUDA stubs of paged_write_ and paged_attend: the kernels and their
// plans live in paged_kernels.cuh (framework-free, also run on the CPU by
// the emulated host tests), the CUDA runtime they launch on in runtime.cuh.
#include "paged_kernels.cuh"
#include "runtime.cuh"

namespace kvcache {
namespace {

void paged_write_cuda(const detail::PagedWriteParams& p) {
  cuda::CudaRuntime rt(p.device_index);
  paged_kernels::run_paged_write(p, rt);
}

void paged_attend_cuda(const detail::AttendParams& p) {
  cuda::CudaRuntime rt(p.device_index);
  paged_kernels::run_paged_attend(p, rt);
}

}  // namespace
}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(paged_write_stub, cuda, &kvcache::paged_write_cuda);
KVCACHE_REGISTER_KERNEL(paged_attend_stub, cuda, &kvcache::paged_attend_cuda);
