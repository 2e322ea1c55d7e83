// Operators on whole rows of a cache: rollback (the lengths after dropping
// the last n[b] tokens of each row), select_rows_ (row b takes the
// contents of row index[b]: beam reorder, forking, compaction, in place, the
// buffers keeping their addresses) and reset_rows (the lengths with some
// rows emptied).
//
// All three return new lengths instead of writing the caller's: the Python API
// copies them into the cache's length tensor. Under torch.compile that
// copy_ is functionalized, while an in-place custom op on a graph-input
// length tensor is exposed to an Inductor bug (torch 2.13): a pointwise read
// of the tensor made before the op can be re-inlined after it and see the
// new value (see docs/design.md).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "../core/device_stub.h"
#include "kvcache/export.h"
#include "../core/params.h"

namespace kvcache {
namespace detail {

struct RollbackParams {
  IntRows lengths;   // read
  IntRows n;
  IntRows kv_start;  // absent: 0
  IntRows out;       // lengths - n (lengths' dtype and shape), or -1 (CUDA)
  // Entries of lengths. With a 0-D lengths a (k,) kv_start is broadcast: the
  // one length is checked against each of its k entries (as attend does);
  // k >= 1 (check_rollback refuses an empty one: nothing to check against).
  int64_t rows = 0;
  const int64_t* host_new_lengths = nullptr;  // CPU: checked results
  // The tensors' device index (CUDA: the device the kernels run on).
  int device_index = -1;
};
using RollbackFn = void (*)(const RollbackParams&);
extern DeviceStub<RollbackFn> rollback_stub;

struct SelectRowsParams {
  DstRows buf[2];  // keys, values (read and written)
  int64_t batch = 0;
  int64_t num_kv_heads = 0;
  int64_t max_len = 0;
  int64_t head_dim = 0;
  int64_t elem = 0;
  IntRows lengths;  // read
  IntRows index;    // (batch,)
  IntRows out;      // lengths[index[b]] (lengths' dtype and shape), or -1 (CUDA)
  // CPU: the checked values (one length per row).
  const int64_t* host_lengths = nullptr;
  const int64_t* host_index = nullptr;
  // The tensors' device index (CUDA: the device the kernels run on).
  int device_index = -1;
};
using SelectRowsFn = void (*)(const SelectRowsParams&);
extern DeviceStub<SelectRowsFn> select_rows_stub;

struct ResetRowsParams {
  IntRows lengths;  // read, (batch,)
  // Either a (batch,) bool mask (1 byte per entry, `mask_stride` apart) ...
  const bool* mask = nullptr;
  int64_t mask_stride = 0;
  // ... or row indices (0-D or (k,)), each in [0, batch).
  IntRows index;
  IntRows out;  // lengths with the selected rows 0, or -1 everywhere (CUDA)
  int64_t batch = 0;
  const int64_t* host_new_lengths = nullptr;  // CPU: checked results
  // The tensors' device index (CUDA: the device the kernels run on).
  int device_index = -1;
};
using ResetRowsFn = void (*)(const ResetRowsParams&);
extern DeviceStub<ResetRowsFn> reset_rows_stub;

// Checks (shared with the fake kernels). Return the checked values when
// they can be read here (CPU tensors outside tracing), else empty.
KVCACHE_API std::vector<int64_t> check_rollback(const at::Tensor& lengths,
                                    const at::Tensor& n,
                                    const std::optional<at::Tensor>& kv_start,
                                    bool values_known);
struct SelectRowsValues {
  std::vector<int64_t> lengths;
  std::vector<int64_t> index;
};
KVCACHE_API SelectRowsValues check_select_rows(const at::Tensor& keys,
                                   const at::Tensor& values,
                                   const at::Tensor& lengths,
                                   const at::Tensor& index, bool values_known);
// What a caller's in-place write of new lengths needs (check_written_rows).
KVCACHE_API void check_lengths_writable(const at::Tensor& lengths);
KVCACHE_API std::vector<int64_t> check_reset_rows(const at::Tensor& lengths,
                                                  const at::Tensor& rows,
                                                  bool values_known);


// The checks with each schema's arguments, as a fake kernel runs them.
inline void trace_check_rollback(const at::Tensor& lengths, const at::Tensor& n,
                                 const std::optional<at::Tensor>& kv_start) {
  check_rollback(lengths, n, kv_start, false);
}
inline void trace_check_reset_rows(const at::Tensor& lengths,
                                   const at::Tensor& rows) {
  check_reset_rows(lengths, rows, false);
}
inline void trace_check_check_lengths_writable(const at::Tensor& lengths) {
  check_lengths_writable(lengths);
}
inline void trace_check_select_rows_(const at::Tensor& keys,
                                     const at::Tensor& values,
                                     const at::Tensor& lengths,
                                     const at::Tensor& index) {
  check_select_rows(keys, values, lengths, index, false);
}

}  // namespace detail

// Operator entry points (registered in csrc/schema.cpp).
namespace ops {

at::Tensor rollback(const at::Tensor& lengths, const at::Tensor& n,
                    const std::optional<at::Tensor>& kv_start);
at::Tensor select_rows_(at::Tensor& keys, at::Tensor& values,
                        const at::Tensor& lengths, const at::Tensor& index);
at::Tensor reset_rows(const at::Tensor& lengths, const at::Tensor& rows);
void check_lengths_writable(const at::Tensor& lengths);

}  // namespace ops
}  // namespace kvcache
