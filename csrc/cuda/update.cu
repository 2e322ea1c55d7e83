// The CUDA stubs of update_, update_.Tensor and append_ (plain and
// quantized): the kernels and their launches live in update_kernels.cuh
// (also run on the CPU by the emulated host tests), the CUDA runtime in
// runtime.cuh.
#include "runtime.cuh"
#include "update_kernels.cuh"

namespace kvcache {
namespace {

void update_cuda(const detail::UpdateParams& p) {
  cuda::CudaRuntime rt(p.device_index);
  update_kernels::run_update(p, rt);
}

void quant_update_cuda(const detail::QuantUpdateParams& q) {
  cuda::CudaRuntime rt(q.base.device_index);
  update_kernels::run_quant_update(q, rt);
}

}  // namespace
}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(update_stub, cuda, &kvcache::update_cuda);
KVCACHE_REGISTER_KERNEL(quant_update_stub, cuda, &kvcache::quant_update_cuda);
