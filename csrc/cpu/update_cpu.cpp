// CPU kernels for kvcache::update_ and kvcache::update_at_.
//
// Both buffers are written in one parallel pass over (buffer, batch, head)
// slabs. A slab whose (seq, head_dim) block is contiguous in source and
// destination is one memcpy; a contiguous head_dim row is one memcpy; any
// other layout is copied element by element, by element size, so every dtype
// (float8, bool, complex, ...) takes the same path without a dtype switch.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "../strided_rows.h"
#include "../validate.h"

namespace kvcache {
namespace {

using detail::DstRows;
using detail::SrcRows;
using detail::UpdateGeometry;

// Below this many bytes per task, threads cost more than they save; a
// single-token decode update always runs inline on the calling thread.
constexpr int64_t kGrainBytes = 64 * 1024;

template <int64_t kSize>
void copy_elements(char* dst, int64_t dst_stride, const char* src,
                   int64_t src_stride, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(dst + i * dst_stride, src + i * src_stride, kSize);
  }
}

void copy_strided_row(char* dst, int64_t dst_stride, const char* src,
                      int64_t src_stride, int64_t n, int64_t elem) {
  switch (elem) {
    case 1: return copy_elements<1>(dst, dst_stride, src, src_stride, n);
    case 2: return copy_elements<2>(dst, dst_stride, src, src_stride, n);
    case 4: return copy_elements<4>(dst, dst_stride, src, src_stride, n);
    case 8: return copy_elements<8>(dst, dst_stride, src, src_stride, n);
    case 16: return copy_elements<16>(dst, dst_stride, src, src_stride, n);
    default:
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(dst + i * dst_stride, src + i * src_stride, elem);
      }
  }
}

// Copies one (chunk, head_dim) slab.
void copy_slab(const DstRows& d, const SrcRows& s, int64_t b, int64_t h,
               int64_t start, const UpdateGeometry& g, int64_t elem) {
  char* dst = d.data + b * d.stride_b + h * d.stride_h + start * d.stride_t;
  const char* src = s.data + b * s.stride_b + h * s.stride_h;
  const int64_t row_bytes = g.head_dim * elem;
  const bool rows_dense = d.stride_d == elem && s.stride_d == elem;
  if (rows_dense && d.stride_t == row_bytes && s.stride_t == row_bytes) {
    std::memcpy(dst, src, g.chunk * row_bytes);
  } else if (rows_dense) {
    for (int64_t t = 0; t < g.chunk; ++t) {
      std::memcpy(dst + t * d.stride_t, src + t * s.stride_t, row_bytes);
    }
  } else {
    for (int64_t t = 0; t < g.chunk; ++t) {
      copy_strided_row(dst + t * d.stride_t, d.stride_d, src + t * s.stride_t,
                       s.stride_d, g.head_dim, elem);
    }
  }
}

// `start_of(b)` gives the already-validated start of batch row b.
template <typename StartFn>
void write_both(at::Tensor& keys, at::Tensor& values,
                const at::Tensor& keys_new, const at::Tensor& values_new,
                const UpdateGeometry& g, StartFn start_of) {
  if (g.batch == 0 || g.heads == 0 || g.chunk == 0 || g.head_dim == 0) {
    return;
  }
  const int64_t elem = keys.element_size();
  const DstRows dst[2] = {detail::dst_rows(keys), detail::dst_rows(values)};
  const SrcRows src[2] = {detail::src_rows(keys_new),
                          detail::src_rows(values_new)};
  const int64_t slabs_per_buffer = g.batch * g.heads;
  const int64_t slab_bytes = g.chunk * g.head_dim * elem;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / slab_bytes);
  at::parallel_for(0, 2 * slabs_per_buffer, grain,
                   [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i) {
                       const int64_t which = i / slabs_per_buffer;
                       const int64_t bh = i % slabs_per_buffer;
                       const int64_t b = bh / g.heads;
                       const int64_t h = bh % g.heads;
                       copy_slab(dst[which], src[which], b, h, start_of(b), g,
                                 elem);
                     }
                   });
}

at::Tensor update_cpu(at::Tensor& keys, at::Tensor& values,
                      const at::Tensor& keys_new, const at::Tensor& values_new,
                      int64_t start) {
  const auto g =
      detail::check_update_tensors(keys, values, keys_new, values_new);
  detail::check_start(start, g);
  at::Tensor length = at::empty({}, keys.options().dtype(at::kInt));
  *length.mutable_data_ptr<int32_t>() = static_cast<int32_t>(start + g.chunk);
  write_both(keys, values, keys_new, values_new, g,
             [start](int64_t) { return start; });
  return length;
}

at::Tensor update_at_cpu(at::Tensor& keys, at::Tensor& values,
                         const at::Tensor& keys_new,
                         const at::Tensor& values_new,
                         const at::Tensor& positions) {
  const auto g =
      detail::check_update_tensors(keys, values, keys_new, values_new);
  detail::check_positions_meta(positions, keys, g);
  const auto pos = detail::read_positions_cpu(positions, g);
  at::Tensor length =
      at::empty(positions.sizes(), keys.options().dtype(at::kInt));
  int32_t* out = length.mutable_data_ptr<int32_t>();
  for (size_t i = 0; i < pos.size(); ++i) {
    out[i] = static_cast<int32_t>(pos[i] + g.chunk);
  }
  const bool shared = positions.dim() == 0;  // one start for every row
  write_both(keys, values, keys_new, values_new, g,
             [&pos, shared](int64_t b) { return shared ? pos[0] : pos[b]; });
  return length;
}

}  // namespace
}  // namespace kvcache

TORCH_LIBRARY_IMPL(kvcache, CPU, m) {
  m.impl("update_", &kvcache::update_cpu);
  m.impl("update_at_", &kvcache::update_at_cpu);
}

// Sparse and quantized tensors are not supported; registering the same
// kernels for their dispatch keys makes validation reject them with a
// ValueError/TypeError naming the argument, instead of the dispatcher's
// generic "could not run ... with arguments from the 'SparseCPU' backend".
TORCH_LIBRARY_IMPL(kvcache, SparseCPU, m) {
  m.impl("update_", &kvcache::update_cpu);
  m.impl("update_at_", &kvcache::update_at_cpu);
}
TORCH_LIBRARY_IMPL(kvcache, SparseCsrCPU, m) {
  m.impl("update_", &kvcache::update_cpu);
  m.impl("update_at_", &kvcache::update_at_cpu);
}
TORCH_LIBRARY_IMPL(kvcache, QuantizedCPU, m) {
  m.impl("update_", &kvcache::update_cpu);
  m.impl("update_at_", &kvcache::update_at_cpu);
}
