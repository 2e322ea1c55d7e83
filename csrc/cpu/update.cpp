// CPU work of update_, update_.Tensor and append_ (see csrc/ops/update.h).
//
// Both buffers are written in one pass over (buffer, batch, head) slabs of
// (chunk, head_dim), each copied by copy_block (by element size: every dtype
// takes the same path).
#include <algorithm>

#include "../ops/update.h"
#include "copy_block.h"
#include "helpers.h"

namespace kvcache {
namespace {

using detail::DstRows;
using detail::SrcRows;
using detail::UpdateParams;

// Threads: a write goes parallel only from kParallelBytes in all, and a
// single-token decode step never does, whatever its size (a batch-16 decode
// step once went parallel and took 10-16 ms on a busy machine instead of
// ~15 us). The helpers come from helpers.h, not an OpenMP region: on the
// shared 2-core CI machine an OpenMP region cost 4-20 ms when the other
// core was busy (a 2 MiB copy took 20 ms instead of 0.26 ms), which forced
// a 256 MiB threshold and left a quiet machine's prefill at half the speed
// of ATen's copy_. Helpers join only when they get a core, but waking one
// costs tens of microseconds here. Measured (update_, fp32, 8 heads,
// head_dim 128, p50 of 400 calls, 2 threads vs 1, the machine's other core
// partly used by others): 1 MiB 1.17-1.20x (slower), 4 MiB 0.72-0.76x in
// two runs but 1.3x in a third, 8 MiB 0.61-0.63x, 16 MiB 0.54-0.55x, 32 MiB
// 0.57-0.61x; with a spinning process on the other core, 32 MiB 1.17x (p50;
// p99 6.2 ms, where ATen's parallel copy_ of the same bytes had 10 ms).
// So from 8 MiB. KVCACHE_PARALLEL_BYTES overrides it at build time.
#ifdef KVCACHE_PARALLEL_BYTES
constexpr int64_t kParallelBytes = KVCACHE_PARALLEL_BYTES;
#else
constexpr int64_t kParallelBytes = int64_t{8} << 20;
#endif
// Bytes per task once parallel (several tasks per thread balance the load).
constexpr int64_t kGrainBytes = int64_t{256} << 10;

// Copies one (chunk, head_dim) slab of batch row b, head h.
void copy_slab(const DstRows& d, const SrcRows& s, int64_t b, int64_t h,
               int64_t start, const UpdateParams& p) {
  cpu::copy_block(
      d.data + b * d.stride[0] + h * d.stride[1] + start * d.stride[2],
      d.stride[2], d.stride[3], s.data + b * s.stride[0] + h * s.stride[1],
      s.stride[2], s.stride[3], p.chunk, p.head_dim, p.elem);
}

void update_cpu(const UpdateParams& p) {
  // host_starts holds one start for every row, or one per row; the checks
  // have validated each.
  const bool per_row = p.starts.data != nullptr && p.starts.numel > 1;
  auto start_of = [&](int64_t b) { return p.host_starts[per_row ? b : 0]; };

  const int64_t slabs = p.batch * p.num_kv_heads;
  const int64_t slab_bytes = p.chunk * p.head_dim * p.elem;
  if (slabs > 0 && slab_bytes > 0) {
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int which = i >= slabs ? 1 : 0;
        const int64_t bh = i - which * slabs;
        const int64_t b = bh / p.num_kv_heads;
        copy_slab(p.dst[which], p.src[which], b, bh - b * p.num_kv_heads, start_of(b), p);
      }
    };
    const int64_t total = 2 * slabs * slab_bytes;
    if (p.chunk == 1 || total < kParallelBytes) {
      work(0, 2 * slabs);
    } else {
      const int64_t per_task = std::max<int64_t>(1, kGrainBytes / slab_bytes);
      const int64_t tasks = (2 * slabs + per_task - 1) / per_task;
      cpu::for_each_task(tasks, [&](int64_t t) {
        work(t * per_task, std::min(2 * slabs, (t + 1) * per_task));
      });
    }
  }
  // After the copy: for append_, lengths_out is the start tensor itself, but
  // the starts were copied to host_starts before anything was written.
  const int64_t n = p.lengths_out.numel;
  for (int64_t i = 0; i < n; ++i) {
    detail::write_row(p.lengths_out, i,
                      p.host_starts[n > 1 && per_row ? i : 0] + p.chunk);
  }
}

}  // namespace
}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(update_stub, cpu, &kvcache::update_cpu);
