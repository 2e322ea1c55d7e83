// CPU work of update_, update_.Tensor and append_ (see csrc/ops/update.h).
//
// Both buffers are written in one pass over (buffer, batch, head) slabs of
// (chunk, head_dim), each copied by copy_block (by element size: every dtype
// takes the same path).
#include <ATen/Parallel.h>

#include <algorithm>

#include "../ops/update.h"
#include "copy_block.h"

namespace kvcache {
namespace {

using detail::DstRows;
using detail::SrcRows;
using detail::UpdateParams;

// An OpenMP region costs microseconds on an idle machine and milliseconds
// when the other cores are busy: the worker waits for a scheduler slice.
// Measured on the 2-core CI machine (shared, load ~7; update_ fp32, batch 4,
// 8 heads, head_dim 128, a build with KVCACHE_PARALLEL_BYTES=0, medians of
// 5 rounds, 1 vs 2 threads): up to 1 MiB at::parallel_for stays inline (the
// grain below); from 2 MiB to 128 MiB the 2-thread copy was 1.4-78x SLOWER
// (a region cost 4-20 ms: 2 MiB took 20 ms instead of 0.26 ms; 32 MiB 8 ms
// instead of 4 ms; 128 MiB 24 ms instead of 17.6 ms); at 256 MiB it was 2.5x
// faster (40 ms vs 99 ms). With a spinning process on the other core the
// picture is the same. Only rounds where the other core happened to be free
// showed a 2x gain from 2 MiB on. So the copy runs on the calling thread
// below 256 MiB in all (a prefill that large amortizes a lost slice), and a
// single-token decode step never goes parallel, whatever its size. At one
// thread at::parallel_for runs inline: no threshold matters.
// KVCACHE_PARALLEL_BYTES overrides it at build time, only to measure the
// crossover (a build with 0 goes parallel from the first grain).
#ifdef KVCACHE_PARALLEL_BYTES
constexpr int64_t kParallelBytes = KVCACHE_PARALLEL_BYTES;
#else
constexpr int64_t kParallelBytes = int64_t{256} << 20;
#endif
// Bytes per task once parallel.
constexpr int64_t kGrainBytes = int64_t{1} << 20;

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

  const int64_t slabs = p.batch * p.heads;
  const int64_t slab_bytes = p.chunk * p.head_dim * p.elem;
  if (slabs > 0 && slab_bytes > 0) {
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int which = i >= slabs ? 1 : 0;
        const int64_t bh = i - which * slabs;
        const int64_t b = bh / p.heads;
        copy_slab(p.dst[which], p.src[which], b, bh - b * p.heads, start_of(b), p);
      }
    };
    const int64_t total = 2 * slabs * slab_bytes;
    if (p.chunk == 1 || total < kParallelBytes) {
      work(0, 2 * slabs);
    } else {
      at::parallel_for(0, 2 * slabs,
                       std::max<int64_t>(1, kGrainBytes / slab_bytes), work);
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
