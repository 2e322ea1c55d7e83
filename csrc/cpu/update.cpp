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
// single-token decode step never does, whatever its size: a decode step's
// copy takes microseconds, less than waking a helper, and on a busy machine
// a helper that waits for a core would stretch it to a scheduler slice. The
// helpers come from helpers.h, not an OpenMP region (whose caller waits for
// every worker to start, see there). Below the threshold one thread copies
// at memory speed for less than a helper's wake-up saves; above it the
// second thread's bandwidth pays. Re-tune it on a machine with
// `python benchmarks/bench_update.py --cases prefill --threads 1 2` (the
// chunk at which 2 threads start to beat 1) and build with
// -DKVCACHE_PARALLEL_BYTES=<bytes>.
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
