// Row copies between byte-strided 4-D tensors, shared by the CUDA kernels
// of update_/append_ (csrc/cuda/update.cu) and select_rows_ (rows.cu).
//
// A "row" is one (batch, head, position) vector of head_dim elements. A
// copy moves rows in units of 16, 8, 4, 2 or 1 bytes: the widest unit that
// divides the element size (or, for rows that are contiguous on both
// sides, the row's byte size), both base pointers and every stride that is
// used (a dimension of size 1 is never stepped along, so its stride does
// not count). The unit is chosen per source/destination pair, so one
// strided or misaligned tensor never slows the copy of another pair, and
// no access is ever wider than its address is aligned: complex128 taken
// from a buffer at an 8-byte offset moves in 8-byte units.
//
// Within a row, unit u sits at byte (u >> shift) * group + (u & mask) * unit:
// rows contiguous on both sides use group = unit and shift = 0 (u * unit);
// otherwise a row is head_dim elements `group` bytes apart, each moved as
// 2^shift units. Shifts and masks only: no division per unit. Offsets are
// 64-bit throughout (caches over 2^31 elements are normal).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

#include "../core/params.h"

namespace kvcache {
namespace cuda {

// One side of a copy: its first byte and the byte steps along batch, head
// and position; `group` as above.
struct CopySide {
  char* data = nullptr;
  int64_t stride[3] = {};
  int64_t group = 0;
};

struct CopyPlan {
  CopySide dst;
  CopySide src;
  int unit = 1;       // bytes per access
  int shift = 0;      // log2(units per element); 0 for contiguous rows
  int64_t units = 0;  // units per row
};

// A tensor as the planner sees it: sizes and byte strides of (batch, head,
// position, element).
struct SideShape {
  const char* data;
  const int64_t* stride;  // 4 byte strides
  const int64_t* size;    // 4 sizes
};

inline bool side_allows(const SideShape& s, int64_t unit, bool with_elem_stride) {
  if (reinterpret_cast<uintptr_t>(s.data) % static_cast<uintptr_t>(unit) != 0) {
    return false;
  }
  const int dims = with_elem_stride ? 4 : 3;
  for (int k = 0; k < dims; ++k) {
    if (s.size[k] > 1 && s.stride[k] % unit != 0) return false;
  }
  return true;
}

inline int log2_exact(int64_t v) {
  int s = 0;
  while ((int64_t{1} << s) < v) ++s;
  return s;
}

// Plans the copy of head_dim-element rows from `src` to `dst` (same element
// size `elem`, a power of two up to 16: every torch dtype).
inline CopyPlan plan_copy(char* dst, const int64_t* dst_stride,
                          const int64_t* dst_size, const char* src,
                          const int64_t* src_stride, const int64_t* src_size,
                          int64_t head_dim, int64_t elem) {
  TORCH_INTERNAL_ASSERT(elem >= 1 && elem <= 16 && (elem & (elem - 1)) == 0,
                        "kvcache: unexpected element size ", elem);
  const SideShape d{dst, dst_stride, dst_size};
  const SideShape s{src, src_stride, src_size};
  // A row of one element is contiguous whatever its stride.
  const bool dense = (head_dim <= 1 || dst_stride[3] == elem) &&
                     (head_dim <= 1 || src_stride[3] == elem);
  CopyPlan p;
  for (int64_t c : {16, 8, 4, 2, 1}) {
    bool ok;
    if (dense) {
      ok = (head_dim * elem) % c == 0 && side_allows(d, c, false) &&
           side_allows(s, c, false);
    } else {
      ok = elem % c == 0 && side_allows(d, c, true) && side_allows(s, c, true);
    }
    if (ok) {
      p.unit = static_cast<int>(c);
      break;
    }
  }
  p.dst.data = dst;
  p.src.data = const_cast<char*>(src);
  for (int k = 0; k < 3; ++k) {
    p.dst.stride[k] = dst_stride[k];
    p.src.stride[k] = src_stride[k];
  }
  if (dense) {
    p.shift = 0;
    p.dst.group = p.src.group = p.unit;
    p.units = head_dim * elem / p.unit;
  } else {
    p.shift = log2_exact(elem / p.unit);
    p.dst.group = dst_stride[3];
    p.src.group = src_stride[3];
    p.units = head_dim << p.shift;
  }
  return p;
}

// Device code: nvcc, or the CUDA emulator of the host tests.
#if defined(__CUDACC__) || defined(KVCACHE_CUDA_EMULATOR)

// Copies rows [0, rows) of one (batch, head) slab: dst_row / src_row point
// at the slab's row 0. Threads: x along the units of a row, y along rows
// (with blockIdx.y tiling the rows). Source and destination never overlap
// (the operators' checks).
template <typename Unit>
__device__ __forceinline__ void copy_rows(char* dst_row, int64_t dst_step,
                                          int64_t dst_group,
                                          const char* src_row,
                                          int64_t src_step, int64_t src_group,
                                          int shift, int64_t units,
                                          int64_t rows) {
  const int64_t mask = (int64_t{1} << shift) - 1;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t t = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
       t < rows; t += row_step) {
    char* d = dst_row + t * dst_step;
    const char* s = src_row + t * src_step;
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
      const int64_t g = u >> shift;
      const int64_t w = (u & mask) * static_cast<int64_t>(sizeof(Unit));
      *reinterpret_cast<Unit*>(d + g * dst_group + w) =
          *reinterpret_cast<const Unit*>(s + g * src_group + w);
    }
  }
}

// copy_rows with the plan's unit (uniform across the block: no divergence).
__device__ __forceinline__ void copy_rows_planned(const CopyPlan& p,
                                                  char* dst_row,
                                                  const char* src_row,
                                                  int64_t rows) {
  switch (p.unit) {
    case 16:
      copy_rows<uint4>(dst_row, p.dst.stride[2], p.dst.group, src_row,
                       p.src.stride[2], p.src.group, p.shift, p.units, rows);
      break;
    case 8:
      copy_rows<uint2>(dst_row, p.dst.stride[2], p.dst.group, src_row,
                       p.src.stride[2], p.src.group, p.shift, p.units, rows);
      break;
    case 4:
      copy_rows<uint32_t>(dst_row, p.dst.stride[2], p.dst.group, src_row,
                          p.src.stride[2], p.src.group, p.shift, p.units, rows);
      break;
    case 2:
      copy_rows<uint16_t>(dst_row, p.dst.stride[2], p.dst.group, src_row,
                          p.src.stride[2], p.src.group, p.shift, p.units, rows);
      break;
    default:
      copy_rows<uint8_t>(dst_row, p.dst.stride[2], p.dst.group, src_row,
                         p.src.stride[2], p.src.group, p.shift, p.units, rows);
      break;
  }
}

#endif  // __CUDACC__ || KVCACHE_CUDA_EMULATOR

// Threads per block of the copy kernels, and their 2-D shape for a slab of
// `rows` rows of `units` units: x covers a row (a warp multiple, at most
// kCopyThreads), y the rows (never more than there are).
constexpr int kCopyThreads = 256;

struct CopyBlock {
  unsigned x = 32;
  unsigned y = 1;
};

inline CopyBlock copy_block_shape(int64_t units, int64_t rows) {
  CopyBlock b;
  const int64_t x = ((units + 31) / 32) * 32;
  b.x = static_cast<unsigned>(x < kCopyThreads ? (x < 32 ? 32 : x) : kCopyThreads);
  int64_t y = kCopyThreads / b.x;
  if (y > rows) y = rows;
  b.y = static_cast<unsigned>(y < 1 ? 1 : y);
  return b;
}

// Grid rows (blockIdx.y) covering `rows` rows of b.y threads each.
inline unsigned copy_grid_y(int64_t rows, const CopyBlock& b) {
  int64_t gy = (rows + b.y - 1) / b.y;
  if (gy > 65535) gy = 65535;
  return static_cast<unsigned>(gy < 1 ? 1 : gy);
}

}  // namespace cuda
}  // namespace kvcache
