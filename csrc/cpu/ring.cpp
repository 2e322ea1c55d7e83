// CPU work of ring_update_ (see csrc/ops/ring.h).
//
// Per row, the kept positions of a write (ring_keeps) fall into at most
// three runs of consecutive slots: the sinks, then the ring part up to the
// end of the buffer, then its wrap to slot `sinks`. Each run of each (buffer,
// head) slab is one copy_block; the positions of the run are written after
// the keys and values of the row (the checks ran before anything).
//
// ring_update_quantized_ walks the same runs, quantizing each straight into
// its slots with cpu::quantize_slab (the quantizer of update_quantized_),
// the slot scales next to it.
#include <algorithm>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../core/visibility.h"
#include "../ops/ring.h"
#include "copy_block.h"
#include "helpers.h"
#include "quantize_slab.h"

namespace kvcache {
namespace {

using detail::RingUpdateParams;

struct Run {
  int64_t t = 0;     // first token of keys_new
  int64_t slot = 0;  // its slot
  int64_t n = 0;     // tokens
};

// The runs of row b's write of [start, start + chunk).
int ring_runs(const RingUpdateParams& p, int64_t start, Run* runs) {
  const int64_t end = start + p.chunk;
  const int64_t s = p.sinks, cap = p.capacity;
  int count = 0;
  // Sinks: [start, min(end, sinks)).
  if (start < s) {
    const int64_t e = std::min(end, s);
    runs[count++] = {0, start, e - start};
  }
  // Ring part: [max(start, sinks, end - (cap - sinks)), end).
  const int64_t first = std::max({start, s, end - (cap - s)});
  if (first < end) {
    int64_t slot = detail::ring_slot(first, s, cap);
    int64_t left = end - first;
    int64_t t = first - start;
    const int64_t n1 = std::min(left, cap - slot);
    runs[count++] = {t, slot, n1};
    if (left > n1) runs[count++] = {t + n1, s, left - n1};
  }
  return count;
}

// Records the positions of row b's runs (after the row's data).
void write_positions(const RingUpdateParams& p, int64_t b, int64_t start,
                     const Run* runs, int count) {
  // A cache without heads holds nothing (CUDA launches no block for it).
  int32_t* pos = p.positions + b * p.pos_stride[0];
  for (int r = 0; r < (p.heads > 0 ? count : 0); ++r) {
    for (int64_t i = 0; i < runs[r].n; ++i) {
      pos[(runs[r].slot + i) * p.pos_stride[1]] =
          static_cast<int32_t>(start + runs[r].t + i);
    }
  }
}

void ring_update_cpu(const RingUpdateParams& p) {
  const bool per_row = p.starts.numel > 1 || p.starts.stride != 0;
  auto start_of = [&](int64_t b) { return p.host_starts[per_row ? b : 0]; };
  for (int64_t b = 0; b < p.batch; ++b) {
    Run runs[3];
    const int count = ring_runs(p, start_of(b), runs);
    if (p.head_dim > 0) {
      for (int w = 0; w < 2; ++w) {
        const detail::DstRows& d = p.dst[w];
        const detail::SrcRows& s = p.src[w];
        for (int64_t h = 0; h < p.heads; ++h) {
          for (int r = 0; r < count; ++r) {
            const Run& run = runs[r];
            cpu::copy_block(
                d.data + b * d.stride[0] + h * d.stride[1] + run.slot * d.stride[2],
                d.stride[2], d.stride[3],
                s.data + b * s.stride[0] + h * s.stride[1] + run.t * s.stride[2],
                s.stride[2], s.stride[3], run.n, p.head_dim, p.elem);
          }
        }
      }
    }
    write_positions(p, b, start_of(b), runs, count);
  }
  for (int64_t i = 0; i < p.lengths_out.numel; ++i) {
    detail::write_row(p.lengths_out, i, start_of(i) + p.chunk);
  }
}

// As csrc/cpu/quant_update.cpp: helper threads join only for big writes.
constexpr int64_t kQuantParallelBytes = int64_t{8} << 20;
constexpr int64_t kQuantGrainBytes = int64_t{256} << 10;

template <typename T, detail::KvFormat F>
void ring_quant_typed(const detail::RingQuantUpdateParams& q) {
  const RingUpdateParams& p = q.ring;
  const bool per_row = p.starts.numel > 1 || p.starts.stride != 0;
  auto start_of = [&](int64_t b) { return p.host_starts[per_row ? b : 0]; };
  struct RowRuns {
    Run runs[3];
    int count = 0;
  };
  std::vector<RowRuns> rows(static_cast<size_t>(p.batch));
  int64_t kept = 0;  // slots written per (buffer, head)
  for (int64_t b = 0; b < p.batch; ++b) {
    rows[b].count = ring_runs(p, start_of(b), rows[b].runs);
    for (int r = 0; r < rows[b].count; ++r) kept += rows[b].runs[r].n;
  }
  const int64_t slabs = p.batch * p.heads;
  if (slabs > 0 && p.head_dim > 0 && kept > 0) {
    auto work = [&](int64_t begin, int64_t end) {
      std::vector<float> row(static_cast<size_t>(p.head_dim));
      for (int64_t i = begin; i < end; ++i) {
        const int w = i >= slabs ? 1 : 0;
        const int64_t bh = i - w * slabs;
        const int64_t b = bh / p.heads;
        const int64_t h = bh - b * p.heads;
        const detail::DstRows& d = p.dst[w];
        const detail::SrcRows& s = p.src[w];
        const int64_t* ss = q.scale_stride[w];
        for (int r = 0; r < rows[b].count; ++r) {
          const Run& run = rows[b].runs[r];
          cpu::quantize_slab<T, F>(
              s.data + b * s.stride[0] + h * s.stride[1] + run.t * s.stride[2],
              s.stride[2], s.stride[3],
              d.data + b * d.stride[0] + h * d.stride[1] + run.slot * d.stride[2],
              d.stride[2], d.stride[3],
              q.scale[w] + b * ss[0] + h * ss[1] + run.slot * ss[2], ss[2],
              run.n, p.head_dim, row.data());
        }
      }
    };
    // Bytes read: kept slots of head_dim source elements, both buffers.
    const int64_t total = 2 * p.heads * kept * p.head_dim * p.elem;
    if (total < kQuantParallelBytes) {
      work(0, 2 * slabs);
    } else {
      const int64_t slab_bytes =
          std::max<int64_t>(1, total / std::max<int64_t>(1, 2 * slabs));
      const int64_t per_task = std::max<int64_t>(1, kQuantGrainBytes / slab_bytes);
      const int64_t tasks = (2 * slabs + per_task - 1) / per_task;
      cpu::for_each_task(tasks, [&](int64_t t) {
        work(t * per_task, std::min(2 * slabs, (t + 1) * per_task));
      });
    }
  }
  for (int64_t b = 0; b < p.batch; ++b) {
    write_positions(p, b, start_of(b), rows[b].runs, rows[b].count);
  }
  for (int64_t i = 0; i < p.lengths_out.numel; ++i) {
    detail::write_row(p.lengths_out, i, start_of(i) + p.chunk);
  }
}

template <detail::KvFormat F>
void ring_quant_format(const detail::RingQuantUpdateParams& q) {
  switch (q.src_dtype) {
    case detail::FloatDtype::kFloat32: return ring_quant_typed<float, F>(q);
    case detail::FloatDtype::kBFloat16: return ring_quant_typed<c10::BFloat16, F>(q);
    case detail::FloatDtype::kFloat16: return ring_quant_typed<c10::Half, F>(q);
  }
}

void ring_update_quantized_cpu(const detail::RingQuantUpdateParams& q) {
  if (q.format == detail::KvFormat::kInt8) {
    ring_quant_format<detail::KvFormat::kInt8>(q);
  } else {
    ring_quant_format<detail::KvFormat::kFp8>(q);
  }
}

}  // namespace
}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(ring_update_stub, cpu, &kvcache::ring_update_cpu);
KVCACHE_REGISTER_KERNEL(ring_update_quantized_stub, cpu,
                        &kvcache::ring_update_quantized_cpu);
