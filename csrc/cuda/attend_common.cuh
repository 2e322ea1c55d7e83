// Pieces of the CUDA attention kernels shared by attend (attend.cu: a
// contiguous or ring cache) and paged_attend (paged_kernels.cuh: pages
// through a block table): block shape and tile limits, the element
// conversion, the K/V tile loader (slot rows found through an accessor) and
// the shared-memory plan. See attend.cu for the kernel they serve. No CUDA
// runtime call lives here (those are in runtime.cuh), so the kernel
// cores also compile as plain C++ under tests/cpp/cuda_emulator.h.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

// A kernel's dynamic shared memory as `T* name` (16-byte aligned for
// float4). The CUDA emulator of the host tests defines its own.
#ifndef KVCACHE_EXTERN_SMEM
#define KVCACHE_EXTERN_SMEM(T, name) extern __shared__ T name[]
#endif

namespace kvcache {
namespace attn_cuda {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRows = 16;           // query rows per block (R) at most
constexpr int64_t kMinSplitSlots = 64;  // a split covers at least this many slots
constexpr int64_t kMaxSplits = 64;
constexpr int kCombineThreads = 128;
// An upper bound on the attention kernels' static shared memory (per-row
// scalars; the paged kernel's 16-row blocks also hold a tile's page and
// offset arrays: ptxas reports 1072 bytes for them on sm_80 and sm_90, the
// others at most 688). The plans leave this much of the opt-in maximum for
// it, and allow_dynamic_smem checks it against the kernel's real size.
constexpr int64_t kStaticSmemBytes = 2048;

template <typename TKV>
constexpr bool kQuantizedKV =
    std::is_same_v<TKV, int8_t> || std::is_same_v<TKV, c10::Float8_e4m3fn>;

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

// The 16 / sizeof(T) elements at src (16-byte aligned) as floats at dst
// (16-byte aligned): one 16-byte load, float4 stores. The loaded bits are
// copied into a T array, not read through a T* to the uint4: that breaks
// strict aliasing, and g++ -O2 compiling these kernels for the emulated
// host tests then reads zeros. nvcc turns the copy into register moves.
template <typename T>
__device__ __forceinline__ void widen16(float* dst, const T* src) {
  constexpr int V = 16 / sizeof(T);
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  T vals[V];
  memcpy(vals, &raw, sizeof(raw));
#pragma unroll
  for (int e = 0; e < V; e += 4) {
    *reinterpret_cast<float4*>(dst + e) =
        make_float4(to_float(vals[e]), to_float(vals[e + 1]),
                    to_float(vals[e + 2]), to_float(vals[e + 3]));
  }
}

// Loads slots [j0, j0 + n) of one (b, KV head) of a linear cache into kv_s
// (float, `pitch` floats per slot). `base` points at slot 0 of that (b, KV
// head).
template <typename T>
__device__ __forceinline__ void load_tile(float* kv_s, int pitch,
                                          const T* base, int64_t slot_stride,
                                          int64_t elem_stride, int64_t j0,
                                          int n, int D, bool vec) {
  const T* rows = base + j0 * slot_stride;
  if (vec) {
    // 16 bytes = V elements per load; rows are V-aligned (checked on the
    // host), and so are the shared-memory rows (pitch and D are multiples
    // of 4 floats here), so the floats go out as float4 stores.
    constexpr int V = 16 / sizeof(T);
    const int per_row = D / V;
    const int total = n * per_row;
    for (int idx = threadIdx.x; idx < total; idx += kThreads) {
      const int jl = idx / per_row;
      const int c = idx - jl * per_row;
      widen16(kv_s + jl * pitch + c * V, rows + jl * slot_stride + c * V);
    }
  } else {
    const int total = n * D;
    for (int idx = threadIdx.x; idx < total; idx += kThreads) {
      const int jl = idx / D;
      const int d = idx - jl * D;
      kv_s[jl * pitch + d] = to_float(rows[jl * slot_stride + d * elem_stride]);
    }
  }
}

// load_tile for slots found through an accessor (a paged cache's slots, by
// the block table): row_at(jl) is the address of tile slot jl's element 0,
// or nullptr for a slot that must not be read (its floats are zero). The
// same loads as load_tile otherwise.
template <typename T, typename RowAt>
__device__ __forceinline__ void load_tile_at(float* kv_s, int pitch, const RowAt& row_at,
                                             int64_t elem_stride, int n, int D, bool vec) {
  if (vec) {
    constexpr int V = 16 / sizeof(T);
    const int per_row = D / V;
    const int total = n * per_row;
    for (int idx = threadIdx.x; idx < total; idx += kThreads) {
      const int jl = idx / per_row;
      const int c = idx - jl * per_row;
      const T* row = row_at(jl);
      float* dst = kv_s + jl * pitch + c * V;
      if (row == nullptr) {
#pragma unroll
        for (int e = 0; e < V; e += 4) *reinterpret_cast<float4*>(dst + e) = make_float4(0.f, 0.f, 0.f, 0.f);
        continue;
      }
      widen16(dst, row + c * V);
    }
  } else {
    const int total = n * D;
    for (int idx = threadIdx.x; idx < total; idx += kThreads) {
      const int jl = idx / D;
      const int d = idx - jl * D;
      const T* row = row_at(jl);
      kv_s[jl * pitch + d] = row == nullptr ? 0.f : to_float(row[d * elem_stride]);
    }
  }
}

// 16-byte loads of a (row or page, KV head, slot, element) buffer:
// contiguous rows, and every address they form a multiple of 16 bytes.
inline bool allows_vec(const void* data, const int64_t* stride, const int64_t* size,
                       int64_t elem) {
  if (size[3] > 1 && stride[3] != 1) return false;
  if ((size[3] * elem) % 16 != 0) return false;
  if (reinterpret_cast<uintptr_t>(data) % 16 != 0) return false;
  for (int k = 0; k < 3; ++k) {
    if (size[k] > 1 && (stride[k] * elem) % 16 != 0) return false;
  }
  return true;
}

struct DeviceLimits {
  int64_t smem_optin;       // shared memory per block, with the opt-in
  int64_t multiprocessors;
};

// Dynamic shared memory of a block of R query rows over tiles of N slots
// (P threads per slot's dot product): the K/V tile, queries, accumulators
// and scores.
inline int64_t smem_bytes(int R, int N, int64_t D, int P) {
  const int64_t pitch = ((D + 31) / 32) * 32 + P;
  return 4 * (N * pitch + 2 * R * D + R * N);
}

// The largest R (a power of two up to kMaxRows, at most the first power of
// two >= rows) and then the widest tile N of {64, 32, 16, 8} whose shared
// memory fits `limit` bytes; N = 0 when none fits.
struct TilePlan {
  int R = 1;
  int N = 0;
  int64_t smem = 0;
};

inline TilePlan plan_tiles(int64_t rows, int64_t D, int64_t limit) {
  TilePlan t;
  int R = 1;
  while (R < kMaxRows && R < rows) R *= 2;
  for (; R >= 1; R /= 2) {
    for (int n : {64, 32, 16, 8}) {
      const int64_t bytes = smem_bytes(R, n, D, kThreads / n);
      if (bytes <= limit) {
        t.R = R;
        t.N = n;
        t.smem = bytes;
        return t;
      }
    }
  }
  return t;
}

}  // namespace attn_cuda
}  // namespace kvcache
