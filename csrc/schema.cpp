// The kvcache operator library: every schema, and which kernel serves each
// dispatch key. The only TORCH_LIBRARY(kvcache) block: a process that sees
// two fails to load the second.
//
// Adding an operator touches: its schema here; csrc/ops/<op>.{h,cpp} (the
// checks, written once and also run by the fake kernel, and the entry point
// that allocates outputs and calls the device stub); csrc/cpu/<op>.cpp and
// csrc/cuda/<op>.cu (the device work on plain parameters); the kernel table
// below; python/kvcache/_fake.py; the Python and C++ APIs.
#include <torch/library.h>

#include "core/dispatch_guards.h"
#include "ops/attend.h"
#include "ops/init_layer_cache.h"
#include "ops/ring.h"
#include "ops/rows.h"
#include "ops/update.h"

TORCH_LIBRARY(kvcache, m) {
  // Zero-filled keys and values (batch_size, num_kv_heads, max_len,
  // head_dim), two separate buffers of `dtype` (default: the global default
  // dtype) on `device` (default: CPU), and length, an int32 0-D tensor
  // holding 0 on the same device.
  m.def(
      "init_layer_cache(SymInt batch_size, SymInt num_kv_heads, "
      "SymInt head_dim, SymInt max_len, *, ScalarType? dtype=None, "
      "Device? device=None) -> (Tensor, Tensor, Tensor)");

  // Writes keys_new / values_new (batch, num_kv_heads, chunk, head_dim) into
  // keys / values (batch, num_kv_heads, max_len, head_dim) at rows
  // [start, start + chunk) of dim 2, in place, both buffers in one pass.
  // Returns the new length, start + chunk, as a new int32 tensor that
  // aliases no input (one dispatch per decode step). Two overloads of one
  // operation, as fill_.Scalar / fill_.Tensor: a host start (a SymInt, so a
  // changing Python int does not recompile), or a start tensor read on the
  // device (int32/int64, 0-D or one per row (batch,); no host sync, CUDA
  // graph safe), whose new length has the start's shape.
  m.def(
      "update_(Tensor(a!) keys, Tensor(b!) values, Tensor keys_new, "
      "Tensor values_new, SymInt start) -> Tensor");
  m.def(
      "update_.Tensor(Tensor(a!) keys, Tensor(b!) values, Tensor keys_new, "
      "Tensor values_new, Tensor start) -> Tensor");

  // As update_.Tensor with start = lengths, and lengths advanced by chunk in
  // place: one call per layer per step on a caller-owned length tensor
  // (stateful caches, module buffers, CUDA graphs).
  m.def(
      "append_(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) lengths, "
      "Tensor keys_new, Tensor values_new) -> ()");

  // Attention of q (batch, num_heads, seq, head_dim) over the filled slots
  // of the cache: query i of row b sits at slot lengths[b] - seq + i and sees
  // the slots from kv_start[b] (default 0) up to itself (and, with window >
  // 0, the last `window` of them); slots outside [kv_start, lengths) are
  // never read. With `positions` ((batch, max_len) int32, a ring's record of
  // the logical position in each slot, -1: empty) the cache is read by
  // position instead: query i sits at position lengths[b] - seq + i and sees
  // the slots whose position q has kv_start[b] <= q <= p and (q < sinks or
  // p - q < window) (csrc/core/visibility.h); a query whose visible slots
  // are fewer than that rule asks for (a ring that lost a position) gets
  // NaN. Grouped-query attention when num_heads is a multiple of
  // num_kv_heads. scale defaults to head_dim ** -0.5; softcap > 0 applies
  // softcap * tanh(score / softcap). Returns (batch, num_heads, seq,
  // head_dim) in q's dtype (float32, bfloat16, float16; float32 math).
  m.def(
      "attend(Tensor q, Tensor keys, Tensor values, Tensor lengths, *, "
      "Tensor? kv_start=None, float? scale=None, int window=0, "
      "float softcap=0.0, Tensor? positions=None, int sinks=0) -> Tensor");

  // Writes keys_new / values_new (batch, num_kv_heads, chunk, head_dim) into
  // a ring cache (keys / values (batch, num_kv_heads, capacity, head_dim))
  // at the logical positions [start_b, start_b + chunk) of each row, and
  // records them in positions ((batch, capacity) int32), in one pass:
  // position p goes to slot p if p < sinks, else sinks + (p - sinks) mod
  // (capacity - sinks). Only what the ring keeps is written (the sinks and
  // the last capacity - sinks positions), so a chunk of any length is fine.
  // start: int32/int64, 0-D or (batch,), read on the device. Returns
  // start + chunk (int32, the start's shape); on CUDA a bad start writes
  // nothing and returns -1 everywhere.
  m.def(
      "ring_update_(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) positions, "
      "Tensor keys_new, Tensor values_new, Tensor start, *, int sinks=0) "
      "-> Tensor");

  // The lengths after dropping the last n[b] tokens of each row: lengths - n
  // as a new tensor (nothing else moves: later writes overwrite the stale
  // slots and attend never reads them). Refuses to go below kv_start
  // (default 0). New lengths rather than an in-place write: see rows.h.
  m.def("rollback(Tensor lengths, Tensor n, *, Tensor? kv_start=None) -> Tensor");

  // Row b of keys and values takes the filled slots of row index[b], for
  // every row at once (any index: permutation, repeats, subset), in place;
  // returns the new lengths, lengths[index] (0-D lengths: unchanged).
  m.def(
      "select_rows_(Tensor(a!) keys, Tensor(b!) values, Tensor lengths, "
      "Tensor index) -> Tensor");
}

namespace {

// The entry points check, allocate and call the device stub, so one function
// serves every backend. Sparse, quantized, MKLDNN and nested tensors get the
// same entry, whose checks reject them with a ValueError/TypeError naming the
// argument (instead of the dispatcher's "could not run ... with arguments
// from the 'SparseCPU' backend").
void register_entries(torch::Library& m) {
  m.impl("update_", &kvcache::ops::update_);
  m.impl("update_.Tensor", &kvcache::ops::update_tensor_);
  m.impl("append_", &kvcache::ops::append_);
  m.impl("attend", &kvcache::ops::attend);
  m.impl("rollback", &kvcache::ops::rollback);
  m.impl("select_rows_", &kvcache::ops::select_rows_);
  m.impl("ring_update_", &kvcache::ops::ring_update_);
}

constexpr const char* kWriteOps[] = {"update_", "update_.Tensor", "append_",
                                     "select_rows_", "ring_update_"};
constexpr const char* kReadOps[] = {"attend", "rollback"};

}  // namespace

TORCH_LIBRARY_IMPL(kvcache, CPU, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, CUDA, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, SparseCPU, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, SparseCUDA, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, SparseCsrCPU, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, SparseCsrCUDA, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, QuantizedCPU, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, QuantizedCUDA, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, MkldnnCPU, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, NestedTensorCPU, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, NestedTensorCUDA, m) { register_entries(m); }

TORCH_LIBRARY_IMPL(kvcache, CompositeExplicitAutograd, m) {
  m.impl("init_layer_cache", &kvcache::ops::init_layer_cache);
}

// Above the backends: no autograd (a clear error instead of a silent
// detach), version bumps for what is written, no lazy conj/neg writes.
TORCH_LIBRARY_IMPL(kvcache, Autograd, m) {
  for (const char* op : kWriteOps) m.impl(op, kvcache::detail::autograd_guard());
  for (const char* op : kReadOps) m.impl(op, kvcache::detail::autograd_guard());
}
TORCH_LIBRARY_IMPL(kvcache, ADInplaceOrView, m) {
  for (const char* op : kWriteOps) m.impl(op, kvcache::detail::inplace_version_bump());
}
TORCH_LIBRARY_IMPL(kvcache, Conjugate, m) {
  for (const char* op : kWriteOps) m.impl(op, kvcache::detail::math_bits_guard());
  for (const char* op : kReadOps) m.impl(op, kvcache::detail::math_bits_guard());
}
TORCH_LIBRARY_IMPL(kvcache, Negative, m) {
  for (const char* op : kWriteOps) m.impl(op, kvcache::detail::math_bits_guard());
  for (const char* op : kReadOps) m.impl(op, kvcache::detail::math_bits_guard());
}
