// The CUDA stubs of ring_update_ (plain and quantized): the kernels and
// their launches live in ring_kernels.cuh (also run on the CPU by the
// emulated host tests), the CUDA runtime in runtime.cuh.
#include "ring_kernels.cuh"
#include "runtime.cuh"

namespace kvcache {
namespace {

void ring_update_cuda(const detail::RingUpdateParams& p) {
  cuda::CudaRuntime rt(p.device_index);
  ring_kernels::run_ring_update(p, rt);
}

void ring_update_quantized_cuda(const detail::RingQuantUpdateParams& q) {
  cuda::CudaRuntime rt(q.ring.device_index);
  ring_kernels::run_ring_update_quantized(q, rt);
}

}  // namespace
}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(ring_update_stub, cuda, &kvcache::ring_update_cuda);
KVCACHE_REGISTER_KERNEL(ring_update_quantized_stub, cuda,
                        &kvcache::ring_update_quantized_cuda);
