// CPU work of the quantized format of update_, update_.Tensor, append_ and
// append_returning_ (k_scale / v_scale given; see csrc/ops/update.h; formats
// in csrc/core/quant.h).
//
// One pass over (buffer, batch, head) slabs, each quantized by
// cpu::quantize_slab (quantize_slab.h, shared with the quantized ring
// write). The same thresholds as the plain write decide when helper threads
// join (a decode step never does).
#include <algorithm>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../core/quant.h"
#include "../ops/update.h"
#include "helpers.h"
#include "quantize_slab.h"

namespace kvcache {
namespace {

using detail::FloatDtype;
using detail::KvFormat;
using detail::QuantUpdateParams;

constexpr int64_t kParallelBytes = int64_t{8} << 20;  // as csrc/cpu/update.cpp
constexpr int64_t kGrainBytes = int64_t{256} << 10;

template <typename T, KvFormat F>
void quant_update_typed(const QuantUpdateParams& q) {
  const detail::UpdateParams& p = q.base;
  const bool per_row = p.starts.data != nullptr && p.starts.numel > 1;
  auto start_of = [&](int64_t b) { return p.host_starts[per_row ? b : 0]; };

  const int64_t slabs = p.batch * p.num_kv_heads;
  const int64_t slab_bytes = p.chunk * p.head_dim * p.elem;
  if (slabs > 0 && p.chunk > 0 && p.head_dim > 0) {
    auto work = [&](int64_t begin, int64_t end) {
      std::vector<float> row(static_cast<size_t>(p.head_dim));
      for (int64_t i = begin; i < end; ++i) {
        const int which = i >= slabs ? 1 : 0;
        const int64_t bh = i - which * slabs;
        const int64_t b = bh / p.num_kv_heads;
        const int64_t h = bh - b * p.num_kv_heads;
        const int64_t start = start_of(b);
        const auto& d = p.dst[which];
        const auto& s = p.src[which];
        const int64_t* ss = q.scale_stride[which];
        cpu::quantize_slab<T, F>(
            s.data + b * s.stride[0] + h * s.stride[1], s.stride[2], s.stride[3],
            d.data + b * d.stride[0] + h * d.stride[1] + start * d.stride[2],
            d.stride[2], d.stride[3],
            q.scale[which] + b * ss[0] + h * ss[1] + start * ss[2], ss[2],
            p.chunk, p.head_dim, row.data());
      }
    };
    const int64_t total = 2 * slabs * slab_bytes;
    if (p.chunk == 1 || total < kParallelBytes) {
      work(0, 2 * slabs);
    } else {
      const int64_t per_task = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, slab_bytes));
      const int64_t tasks = (2 * slabs + per_task - 1) / per_task;
      cpu::for_each_task(tasks, [&](int64_t t) {
        work(t * per_task, std::min(2 * slabs, (t + 1) * per_task));
      });
    }
  }
  // After the write: for append_, lengths_out is the start tensor
  // itself, whose values were copied to host_starts by the checks.
  const int64_t n = p.lengths_out.numel;
  for (int64_t i = 0; i < n; ++i) {
    detail::write_row(p.lengths_out, i,
                      p.host_starts[n > 1 && per_row ? i : 0] + p.chunk);
  }
}

template <KvFormat F>
void quant_update_format(const QuantUpdateParams& q) {
  switch (q.src_dtype) {
    case FloatDtype::kFloat32: return quant_update_typed<float, F>(q);
    case FloatDtype::kBFloat16: return quant_update_typed<c10::BFloat16, F>(q);
    case FloatDtype::kFloat16: return quant_update_typed<c10::Half, F>(q);
  }
}

void quant_update_cpu(const QuantUpdateParams& q) {
  if (q.format == KvFormat::kInt8) {
    quant_update_format<KvFormat::kInt8>(q);
  } else {
    quant_update_format<KvFormat::kFp8>(q);
  }
}

}  // namespace
}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(quant_update_stub, cpu, &kvcache::quant_update_cpu);
