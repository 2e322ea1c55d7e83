// The CUDA kernels of attend (see csrc/ops/attend.h) and the host code that
// plans and launches them over a runtime `Rt`, as paged_kernels.cuh does
// (see there for Rt): attend.cu passes the CUDA one,
// tests/cpp/test_attend_cuda_emulated.cpp the CPU emulator's.
//
// One kernel serves decode (seq = 1), chunked prefill, prefill and
// speculative verification; a second merges the splits when there are
// several.
//
// Work split. A (batch row b, KV head) owns group * seq query rows, ordered
// query position major (row = i * group + g, query head = kvh * group + g),
// so a tile of rows shares nearly one slot range. A block takes up to R of
// those rows (grouped-query packing: each K/V slot it loads serves all the
// query heads of the group) and one split of their slots. Grid: x = (b,
// KV head, row tile), y = split.
//
// Everything that depends on the lengths is decided on the device: each
// block reads lengths[b] and kv_start[b] (O(1)), so there is no host sync
// and the launches can be captured in a CUDA graph. A row whose length is
// outside [seq, max_len] or whose kv_start is outside [0, length] reads
// nothing and gets NaN. Query i of row b sits at slot p = length - seq + i
// and sees slots [max(kv_start, p - window + 1 if window), p]; one that sees
// no slot gets zeros. Slots are read only inside a row's visible ranges'
// union, which lies within [kv_start, length): NaN or Inf in unused slots
// never reaches the result.
//
// Per block, over tiles of N slots (attend_common.cuh: attend_tile, the
// tile step paged_attend shares): K tile -> shared memory (float), scores
// of R rows x N slots (each thread one slot, all R rows: a K element is read
// once per R multiply-adds; P threads share a slot's dot product and reduce
// with warp shuffles), online softmax per row (float32), V tile -> shared
// memory, accumulate. 16-byte global loads when a buffer's rows allow them,
// element loads otherwise. Accumulation in float32 for every dtype.
//
// Splits: the host picks an upper bound from host-known shapes only (enough
// blocks to fill the GPU); on the device each block takes
// max(ceil(range / splits), kMinSplitSlots) slots of its rows' range, so a
// short row uses few splits and the rest exit at once. With one split the
// block writes the output; otherwise it writes (max, sum, accumulator) to a
// scratch buffer from the caching allocator (sized from shapes, never from
// device values) and attend_combine_kernel merges them.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../core/merge.h"
#include "../core/rules.h"
#include "../core/visibility.h"
#include "../ops/attend.h"
#include "attend_common.cuh"

namespace kvcache {
namespace attend_kernels {

using detail::AttendParams;
using detail::IntRows;
using namespace attn_cuda;

struct AttnArgs {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  int64_t qs[4], ks[4], vs[4], os[4];  // element strides
  int64_t batch, num_heads, num_kv_heads, group, seq, head_dim, max_len;
  int64_t rows_per_kv;  // group * seq
  int64_t row_tiles;    // ceil(rows_per_kv / R)
  int tile_slots;       // N: slots per tile
  int parts;            // P = kThreads / N: threads per slot's dot product
  int pitch;            // floats between two slots' rows in shared memory
  int splits;
  bool k_vec, v_vec;  // 16-byte loads allowed
  float scale, softcap;
  int64_t window;
  IntRows lengths, kv_start;
  // Rings: (batch, max_len) slot positions (nullptr: a linear cache).
  const int32_t* positions;
  int64_t ps[2];
  int64_t sinks;
  // Learned per-head sink logits ((num_heads,) float32; nullptr: none):
  // one more term exp(sink - max) in each row's softmax denominator.
  const float* sink_logits;
  int64_t sink_stride;
  float* part_ml;   // splits > 1: (split, row) -> (max, sum)
  float* part_acc;  // splits > 1: (split, row, head_dim)
  int64_t total_rows;  // batch * num_heads * seq
  // A quantized cache (int8 / e4m3 keys and values): per-slot scales, the
  // key scale multiplying a score, the value scale a probability.
  const float* k_scale;
  const float* v_scale;
  int64_t kss[3], vss[3];  // element strides (batch, KV head, slot)
};

// Row b's length and first slot, and whether they are usable.
struct RowBounds {
  int64_t len;
  int64_t first;
  bool valid;
};

// Read by thread 0 and shared, so that every thread of the block takes the
// same branch (it decides early exits before barriers) even if another
// stream were changing the lengths meanwhile. Ends with a barrier.
__device__ __forceinline__ RowBounds row_bounds(const AttnArgs& a, int64_t b) {
  __shared__ RowBounds shared;
  if (threadIdx.x == 0) {
    RowBounds r;
    r.len = detail::read_row(a.lengths, b);
    r.first = a.kv_start.data != nullptr ? detail::read_row(a.kv_start, b) : 0;
    // A ring's lengths are logical positions (int32), not slots.
    r.valid = detail::attend_row_fits(
        r.len, r.first, a.seq,
        a.positions != nullptr ? int64_t{INT32_MAX} : a.max_len);
    shared = r;
  }
  __syncthreads();
  return shared;
}

// The query head and position of row r (of rows_per_kv) of KV head kvh.
__device__ __forceinline__ void row_place(const AttnArgs& a, int64_t kvh,
                                          int64_t row, int64_t* h,
                                          int64_t* i) {
  *i = row / a.group;
  *h = kvh * a.group + (row - *i * a.group);
}

// T: q's and the output's dtype; TKV: the cache's (T, or a quantized format).
template <typename T, typename TKV, int R>
__global__ void __launch_bounds__(kThreads)
    attend_kernel(const AttnArgs a) {
  KVCACHE_EXTERN_SMEM(float4, smem4);  // 16-byte aligned
  float* kv_s = reinterpret_cast<float*>(smem4);  // N x pitch
  const int D = static_cast<int>(a.head_dim);
  const int N = a.tile_slots;
  float* q_s = kv_s + N * a.pitch;  // R x D
  float* acc_s = q_s + R * D;       // R x D
  float* p_s = acc_s + R * D;       // R x N: scores, then probabilities
  __shared__ float m_s[R], l_s[R], alpha_s[R];
  __shared__ int64_t lo_s[R], hi_s[R];  // visible slots [lo, hi); empty: lo == hi
  __shared__ int64_t range_s[2];        // this block's slots
  __shared__ int64_t qpos_s[R];         // rings: each row's query position
  __shared__ int count_s[R];            // rings: visible slots found (split 0)

  const int tid = threadIdx.x;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) % a.row_tiles;
  const int64_t bk = static_cast<int64_t>(blockIdx.x) / a.row_tiles;
  const int64_t kvh = bk % a.num_kv_heads;
  const int64_t b = bk / a.num_kv_heads;
  const int split = blockIdx.y;
  const int64_t row0 = tile * R;
  const int64_t rem = a.rows_per_kv - row0;
  const int rows = rem < R ? static_cast<int>(rem) : R;

  const T* qp = static_cast<const T*>(a.q);
  T* outp = static_cast<T*>(a.out);

  const RowBounds rb = row_bounds(a, b);  // uniform across the block
  if (!rb.valid) {
    if (a.splits == 1) {
      for (int idx = tid; idx < rows * D; idx += kThreads) {
        const int r = idx / D;
        const int d = idx - r * D;
        int64_t h, i;
        row_place(a, kvh, row0 + r, &h, &i);
        outp[b * a.os[0] + h * a.os[1] + i * a.os[2] + d * a.os[3]] =
            static_cast<T>(std::numeric_limits<float>::quiet_NaN());
      }
    }
    return;  // with splits, attend_combine_kernel writes the NaN
  }

  if (tid < R) {
    int64_t lo = 0, hi = 0;
    if (tid < rows) {
      int64_t h, i;
      row_place(a, kvh, row0 + tid, &h, &i);
      const int64_t pos = rb.len - a.seq + i;  // in [0, len)
      qpos_s[tid] = pos;
      if (a.positions != nullptr) {
        lo = 0;  // a ring's query may see any slot: decided per slot
        hi = a.max_len;
      } else {
        detail::visible_range(pos, rb.first, a.window, &lo, &hi);
      }
    } else {
      qpos_s[tid] = -1;
    }
    count_s[tid] = 0;
    lo_s[tid] = lo;
    hi_s[tid] = hi;
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.f;
  }
  for (int idx = tid; idx < R * D; idx += kThreads) {
    const int r = idx / D;
    const int d = idx - r * D;
    float x = 0.f;  // rows past `rows`: zero queries, never visible
    if (r < rows) {
      int64_t h, i;
      row_place(a, kvh, row0 + r, &h, &i);
      x = to_float(qp[b * a.qs[0] + h * a.qs[1] + i * a.qs[2] + d * a.qs[3]]);
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
      s0 = lo + split * per;  // <= 2^31 + 64 * 2^31: no overflow
      s1 = s0 + per < hi ? s0 + per : hi;
      if (s0 >= s1) s0 = s1 = 0;
    }
    range_s[0] = s0;
    range_s[1] = s1;
  }
  __syncthreads();
  const int64_t s0 = range_s[0];
  const int64_t s1 = range_s[1];

  const TKV* kp = static_cast<const TKV*>(a.k) + b * a.ks[0] + kvh * a.ks[1];
  const TKV* vp = static_cast<const TKV*>(a.v) + b * a.vs[0] + kvh * a.vs[1];
  const float* ksp = nullptr;
  const float* vsp = nullptr;
  if constexpr (kQuantizedKV<TKV>) {
    ksp = a.k_scale + b * a.kss[0] + kvh * a.kss[1];
    vsp = a.v_scale + b * a.vss[0] + kvh * a.vss[1];
  }
  TileCtx t = tile_ctx(kv_s, q_s, acc_s, p_s, m_s, l_s, alpha_s, lo_s, hi_s, a.pitch, N,
                       a.parts, D, a.softcap);
  t.rows = rows;
  const bool ring = a.positions != nullptr;

  for (int64_t j0 = s0; j0 < s1; j0 += N) {
    const int n = s1 - j0 < N ? static_cast<int>(s1 - j0) : N;
    attend_tile<R, kQuantizedKV<TKV>>(
        t, j0, n, ring,
        [&] { load_tile(kv_s, a.pitch, kp, a.ks[2], a.ks[3], j0, n, D, a.k_vec); },
        [&] { load_tile(kv_s, a.pitch, vp, a.vs[2], a.vs[3], j0, n, D, a.v_vec); },
        [&](int jl) {
          float qscale = a.scale;
          if constexpr (kQuantizedKV<TKV>) qscale *= ksp[(j0 + jl) * a.kss[2]];  // the slot's key scale
          return qscale;
        },
        [&](int r, int, int64_t j) {
          return !ring || detail::sees(a.positions[b * a.ps[0] + j * a.ps[1]], qpos_s[r],
                                       rb.first, a.window, a.sinks);
        },
        [&](int c) {
          float sc = 1.f;
          if constexpr (kQuantizedKV<TKV>) sc = vsp[(j0 + c) * a.vss[2]];
          return sc;
        });
  }

  // Rings: split 0 counts every visible slot of its rows (positions only,
  // O(max_len) int reads) against the rule's count; a row that lost a
  // position it needs gets NaN (l = NaN, also through the combine).
  if (a.positions != nullptr && split == 0) {
    int cnt[R];
#pragma unroll
    for (int r = 0; r < R; ++r) cnt[r] = 0;
    for (int64_t j = tid; j < a.max_len; j += kThreads) {
      const int64_t q = a.positions[b * a.ps[0] + j * a.ps[1]];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < rows) cnt[r] += detail::sees(q, qpos_s[r], rb.first, a.window, a.sinks) ? 1 : 0;
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r < rows && cnt[r] > 0) atomicAdd(&count_s[r], cnt[r]);
    }
    __syncthreads();
    if (tid < rows &&
        count_s[tid] != detail::visible_count(qpos_s[tid], rb.first, a.window, a.sinks)) {
      l_s[tid] = NAN;
    }
    __syncthreads();
  }

  if (a.splits == 1) {
    for (int idx = tid; idx < rows * D; idx += kThreads) {
      const int r = idx / D;
      const int d = idx - r * D;
      int64_t h, i;
      row_place(a, kvh, row0 + r, &h, &i);
      float l = l_s[r];
      if (a.sink_logits != nullptr && l > 0.f) l += expf(a.sink_logits[h * a.sink_stride] - m_s[r]);
      const float o = l != l ? NAN : l > 0.f ? acc_s[idx] / l : 0.f;  // no visible slot: 0
      outp[b * a.os[0] + h * a.os[1] + i * a.os[2] + d * a.os[3]] =
          static_cast<T>(o);
    }
  } else {
    for (int idx = tid; idx < rows * D; idx += kThreads) {
      const int r = idx / D;
      const int d = idx - r * D;
      int64_t h, i;
      row_place(a, kvh, row0 + r, &h, &i);
      const int64_t prow = (b * a.num_heads + h) * a.seq + i;
      const int64_t at = split * a.total_rows + prow;
      if (d == 0) {
        a.part_ml[2 * at] = m_s[r];
        a.part_ml[2 * at + 1] = l_s[r];
      }
      a.part_acc[at * D + d] = acc_s[idx];
    }
  }
}

// Merges the splits of one query row (b, h, i) per block, by the rule of
// core/merge.h (the CPU's merge_parts calls the same function): parts that
// saw a slot (sum != 0) are merged, so a NaN or +inf score, which leaves
// its part's sum NaN, makes the row NaN, as with one split.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    attend_combine_kernel(const AttnArgs a) {
  const int64_t prow = blockIdx.x;
  const int64_t i = prow % a.seq;
  const int64_t bh = prow / a.seq;
  const int64_t h = bh % a.num_heads;
  const int64_t b = bh / a.num_heads;
  T* out = static_cast<T*>(a.out) + b * a.os[0] + h * a.os[1] + i * a.os[2];
  const int D = static_cast<int>(a.head_dim);
  const RowBounds rb = row_bounds(a, b);
  if (!rb.valid) {  // attend_kernel wrote no partials for this row
    for (int d = threadIdx.x; d < D; d += kCombineThreads) {
      out[d * a.os[3]] = static_cast<T>(std::numeric_limits<float>::quiet_NaN());
    }
    return;
  }
  // A ring row that lost a position (split 0 wrote sum NaN): NaN.
  if (a.positions != nullptr && a.part_ml[2 * prow + 1] != a.part_ml[2 * prow + 1]) {
    for (int d = threadIdx.x; d < D; d += kCombineThreads) {
      out[d * a.os[3]] = static_cast<T>(std::numeric_limits<float>::quiet_NaN());
    }
    return;
  }
  const bool has_sink = a.sink_logits != nullptr;
  merge_split_row(out, a.os[3], D, a.splits, a.total_rows, prow, a.part_ml, a.part_acc, has_sink,
                  has_sink ? a.sink_logits[h * a.sink_stride] : 0.f);
}

// ============================================================ host side

template <typename T, typename TKV, typename Rt>
void launch_attend_typed(const AttendParams& p, const AttnArgs& a, int R, int64_t smem, Rt& rt) {
  const dim3 grid(static_cast<unsigned>(p.batch * p.num_kv_heads * a.row_tiles),
                  static_cast<unsigned>(a.splits));
  const dim3 block(kThreads);
  const size_t bytes = static_cast<size_t>(smem);
  switch (R) {
    case 1: rt.launch(attend_kernel<T, TKV, 1>, grid, block, bytes, a); break;
    case 2: rt.launch(attend_kernel<T, TKV, 2>, grid, block, bytes, a); break;
    case 4: rt.launch(attend_kernel<T, TKV, 4>, grid, block, bytes, a); break;
    case 8: rt.launch(attend_kernel<T, TKV, 8>, grid, block, bytes, a); break;
    default: rt.launch(attend_kernel<T, TKV, 16>, grid, block, bytes, a); break;
  }
  if (a.splits > 1) {
    rt.launch(attend_combine_kernel<T>, dim3(static_cast<unsigned>(a.total_rows)),
              dim3(kCombineThreads), 0, a);
  }
}

// The cache's element type: q's dtype, or a quantized format.
template <typename T, typename Rt>
void launch_attend_format(const AttendParams& p, const AttnArgs& a, int R, int64_t smem, Rt& rt) {
  switch (p.kv_format) {
    case detail::KvFormat::kPlain: return launch_attend_typed<T, T>(p, a, R, smem, rt);
    case detail::KvFormat::kInt8: return launch_attend_typed<T, int8_t>(p, a, R, smem, rt);
    case detail::KvFormat::kFp8:
      return launch_attend_typed<T, c10::Float8_e4m3fn>(p, a, R, smem, rt);
  }
}

template <typename Rt>
void run_attend(const AttendParams& p, Rt& rt) {
  const DeviceLimits dev = rt.limits();

  AttnArgs a{};
  a.q = p.q;
  a.k = p.k;
  a.v = p.v;
  a.out = p.out;
  for (int k = 0; k < 4; ++k) {
    a.qs[k] = p.q_stride[k];
    a.ks[k] = p.k_stride[k];
    a.vs[k] = p.v_stride[k];
    a.os[k] = p.out_stride[k];
  }
  a.batch = p.batch;
  a.num_heads = p.num_heads;
  a.num_kv_heads = p.num_kv_heads;
  a.group = p.num_heads / p.num_kv_heads;  // num_kv_heads >= 1: the output is not empty
  a.seq = p.seq;
  a.head_dim = p.head_dim;
  a.max_len = p.max_len;
  a.scale = p.scale;
  a.softcap = p.softcap;
  a.window = p.window;
  a.lengths = p.lengths;
  a.kv_start = p.kv_start;
  a.positions = p.positions;
  a.sink_logits = p.sink_logits;
  a.sink_stride = p.sink_stride;
  a.ps[0] = p.pos_stride[0];
  a.ps[1] = p.pos_stride[1];
  a.sinks = p.sinks;
  a.rows_per_kv = a.group * a.seq;
  a.total_rows = p.batch * p.num_heads * p.seq;

  const int64_t elem = p.kv_format != detail::KvFormat::kPlain ? 1
                       : p.dtype == detail::AttnDtype::kFloat32 ? 4 : 2;
  a.k_scale = p.k_scale;
  a.v_scale = p.v_scale;
  for (int k = 0; k < 3; ++k) {
    a.kss[k] = p.ks_stride[k];
    a.vss[k] = p.vs_stride[k];
  }
  const int64_t D = p.head_dim;
  // Shared memory: prefer R rows (the whole group when it fits), then the
  // widest slot tile that fits the device's limit.
  const int64_t limit = dev.smem_optin - kStaticSmemBytes;
  const TilePlan tp = plan_tiles(a.rows_per_kv, D, limit);
  const int R = tp.R;
  const int N = tp.N;
  const int64_t smem = tp.smem;
  TORCH_CHECK_VALUE(N != 0, "kvcache::attend on CUDA: head_dim=", D,
                    " needs more shared memory than this GPU offers (",
                    limit, " bytes per block)");
  a.tile_slots = N;
  a.parts = kThreads / N;
  a.pitch = static_cast<int>(((D + 31) / 32) * 32 + a.parts);
  a.row_tiles = (a.rows_per_kv + R - 1) / R;

  const int64_t blocks = p.batch * p.num_kv_heads * a.row_tiles;
  TORCH_CHECK_VALUE(blocks <= std::numeric_limits<int32_t>::max(),
                    "kvcache::attend on CUDA: batch * num_kv_heads * query "
                    "tiles = ", blocks, " is too large for one launch");
  // Splits: enough blocks for two waves on every multiprocessor, from
  // host-known shapes only; never more than the longest possible row needs.
  int64_t splits = 1;
  const int64_t want = 2 * dev.multiprocessors;
  if (blocks < want) {
    splits = (want + blocks - 1) / blocks;
    const int64_t by_len = (p.max_len + kMinSplitSlots - 1) / kMinSplitSlots;
    if (splits > by_len) splits = by_len;
    if (splits > kMaxSplits) splits = kMaxSplits;
    if (splits < 1) splits = 1;
  }
  a.splits = static_cast<int>(splits);
  a.k_vec = false;
  a.v_vec = false;
  const int64_t kv_size[4] = {p.batch, p.num_kv_heads, p.max_len, D};
  // float4 shared-memory stores need D to be a multiple of 4 floats.
  if (D % 4 == 0) {
    a.k_vec = allows_vec(p.k, p.k_stride, kv_size, elem);
    a.v_vec = allows_vec(p.v, p.v_stride, kv_size, elem);
  }

  if (a.splits > 1) {
    // (max, sum) and the accumulator of every (split, row): host-known
    // sizes; stream-ordered device memory (graph-safe), freed when the
    // runtime goes.
    const int64_t floats = a.splits * a.total_rows * (D + 2);
    a.part_ml = static_cast<float*>(rt.scratch(static_cast<size_t>(floats) * sizeof(float)));
    a.part_acc = a.part_ml + 2 * a.splits * a.total_rows;
  }

  switch (p.dtype) {
    case detail::AttnDtype::kFloat32:
      launch_attend_format<float>(p, a, R, smem, rt);
      break;
    case detail::AttnDtype::kBFloat16:
      launch_attend_format<c10::BFloat16>(p, a, R, smem, rt);
      break;
    case detail::AttnDtype::kFloat16:
      launch_attend_format<c10::Half>(p, a, R, smem, rt);
      break;
  }
}

}  // namespace attend_kernels
}  // namespace kvcache
