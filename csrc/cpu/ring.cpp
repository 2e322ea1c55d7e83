// CPU work of ring_update_, plain and quantized (see csrc/ops/ring.h).
//
// The ring's slot mapping in closed form: per row, the kept positions of a
// write (ring_keeps) fall into at most three runs of consecutive slots: the
// sinks, then the ring part up to the end of the buffer, then its wrap to
// slot `sinks`. The runs go to the slot-mapped write shared with the paged
// write (slot_write.h: a copy, or quantize_slab with the scales, per run and
// head); the positions of the runs are written after the data (the checks
// ran before anything).
#include <algorithm>
#include <vector>

#include "../core/visibility.h"
#include "../ops/ring.h"
#include "slot_write.h"

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

// Row b's runs as slot-mapped runs of the shared write (scales: the
// quantized write's, else null).
void add_runs(const RingUpdateParams& p, int64_t b, const Run* runs, int count,
              float* const* scale, const int64_t (*scale_stride)[3],
              std::vector<cpu::SlotRun>& out) {
  for (int r = 0; r < count; ++r) {
    cpu::SlotRun run;
    for (int w = 0; w < 2; ++w) {
      const detail::DstRows& d = p.dst[w];
      const detail::SrcRows& s = p.src[w];
      run.src[w] = s.data + b * s.stride[0] + runs[r].t * s.stride[2];
      run.dst[w] = d.data + b * d.stride[0] + runs[r].slot * d.stride[2];
      if (scale != nullptr) {
        run.scale[w] = scale[w] + b * scale_stride[w][0] + runs[r].slot * scale_stride[w][2];
      }
    }
    run.n = runs[r].n;
    out.push_back(run);
  }
}

// Both formats: the runs of every row written by the shared core, then the
// positions and the lengths.
void ring_write(const RingUpdateParams& p, const cpu::SlotWrite& w, float* const* scale,
                const int64_t (*scale_stride)[3]) {
  const bool per_row = p.starts.numel > 1 || p.starts.stride != 0;
  auto start_of = [&](int64_t b) { return p.host_starts[per_row ? b : 0]; };
  struct RowRuns {
    Run runs[3];
    int count = 0;
  };
  std::vector<RowRuns> rows(static_cast<size_t>(p.batch));
  std::vector<cpu::SlotRun> slot_runs;
  for (int64_t b = 0; b < p.batch; ++b) {
    rows[b].count = ring_runs(p, start_of(b), rows[b].runs);
    add_runs(p, b, rows[b].runs, rows[b].count, scale, scale_stride, slot_runs);
  }
  cpu::write_slot_runs(w, std::move(slot_runs));
  for (int64_t b = 0; b < p.batch; ++b) {
    write_positions(p, b, start_of(b), rows[b].runs, rows[b].count);
  }
  for (int64_t i = 0; i < p.lengths_out.numel; ++i) {
    detail::write_row(p.lengths_out, i, start_of(i) + p.chunk);
  }
}

// The geometry of a ring's runs: a token of the new data and a slot of the
// ring are one position step apart, heads one head step.
cpu::SlotWrite ring_geometry(const RingUpdateParams& p) {
  cpu::SlotWrite w;
  for (int b = 0; b < 2; ++b) {
    w.src_token[b] = p.src[b].stride[2];
    w.src_head[b] = p.src[b].stride[1];
    w.src_elem[b] = p.src[b].stride[3];
    w.dst_token[b] = p.dst[b].stride[2];
    w.dst_head[b] = p.dst[b].stride[1];
    w.dst_elem[b] = p.dst[b].stride[3];
  }
  w.heads = p.heads;
  w.head_dim = p.head_dim;
  w.elem = p.elem;
  return w;
}

void ring_update_cpu(const RingUpdateParams& p) {
  ring_write(p, ring_geometry(p), nullptr, nullptr);
}

void ring_update_quantized_cpu(const detail::RingQuantUpdateParams& q) {
  cpu::SlotWrite w = ring_geometry(q.ring);
  for (int b = 0; b < 2; ++b) {
    w.scale_token[b] = q.scale_stride[b][2];
    w.scale_head[b] = q.scale_stride[b][1];
  }
  w.format = q.format;
  w.source = q.src_dtype;
  ring_write(q.ring, w, q.scale, q.scale_stride);
}

}  // namespace
}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(ring_update_stub, cpu, &kvcache::ring_update_cpu);
KVCACHE_REGISTER_KERNEL(ring_update_quantized_stub, cpu,
                        &kvcache::ring_update_quantized_cpu);
