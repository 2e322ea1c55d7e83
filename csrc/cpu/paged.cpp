// CPU work of paged_write_ (see csrc/ops/paged.h): token t's (num_kv_heads,
// head_dim) keys and values go to slot slot_mapping[t] of the pages, -1
// skipped. The slot mapping is read once into runs (neighbouring tokens
// mapped to neighbouring slots of one page join one run), which the
// slot-mapped write shared with the ring write (slot_write.h) copies, or
// quantizes head by head with their scales beside them. The checks (every
// slot in range, none twice) ran before anything is written, so runs are
// independent and split over threads when the write is large.
#include <vector>

#include "../core/params.h"
#include "../ops/paged.h"
#include "slot_write.h"

namespace kvcache {
namespace {

using detail::KvFormat;
using detail::PagedWriteParams;

void paged_write_cpu(const PagedWriteParams& p) {
  cpu::SlotWrite w;
  // A run's tokens step along dim 0 of the new data and along the slots of
  // a page (dim 1 of the pages); heads along dim 1 / dim 2.
  const int64_t* ss[2] = {p.k_src_stride, p.v_src_stride};
  const int64_t* ps[2] = {p.k_page_stride, p.v_page_stride};
  const int64_t* cs[2] = {p.ks_stride, p.vs_stride};
  const bool quantized = p.format != KvFormat::kPlain;
  for (int b = 0; b < 2; ++b) {
    w.src_token[b] = ss[b][0];
    w.src_head[b] = ss[b][1];
    w.src_elem[b] = ss[b][2];
    w.dst_token[b] = ps[b][1];
    w.dst_head[b] = ps[b][2];
    w.dst_elem[b] = ps[b][3];
    if (quantized) {
      w.scale_token[b] = cs[b][1];
      w.scale_head[b] = cs[b][2];
    }
  }
  w.heads = p.num_kv_heads;
  w.head_dim = p.head_dim;
  w.format = p.format;
  if (quantized) {
    // The source's element size (the pages hold one byte).
    w.elem = p.src_dtype == detail::FloatDtype::kFloat32 ? 4 : 2;
    w.source = p.src_dtype;
  } else {
    w.elem = p.elem_size;
  }

  const char* src[2] = {p.k_src, p.v_src};
  char* pages[2] = {p.k_pages, p.v_pages};
  float* scales[2] = {p.k_scale, p.v_scale};
  std::vector<cpu::SlotRun> runs;
  int64_t last = -2;  // the slot of the previous token (-2: none)
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = detail::read_row(p.slots, t);
    if (slot < 0) {
      last = -2;
      continue;
    }
    const int64_t page = slot / p.block_size, off = slot % p.block_size;
    if (!runs.empty() && slot == last + 1 && off != 0) {
      // The next slot of the same page: the previous token's run grows.
      ++runs.back().n;
    } else {
      cpu::SlotRun run;
      for (int b = 0; b < 2; ++b) {
        run.src[b] = src[b] + t * ss[b][0];
        run.dst[b] = pages[b] + page * ps[b][0] + off * ps[b][1];
        if (quantized) run.scale[b] = scales[b] + page * cs[b][0] + off * cs[b][1];
      }
      run.n = 1;
      runs.push_back(run);
    }
    last = slot;
  }
  cpu::write_slot_runs(w, std::move(runs));
}

}  // namespace
}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(paged_write_stub, cpu, &kvcache::paged_write_cpu);
