// Copies one (rows, head_dim) block between byte-strided tensors, for any
// element size: one memcpy when both blocks are contiguous, one per row when
// rows are, element by element otherwise. Callers guarantee that source and
// destination do not overlap (the operators' checks), so memcpy is defined.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvcache {
namespace cpu {

template <int64_t kSize>
inline void copy_elements(char* dst, int64_t dst_stride, const char* src,
                          int64_t src_stride, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(dst + i * dst_stride, src + i * src_stride, kSize);
  }
}

inline void copy_strided_row(char* dst, int64_t dst_stride, const char* src,
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

// dst_row/src_row: byte step between rows; dst_elem/src_elem: between the
// elements of a row.
inline void copy_block(char* dst, int64_t dst_row, int64_t dst_elem,
                       const char* src, int64_t src_row, int64_t src_elem,
                       int64_t rows, int64_t head_dim, int64_t elem) {
  if (rows <= 0 || head_dim <= 0) return;
  const int64_t row_bytes = head_dim * elem;
  const bool rows_dense = dst_elem == elem && src_elem == elem;
  if (rows_dense && (rows == 1 || (dst_row == row_bytes && src_row == row_bytes))) {
    std::memcpy(dst, src, rows * row_bytes);
  } else if (rows_dense) {
    for (int64_t t = 0; t < rows; ++t) {
      std::memcpy(dst + t * dst_row, src + t * src_row, row_bytes);
    }
  } else {
    for (int64_t t = 0; t < rows; ++t) {
      copy_strided_row(dst + t * dst_row, dst_elem, src + t * src_row, src_elem,
                       head_dim, elem);
    }
  }
}

}  // namespace cpu
}  // namespace kvcache
