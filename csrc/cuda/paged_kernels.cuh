// The CUDA kernels of paged_write_ and paged_attend (see csrc/ops/paged.h)
// and the host code that plans and launches them, over a runtime `Rt`:
// paged.cu passes the CUDA one (runtime.cuh: stream, caching allocator,
// <<<>>>);
// tests/cpp/test_paged_cuda_emulated.cpp passes tests/cpp/cuda_emulator.h's,
// which runs these same kernels on the CPU, every block's threads as fibers
// with real barriers and warp shuffles. So nothing here may call the CUDA
// runtime or ATen's CUDA parts: those go through Rt,
//
//   DeviceLimits limits();                   the device's opt-in shared
//                                            memory and multiprocessors
//   void* scratch(size_t bytes);             device memory, stream-ordered,
//                                            alive until Rt is destroyed
//   void memset(void* p, int byte, size_t n);  stream-ordered
//   void launch(kernel, dim3 grid, dim3 block, size_t smem, args...);
//
// and every kernel is `static` (one translation unit includes this file).
//
// ---- paged_write_ ---------------------------------------------------------
//
// Block x = (buffer, token): the token's num_kv_heads rows go to slot
// slot_mapping[t] of the key or value pages (grid y tiles the heads). Plain
// pages: the rows are copied in the widest unit both sides allow (a
// cuda::CopyPlan per buffer, csrc/cuda/copy.cuh; the "rows" it steps along
// are the heads). int8 / e4m3 pages: one warp per head quantizes it with
// cuda::quantize_slot (quant.cuh, the quantizer of every quantized write),
// its scale beside it.
//
// Nothing written on error: a slot outside [-1, num_blocks * block_size) or
// a slot given to two tokens makes the whole call write nothing. The values
// are on the device, so this is decided there, without a host sync:
//  - up to kInlineCheckTokens tokens (decode-sized writes): one launch;
//    every block first reads the whole slot mapping, checks the range and
//    inserts the slots into a shared-memory hash table (a slot found there
//    already is a duplicate), then writes only if the block-wide answer is
//    "valid" (O(num_tokens) per block, all blocks reach the same answer);
//  - more tokens: a memset and a check kernel over a global hash table in
//    caching-allocator scratch (sized from num_tokens) clear a flag on any
//    bad or duplicate slot; the write kernel reads the flag (O(1) per block).
//    Three stream-ordered operations, capturable in a CUDA graph.
//
// ---- paged_attend ---------------------------------------------------------
//
// A separate kernel from attend_kernels.cuh's with the same tile step
// (attend_common.cuh: attend_tile, K tile -> scores of R rows x N slots ->
// online softmax -> V tile -> accumulate, with the pages' loaders, key and
// value scales and bad-page rule as its functors), tile loader and
// shared-memory plan, and core/merge.h's split merge. What differs:
//  - K/V slots are found through the block table: per tile, N threads look
//    up the page and offset of the tile's slots once (shared memory) and the
//    loader reads slot jl at page_s[jl] * page_stride + off_s[jl] * ld;
//  - the grid depends only on host-known shapes: x = (sequence, KV head),
//    y = (split, row slice). A block reads its sequence's query range
//    (cu_seqlens_q) and context length (context_lens) on the device and
//    loops over its sequence's row tiles (tile = slice, slice + slices,
//    ...), each over its split of the tile's visible slots. Decode-like
//    batches (at most one row tile per sequence on average) split the slots
//    (flash decoding, merged by paged_combine_kernel); longer query runs
//    split the row tiles over slices instead (no merge needed);
//  - bad metadata never reads out of bounds: every block checks that
//    cu_seqlens_q starts at 0, ends at most at total_q and never decreases
//    (a read of num_seqs + 1 ints), else the whole output is NaN; the rows
//    after its end (a padded batch) are no sequence's and stay 0 (the entry
//    allocates zeros; the combine writes 0); a sequence whose
//    context_len is below its query count or above max_blocks * block_size
//    gets NaN rows; a table entry outside [0, num_blocks) of a page a query
//    would read is not read, and the queries that see one of its slots get
//    NaN.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "../core/merge.h"
#include "../core/quant.h"
#include "../core/visibility.h"
#include "../ops/paged.h"
#include "attend_common.cuh"
#include "copy.cuh"
#include "quant.cuh"

namespace kvcache {
namespace paged_kernels {

using namespace attn_cuda;
using detail::AttendParams;
using detail::IntRows;
using detail::KvFormat;
using detail::PagedWriteParams;

// ============================================================ paged_write_

// Tokens up to which every write block checks the slot mapping itself.
constexpr int64_t kInlineCheckTokens = 512;
constexpr int kInlineTable = 1024;  // >= 2 * kInlineCheckTokens, a power of two
constexpr int kQuantWarps = 8;
constexpr int kGlobalCheckThreads = 256;

// Fibonacci hashing: the top bits of s * 2^32 / phi (mask + 1 a power of
// two). The low bits of the product depend only on the low bits of s, so
// slots at the same offset of their pages (a decode step over sequences of
// equal length) would share a few home entries: 64 probes an insert, where
// the top bits give about 1.4.
__device__ __forceinline__ uint32_t slot_hash(int64_t s, uint32_t mask) {
  const uint32_t h = static_cast<uint32_t>(s) * 2654435761u;  // s in [0, 2^31)
  return mask == 0 ? 0u : (h >> __clz(mask)) & mask;
}

// Inserts slot s (>= 0) into an open-addressing table of mask + 1 entries
// (-1: empty) holding fewer than mask + 1 keys; returns whether s was there
// already (a duplicate).
template <typename Table>
__device__ __forceinline__ bool insert_slot(Table* table, uint32_t mask, int64_t s) {
  const int32_t key = static_cast<int32_t>(s);
  for (uint32_t h = slot_hash(s, mask);; h = (h + 1) & mask) {
    const int32_t prev = atomicCAS(reinterpret_cast<int*>(table + h), -1, key);
    if (prev == -1) return false;
    if (prev == key) return true;
  }
}

__device__ __forceinline__ bool slot_in_range(int64_t s, int64_t total) {
  return s >= -1 && s < total;
}

// Every slot of the mapping in [-1, total) and none >= 0 twice. Every thread
// of the block calls it (it has barriers) and gets the same answer.
static __device__ bool block_checks_slots(const IntRows slots, int64_t n, int64_t total) {
  __shared__ int32_t table[kInlineTable];
  const int tid = threadIdx.x + threadIdx.y * blockDim.x;
  const int nt = blockDim.x * blockDim.y;
  uint32_t size = 32;
  while (size < 2 * n) size *= 2;  // n <= kInlineCheckTokens: size <= kInlineTable
  for (uint32_t i = tid; i < size; i += nt) table[i] = -1;
  __syncthreads();
  int bad = 0;
  for (int64_t t = tid; t < n; t += nt) {
    const int64_t s = detail::read_row(slots, t);
    if (!slot_in_range(s, total)) {
      bad = 1;
    } else if (s >= 0 && insert_slot(table, size - 1, s)) {
      bad = 1;
    }
  }
  return !__syncthreads_or(bad);
}

// The large-write check: scratch = [flag, table of mask + 1 entries], all
// -1 before (a memset); any bad or duplicate slot sets the flag to 0.
static __global__ void __launch_bounds__(kGlobalCheckThreads)
    paged_slots_check_kernel(const IntRows slots, int64_t n, int64_t total,
                             int32_t* scratch, uint32_t mask) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const int64_t s = detail::read_row(slots, t);
  bool bad = !slot_in_range(s, total);
  if (!bad && s >= 0) bad = insert_slot(scratch + 1, mask, s);
  if (bad) scratch[0] = 0;
}

struct WriteArgs {
  cuda::CopyPlan pair[2];  // plain pages: keys, values
  // src: bytes per token, head, element; dst: bytes per page, slot in page,
  // head, element; scales: elements per page, slot in page, head.
  cuda::QuantSides<3, 4> io;
  IntRows slots;
  int64_t n, heads, head_dim, block_size, total_slots;
  const int32_t* flag;  // the large-write check's verdict; nullptr: check here
};

// Whether this block may write: the inline check or the check kernel's flag.
__device__ __forceinline__ bool write_allowed(const WriteArgs& a) {
  if (a.flag != nullptr) return *a.flag == -1;
  return block_checks_slots(a.slots, a.n, a.total_slots);
}

static __global__ void paged_write_copy_kernel(const WriteArgs a) {
  if (!write_allowed(a)) return;
  const int64_t x = blockIdx.x;
  const bool which = x >= a.n;
  const int64_t t = which ? x - a.n : x;
  const int64_t slot = detail::read_row(a.slots, t);
  if (slot < 0) return;
  const int64_t page = slot / a.block_size, off = slot - page * a.block_size;
  // Select by value (see cuda::quant_side: a runtime index into the
  // parameter arrays would copy them to local memory).
  const cuda::CopyPlan p = which ? a.pair[1] : a.pair[0];
  const auto s = cuda::quant_side(a.io, which);
  cuda::copy_rows_planned(p, p.dst.data + page * s.ds[0] + off * s.ds[1],
                          p.src.data + t * s.ss[0], a.heads);
}

template <typename T, KvFormat F>
__global__ void __launch_bounds__(kQuantWarps * 32) paged_write_quant_kernel(const WriteArgs a) {
  if (!write_allowed(a)) return;
  const int64_t x = blockIdx.x;
  const bool which = x >= a.n;
  const int64_t t = which ? x - a.n : x;
  const int64_t slot = detail::read_row(a.slots, t);
  if (slot < 0) return;
  const int64_t page = slot / a.block_size, off = slot - page * a.block_size;
  const auto s = cuda::quant_side(a.io, which);
  const char* src = s.src + t * s.ss[0];
  char* dst = s.dst + page * s.ds[0] + off * s.ds[1];
  float* scale = s.scale + page * s.cs[0] + off * s.cs[1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int64_t h = static_cast<int64_t>(blockIdx.y) * kQuantWarps + warp; h < a.heads;
       h += static_cast<int64_t>(gridDim.y) * kQuantWarps) {
    cuda::quantize_slot<T, F>(src + h * s.ss[1], s.ss[2], dst + h * s.ds[2], s.ds[3],
                              scale + h * s.cs[2], a.head_dim, lane);
  }
}

// ============================================================ paged_attend

// Query rows per block: R in {1, 4, 16} (fewer instances than attend's
// five: each is a full kernel per dtype and page format).
constexpr int kPagedMaxTile = 64;  // N at most (the plan's widest tile)
// Scratch for split partials is bounded: fewer splits past this many bytes.
constexpr int64_t kPartialBudgetBytes = int64_t(256) << 20;
// Row slices: enough that no block loops over more than this many row tiles
// of one sequence (past the 2 waves that fill the GPU).
constexpr int64_t kTilesPerBlock = 16;

struct PagedArgs {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  int64_t qs[3], os[3];  // element strides: head, token, element
  int64_t ks[4], vs[4];  // element strides: page, head, slot in page, element
  int64_t num_seqs, num_heads, num_kv_heads, group, head_dim, total_q, max_len;
  const int32_t* table;
  int64_t bts[2];
  int64_t block_size, num_blocks;
  IntRows context_lens;
  const int32_t* cu;
  int64_t cu_stride;
  int tile_slots;  // N
  int parts;       // P = kThreads / N
  int pitch;
  int splits;  // S: slot splits (> 1: partials + paged_combine_kernel)
  int slices;  // row-tile slices
  bool k_vec, v_vec;
  float scale, softcap;
  int64_t window;
  const float* sink_logits;
  int64_t sink_stride;
  float* part_ml;      // splits > 1: (split, token * num_heads + head) -> (max, sum)
  float* part_acc;     // splits > 1: (split, token * num_heads + head, head_dim)
  int32_t* batch_ok;   // splits > 1: 1 when cu_seqlens_q is consistent (block (0, 0))
  int64_t total_rows;  // total_q * num_heads
  const float* k_scale;
  const float* v_scale;
  int64_t kss[3], vss[3];  // element strides: page, head, slot in page
};

// A sequence's query tokens [q0, q1) and context length, read once per block.
struct SeqBounds {
  int64_t q0, q1, len;
};

__device__ __forceinline__ int64_t cu_at(const PagedArgs& a, int64_t i) {
  return a.cu[i * a.cu_stride];
}

// Whether cu_seqlens_q starts at 0, ends at most at total_q and never
// decreases (then every sequence's range lies in [0, total_q) and they tile
// [0, cu_seqlens_q[num_seqs]); the rest is padding). All
// threads call it; ends with a barrier.
__device__ __forceinline__ bool batch_consistent(const PagedArgs& a) {
  int bad = 0;
  if (threadIdx.x == 0) bad = cu_at(a, 0) != 0 || cu_at(a, a.num_seqs) > a.total_q;
  for (int64_t i = threadIdx.x; i < a.num_seqs; i += kThreads) {
    bad |= cu_at(a, i) > cu_at(a, i + 1);
  }
  return !__syncthreads_or(bad);
}

template <typename T>
__device__ __forceinline__ void store_nan(T* p) {
  *p = static_cast<T>(std::numeric_limits<float>::quiet_NaN());
}

// T: q's and the output's dtype; TKV: the pages' (T, or a quantized format).
template <typename T, typename TKV, int R>
// Three blocks per multiprocessor: ptxas then keeps every instance in 80
// registers without spills (at its default 64 most instances spilled).
__global__ void __launch_bounds__(kThreads, 3) paged_attend_kernel(const PagedArgs a) {
  KVCACHE_EXTERN_SMEM(float4, smem4);  // 16-byte aligned
  float* kv_s = reinterpret_cast<float*>(smem4);  // N x pitch
  const int D = static_cast<int>(a.head_dim);
  const int N = a.tile_slots;
  float* q_s = kv_s + N * a.pitch;  // R x D
  float* acc_s = q_s + R * D;       // R x D
  float* p_s = acc_s + R * D;       // R x N: scores, then probabilities
  __shared__ float m_s[R], l_s[R], alpha_s[R];
  __shared__ int64_t lo_s[R], hi_s[R];  // visible slots [lo, hi); empty: lo == hi
  __shared__ int bad_s[R];              // the row sees a slot of a bad page
  __shared__ int64_t range_s[2];        // this block's slots of the current tile
  __shared__ int32_t page_s[kPagedMaxTile], off_s[kPagedMaxTile];  // -1: bad page
  __shared__ SeqBounds seq_s;

  const int tid = threadIdx.x;
  const int64_t kvh = static_cast<int64_t>(blockIdx.x) % a.num_kv_heads;
  const int64_t s = static_cast<int64_t>(blockIdx.x) / a.num_kv_heads;
  const int split = static_cast<int>(blockIdx.y) % a.splits;
  const int slice = static_cast<int>(blockIdx.y) / a.splits;
  const T* qp = static_cast<const T*>(a.q);
  T* outp = static_cast<T*>(a.out);

  if (tid == 0) {
    seq_s.q0 = cu_at(a, s);
    seq_s.q1 = cu_at(a, s + 1);
    seq_s.len = detail::read_row(a.context_lens, s);
  }
  __syncthreads();
  const SeqBounds sb = seq_s;
  // A block with no row tile leaves at once (block y == 0 never does: it
  // answers for the batch check below).
  if (blockIdx.y != 0) {
    const int64_t q_len = sb.q1 - sb.q0;
    if (q_len <= 0 || (a.group * q_len + R - 1) / R <= slice) return;
  }
  const bool ok = batch_consistent(a);
  if (a.splits > 1 && blockIdx.x == 0 && blockIdx.y == 0 && tid == 0) *a.batch_ok = ok ? 1 : 0;
  if (!ok) {
    // Every output NaN: with one split, the y == 0 blocks share the tokens
    // (sequence s takes tokens s, s + num_seqs, ...; its KV head's query
    // heads); with splits, paged_combine_kernel writes them.
    if (a.splits == 1 && blockIdx.y == 0) {
      const int64_t per = a.group * D;
      for (int64_t t = s; t < a.total_q; t += a.num_seqs) {
        for (int64_t idx = tid; idx < per; idx += kThreads) {
          const int64_t h = kvh * a.group + idx / D;
          const int64_t d = idx % D;
          store_nan(outp + h * a.os[0] + t * a.os[1] + d * a.os[2]);
        }
      }
    }
    return;
  }
  const int64_t q_len = sb.q1 - sb.q0;  // >= 0, within [0, total_q]
  const bool seq_ok = sb.len >= q_len && sb.len <= a.max_len;
  const int64_t rows_total = a.group * q_len;
  const int64_t tiles = (rows_total + R - 1) / R;

  const TKV* kbase = static_cast<const TKV*>(a.k) + kvh * a.ks[1];
  const TKV* vbase = static_cast<const TKV*>(a.v) + kvh * a.vs[1];
  const float* ksp = nullptr;
  const float* vsp = nullptr;
  if constexpr (kQuantizedKV<TKV>) {
    ksp = a.k_scale + kvh * a.kss[1];
    vsp = a.v_scale + kvh * a.vss[1];
  }
  const int32_t* table = a.table + s * a.bts[0];
  const uint32_t bs = static_cast<uint32_t>(a.block_size);
  TileCtx t = tile_ctx(kv_s, q_s, acc_s, p_s, m_s, l_s, alpha_s, lo_s, hi_s, a.pitch, N,
                       a.parts, D, a.softcap);
  // The K or V tile of n slots through the tile's pages (page_s, off_s);
  // a bad page's slots are zeros and never read.
  const auto load_pages = [&](const TKV* base, const int64_t* st, bool vec, int n) {
    load_tile_at<TKV>(
        kv_s, a.pitch,
        [&](int c) -> const TKV* {
          const int32_t pg = page_s[c];
          return pg < 0 ? nullptr : base + pg * st[0] + off_s[c] * st[2];
        },
        st[3], n, D, vec);
  };

  for (int64_t tile = slice; tile < tiles; tile += a.slices) {
    const int64_t row0 = tile * R;
    const int64_t rem = rows_total - row0;
    const int rows = rem < R ? static_cast<int>(rem) : R;
    t.rows = rows;

    if (tid < R) {
      int64_t lo = 0, hi = 0;
      if (tid < rows && seq_ok) {
        const int64_t row = row0 + tid;
        const int64_t i = row / a.group;
        detail::visible_range(sb.len - q_len + i, 0, a.window, &lo, &hi);
      }
      lo_s[tid] = lo;
      hi_s[tid] = hi;
      bad_s[tid] = seq_ok ? 0 : 1;
      m_s[tid] = -INFINITY;
      l_s[tid] = 0.f;
    }
    for (int idx = tid; idx < R * D; idx += kThreads) {
      const int r = idx / D;
      const int d = idx - r * D;
      float x = 0.f;  // rows past `rows`: zero queries, never visible
      if (r < rows) {
        const int64_t row = row0 + r;
        const int64_t i = row / a.group;
        const int64_t h = kvh * a.group + (row - i * a.group);
        x = to_float(qp[h * a.qs[0] + (sb.q0 + i) * a.qs[1] + d * a.qs[2]]);
      }
      q_s[idx] = x;
      acc_s[idx] = 0.f;
    }
    __syncthreads();
    if (tid == 0) {
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
      for (int r = 0; r < rows; ++r) {
        if (lo_s[r] < hi_s[r]) {
          lo = lo_s[r] < lo ? lo_s[r] : lo;
          hi = hi_s[r] > hi ? hi_s[r] : hi;
        }
      }
      int64_t s0 = 0, s1 = 0;
      if (lo < hi) {
        int64_t per = (hi - lo + a.splits - 1) / a.splits;
        if (per < kMinSplitSlots) per = kMinSplitSlots;
        s0 = lo + split * per;
        s1 = s0 + per < hi ? s0 + per : hi;
        if (s0 >= s1) s0 = s1 = 0;
      }
      range_s[0] = s0;
      range_s[1] = s1;
    }
    __syncthreads();
    const int64_t s0 = range_s[0];
    const int64_t s1 = range_s[1];

    for (int64_t j0 = s0; j0 < s1; j0 += N) {
      const int n = s1 - j0 < N ? static_cast<int>(s1 - j0) : N;
      // The tile's pages: slots < len <= max_blocks * block_size, so the
      // table index is in range; the entry itself is checked.
      if (tid < n) {
        const uint32_t j = static_cast<uint32_t>(j0 + tid);  // < 2^31
        const uint32_t blk = j / bs;
        const int32_t pg = table[static_cast<int64_t>(blk) * a.bts[1]];
        page_s[tid] = pg >= 0 && pg < a.num_blocks ? pg : -1;
        off_s[tid] = static_cast<int32_t>(j - blk * bs);
      }
      __syncthreads();
      attend_tile<R, kQuantizedKV<TKV>>(
          t, j0, n, false,
          [&] { load_pages(kbase, a.ks, a.k_vec, n); },
          [&] { load_pages(vbase, a.vs, a.v_vec, n); },
          [&](int c) {
            float qscale = a.scale;
            if constexpr (kQuantizedKV<TKV>) {
              const int32_t pg = page_s[c];
              if (pg >= 0) qscale *= ksp[pg * a.kss[0] + off_s[c] * a.kss[2]];
            }
            return qscale;
          },
          [&](int r, int c, int64_t) {
            if (page_s[c] >= 0) return true;
            bad_s[r] = 1;  // a page this row needs is bad: its slots are not read
            return false;
          },
          [&](int c) {
            // Seen slots only: their pages are good.
            float sc = 1.f;
            if constexpr (kQuantizedKV<TKV>) sc = vsp[page_s[c] * a.vss[0] + off_s[c] * a.vss[2]];
            return sc;
          });
    }

    if (tid < rows && bad_s[tid]) l_s[tid] = NAN;
    __syncthreads();

    if (a.splits == 1) {
      for (int idx = tid; idx < rows * D; idx += kThreads) {
        const int r = idx / D;
        const int d = idx - r * D;
        const int64_t row = row0 + r;
        const int64_t i = row / a.group;
        const int64_t h = kvh * a.group + (row - i * a.group);
        float l = l_s[r];
        if (a.sink_logits != nullptr && l > 0.f) l += expf(a.sink_logits[h * a.sink_stride] - m_s[r]);
        const float o = l != l ? NAN : l > 0.f ? acc_s[idx] / l : 0.f;
        outp[h * a.os[0] + (sb.q0 + i) * a.os[1] + d * a.os[2]] = static_cast<T>(o);
      }
    } else {
      for (int idx = tid; idx < rows * D; idx += kThreads) {
        const int r = idx / D;
        const int d = idx - r * D;
        const int64_t row = row0 + r;
        const int64_t i = row / a.group;
        const int64_t h = kvh * a.group + (row - i * a.group);
        const int64_t at = split * a.total_rows + (sb.q0 + i) * a.num_heads + h;
        if (d == 0) {
          a.part_ml[2 * at] = m_s[r];
          a.part_ml[2 * at + 1] = l_s[r];
        }
        a.part_acc[at * D + d] = acc_s[idx];
      }
    }
    __syncthreads();  // before the next row tile resets the per-row state
  }
}

// Merges the splits of one (token, head) row, by core/merge.h's rule (as
// attend_combine_kernel does). Every split wrote the row's partial when the
// batch was consistent; otherwise the row is NaN.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads) paged_combine_kernel(const PagedArgs a) {
  const int64_t prow = blockIdx.x;
  const int64_t h = prow % a.num_heads;
  const int64_t t = prow / a.num_heads;
  T* out = static_cast<T*>(a.out) + h * a.os[0] + t * a.os[1];
  const int D = static_cast<int>(a.head_dim);
  if (*a.batch_ok != 1) {
    for (int d = threadIdx.x; d < D; d += kCombineThreads) store_nan(out + d * a.os[2]);
    return;
  }
  if (t >= cu_at(a, a.num_seqs)) {  // padding after the last sequence: no split wrote it
    for (int d = threadIdx.x; d < D; d += kCombineThreads) out[d * a.os[2]] = static_cast<T>(0.f);
    return;
  }
  const bool has_sink = a.sink_logits != nullptr;
  merge_split_row(out, a.os[2], D, a.splits, a.total_rows, prow, a.part_ml, a.part_acc, has_sink,
                  has_sink ? a.sink_logits[h * a.sink_stride] : 0.f);
}

// A batch of no sequence: the output's bytes become 0xff (NaN) unless
// cu_seqlens_q = [0] (then every row is padding and stays 0).
static __global__ void nan_unless_start_zero_kernel(unsigned char* out, int64_t bytes,
                                             const int32_t* cu) {
  if (cu[0] == 0) return;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < bytes;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = 0xff;
  }
}

// ============================================================ host side

template <typename Rt>
void run_paged_write(const PagedWriteParams& p, Rt& rt) {
  // The entry skips empty writes; nothing to do for them here either.
  if (p.num_tokens <= 0 || p.num_kv_heads <= 0 || p.head_dim <= 0) return;
  // 2 * num_tokens blocks along grid x: refused before anything runs.
  TORCH_CHECK_VALUE(2 * p.num_tokens <= std::numeric_limits<int32_t>::max(),
                    "kvcache::paged_write_ on CUDA: num_tokens = ", p.num_tokens,
                    " is too large for one launch (at most 2^30 - 1)");

  WriteArgs a{};
  a.io = cuda::quant_sides<3, 4>({p.k_src, p.v_src}, {p.k_src_stride, p.v_src_stride},
                                 {p.k_pages, p.v_pages}, {p.k_page_stride, p.v_page_stride},
                                 {p.k_scale, p.v_scale}, {p.ks_stride, p.vs_stride});
  a.slots = p.slots;
  a.n = p.num_tokens;
  a.heads = p.num_kv_heads;
  a.head_dim = p.head_dim;
  a.block_size = p.block_size;
  a.total_slots = p.num_blocks * p.block_size;
  a.flag = nullptr;

  if (p.num_tokens > kInlineCheckTokens) {
    uint32_t size = 2;
    while (size < 2 * p.num_tokens) size *= 2;  // num_tokens < 2^30 (checked above)
    const size_t bytes = (static_cast<size_t>(size) + 1) * sizeof(int32_t);
    int32_t* s = static_cast<int32_t*>(rt.scratch(bytes));
    rt.memset(s, 0xff, bytes);  // flag and table: -1
    const int64_t blocks = (p.num_tokens + kGlobalCheckThreads - 1) / kGlobalCheckThreads;
    rt.launch(paged_slots_check_kernel, dim3(static_cast<unsigned>(blocks)),
              dim3(kGlobalCheckThreads), 0, p.slots, p.num_tokens, a.total_slots, s, size - 1);
    a.flag = s;
  }

  if (p.format == KvFormat::kPlain) {
    // The copy's rows are a token's heads: sizes and byte strides in the
    // planner's (batch, head, position, element) order, position = head.
    const int64_t dst_size[4] = {p.num_blocks, p.block_size, p.num_kv_heads, p.head_dim};
    const int64_t src_size[4] = {p.num_tokens, 1, p.num_kv_heads, p.head_dim};
    for (int w = 0; w < 2; ++w) {
      const int64_t* const ds = a.io.ds[w];
      const int64_t* const ss = a.io.ss[w];
      const int64_t src_stride[4] = {ss[0], 0, ss[1], ss[2]};
      a.pair[w] = cuda::plan_copy(a.io.dst[w], ds, dst_size, a.io.src[w], src_stride, src_size,
                                  p.head_dim, p.elem_size);
    }
    const int64_t units = a.pair[0].units > a.pair[1].units ? a.pair[0].units : a.pair[1].units;
    const cuda::CopyBlock block = cuda::copy_block_shape(units, p.num_kv_heads);
    const dim3 grid(static_cast<unsigned>(2 * p.num_tokens),
                    cuda::copy_grid_y(p.num_kv_heads, block));
    rt.launch(paged_write_copy_kernel, grid, dim3(block.x, block.y), 0, a);
    return;
  }
  const int64_t tiles = (p.num_kv_heads + kQuantWarps - 1) / kQuantWarps;
  const dim3 grid(static_cast<unsigned>(2 * p.num_tokens),
                  static_cast<unsigned>(tiles < 65535 ? tiles : 65535));
  cuda::with_quant_types(p.src_dtype, p.format, [&](auto t, auto f) {
    rt.launch(paged_write_quant_kernel<decltype(t), decltype(f)::value>, grid,
              dim3(kQuantWarps * 32), 0, a);
  });
}

template <typename T, typename TKV, typename Rt>
void launch_paged_typed(const PagedArgs& a, int R, int64_t smem, dim3 grid, Rt& rt) {
  const dim3 block(kThreads);
  const size_t bytes = static_cast<size_t>(smem);
  switch (R) {
    case 1: rt.launch(paged_attend_kernel<T, TKV, 1>, grid, block, bytes, a); break;
    case 4: rt.launch(paged_attend_kernel<T, TKV, 4>, grid, block, bytes, a); break;
    default: rt.launch(paged_attend_kernel<T, TKV, 16>, grid, block, bytes, a); break;
  }
  if (a.splits > 1) {
    rt.launch(paged_combine_kernel<T>, dim3(static_cast<unsigned>(a.total_rows)),
              dim3(kCombineThreads), 0, a);
  }
}

template <typename T, typename Rt>
void launch_paged_format(const AttendParams& p, const PagedArgs& a, int R, int64_t smem,
                         dim3 grid, Rt& rt) {
  switch (p.kv_format) {
    case KvFormat::kPlain: return launch_paged_typed<T, T>(a, R, smem, grid, rt);
    case KvFormat::kInt8: return launch_paged_typed<T, int8_t>(a, R, smem, grid, rt);
    case KvFormat::kFp8: return launch_paged_typed<T, c10::Float8_e4m3fn>(a, R, smem, grid, rt);
  }
}

template <typename Rt>
void run_paged_attend(const AttendParams& p, Rt& rt) {
  const int64_t total_q = p.seq;  // q.size(0) (csrc/ops/paged.cpp)
  const int64_t D = p.head_dim;
  const int64_t elem_q = p.dtype == detail::AttnDtype::kFloat32 ? 4 : 2;
  if (p.batch == 0) {
    // No sequence but queries (the entry launches nothing for an empty
    // output): every row is padding (the entry's zeros) when cu_seqlens_q
    // = [0], else the batch is bad and every output NaN. The output is the
    // entry's fresh contiguous tensor; 0xff bytes are NaN in float32,
    // bfloat16 and float16.
    const int64_t bytes = total_q * p.num_heads * D * elem_q;
    const int64_t grid = std::min<int64_t>((bytes + kThreads - 1) / kThreads, 1024);
    rt.launch(nan_unless_start_zero_kernel, dim3(static_cast<unsigned>(grid)), dim3(kThreads), 0,
              static_cast<unsigned char*>(p.out), bytes, p.cu_seqlens_q);
    return;
  }
  const DeviceLimits dev = rt.limits();
  PagedArgs a{};
  a.q = p.q;
  a.k = p.k;
  a.v = p.v;
  a.out = p.out;
  for (int k = 0; k < 3; ++k) {
    a.qs[k] = p.q_stride[k + 1];
    a.os[k] = p.out_stride[k + 1];
  }
  for (int k = 0; k < 4; ++k) {
    a.ks[k] = p.k_stride[k];
    a.vs[k] = p.v_stride[k];
  }
  a.num_seqs = p.batch;
  a.num_heads = p.num_heads;
  a.num_kv_heads = p.num_kv_heads;
  a.group = p.num_heads / p.num_kv_heads;  // num_kv_heads >= 1: the output is not empty
  a.head_dim = D;
  a.total_q = total_q;
  a.max_len = p.max_len;
  a.table = p.block_table;
  a.bts[0] = p.bt_stride[0];
  a.bts[1] = p.bt_stride[1];
  a.block_size = p.block_size;
  a.num_blocks = p.num_blocks;
  a.context_lens = p.lengths;
  a.cu = p.cu_seqlens_q;
  a.cu_stride = p.cu_stride;
  a.scale = p.scale;
  a.softcap = p.softcap;
  a.window = p.window;
  a.sink_logits = p.sink_logits;
  a.sink_stride = p.sink_stride;
  a.k_scale = p.k_scale;
  a.v_scale = p.v_scale;
  for (int k = 0; k < 3; ++k) {
    a.kss[k] = p.ks_stride[k];
    a.vss[k] = p.vs_stride[k];
  }
  a.total_rows = total_q * p.num_heads;

  // Rows per block: from the average rows per (sequence, KV head), rounded
  // up to 1, 4 or 16, smaller when the shared memory does not fit.
  const int64_t rows_avg = (a.group * total_q + p.batch - 1) / p.batch;
  const int64_t limit = dev.smem_optin - kStaticSmemBytes;
  int R = rows_avg <= 1 ? 1 : rows_avg <= 4 ? 4 : 16;
  int N = 0;
  int64_t smem = 0;
  for (; R >= 1; R /= 4) {
    for (int n : {64, 32, 16, 8}) {
      const int64_t bytes = smem_bytes(R, n, D, kThreads / n);
      if (bytes <= limit) {
        N = n;
        smem = bytes;
        break;
      }
    }
    if (N != 0) break;
  }
  TORCH_CHECK_VALUE(N != 0, "kvcache::paged_attend on CUDA: head_dim=", D,
                    " needs more shared memory than this GPU offers (", limit,
                    " bytes per block)");
  a.tile_slots = N;
  a.parts = kThreads / N;
  a.pitch = static_cast<int>(((D + 31) / 32) * 32 + a.parts);

  const int64_t base = p.batch * p.num_kv_heads;
  TORCH_CHECK_VALUE(base <= std::numeric_limits<int32_t>::max(),
                    "kvcache::paged_attend on CUDA: num_seqs * num_kv_heads = ", base,
                    " is too large for one launch");
  TORCH_CHECK_VALUE(a.total_rows <= std::numeric_limits<int32_t>::max(),
                    "kvcache::paged_attend on CUDA: total_q * num_heads = ", a.total_rows,
                    " is too large for one launch");
  // Splits and slices from host-known shapes only (graph-safe): decode-like
  // batches split the slots, longer query runs the row tiles.
  const int64_t want = 2 * dev.multiprocessors;
  int64_t splits = 1, slices = 1;
  const int64_t tiles_max = (a.group * total_q + R - 1) / R;  // any one sequence's row tiles, at most
  const int64_t by_tiles = (tiles_max + kTilesPerBlock - 1) / kTilesPerBlock;
  if (rows_avg <= R) {
    // One long query run among decodes (a prefill chunk in a decode batch)
    // would loop over all its row tiles in one block while the others
    // finish: slices bound every block's tiles (blocks past a sequence's
    // tiles return at once).
    slices = by_tiles;
    if (base < want) {
      splits = (want + base - 1) / base;
      const int64_t by_len = (p.max_len + kMinSplitSlots - 1) / kMinSplitSlots;
      const int64_t per_split = a.total_rows * (D + 2) * 4;
      const int64_t by_mem = per_split > 0 ? kPartialBudgetBytes / per_split : kMaxSplits;
      if (splits > by_len) splits = by_len;
      if (splits > by_mem) splits = by_mem;
      if (splits > kMaxSplits) splits = kMaxSplits;
      if (splits < 1) splits = 1;
    }
  } else {
    slices = (want + base - 1) / base;
    if (slices < by_tiles) slices = by_tiles;
    if (slices > tiles_max) slices = tiles_max;
  }
  if (slices > 65535 / splits) slices = 65535 / splits;  // grid.y = splits * slices
  if (slices < 1) slices = 1;
  a.splits = static_cast<int>(splits);
  a.slices = static_cast<int>(slices);

  const int64_t elem = p.kv_format != KvFormat::kPlain ? 1 : elem_q;
  const int64_t kv_size[4] = {p.num_blocks, p.num_kv_heads, p.block_size, D};
  a.k_vec = D % 4 == 0 && allows_vec(p.k, p.k_stride, kv_size, elem);
  a.v_vec = D % 4 == 0 && allows_vec(p.v, p.v_stride, kv_size, elem);

  if (a.splits > 1) {
    // Host-known size; stream-ordered caching-allocator memory (graph-safe).
    const int64_t floats = a.splits * a.total_rows * (D + 2);
    a.part_ml = static_cast<float*>(
        rt.scratch(static_cast<size_t>(floats) * sizeof(float) + sizeof(int32_t)));
    a.part_acc = a.part_ml + 2 * a.splits * a.total_rows;
    a.batch_ok = reinterpret_cast<int32_t*>(a.part_acc + a.splits * a.total_rows * D);
  }
  const dim3 grid(static_cast<unsigned>(base), static_cast<unsigned>(splits * slices));
  switch (p.dtype) {
    case detail::AttnDtype::kFloat32: launch_paged_format<float>(p, a, R, smem, grid, rt); break;
    case detail::AttnDtype::kBFloat16:
      launch_paged_format<c10::BFloat16>(p, a, R, smem, grid, rt);
      break;
    case detail::AttnDtype::kFloat16: launch_paged_format<c10::Half>(p, a, R, smem, grid, rt); break;
  }
}

}  // namespace paged_kernels
}  // namespace kvcache
