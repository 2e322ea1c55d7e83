// CPU work of attend (see csrc/ops/attend.h).
//
// One task per (batch row, KV head, tile of query positions): the query
// heads that share the KV head (grouped-query attention) and the tile's
// positions form the task's query rows, so each cached row is read once per
// group, not once per query head. Online softmax in float32 over the visible
// slots only; bfloat16/float16 rows are widened to float32 as they are read.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../ops/attend.h"

namespace kvcache {
namespace {

using detail::AttendParams;

constexpr int64_t kQueryTile = 16;   // query positions per task
constexpr int64_t kSlotBlock = 64;   // cached slots widened at a time
constexpr int64_t kParallelFlops = int64_t{1} << 22;

template <typename T>
inline float widen(T x) {
  return static_cast<float>(x);
}

template <typename T>
void load_row(const T* src, int64_t stride, int64_t n, float* dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = widen(src[d * stride]);
}

template <typename T>
void store_row(const float* src, float scale, T* dst, int64_t stride,
               int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d * stride] = static_cast<T>(src[d] * scale);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
}

template <typename T>
void attend_task(const AttendParams& p, int64_t b, int64_t kvh, int64_t i0,
                 int64_t i1) {
  const int64_t group = p.num_heads / p.kv_heads;
  const int64_t D = p.head_dim;
  const int64_t len = p.host_lengths[b];
  const int64_t first = p.host_kv_start ? p.host_kv_start[b] : 0;
  const int64_t rows = group * (i1 - i0);
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + kvh * p.k_stride[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + kvh * p.v_stride[1];
  T* out = static_cast<T*>(p.out);

  std::vector<float> qf(rows * D), acc(rows * D, 0.f), kb(kSlotBlock * D),
      vb(kSlotBlock * D), m(rows, -std::numeric_limits<float>::infinity()),
      l(rows, 0.f);
  std::vector<int64_t> lo(rows), hi(rows);  // visible slots [lo, hi)
  int64_t slot_lo = len, slot_hi = first;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = kvh * group + g;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = g * (i1 - i0) + (i - i0);
      load_row(q + b * p.q_stride[0] + h * p.q_stride[1] + i * p.q_stride[2],
               p.q_stride[3], D, &qf[r * D]);
      const int64_t pos = len - p.seq + i;  // this query's slot
      int64_t from = first;
      if (p.window > 0) from = std::max(from, pos - p.window + 1);
      lo[r] = from;
      hi[r] = std::max(from, pos + 1);
      slot_lo = std::min(slot_lo, lo[r]);
      slot_hi = std::max(slot_hi, hi[r]);
    }
  }
  float scores[kSlotBlock];
  for (int64_t j0 = slot_lo; j0 < slot_hi; j0 += kSlotBlock) {
    const int64_t nj = std::min(kSlotBlock, slot_hi - j0);
    for (int64_t j = 0; j < nj; ++j) {
      load_row(k + (j0 + j) * p.k_stride[2], p.k_stride[3], D, &kb[j * D]);
      load_row(v + (j0 + j) * p.v_stride[2], p.v_stride[3], D, &vb[j * D]);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t a = std::max(lo[r], j0) - j0;
      const int64_t e = std::min(hi[r], j0 + nj) - j0;
      if (a >= e) continue;
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = a; j < e; ++j) {
        float s = p.scale * dot(&qf[r * D], &kb[j * D], D);
        if (p.softcap > 0.f) s = p.softcap * std::tanh(s / p.softcap);
        scores[j] = s;
        block_max = std::max(block_max, s);
      }
      const float new_max = std::max(m[r], block_max);
      const float rescale = std::exp(m[r] - new_max);  // 0 when m was -inf
      float* ar = &acc[r * D];
      if (rescale != 1.f) {
        for (int64_t d = 0; d < D; ++d) ar[d] *= rescale;
      }
      float sum = l[r] * rescale;
      for (int64_t j = a; j < e; ++j) {
        const float w = std::exp(scores[j] - new_max);
        sum += w;
        axpy(w, &vb[j * D], ar, D);
      }
      m[r] = new_max;
      l[r] = sum;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = kvh * group + g;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = g * (i1 - i0) + (i - i0);
      // No visible slot (a left-padding query): zeros.
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      store_row(&acc[r * D], inv,
                out + b * p.out_stride[0] + h * p.out_stride[1] + i * p.out_stride[2],
                p.out_stride[3], D);
    }
  }
}

template <typename T>
void attend_typed(const AttendParams& p) {
  const int64_t tiles = (p.seq + kQueryTile - 1) / kQueryTile;
  const int64_t tasks = p.batch * p.kv_heads * tiles;
  int64_t flops = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    flops += p.host_lengths[b] * p.seq;
  }
  flops *= 4 * p.num_heads * p.head_dim;
  auto work = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t tile = t % tiles;
      const int64_t bh = t / tiles;
      const int64_t i0 = tile * kQueryTile;
      attend_task<T>(p, bh / p.kv_heads, bh % p.kv_heads, i0,
                     std::min(p.seq, i0 + kQueryTile));
    }
  };
  if (flops < kParallelFlops) {
    work(0, tasks);
  } else {
    at::parallel_for(0, tasks, 1, work);
  }
}

void attend_cpu(const AttendParams& p) {
  switch (p.dtype) {
    case detail::AttnDtype::kFloat32: return attend_typed<float>(p);
    case detail::AttnDtype::kBFloat16: return attend_typed<c10::BFloat16>(p);
    case detail::AttnDtype::kFloat16: return attend_typed<c10::Half>(p);
  }
}

}  // namespace
}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(attend_stub, cpu, &kvcache::attend_cpu);
