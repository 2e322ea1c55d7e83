// The emulator's own guarantees that the kernel tests (test_*_cuda_emulated.cpp) rely on.
#include "cuda_emulator.h"  // first: __global__, __shared__, threadIdx, ...

#include <cstdint>
#include <cstring>
#include <vector>

#include "catch.h"

namespace {

// Block b records what its shared memory held before any of its threads wrote it, then writes
// it, so that a block that sees the previous block's data records 7.
__global__ void record_then_write(uint32_t* seen) {
  __shared__ uint32_t fixed;
  __shared__ float fixed_array[4];
  KVCACHE_EXTERN_SMEM(uint32_t, dynamic);
  if (threadIdx.x == 0) {
    uint32_t bits = 0;
    std::memcpy(&bits, &fixed_array[3], sizeof(bits));
    seen[3 * blockIdx.x] = fixed;
    seen[3 * blockIdx.x + 1] = bits;
    seen[3 * blockIdx.x + 2] = dynamic[5];
  }
  __syncthreads();
  if (threadIdx.x == 31) {
    fixed = 7;
    fixed_array[3] = 7.f;
    dynamic[5] = 7;
  }
}

}  // namespace

TEST_CASE("emulated CUDA harness: shared memory holds 0xff bytes until the block writes it", "[cuda-emulated]") {
  // Static __shared__ variables as well as dynamic shared memory: a kernel that reads a slot
  // before writing it then reads NaN floats or -1 integers, not zeros or another block's data.
  std::vector<uint32_t> seen(9, 0);
  kvemu::launch(record_then_write, dim3(3), dim3(64), 8 * sizeof(uint32_t), seen.data());
  for (uint32_t v : seen) CHECK(v == 0xffffffffu);
}
