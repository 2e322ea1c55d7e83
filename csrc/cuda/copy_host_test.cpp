// Host test of csrc/cuda/copy.cuh: the real plan_copy, copy_block_shape,
// copy_grid_y and copy_rows code, run on the CPU with the CUDA thread
// indices emulated (every block and thread in turn; the copy kernels have no
// barriers), driving the slab loop of update_copy_kernel. Built and run by
// scripts/check_cuda_build.sh with UBSan's alignment check: a unit wider
// than its address allows aborts the test, a wrong offset shows as a byte
// mismatch against a plain element-by-element copy. Not part of the library.
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {
struct Index3 {
  unsigned x = 0, y = 0, z = 0;
};
Index3 blockIdx, threadIdx, blockDim, gridDim;
}  // namespace

#define __device__
#define __host__
#define __forceinline__ inline
#define __CUDACC__ 1
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
#include "copy.cuh"
#undef __CUDACC__

using kvcache::cuda::CopyBlock;
using kvcache::cuda::CopyPlan;

int main() {
  std::mt19937_64 rng(1);
  int cases = 0;
  int units_seen[17] = {};
  for (int it = 0; it < 3000; ++it) {
    const int64_t elem = int64_t{1} << (rng() % 5);
    const int64_t B = 1 + rng() % 3, H = 1 + rng() % 3, T = 1 + rng() % 9,
                  D = 1 + rng() % 12;
    const int64_t chunk = 1 + rng() % T;
    const int64_t start = rng() % (T - chunk + 1);
    // A tensor: dims in a random memory order, sometimes padded, element
    // stride 1 or 2, first byte 0..12 bytes past a 64-byte boundary.
    auto make = [&](int64_t t, std::vector<int64_t>& st, int64_t& off,
                    int64_t& bytes) {
      const int64_t sizes[4] = {B, H, t, D};
      int perm[4] = {0, 1, 2, 3};
      std::shuffle(perm, perm + 4, rng);
      int64_t acc = 1 + static_cast<int64_t>(rng() % 2);
      st.assign(4, 0);
      for (int k = 3; k >= 0; --k) {
        st[perm[k]] = acc * elem;
        acc = acc * sizes[perm[k]] + (rng() % 3 == 0 ? 1 : 0);
      }
      const int64_t offs[] = {0, 0, 1, 2, 4, 8, 3, 12};
      off = offs[rng() % 8];
      bytes = acc * elem + off + 64;
    };
    std::vector<int64_t> ds, ss;
    int64_t doff, soff, dbytes, sbytes;
    make(T, ds, doff, dbytes);
    make(chunk, ss, soff, sbytes);
    std::vector<unsigned char> dmem(dbytes + 64), smem(sbytes + 64);
    for (auto& c : smem) c = static_cast<unsigned char>(rng());
    for (auto& c : dmem) c = static_cast<unsigned char>(rng());
    auto aligned64 = [](unsigned char* p) {
      return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 63) &
                                     ~uintptr_t{63});
    };
    char* dbase = aligned64(dmem.data()) + doff;
    char* sbase = aligned64(smem.data()) + soff;
    std::vector<unsigned char> expect(dmem);
    char* ebase = reinterpret_cast<char*>(expect.data()) +
                  (dbase - reinterpret_cast<char*>(dmem.data()));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < chunk; ++t)
          for (int64_t d = 0; d < D; ++d)
            std::memcpy(ebase + b * ds[0] + h * ds[1] + (start + t) * ds[2] + d * ds[3],
                        sbase + b * ss[0] + h * ss[1] + t * ss[2] + d * ss[3], elem);
    const int64_t dsz[4] = {B, H, T, D}, ssz[4] = {B, H, chunk, D};
    const CopyPlan p = kvcache::cuda::plan_copy(dbase, ds.data(), dsz, sbase,
                                                ss.data(), ssz, D, elem);
    units_seen[p.unit]++;
    const CopyBlock blk = kvcache::cuda::copy_block_shape(p.units, chunk);
    blockDim = {blk.x, blk.y, 1};
    gridDim = {static_cast<unsigned>(B * H), kvcache::cuda::copy_grid_y(chunk, blk), 1};
    // The slab part of update_copy_kernel (one buffer).
    for (unsigned bx = 0; bx < gridDim.x; ++bx)
      for (unsigned by = 0; by < gridDim.y; ++by)
        for (unsigned ty = 0; ty < blk.y; ++ty)
          for (unsigned tx = 0; tx < blk.x; ++tx) {
            blockIdx = {bx, by, 0};
            threadIdx = {tx, ty, 0};
            const unsigned b = bx / static_cast<unsigned>(H);
            const unsigned h = bx - b * static_cast<unsigned>(H);
            char* dst = p.dst.data + b * p.dst.stride[0] + h * p.dst.stride[1] +
                        start * p.dst.stride[2];
            const char* src = p.src.data + b * p.src.stride[0] + h * p.src.stride[1];
            kvcache::cuda::copy_rows_planned(p, dst, src, chunk);
          }
    if (dmem != expect) {
      std::printf("copy_host_test: MISMATCH in case %d (elem %lld, unit %d)\n", it,
                  static_cast<long long>(elem), p.unit);
      return 1;
    }
    ++cases;
  }
  std::printf("copy_host_test: %d random copies exact; units used 16:%d 8:%d 4:%d 2:%d 1:%d\n",
              cases, units_seen[16], units_seen[8], units_seen[4], units_seen[2],
              units_seen[1]);
  for (int u : {16, 8, 4, 2, 1}) {
    if (units_seen[u] == 0) {
      std::printf("copy_host_test: no case used %d-byte units\n", u);
      return 1;
    }
  }
  return 0;
}
