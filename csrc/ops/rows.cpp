#include "rows.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <string>

#include "../core/checks.h"
#include "../core/rules.h"
#include "../core/overlap.h"
#include "../core/tensor_params.h"

namespace kvcache {
namespace detail {

DeviceStub<RollbackFn> rollback_stub;
DeviceStub<SelectRowsFn> select_rows_stub;
DeviceStub<ResetRowsFn> reset_rows_stub;

namespace {

// A per-row integer tensor shaped like `lengths` (0-D, or the same (rows,)).
void check_like_lengths(const at::Tensor& t, const char* name,
                        const at::Tensor& lengths) {
  check_dense(t, name);
  check_int_dtype(t, name);
  TORCH_CHECK_VALUE(
      t.dim() == 0 || (lengths.dim() == 1 && t.dim() == 1 &&
                       holds(t.sym_size(0).sym_eq(lengths.sym_size(0)))),
      name, " must be a 0-D tensor or have the shape of lengths ",
      shape_str(lengths), ", got shape ", shape_str(t));
  check_device(t, lengths.device(), name, "the device of lengths");
}

void check_lengths_tensor(const at::Tensor& lengths) {
  check_dense(lengths, "lengths");
  check_int_dtype(lengths, "lengths");
  TORCH_CHECK_VALUE(lengths.dim() <= 1,
                    "lengths must be a 0-D tensor or have shape (batch,), got "
                    "shape ",
                    shape_str(lengths));
}

}  // namespace

std::vector<int64_t> check_rollback(const at::Tensor& lengths,
                                    const at::Tensor& n,
                                    const std::optional<at::Tensor>& kv_start,
                                    bool values_known) {
  check_lengths_tensor(lengths);
  check_like_lengths(n, "n", lengths);
  if (kv_start.has_value()) {
    if (lengths.dim() == 0) {
      // One length shared by every row and a first slot per row: each row
      // is checked against the shared length (attend takes the same pair).
      // The result keeps lengths' shape: n stays 0-D or lengths' shape.
      check_dense(*kv_start, "kv_start");
      check_int_dtype(*kv_start, "kv_start");
      TORCH_CHECK_VALUE(kv_start->dim() <= 1,
                        "kv_start must be a 0-D tensor or have shape (batch,), "
                        "got shape ",
                        shape_str(*kv_start));
      // At least one row: the rows checked are kv_start's entries, and an
      // empty kv_start would leave the shared length unchecked (the CPU
      // returned 0, the CUDA kernel read one entry past it). Refused here,
      // for every device and while tracing, before any kernel runs.
      TORCH_CHECK_VALUE(kv_start->dim() == 0 || holds(kv_start->sym_size(0).sym_ge(1)),
                        "kv_start must be a 0-D tensor or have shape (batch,) "
                        "with batch >= 1 (a 0-D lengths is checked against "
                        "each row's kv_start), got shape ",
                        shape_str(*kv_start));
      check_device(*kv_start, lengths.device(), "kv_start",
                   "the device of lengths");
    } else {
      check_like_lengths(*kv_start, "kv_start", lengths);
    }
  }
  std::vector<int64_t> out;
  if (!values_known || !lengths.device().is_cpu()) {
    return out;
  }
  // A (k,) kv_start with a 0-D lengths: k rows to check, one result.
  const at::Tensor& shaped =
      lengths.dim() == 0 && kv_start.has_value() && kv_start->dim() == 1
          ? *kv_start
          : lengths;
  const int64_t rows = shaped.numel();
  out.resize(static_cast<size_t>(lengths.numel()));
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t len = row_value(lengths, b);
    const int64_t drop = row_value(n, b);
    const int64_t first = kv_start.has_value() ? row_value(*kv_start, b) : 0;
    // The rule (core/rules.h, shared with the CUDA kernel); inside, the
    // message for the part of it that failed.
    if (!rollback_fits(len, first, drop)) {
      TORCH_CHECK_VALUE(len >= 0, "lengths must be >= 0, got ", len,
                        at_index(shaped, b));
      TORCH_CHECK_VALUE(first >= 0 && first <= len,
                        "kv_start must be in [0, lengths] = [0, ", len, "], got ",
                        first, at_index(shaped, b));
      TORCH_CHECK_VALUE(drop >= 0, "n must be >= 0, got ", drop,
                        at_index(shaped, b));
      // Never len - drop < first: compare without the subtraction of a drop
      // that may be near 2^63.
      TORCH_CHECK_VALUE(drop <= len - first,
                        "cannot roll back more tokens than the row holds: n=",
                        drop, " but lengths=", len, kv_start ? " - kv_start=" : "",
                        kv_start ? std::to_string(first) : std::string(),
                        " leaves ", len - first, at_index(shaped, b));
    }
    out[lengths.dim() == 0 ? 0 : b] = len - drop;
  }
  return out;
}

SelectRowsValues check_select_rows(const at::Tensor& keys,
                                   const at::Tensor& values,
                                   const at::Tensor& lengths,
                                   const at::Tensor& index, bool values_known) {
  check_cache(keys, values);
  const c10::SymInt batch = keys.sym_size(0);
  check_row_ints(lengths, "lengths", batch, keys.device());
  check_dense(index, "index");
  check_int_dtype(index, "index");
  TORCH_CHECK_VALUE(
      index.dim() == 1 && holds(index.sym_size(0).sym_eq(batch)),
      "index must have shape (batch=", shown(batch), ",), got shape ",
      shape_str(index));
  check_device(index, keys.device(), "index", "the cache's device");
  for (const auto& [t, name] :
       {std::pair<const at::Tensor&, const char*>{lengths, "lengths"},
        {index, "index"}}) {
    const Box b = box_of(t);
    TORCH_CHECK_VALUE(!overlaps(b, box_of(keys)) && !overlaps(b, box_of(values)),
                      name, " must not share memory with keys or values");
  }

  SelectRowsValues out;
  if (!values_known || !keys.device().is_cpu()) {
    return out;
  }
  const int64_t n = keys.size(0);
  const int64_t cap = keys.size(2);
  out.lengths.resize(static_cast<size_t>(n));
  out.index.resize(static_cast<size_t>(n));
  for (int64_t b = 0; b < n; ++b) {
    const int64_t len = row_value(lengths, b);
    TORCH_CHECK_VALUE(length_fits(len, cap), "lengths must be in [0, max_len=",
                      cap, "], got ", len, at_index(lengths, b));
    out.lengths[b] = len;
    const int64_t src = row_value(index, b);
    TORCH_CHECK_VALUE(row_index_fits(src, n), "index must be in [0, batch=", n,
                      "), got ", src, " at index ", b);
    out.index[b] = src;
  }
  return out;
}

void check_lengths_writable(const at::Tensor& lengths) {
  check_written_rows(lengths, "lengths");
}

std::vector<int64_t> check_reset_rows(const at::Tensor& lengths,
                                      const at::Tensor& rows,
                                      bool values_known) {
  check_lengths_tensor(lengths);
  TORCH_CHECK_VALUE(lengths.dim() == 1,
                    "reset_rows needs a per-row length of shape (batch,), got "
                    "a 0-D lengths (one length shared by every row cannot be "
                    "reset for some rows only): make it per-row with "
                    "length.expand(batch).clone() first");
  const c10::SymInt batch = lengths.sym_size(0);
  check_dense(rows, "rows");
  const auto dt = rows.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kBool || dt == at::kInt || dt == at::kLong,
                   "rows must be a bool mask or an int32 or int64 tensor of "
                   "row indices, got dtype ",
                   py_dtype(dt));
  if (dt == at::kBool) {
    // Exactly one entry per row: a shorter mask would broadcast (one entry
    // emptying every row) or be refused only half way.
    TORCH_CHECK_VALUE(rows.dim() == 1 && holds(rows.sym_size(0).sym_eq(batch)),
                      "rows (a bool mask) must have shape (batch=",
                      shown(batch), ",), got shape ", shape_str(rows));
  } else {
    TORCH_CHECK_VALUE(rows.dim() <= 1,
                      "rows (row indices) must be a 0-D or 1-D tensor, got "
                      "shape ",
                      shape_str(rows));
  }
  check_device(rows, lengths.device(), "rows", "the device of lengths");

  std::vector<int64_t> out;
  if (!values_known || !lengths.device().is_cpu()) {
    return out;
  }
  const int64_t n = lengths.size(0);
  out.resize(static_cast<size_t>(n));
  for (int64_t b = 0; b < n; ++b) out[b] = row_value(lengths, b);
  if (dt == at::kBool) {
    const bool* m = rows.const_data_ptr<bool>();
    for (int64_t b = 0; b < n; ++b) {
      if (m[b * rows.stride(0)]) out[b] = 0;
    }
    return out;
  }
  // Every index checked before the result is used: negative indices are
  // refused (no wrap-around), as select_rows_ refuses them.
  const int64_t k = rows.numel();
  for (int64_t i = 0; i < k; ++i) {
    const int64_t r = row_value(rows, i);
    TORCH_CHECK_VALUE(row_index_fits(r, n), "rows must be in [0, batch=", n,
                      "), got ", r, at_index(rows, i));
  }
  for (int64_t i = 0; i < k; ++i) out[row_value(rows, i)] = 0;
  return out;
}

}  // namespace detail

namespace ops {

at::Tensor rollback(const at::Tensor& lengths, const at::Tensor& n,
                    const std::optional<at::Tensor>& kv_start) {
  const auto next = detail::check_rollback(lengths, n, kv_start, true);
  at::Tensor out = at::empty(lengths.sizes(), lengths.options());
  detail::RollbackParams p;
  p.lengths = detail::int_rows(lengths);
  p.n = detail::int_rows(n);
  if (kv_start.has_value()) p.kv_start = detail::int_rows(*kv_start);
  p.out = detail::int_rows(out);
  p.rows = lengths.numel();
  p.host_new_lengths = next.empty() ? nullptr : next.data();
  p.device_index = lengths.device().index();
  detail::rollback_stub.get(lengths.device().type(), "rollback")(p);
  return out;
}

at::Tensor select_rows_(at::Tensor& keys, at::Tensor& values,
                        const at::Tensor& lengths, const at::Tensor& index) {
  const auto vals =
      detail::check_select_rows(keys, values, lengths, index, true);
  detail::SelectRowsParams p;
  p.buf[0] = detail::dst_rows(keys);
  p.buf[1] = detail::dst_rows(values);
  p.batch = keys.size(0);
  p.num_kv_heads = keys.size(1);
  p.max_len = keys.size(2);
  p.head_dim = keys.size(3);
  p.elem = static_cast<int64_t>(keys.element_size());
  p.lengths = detail::int_rows(lengths);
  p.index = detail::int_rows(index);
  at::Tensor out = at::empty(lengths.sizes(), lengths.options());
  p.out = detail::int_rows(out);
  p.host_lengths = vals.lengths.empty() ? nullptr : vals.lengths.data();
  p.host_index = vals.index.empty() ? nullptr : vals.index.data();
  p.device_index = keys.device().index();
  detail::select_rows_stub.get(keys.device().type(), "select_rows_")(p);
  return out;
}

void check_lengths_writable(const at::Tensor& lengths) {
  detail::check_lengths_writable(lengths);
}

at::Tensor reset_rows(const at::Tensor& lengths, const at::Tensor& rows) {
  const auto next = detail::check_reset_rows(lengths, rows, true);
  at::Tensor out = at::empty(lengths.sizes(), lengths.options());
  detail::ResetRowsParams p;
  p.lengths = detail::int_rows(lengths);
  if (rows.scalar_type() == at::kBool) {
    p.mask = rows.const_data_ptr<bool>();
    p.mask_stride = rows.stride(0);
  } else {
    p.index = detail::int_rows(rows);
  }
  p.out = detail::int_rows(out);
  p.batch = lengths.size(0);
  p.host_new_lengths = next.empty() ? nullptr : next.data();
  p.device_index = lengths.device().index();
  detail::reset_rows_stub.get(lengths.device().type(), "reset_rows")(p);
  return out;
}

}  // namespace ops
}  // namespace kvcache
