// Byte-stride view of a 4-D (batch, heads, seq, head_dim) tensor, shared by
// the CPU and CUDA kernels. Byte strides let one kernel copy any dtype by
// element size; int64_t keeps offsets exact for caches over 2^31 elements.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvcache {
namespace detail {

template <typename Ptr>
struct StridedRows {
  Ptr data;
  int64_t stride_b;  // bytes between batch rows
  int64_t stride_h;  // bytes between heads
  int64_t stride_t;  // bytes between sequence positions
  int64_t stride_d;  // bytes between head_dim elements
};

using DstRows = StridedRows<char*>;
using SrcRows = StridedRows<const char*>;

inline DstRows dst_rows(at::Tensor& t) {
  const int64_t es = t.element_size();
  return {static_cast<char*>(t.mutable_data_ptr()), t.stride(0) * es,
          t.stride(1) * es, t.stride(2) * es, t.stride(3) * es};
}

inline SrcRows src_rows(const at::Tensor& t) {
  const int64_t es = t.element_size();
  return {static_cast<const char*>(t.const_data_ptr()), t.stride(0) * es,
          t.stride(1) * es, t.stride(2) * es, t.stride(3) * es};
}

}  // namespace detail
}  // namespace kvcache
