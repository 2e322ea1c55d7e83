// The one list of kvcache's operators. Everything that enumerates them is
// derived from it: the schemas and kernel table (csrc/schema.cpp), the
// CUDA-built check (csrc/build_info.cpp), the trace-time checks exposed to
// Python (csrc/python/module.cpp, read back by python/kvcache/_fake.py as
// kvcache._C.operators()), scripts/check_cuda_build.sh and the C++ and
// Python tests.
//
// X(id, name, kind, stub, schema)
//   id      the C++ name: the entry point is kvcache::ops::<id>, the
//           trace-time check kvcache::detail::trace_check_<id> (both with
//           the schema's arguments), the Python check kvcache._C.check_<id>
//   name    the dispatcher's name, "op" or "op.Overload"
//   kind    Factory: no tensor input, one CompositeExplicitAutograd kernel;
//           Write: mutates its (a!) tensors (backends, autograd refusal,
//           version bump, lazy conj/neg refusal);
//           Read: backends, autograd refusal, conj/neg materialized;
//           Alias: a deprecated name of another operator, kept for one
//           release: one CompositeImplicitAutograd kernel that calls that
//           operator through the dispatcher (so tracing decomposes it into
//           the new operator, whose kernels, guards and fake kernel serve
//           it; no fake kernel, stub or guard of its own)
//   stub    the DeviceStub holding its CPU and CUDA work (NoStub: none;
//           update_stubs / device_start_stubs: a write's plain and
//           quantized stubs, and the ring's for update_.Tensor)
//   schema  the schema after "kvcache::"
//
// Writes take their format from the cache's dtype and optional scales and
// their layout from their arguments (positions: a ring; pages and a slot
// mapping), one schema per kind of position (host start, device start,
// lengths, slot mapping; append_returning_ is append_'s functional form),
// not one per format or layout. The scales are named as the
// Python and C++ APIs name a cache's fields and as attend (which reads the
// same tensors) names them: k_scale / v_scale for a contiguous cache or a
// ring; the paged operators keep vLLM's key_scales / value_scales.
//
// What each operator does (the full contract is in its csrc/ops/<op>.h):
//   init_layer_cache  zero-filled keys and values (batch_size, num_kv_heads,
//       max_len, head_dim), two separate buffers of `dtype` (default: the
//       global default dtype) on `device` (default: CPU), and an int32 0-D
//       length holding 0 on the same device.
//   update_ / update_.Tensor  write keys_new / values_new (batch,
//       num_kv_heads, chunk, head_dim) into rows [start, start + chunk) of
//       dim 2 of keys / values, in place, both buffers in one pass; return
//       the new length start + chunk as a new int32 tensor aliasing no input
//       (one dispatch per decode step). A host start (a SymInt: a changing
//       Python int does not recompile) or a start tensor read on the device
//       (int32/int64, 0-D or (batch,); no host sync, CUDA-graph safe), as
//       fill_.Scalar / fill_.Tensor. The format comes from the cache's
//       dtype and the keyword-only k_scale / v_scale (both or neither): with
//       them keys / values are int8 or float8_e4m3fn (formats in
//       core/quant.h), keys_new / values_new (float32, bfloat16 or float16)
//       are quantized per (row, KV head, slot) and their float32 scales
//       written into k_scale / v_scale (batch, num_kv_heads, max_len);
//       without them keys_new has the cache's dtype and is copied as is.
//       update_.Tensor with positions (keyword-only, the (batch, capacity)
//       int32 record of a ring: keys / values (batch, num_kv_heads,
//       capacity, head_dim)) is a ring's write: keys_new / values_new go to
//       the logical positions [start_b, start_b + chunk), recorded in
//       positions, in one pass; position p goes to slot p if p < sinks,
//       else sinks + (p - sinks) mod (capacity - sinks); only what the ring
//       keeps is written (the sinks and the last capacity - sinks
//       positions). The start's bound is the int32 range, not the capacity;
//       on CUDA a bad start writes nothing and returns -1. Scales as above,
//       (batch, num_kv_heads, capacity), written at the same slots in the
//       same pass. sinks without positions is a ValueError.
//   append_  update_.Tensor at start = lengths, lengths advanced by chunk in
//       place: one call per layer per step on a caller-owned length tensor.
//       The same optional scales.
//   update_quantized_ / update_quantized_.Tensor / append_quantized_  the
//       deprecated aliases (kind Alias, kept for one release) of update_ /
//       update_.Tensor / append_ with k_scale and v_scale given
//       (positionally, after values).
//   attend  attention of q (batch, num_heads, seq, head_dim) over the filled
//       slots: query i of row b sits at slot lengths[b] - seq + i and sees
//       the slots from kv_start[b] (default 0) up to itself (with window > 0
//       the last `window` of them); slots outside [kv_start, lengths) are
//       never read. GQA, scale (default head_dim ** -0.5), softcap; returns
//       (batch, num_heads, seq, head_dim) in q's dtype. With k_scale and
//       v_scale, keys/values are a quantized cache read in place (the key
//       scale multiplies a score, the value scale a probability).
//       With positions ((batch, max_len) int32, a ring's record of the
//       logical position in each slot, -1: empty) the cache is read by
//       position: query i sits at position lengths[b] - seq + i and sees the
//       slots whose position q has kv_start[b] <= q <= p and (q < sinks or
//       p - q < window) (csrc/core/visibility.h); a query that finds fewer
//       of them than that rule asks for (a ring that lost a position) gets
//       NaN. With sink_logits ((num_heads,) float32: learned per-head sink
//       logits, gpt-oss) each head's softmax also counts one virtual slot
//       of that (scaled, capped) score and no value: the weights of the real
//       slots sum to less than 1.
//   rollback  lengths - n as a new tensor, refusing to go below kv_start.
//   select_rows_  row b of keys and values takes the filled slots of row
//       index[b], in place; returns lengths[index].
//   append_returning_  append_ that returns the new lengths (a new tensor of
//       lengths' dtype and shape) instead of writing them, with append_'s
//       checks, messages and optional scales: what traced code calls instead of append_ (the
//       Python API copies the result into lengths; see rows.h for the
//       Inductor bug an in-place length write meets).
//   reset_rows  the lengths with the given rows emptied (rows: a (batch,)
//       bool mask or int32/int64 indices in [0, batch)), a new tensor.
//   check_lengths_writable  raises (ValueError) if lengths cannot take an
//       in-place write of one value per row (an expand()ed view, lazy
//       conj/neg bits, an inference tensor outside inference mode); the
//       Python API calls it before an op whose new lengths it copies into
//       cache.length, so the copy cannot fail after the op ran, eagerly and
//       traced alike.
//   ring_update_ / ring_update_quantized_  the deprecated aliases (kind
//       Alias, kept for one release) of update_.Tensor with positions (and
//       k_scale / v_scale).
//
//   paged_write_ / paged_attend  pages (num_blocks, block_size,
//       num_kv_heads, head_dim) for many sequences (continuous batching),
//       found through a block table (csrc/ops/paged.h): the write puts
//       token t at slot slot_mapping[t] (-1: skipped; quantized on write for
//       int8/fp8 pages, scales (num_blocks, block_size, num_kv_heads)); the
//       attend reads varlen queries q (total_q, num_heads, head_dim), sequence
//       s's at tokens [cu_seqlens_q[s], cu_seqlens_q[s + 1]), as the last of
//       its context_lens[s] positions, and returns (total_q, num_heads,
//       head_dim).
//
// Adding an operator: a line here; csrc/ops/<op>.{h,cpp} (its checks with
// trace_check_<id>, and the entry point); csrc/cpu/<op>.cpp and
// csrc/cuda/<op>.cu (the work); its output allocation in
// python/kvcache/_fake.py; its Python and C++ API; its tests.
#pragma once

#define KVCACHE_OPERATORS(X)                                                  \
  X(init_layer_cache, "init_layer_cache", Factory, NoStub,                   \
    "init_layer_cache(SymInt batch_size, SymInt num_kv_heads, "               \
    "SymInt head_dim, SymInt max_len, *, ScalarType? dtype=None, "            \
    "Device? device=None) -> (Tensor, Tensor, Tensor)")                       \
  X(update_, "update_", Write, update_stubs,                                  \
    "update_(Tensor(a!) keys, Tensor(b!) values, Tensor keys_new, "           \
    "Tensor values_new, SymInt start, *, Tensor(c!)? k_scale=None, "          \
    "Tensor(d!)? v_scale=None) -> Tensor")                                    \
  X(update_tensor_, "update_.Tensor", Write, device_start_stubs,             \
    "update_.Tensor(Tensor(a!) keys, Tensor(b!) values, Tensor keys_new, "    \
    "Tensor values_new, Tensor start, *, Tensor(c!)? k_scale=None, "          \
    "Tensor(d!)? v_scale=None, Tensor(e!)? positions=None, int sinks=0) "     \
    "-> Tensor")                                                              \
  X(append_, "append_", Write, update_stubs,                                  \
    "append_(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) lengths, "        \
    "Tensor keys_new, Tensor values_new, *, Tensor(d!)? k_scale=None, "       \
    "Tensor(e!)? v_scale=None) -> ()")                                        \
  X(update_quantized_, "update_quantized_", Alias, NoStub,                    \
    "update_quantized_(Tensor(a!) keys, Tensor(b!) values, "                  \
    "Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor keys_new, "               \
    "Tensor values_new, SymInt start) -> Tensor")                             \
  X(update_quantized_tensor_, "update_quantized_.Tensor", Alias, NoStub,      \
    "update_quantized_.Tensor(Tensor(a!) keys, Tensor(b!) values, "           \
    "Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor keys_new, "               \
    "Tensor values_new, Tensor start) -> Tensor")                             \
  X(append_quantized_, "append_quantized_", Alias, NoStub,                    \
    "append_quantized_(Tensor(a!) keys, Tensor(b!) values, "                  \
    "Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor(e!) lengths, "            \
    "Tensor keys_new, Tensor values_new) -> ()")                              \
  X(attend, "attend", Read, attend_stub,                                      \
    "attend(Tensor q, Tensor keys, Tensor values, Tensor lengths, *, "        \
    "Tensor? kv_start=None, float? scale=None, int window=0, "                \
    "float softcap=0.0, Tensor? positions=None, int sinks=0, "               \
    "Tensor? k_scale=None, Tensor? v_scale=None, "                          \
    "Tensor? sink_logits=None) -> Tensor")                                    \
  X(rollback, "rollback", Read, rollback_stub,                                \
    "rollback(Tensor lengths, Tensor n, *, Tensor? kv_start=None) -> Tensor") \
  X(select_rows_, "select_rows_", Write, select_rows_stub,                    \
    "select_rows_(Tensor(a!) keys, Tensor(b!) values, Tensor lengths, "       \
    "Tensor index) -> Tensor")                                                \
  X(append_returning_, "append_returning_", Write, update_stubs,             \
    "append_returning_(Tensor(a!) keys, Tensor(b!) values, Tensor lengths, "  \
    "Tensor keys_new, Tensor values_new, *, Tensor(c!)? k_scale=None, "       \
    "Tensor(d!)? v_scale=None) -> Tensor")                                    \
  X(reset_rows, "reset_rows", Read, reset_rows_stub,                          \
    "reset_rows(Tensor lengths, Tensor rows) -> Tensor")                      \
  X(check_lengths_writable, "check_lengths_writable", Read, NoStub,           \
    "check_lengths_writable(Tensor lengths) -> ()")                          \
  X(ring_update_, "ring_update_", Alias, NoStub,                              \
    "ring_update_(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) positions, " \
    "Tensor keys_new, Tensor values_new, Tensor start, *, int sinks=0, "      \
    "Tensor(d!)? k_scale=None, Tensor(e!)? v_scale=None) -> Tensor")          \
  X(ring_update_quantized_, "ring_update_quantized_", Alias, NoStub,          \
    "ring_update_quantized_(Tensor(a!) keys, Tensor(b!) values, "             \
    "Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor(e!) positions, "          \
    "Tensor keys_new, Tensor values_new, Tensor start, *, int sinks=0) "      \
    "-> Tensor")                                                              \
  X(paged_write_, "paged_write_", Write, paged_write_stub,                    \
    "paged_write_(Tensor(a!) key_pages, Tensor(b!) value_pages, Tensor key, " \
    "Tensor value, Tensor slot_mapping, *, Tensor(c!)? key_scales=None, "     \
    "Tensor(d!)? value_scales=None) -> ()")                                   \
  X(paged_attend, "paged_attend", Read, paged_attend_stub,                    \
    "paged_attend(Tensor q, Tensor key_pages, Tensor value_pages, "           \
    "Tensor block_table, Tensor context_lens, Tensor cu_seqlens_q, *, "       \
    "float? scale=None, int window=0, float softcap=0.0, "                    \
    "Tensor? key_scales=None, Tensor? value_scales=None, "                    \
    "Tensor? sink_logits=None) -> Tensor")

#include "../core/device_stub.h"

namespace kvcache {
namespace detail {

// The stub column of an operator without device work (init_layer_cache).
struct NoStubType {};
inline constexpr NoStubType NoStub{};

constexpr bool has_cuda_work(NoStubType) { return true; }
template <typename Fn>
bool has_cuda_work(const DeviceStub<Fn>& stub) {
  return stub.cuda != nullptr;
}

}  // namespace detail
}  // namespace kvcache
