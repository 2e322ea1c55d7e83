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

#include "../core/merge.h"

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

// A block's place in the attention kernels' tile loop: its shared-memory
// arrays (R query rows, tiles of N slots) and this thread's role in them.
struct TileCtx {
  float* kv_s;         // N x pitch: the K tile, then the V tile
  const float* q_s;    // R x D
  float* acc_s;        // R x D
  float* p_s;          // R x N: scores, then probabilities
  float* m_s;          // R: running max
  float* l_s;          // R: running sum
  float* alpha_s;      // R: this tile's rescale of the accumulator
  const int64_t* lo_s;  // R: the row's visible slots [lo, hi)
  const int64_t* hi_s;
  int pitch, N, P, D;
  int rows;  // rows of this block's tile (<= R)
  int tid, jl, part, warp, lane;  // jl: this thread's slot, part: its share of the dot
  float softcap;
};

// The block's TileCtx (rows: set per row tile), this thread's place from
// threadIdx.x: slot jl of a tile and part `part` of its dot product (N * P
// = kThreads), warp and lane.
__device__ __forceinline__ TileCtx tile_ctx(float* kv_s, const float* q_s, float* acc_s,
                                            float* p_s, float* m_s, float* l_s, float* alpha_s,
                                            const int64_t* lo_s, const int64_t* hi_s, int pitch,
                                            int N, int P, int D, float softcap) {
  TileCtx t;
  t.kv_s = kv_s;
  t.q_s = q_s;
  t.acc_s = acc_s;
  t.p_s = p_s;
  t.m_s = m_s;
  t.l_s = l_s;
  t.alpha_s = alpha_s;
  t.lo_s = lo_s;
  t.hi_s = hi_s;
  t.pitch = pitch;
  t.N = N;
  t.P = P;
  t.D = D;
  t.rows = 0;
  t.tid = threadIdx.x;
  t.jl = t.tid / P;
  t.part = t.tid - t.jl * P;
  t.warp = t.tid / 32;
  t.lane = t.tid & 31;
  t.softcap = softcap;
  return t;
}

// One tile of the block's slots, [j0, j0 + n): K tile -> scores of R rows x
// N slots (each thread one slot, all R rows: a K element is read once per R
// multiply-adds; P threads share a slot's dot product and reduce with warp
// shuffles) -> online softmax per row (float32) -> V tile -> accumulate.
// The one tile step of attend_kernel (linear caches, rings) and
// paged_attend_kernel (pages); what the layouts differ in comes as functors:
//   load_k(), load_v(): every thread helps fill kv_s with the tile's keys /
//     values (unreadable slots as zeros);
//   key_scale(jl): the score multiplier of tile slot jl < n (the softmax
//     scale, times a quantized cache's key scale);
//   seen(r, jl, j): whether row r sees slot j = j0 + jl, called for j in the
//     row's [lo, hi) (rings decide by position; pages refuse a bad page and
//     flag the row);
//   value_scale(c): a quantized cache's value scale of tile slot c, called
//     for seen slots only.
// skip_zero: the accumulation skips weights of 0 (a ring's unseen slots
// inside [lo, hi) may hold anything: 0 * Inf is NaN). Starts by loading the
// K tile (kv_s and p_s free) and ends with a barrier, after which kv_s and
// p_s may be overwritten.
template <int R, bool kQuant, typename LoadK, typename LoadV, typename KeyScale, typename Seen,
          typename ValueScale>
__device__ __forceinline__ void attend_tile(const TileCtx& t, int64_t j0, int n, bool skip_zero,
                                            const LoadK& load_k, const LoadV& load_v,
                                            const KeyScale& key_scale, const Seen& seen,
                                            const ValueScale& value_scale) {
  const int N = t.N, D = t.D;
  load_k();
  __syncthreads();

  // Scores: thread (jl, part) sums d = part, part + P, ... for all R rows.
  float dot[R];
#pragma unroll
  for (int r = 0; r < R; ++r) dot[r] = 0.f;
  if (t.jl < n) {
    const float* krow = t.kv_s + t.jl * t.pitch;
    for (int d = t.part; d < D; d += t.P) {
      const float kd = krow[d];
#pragma unroll
      for (int r = 0; r < R; ++r) dot[r] += t.q_s[r * D + d] * kd;
    }
  }
  // The P threads of a slot are adjacent lanes of one warp (P divides 32).
  for (int off = t.P / 2; off > 0; off /= 2) {
#pragma unroll
    for (int r = 0; r < R; ++r) dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], off);
  }
  if (t.part == 0) {
    const int64_t j = j0 + t.jl;
    const float qscale = t.jl < n ? key_scale(t.jl) : 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s = -INFINITY;
      if (t.jl < n && j >= t.lo_s[r] && j < t.hi_s[r] && seen(r, t.jl, j)) {
        s = dot[r] * qscale;
        if (t.softcap > 0.f) s = t.softcap * tanhf(s / t.softcap);
      }
      t.p_s[r * N + t.jl] = s;
    }
  }
  __syncthreads();

  // Online softmax, one warp per row.
  for (int r = t.warp; r < t.rows; r += kWarps) {
    float mx = -INFINITY;
    for (int c = t.lane; c < N; c += 32) mx = fmaxf(mx, t.p_s[r * N + c]);
    for (int off = 16; off > 0; off /= 2) {
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    }
    const float m_old = t.m_s[r];
    const float m_new = fmaxf(m_old, mx);
    float sum = 0.f;
    for (int c = t.lane; c < N; c += 32) {
      const float sc = t.p_s[r * N + c];
      const float e = sc == -INFINITY ? 0.f : expf(sc - m_new);
      // A quantized cache's value scale joins the probability after the
      // row sum (only seen slots, e != 0, are read).
      float pv = e;
      if constexpr (kQuant) {
        if (e != 0.f) pv = e * value_scale(c);
      }
      t.p_s[r * N + c] = pv;
      sum += e;
    }
    for (int off = 16; off > 0; off /= 2) {
      sum += __shfl_xor_sync(0xffffffffu, sum, off);
    }
    if (t.lane == 0) {
      // m_old = -inf: nothing seen yet, the accumulator is zero.
      const float alpha = m_old == -INFINITY ? 0.f : expf(m_old - m_new);
      t.alpha_s[r] = alpha;
      t.l_s[r] = t.l_s[r] * alpha + sum;
      t.m_s[r] = m_new;
    }
  }
  // The K tile is no longer read (barrier above): V replaces it.
  load_v();
  __syncthreads();

  // acc[r][d] = acc * alpha + sum over the row's visible slots of p * v.
  // Only visible slots are touched: a probability of 0 never multiplies a
  // value (0 * Inf would be NaN).
  for (int idx = t.tid; idx < t.rows * D; idx += kThreads) {
    const int r = idx / D;
    const int d = idx - r * D;
    float acc = t.acc_s[idx] * t.alpha_s[r];
    const int64_t from = t.lo_s[r] - j0;
    const int64_t to = t.hi_s[r] - j0;
    const int c0 = from > 0 ? static_cast<int>(from) : 0;
    const int c1 = to < n ? static_cast<int>(to > 0 ? to : 0) : n;
    if (skip_zero) {
      for (int c = c0; c < c1; ++c) {
        const float w = t.p_s[r * N + c];
        if (w > 0.f) acc += w * t.kv_s[c * t.pitch + d];
      }
    } else {
      for (int c = c0; c < c1; ++c) acc += t.p_s[r * N + c] * t.kv_s[c * t.pitch + d];
    }
    t.acc_s[idx] = acc;
  }
  __syncthreads();  // before the next tile overwrites kv_s and p_s
}

// The combine kernels' merge of one output row (attend_combine_kernel,
// paged_combine_kernel): partial `prow` of every split, (max, sum) in
// part_ml and the accumulator in part_acc, merged by core/merge.h's rule
// (the CPU's merge_parts calls the same function) into out[d * out_stride].
// Thread 0 weighs the splits (at most kMaxSplits: a short serial loop), then
// every thread merges its elements. sink_logit: the row's head's learned
// sink, when has_sink. Every thread of the block calls it (a barrier).
template <typename T>
__device__ __forceinline__ void merge_split_row(T* out, int64_t out_stride, int D, int splits,
                                                int64_t total_rows, int64_t prow,
                                                const float* part_ml, const float* part_acc,
                                                bool has_sink, float sink_logit) {
  __shared__ float w_s[kMaxSplits];
  __shared__ float factor_s;
  if (threadIdx.x == 0) {
    factor_s = detail::merge_splits(
        splits,
        [&](int64_t sp, float* m, float* l) {
          const int64_t at = sp * total_rows + prow;
          *m = part_ml[2 * at];
          *l = part_ml[2 * at + 1];
        },
        [](float x) { return expf(x); }, has_sink, sink_logit, w_s);
  }
  __syncthreads();
  const float f = factor_s;
  for (int d = threadIdx.x; d < D; d += kCombineThreads) {
    const float o = detail::merged_sum(
        splits, w_s, [&](int64_t sp) { return part_acc[(sp * total_rows + prow) * D + d]; });
    out[d * out_stride] = static_cast<T>(o * f);
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
