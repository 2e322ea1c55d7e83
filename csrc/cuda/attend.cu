// The CUDA stub of attend: the kernels and their plan live in
// attend_kernels.cuh (framework-free, also run on the CPU by the emulated
// host tests), the CUDA runtime they launch on in runtime.cuh.
#include "attend_kernels.cuh"
#include "runtime.cuh"

namespace kvcache {
namespace {

void attend_cuda(const detail::AttendParams& p) {
  cuda::CudaRuntime rt(p.device_index);
  attend_kernels::run_attend(p, rt);
}

}  // namespace
}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(attend_stub, cuda, &kvcache::attend_cuda);
