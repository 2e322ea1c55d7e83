// CPU work of ring_update_ (see csrc/ops/ring.h).
//
// Per row, the kept positions of a write (ring_keeps) fall into at most
// three runs of consecutive slots: the sinks, then the ring part up to the
// end of the buffer, then its wrap to slot `sinks`. Each run of each (buffer,
// head) slab is one copy_block; the positions of the run are written after
// the keys and values of the row (the checks ran before anything).
#include <algorithm>

#include "../core/visibility.h"
#include "../ops/ring.h"
#include "copy_block.h"

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
    // A cache without heads holds nothing (CUDA launches no block for it).
    int32_t* pos = p.positions + b * p.pos_stride[0];
    for (int r = 0; r < (p.heads > 0 ? count : 0); ++r) {
      for (int64_t i = 0; i < runs[r].n; ++i) {
        pos[(runs[r].slot + i) * p.pos_stride[1]] =
            static_cast<int32_t>(start_of(b) + runs[r].t + i);
      }
    }
  }
  for (int64_t i = 0; i < p.lengths_out.numel; ++i) {
    detail::write_row(p.lengths_out, i, start_of(i) + p.chunk);
  }
}

}  // namespace
}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(ring_update_stub, cpu, &kvcache::ring_update_cpu);
