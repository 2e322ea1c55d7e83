// CPU work of paged_write_ (see csrc/ops/paged.h): token t's (num_kv_heads,
// head_dim) keys and values go to slot slot_mapping[t] of the pages, -1
// skipped. A plain page takes one copy_block per token and buffer (its heads
// are rows); a quantized one is quantized head by head with
// cpu::quantize_slab (the quantizer of every other quantized write), the
// scales beside it. The checks (every slot in range, none twice) ran before
// anything is written, so tokens are independent and split over threads
// when the write is large.
#include <algorithm>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../core/params.h"
#include "../ops/paged.h"
#include "copy_block.h"
#include "helpers.h"
#include "quantize_slab.h"

namespace kvcache {
namespace {

using detail::KvFormat;
using detail::PagedWriteParams;

// Bytes a write must move before it is split over threads, and per task.
constexpr int64_t kParallelBytes = int64_t(1) << 20;
constexpr int64_t kGrainBytes = int64_t(256) << 10;

template <typename T, KvFormat F>
void quantize_token(const PagedWriteParams& p, int which, int64_t t, int64_t slot,
                    float* row) {
  const char* src = which == 0 ? p.k_src : p.v_src;
  const int64_t* ss = which == 0 ? p.k_src_stride : p.v_src_stride;
  char* pages = which == 0 ? p.k_pages : p.v_pages;
  const int64_t* ps = which == 0 ? p.k_page_stride : p.v_page_stride;
  float* scale = which == 0 ? p.k_scale : p.v_scale;
  const int64_t* cs = which == 0 ? p.ks_stride : p.vs_stride;
  const int64_t page = slot / p.block_size, off = slot % p.block_size;
  // The heads of one slot as `num_kv_heads` slots of quantize_slab.
  cpu::quantize_slab<T, F>(src + t * ss[0], ss[1], ss[2],
                           pages + page * ps[0] + off * ps[1], ps[2], ps[3],
                           scale + page * cs[0] + off * cs[1], cs[2], p.num_kv_heads,
                           p.head_dim, row);
}

template <typename T>
void quantize_token_as(const PagedWriteParams& p, int which, int64_t t, int64_t slot,
                       float* row) {
  if (p.format == KvFormat::kInt8) {
    quantize_token<T, KvFormat::kInt8>(p, which, t, slot, row);
  } else {
    quantize_token<T, KvFormat::kFp8>(p, which, t, slot, row);
  }
}

void write_token(const PagedWriteParams& p, int64_t t, std::vector<float>& row) {
  const int64_t slot = detail::read_row(p.slots, t);
  if (slot < 0) return;
  if (p.format == KvFormat::kPlain) {
    const int64_t page = slot / p.block_size, off = slot % p.block_size;
    for (int which = 0; which < 2; ++which) {
      const char* src = which == 0 ? p.k_src : p.v_src;
      const int64_t* ss = which == 0 ? p.k_src_stride : p.v_src_stride;
      char* pages = which == 0 ? p.k_pages : p.v_pages;
      const int64_t* ps = which == 0 ? p.k_page_stride : p.v_page_stride;
      cpu::copy_block(pages + page * ps[0] + off * ps[1], ps[2], ps[3], src + t * ss[0], ss[1],
                      ss[2], p.num_kv_heads, p.head_dim, p.elem_size);
    }
    return;
  }
  row.resize(static_cast<size_t>(p.head_dim));
  for (int which = 0; which < 2; ++which) {
    switch (p.src_dtype) {
      case at::kBFloat16: quantize_token_as<c10::BFloat16>(p, which, t, slot, row.data()); break;
      case at::kHalf: quantize_token_as<c10::Half>(p, which, t, slot, row.data()); break;
      default: quantize_token_as<float>(p, which, t, slot, row.data()); break;
    }
  }
}

void paged_write_cpu(const PagedWriteParams& p) {
  const int64_t token_bytes = 2 * p.num_kv_heads * p.head_dim * p.elem_size;
  const int64_t total = p.num_tokens * token_bytes;
  if (total < kParallelBytes) {
    std::vector<float> row;
    for (int64_t t = 0; t < p.num_tokens; ++t) write_token(p, t, row);
    return;
  }
  const int64_t per_task = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, token_bytes));
  const int64_t tasks = (p.num_tokens + per_task - 1) / per_task;
  cpu::for_each_task(tasks, [&](int64_t i) {
    std::vector<float> row;
    for (int64_t t = i * per_task; t < std::min(p.num_tokens, (i + 1) * per_task); ++t) {
      write_token(p, t, row);
    }
  });
}

}  // namespace
}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(paged_write_stub, cpu, &kvcache::paged_write_cpu);
