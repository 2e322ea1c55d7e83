// Exact memory-overlap tests on the bytes that strided tensors touch.
//
// at::get_overlap_status gives up ("too hard") on views that are not dense,
// which lets interleaved or transposed views that do overlap through. These
// tests decide overlap exactly on the bytes each tensor (or each written box
// of rows) covers:
//
//   1. different storages of fake/meta tensors, or disjoint byte bounds:
//      no overlap (the common case, O(1));
//   2. two boxes of the same shape and strides (keys and values of one fused
//      buffer, the rows of two batch entries): an exact lattice search over
//      index differences, O(dims);
//   3. otherwise, the contiguous runs of both are listed in address order
//      and swept, O(runs); past kMaxRuns runs the answer is "overlaps"
//      (conservative: such a layout is refused, never corrupted).
//
// Real tensors are compared by address; fake/meta tensors, which have no
// data, by storage and storage offset. A box whose geometry is symbolic
// (while tracing) is "unknown": the tests then answer "no overlap" and the
// eager kernel, which always knows, decides at run time.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace kvcache {
namespace detail {

constexpr int kMaxDims = 8;
constexpr int64_t kMaxRuns = int64_t{1} << 16;

// A strided box of elements: offset + sum(i_k * stride_k), 0 <= i_k < size_k,
// every element `elem` bytes wide. Strides and offset are in bytes.
struct Box {
  const void* storage = nullptr;  // nullptr: offset is an absolute address
  int64_t offset = 0;
  int64_t elem = 1;
  int ndim = 0;
  int64_t size[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};
  bool known = true;  // false: symbolic geometry, cannot be decided now
};

// The bytes of a whole tensor.
Box box_of(const at::Tensor& t);

// The bytes of t[..., start:start+len, ...] along `dim` (start, len known).
Box slice_box(Box b, int dim, int64_t start, int64_t len);

// Whether any byte of `a` is also a byte of `b`.
bool overlaps(const Box& a, const Box& b);

// Whether two different elements of `a` share a byte (expand()ed or
// as_strided views whose elements overlap).
bool self_overlaps(const Box& a);
bool self_overlaps(const at::Tensor& t);  // with a fast path for dense tensors

}  // namespace detail
}  // namespace kvcache
