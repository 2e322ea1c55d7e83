// The CUDA stubs of rollback, select_rows_ and reset_rows: the kernels and
// their launches live in rows_kernels.cuh (also run on the CPU by the
// emulated host tests), the CUDA runtime in runtime.cuh.
#include "rows_kernels.cuh"
#include "runtime.cuh"

namespace kvcache {
namespace {

void rollback_cuda(const detail::RollbackParams& p) {
  if (p.rows <= 0) return;
  cuda::CudaRuntime rt(p.device_index);
  rows_kernels::run_rollback(p, rt);
}

void reset_rows_cuda(const detail::ResetRowsParams& p) {
  if (p.batch <= 0) return;
  cuda::CudaRuntime rt(p.device_index);
  rows_kernels::run_reset_rows(p, rt);
}

void select_rows_cuda(const detail::SelectRowsParams& p) {
  if (p.batch <= 0 && p.out.numel <= 0) return;  // nothing to write
  cuda::CudaRuntime rt(p.device_index);
  rows_kernels::run_select_rows(p, rt);
}

}  // namespace
}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(rollback_stub, cuda, &kvcache::rollback_cuda);
KVCACHE_REGISTER_KERNEL(select_rows_stub, cuda, &kvcache::select_rows_cuda);
KVCACHE_REGISTER_KERNEL(reset_rows_stub, cuda, &kvcache::reset_rows_cuda);
