// Argument checks shared by every operator.
//
// Every check raises before anything is read or written: c10::ValueError
// (Python ValueError) or c10::TypeError (Python TypeError), naming the
// argument the user passed and what was expected.
//
// The checks run on real tensors (eager kernels) and on fake/meta tensors
// (the Python fake kernels call them through kvcache._C), so sizes are read
// as c10::SymInt: concrete ints in eager code, symbols while tracing. A
// condition on symbols is decided on their hints (a guard); one on
// data-dependent symbols is left to the kernel at run time (see holds()), so
// traced code raises exactly what eager code raises.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymBool.h>
#include <c10/core/SymInt.h>

#include <cstdint>
#include <optional>
#include <string>

#include "kvcache/export.h"
#include "quant.h"

namespace kvcache {
namespace detail {

// Python spelling of a dtype ("torch.float32"), as users write it.
std::string py_dtype(at::ScalarType t);

// True if `cond` holds. Concrete in eager code. While tracing: a condition
// on backed symbols guards on their hints (the answer eager code gives for
// this input); a data-dependent (unbacked) one is taken as true, with no
// deferred runtime assert: the kernel, which every traced program calls
// (custom ops are opaque to the compilers), checks the concrete value at
// run time and raises eager's exception. A deferred assert would raise
// "Runtime assertion failed for expression u0 <= 6" first instead.
bool holds(const c10::SymBool& cond);

// A SymInt as a plain integer for an error message (its hint while tracing).
int64_t shown(const c10::SymInt& v);

// t's shape as eager code prints it ("[2, 3, 4]"), also while tracing (a
// SymInt prints as its symbol, "[s0, 3, 4]", which eager code never says).
std::string shape_str(const at::Tensor& t);

// a.sizes() == b.sizes() (as symbols while tracing).
bool same_sizes(const at::Tensor& a, const at::Tensor& b);

// A defined, strided, non-nested, non-quantized tensor.
void check_dense(const at::Tensor& t, const char* name);

// check_dense, plus what a tensor the op writes to must satisfy: no lazy
// conjugate/negative bit (the write would land in a temporary), and no
// inference tensor outside inference mode (as PyTorch's in-place ops).
void check_writable(const at::Tensor& t, const char* name);

// check_writable, plus one element per entry: a per-row integer tensor
// (lengths) that is written in place, by an op or by the caller's copy_ of
// an op's result. An expand()ed view is refused also while tracing with
// symbolic sizes (where the byte-level overlap test cannot decide).
void check_written_rows(const at::Tensor& t, const char* name);

// `t` has `rank` dimensions, described as `dims` in the message.
void check_rank(const at::Tensor& t, int64_t rank, const char* name,
                const char* dims);

// `t` has the dtype `expected` (TypeError: no implicit casts).
void check_dtype(const at::Tensor& t, at::ScalarType expected,
                 const char* name, const char* what);

// `t` is on `device`.
void check_device(const at::Tensor& t, const at::Device& device,
                  const char* name, const char* what);

// `t` is an int32 or int64 tensor (TypeError naming it otherwise).
void check_int_dtype(const at::Tensor& t, const char* name);

// " at index b" for a per-row tensor, "" for a 0-D one: where a value
// check's message says which row failed.
std::string at_index(const at::Tensor& t, int64_t b);

// A per-row integer tensor (lengths, positions, kv_start, counts): int32 or
// int64, 0-D (one value for every row) or of shape (batch,), on `device`.
void check_row_ints(const at::Tensor& t, const char* name,
                    const c10::SymInt& batch, const at::Device& device);

// Reads row b's value of a CPU per-row integer tensor (0-D: every row reads
// element 0). Callers have checked it with check_row_ints.
int64_t row_value(const at::Tensor& t, int64_t b);

// The checks every cache pair (keys, values: the buffers an operator
// writes) must pass: writable, 4-D (batch, num_kv_heads, max_len, head_dim),
// same shape, dtype and device, max_len <= kMaxLen, and no byte shared by
// two elements or by keys and values.
void check_cache(const at::Tensor& keys, const at::Tensor& values);

// The quantized format of a cache dtype: int8 and float8_e4m3fn are the
// quantized caches (core/quant.h); any other dtype is kPlain.
KVCACHE_API KvFormat format_of(at::ScalarType t);

// The source dtype of a quantized write's new keys and values (float32,
// bfloat16 or float16, checked by the caller).
KVCACHE_API FloatDtype float_dtype_of(at::ScalarType t);

// float32, bfloat16 or float16: the dtypes of queries, of the caches and
// pages attend reads without scales, and of a quantized write's source.
KVCACHE_API bool is_float_dtype(at::ScalarType t);

// A quantized cache's scale tensor (k_scale / v_scale): dense float32
// (batch, num_kv_heads, max_len) matching `keys`, on its device.
void check_scale_tensor(const at::Tensor& t, const char* name,
                        const at::Tensor& keys);

// The largest cache capacity: lengths are int32.
constexpr int64_t kMaxLen = INT32_MAX;

}  // namespace detail
}  // namespace kvcache
