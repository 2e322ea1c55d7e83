// The C++ API of include/kvcache/kvcache.h, calling through the dispatcher.
//
// Each typed handle must match its schema in csrc/schema.cpp: a mismatch
// throws at the first call ("wrong signature"), and tests/cpp/test_api.cpp
// calls every function here, so a drift fails the C++ tests.
#include "kvcache/kvcache.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "core/typed_op.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace kvcache {
namespace {

using detail::typed_op;

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> init_layer_cache(
    int64_t batch_size, int64_t num_kv_heads, int64_t head_dim,
    int64_t max_len, at::ScalarType dtype, c10::Device device) {
  static const auto op = typed_op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt,
      std::optional<at::ScalarType>, std::optional<at::Device>)>(
      "kvcache::init_layer_cache", "");
  return op.call(c10::SymInt(batch_size), c10::SymInt(num_kv_heads),
                 c10::SymInt(head_dim), c10::SymInt(max_len), dtype, device);
}

// The optional scales of a write: k_scale / v_scale of a quantized cache,
// std::nullopt for a plain one (an undefined tensor).
static std::optional<at::Tensor> scale_arg(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

at::Tensor update_(at::Tensor& keys, at::Tensor& values,
                   const at::Tensor& keys_new, const at::Tensor& values_new,
                   int64_t start, const std::optional<at::Tensor>& k_scale,
                   const std::optional<at::Tensor>& v_scale) {
  static const auto op =
      typed_op<at::Tensor(at::Tensor&, at::Tensor&, const at::Tensor&,
                       const at::Tensor&, c10::SymInt,
                       const std::optional<at::Tensor>&,
                       const std::optional<at::Tensor>&)>("kvcache::update_", "");
  return op.call(keys, values, keys_new, values_new, c10::SymInt(start),
                 k_scale, v_scale);
}

at::Tensor update_(at::Tensor& keys, at::Tensor& values,
                   const at::Tensor& keys_new, const at::Tensor& values_new,
                   const at::Tensor& start,
                   const std::optional<at::Tensor>& k_scale,
                   const std::optional<at::Tensor>& v_scale,
                   const std::optional<at::Tensor>& positions, int64_t sinks) {
  static const auto op =
      typed_op<at::Tensor(at::Tensor&, at::Tensor&, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&,
                       const std::optional<at::Tensor>&,
                       const std::optional<at::Tensor>&,
                       const std::optional<at::Tensor>&, int64_t)>(
          "kvcache::update_", "Tensor");
  return op.call(keys, values, keys_new, values_new, start, k_scale, v_scale,
                 positions, sinks);
}

void append_(at::Tensor& keys, at::Tensor& values, at::Tensor& lengths,
             const at::Tensor& keys_new, const at::Tensor& values_new,
             const std::optional<at::Tensor>& k_scale,
             const std::optional<at::Tensor>& v_scale) {
  static const auto op =
      typed_op<void(at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                 const at::Tensor&, const std::optional<at::Tensor>&,
                 const std::optional<at::Tensor>&)>("kvcache::append_", "");
  op.call(keys, values, lengths, keys_new, values_new, k_scale, v_scale);
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& keys,
                  const at::Tensor& values, const at::Tensor& lengths,
                  const AttendOptions& options) {
  static const auto op = typed_op<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const std::optional<at::Tensor>&,
      std::optional<double>, int64_t, double, const std::optional<at::Tensor>&,
      int64_t, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>(
      "kvcache::attend", "");
  return op.call(q, keys, values, lengths, options.kv_start, options.scale,
                 options.window, options.softcap, options.positions,
                 options.sinks, options.k_scale, options.v_scale,
                 options.sink_logits);
}

at::Tensor rollback(const at::Tensor& lengths, const at::Tensor& n,
                    const std::optional<at::Tensor>& kv_start) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, const at::Tensor&,
                       const std::optional<at::Tensor>&)>("kvcache::rollback", "");
  return op.call(lengths, n, kv_start);
}

at::Tensor select_rows_(at::Tensor& keys, at::Tensor& values,
                        const at::Tensor& lengths, const at::Tensor& index) {
  static const auto op =
      typed_op<at::Tensor(at::Tensor&, at::Tensor&, const at::Tensor&,
                       const at::Tensor&)>("kvcache::select_rows_", "");
  return op.call(keys, values, lengths, index);
}

at::Tensor reset_rows(const at::Tensor& lengths, const at::Tensor& rows) {
  static const auto op =
      typed_op<at::Tensor(const at::Tensor&, const at::Tensor&)>(
          "kvcache::reset_rows", "");
  return op.call(lengths, rows);
}

KVLayerCache init_kv_layer_cache(int64_t batch_size, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t max_len,
                                 at::ScalarType dtype, c10::Device device) {
  auto [keys, values, length] = init_layer_cache(
      batch_size, num_kv_heads, head_dim, max_len, dtype, device);
  return {std::move(keys), std::move(values), std::move(length)};
}

KVLayerCache init_quantized_kv_layer_cache(int64_t batch_size,
                                           int64_t num_kv_heads,
                                           int64_t head_dim, int64_t max_len,
                                           at::ScalarType kv_dtype,
                                           c10::Device device) {
  TORCH_CHECK_TYPE(kv_dtype == at::kChar || kv_dtype == at::kFloat8_e4m3fn,
                   "kv_dtype must be torch.int8 or torch.float8_e4m3fn, got ",
                   c10::toString(kv_dtype));
  KVLayerCache c = init_kv_layer_cache(batch_size, num_kv_heads, head_dim,
                                       max_len, kv_dtype, device);
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  c.k_scale = at::ones({batch_size, num_kv_heads, max_len}, opts);
  c.v_scale = at::ones({batch_size, num_kv_heads, max_len}, opts);
  return c;
}

KVLayerCache update_kv_layer_cache(const KVLayerCache& cache,
                                   const at::Tensor& keys_new,
                                   const at::Tensor& values_new,
                                   int64_t start) {
  KVLayerCache out = cache;  // shares the buffers: the update is in place
  out.length = update_(out.keys, out.values, keys_new, values_new, start,
                       scale_arg(out.k_scale), scale_arg(out.v_scale));
  return out;
}

KVLayerCache update_kv_layer_cache(const KVLayerCache& cache,
                                   const at::Tensor& keys_new,
                                   const at::Tensor& values_new,
                                   const at::Tensor& start) {
  KVLayerCache out = cache;
  out.length = update_(out.keys, out.values, keys_new, values_new, start,
                       scale_arg(out.k_scale), scale_arg(out.v_scale));
  return out;
}

KVLayerCache append_kv_layer_cache(const KVLayerCache& cache,
                                   const at::Tensor& keys_new,
                                   const at::Tensor& values_new) {
  KVLayerCache c = cache;  // the same tensors: written in place
  append_(c.keys, c.values, c.length, keys_new, values_new,
          scale_arg(c.k_scale), scale_arg(c.v_scale));
  return cache;
}

namespace {

// cache.length is written with copy_ after the operator ran: refuse a
// length that copy_ could not write (an expanded view) before the operator
// moves anything.
void check_length_writable(const at::Tensor& length) {
  TORCH_CHECK_VALUE(
      at::has_internal_overlap(length) != at::MemOverlap::Yes,
      "cache.length must be writable in place (not an expanded view with "
      "entries sharing memory), got shape ", length.sizes(), " and strides ",
      length.strides(), "; pass length.clone() or a (batch,) tensor");
}

}  // namespace

KVLayerCache rollback_kv_layer_cache(const KVLayerCache& cache,
                                     const at::Tensor& n,
                                     const std::optional<at::Tensor>& kv_start) {
  check_length_writable(cache.length);
  at::Tensor length = cache.length;
  length.copy_(rollback(cache.length, n, kv_start));
  return cache;
}

KVLayerCache select_rows_kv_layer_cache(const KVLayerCache& cache,
                                        const at::Tensor& index) {
  check_length_writable(cache.length);
  KVLayerCache c = cache;
  if (c.k_scale.defined() || c.v_scale.defined()) {
    // The quantized write's own checks of the scales (both or neither, each
    // float32 (batch, num_kv_heads, max_len), sharing no memory), by an
    // empty write that writes nothing: select_rows_ below moves any
    // (..., n, 1) buffer and would take mismatched scales (kvcache.rows'
    // check_scales in Python).
    const at::Tensor empty = at::empty(
        {c.keys.size(0), c.keys.size(1), 0, c.keys.size(3)}, c.keys.options().dtype(at::kFloat));
    update_(c.keys, c.values, empty, empty, 0, scale_arg(c.k_scale), scale_arg(c.v_scale));
    // The scales are (batch, heads, max_len) buffers indexed like the
    // slots: moved as (..., max_len, 1) caches by the same operator (the
    // same checks: a call that fails raises before either writes).
    at::Tensor ks = c.k_scale.unsqueeze(-1);
    at::Tensor vs = c.v_scale.unsqueeze(-1);
    select_rows_(ks, vs, c.length, index);
  }
  c.length.copy_(select_rows_(c.keys, c.values, c.length, index));
  return cache;
}

KVLayerCache reset_rows_kv_layer_cache(const KVLayerCache& cache,
                                       const at::Tensor& rows) {
  check_length_writable(cache.length);
  at::Tensor length = cache.length;
  length.copy_(reset_rows(cache.length, rows));
  return cache;
}

at::Tensor attend(const at::Tensor& q, const KVLayerCache& cache,
                  const AttendOptions& options) {
  if (!cache.quantized()) {
    return attend(q, cache.keys, cache.values, cache.length, options);
  }
  TORCH_CHECK_VALUE(!options.k_scale.has_value() && !options.v_scale.has_value(),
                    "attend over a quantized cache: the scales come from cache.k_scale / "
                    "cache.v_scale; leave options.k_scale and options.v_scale unset");
  AttendOptions o = options;
  o.k_scale = cache.k_scale;
  o.v_scale = cache.v_scale;
  return attend(q, cache.keys, cache.values, cache.length, o);
}

std::vector<KVLayerCache> init_decoder_kv_caches(
    int64_t num_layers, int64_t batch_size, int64_t num_kv_heads,
    int64_t head_dim, int64_t max_len, at::ScalarType dtype,
    c10::Device device) {
  TORCH_CHECK_VALUE(num_layers >= 0, "num_layers must be >= 0, got ",
                    num_layers);
  std::vector<KVLayerCache> caches;
  caches.reserve(num_layers);
  for (int64_t i = 0; i < num_layers; ++i) {
    caches.push_back(init_kv_layer_cache(batch_size, num_kv_heads, head_dim,
                                         max_len, dtype, device));
  }
  return caches;
}

RingLayerCache init_ring_layer_cache(int64_t batch_size, int64_t num_kv_heads,
                                     int64_t head_dim, int64_t window,
                                     at::ScalarType dtype, c10::Device device,
                                     int64_t sinks, int64_t max_step) {
  TORCH_CHECK_VALUE(window >= 1, "window must be >= 1, got ", window);
  TORCH_CHECK_VALUE(sinks >= 0, "sinks must be >= 0, got ", sinks);
  TORCH_CHECK_VALUE(max_step >= 1, "max_step must be >= 1, got ", max_step);
  // Each term is checked first, so the sum cannot overflow.
  TORCH_CHECK_VALUE(window <= INT32_MAX && sinks <= INT32_MAX &&
                        max_step <= INT32_MAX &&
                        sinks + window + max_step - 1 <= INT32_MAX,
                    "sinks + window + max_step - 1 slots: a ring holds at most ",
                    INT32_MAX, " (int32 positions)");
  const int64_t capacity = sinks + window + max_step - 1;
  auto [keys, values, length] = init_layer_cache(
      batch_size, num_kv_heads, head_dim, capacity, dtype, device);
  at::Tensor positions = at::full({keys.size(0), capacity}, -1,
                                  at::TensorOptions().dtype(at::kInt).device(device));
  return {std::move(keys), std::move(values), std::move(positions),
          std::move(length), window, sinks, max_step};
}

RingLayerCache init_quantized_ring_layer_cache(
    int64_t batch_size, int64_t num_kv_heads, int64_t head_dim, int64_t window,
    at::ScalarType kv_dtype, c10::Device device, int64_t sinks,
    int64_t max_step) {
  TORCH_CHECK_TYPE(kv_dtype == at::kChar || kv_dtype == at::kFloat8_e4m3fn,
                   "kv_dtype must be torch.int8 or torch.float8_e4m3fn, got ",
                   c10::toString(kv_dtype));
  RingLayerCache c = init_ring_layer_cache(batch_size, num_kv_heads, head_dim,
                                           window, kv_dtype, device, sinks,
                                           max_step);
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  c.k_scale = at::ones({c.keys.size(0), c.keys.size(1), c.capacity()}, opts);
  c.v_scale = at::ones({c.keys.size(0), c.keys.size(1), c.capacity()}, opts);
  return c;
}

RingKV write_ring_layer_cache(const RingLayerCache& cache,
                              const at::Tensor& keys_new,
                              const at::Tensor& values_new) {
  // cache.length is advanced by a copy_ after the ring write: refuse a
  // length that copy_ could not write before anything is written.
  check_length_writable(cache.length);
  RingLayerCache c = cache;  // the same tensors: written in place
  RingKV kv{c.keys, c.values, c.positions, c.length, c.window, c.sinks,
            c.k_scale, c.v_scale};
  const int64_t chunk = keys_new.dim() == 4 ? keys_new.size(2) : 0;
  if (chunk > c.max_step) {
    // The chunk's early queries need keys its own later tokens overwrite in
    // the ring: attend over the ring's slots from before the write (stale
    // positions >= start masked as empty) plus the chunk. A quantized ring's
    // chunk is quantized for that view by update_ with scales (the
    // quantizer of the ring's quantized write: exactly the bytes and
    // scales the ring keeps; its checks name bad new data before the ring
    // is touched).
    // The write's own checks first, by an empty write of the same rows,
    // heads and head_dim (nothing is written): new data that does not fit
    // the ring raises its ValueError / TypeError naming keys_new, not
    // at::cat's error below.
    update_(c.keys, c.values, keys_new.narrow(2, 0, 0),
            values_new.dim() == 4 ? values_new.narrow(2, 0, 0) : values_new, c.length,
            scale_arg(c.k_scale), scale_arg(c.v_scale), c.positions, c.sinks);
    at::Tensor kq = keys_new, vq = values_new, ks, vs;
    if (c.quantized()) {
      TORCH_CHECK_VALUE(keys_new.dim() == 4,
                        "keys_new must be (batch, num_kv_heads, chunk, "
                        "head_dim), got shape ", keys_new.sizes());
      const auto& sz = keys_new.sizes();
      kq = at::empty(sz, keys_new.options().dtype(c.keys.scalar_type()));
      vq = at::empty(sz, keys_new.options().dtype(c.keys.scalar_type()));
      ks = at::empty({sz[0], sz[1], sz[2]}, keys_new.options().dtype(at::kFloat));
      vs = at::empty({sz[0], sz[1], sz[2]}, keys_new.options().dtype(at::kFloat));
      update_(kq, vq, keys_new, values_new, int64_t{0}, ks, vs);
    }
    at::Tensor s = c.length.to(at::kInt);
    if (s.dim() == 1) s = s.view({-1, 1});
    const int64_t batch = c.positions.size(0);
    at::Tensor old = at::where(c.positions < s, c.positions,
                               at::full({}, -1, c.positions.options()));
    at::Tensor fresh = (s + at::arange(chunk, c.positions.options())).expand({batch, chunk});
    kv.positions = at::cat({old, fresh}, 1);
    kv.keys = at::cat({c.keys, kq}, 2);
    kv.values = at::cat({c.values, vq}, 2);
    if (c.quantized()) {
      kv.k_scale = at::cat({c.k_scale, ks}, 2);
      kv.v_scale = at::cat({c.v_scale, vs}, 2);
    }
  }
  // One operator call: a quantized ring's data, scales and positions are
  // quantized and placed together.
  at::Tensor length =
      update_(c.keys, c.values, keys_new, values_new, c.length,
              scale_arg(c.k_scale), scale_arg(c.v_scale), c.positions, c.sinks);
  c.length.copy_(length);
  kv.length = c.length;
  return kv;
}

at::Tensor attend(const at::Tensor& q, const RingKV& kv,
                  const AttendOptions& options) {
  // The ring sets these itself: refuse, rather than overwrite, a different
  // one (kvcache.attend refuses a window other than the ring's too).
  TORCH_CHECK_VALUE(options.window == 0 || options.window == kv.window, "window=",
                    options.window, " differs from the ring's window=", kv.window);
  TORCH_CHECK_VALUE(!options.positions.has_value() && options.sinks == 0,
                    "attend over a ring: positions and sinks come from the ring (kv.positions, "
                    "kv.sinks); leave options.positions and options.sinks unset");
  TORCH_CHECK_VALUE(!options.k_scale.has_value() && !options.v_scale.has_value(),
                    "attend over a ring: the scales come from kv.k_scale / kv.v_scale; leave "
                    "options.k_scale and options.v_scale unset");
  AttendOptions o = options;
  o.window = kv.window;
  o.positions = kv.positions;
  o.sinks = kv.sinks;
  if (kv.k_scale.defined()) {
    o.k_scale = kv.k_scale;
    o.v_scale = kv.v_scale;
  }
  return attend(q, kv.keys, kv.values, kv.length, o);
}

void rollback_ring_layer_cache(const RingLayerCache& cache, int64_t n) {
  TORCH_CHECK_VALUE(n >= 0, "n must be >= 0, got ", n);
  TORCH_CHECK_VALUE(n <= cache.max_step, "a ring rolls back at most max_step=",
                    cache.max_step, " tokens exactly, got n=", n);
  check_length_writable(cache.length);
  at::Tensor length = cache.length;
  length.copy_(rollback(length, at::full({}, n, length.options().dtype(at::kLong))));
}

void select_rows_ring_layer_cache(const RingLayerCache& cache, const at::Tensor& index) {
  check_length_writable(cache.length);
  {
    // The ring write's own checks of the ring's tensors (positions; a
    // quantized ring's scales: both or neither, float32 (batch,
    // num_kv_heads, capacity), sharing no memory), by an empty write that
    // writes nothing, before anything moves: select_rows_ moves any
    // (..., n, 1) scale buffer (kvcache.rows' check_ring_tensors in Python).
    RingLayerCache c = cache;
    const bool quantized = c.k_scale.defined() || c.v_scale.defined();
    const at::Tensor empty =
        at::empty({c.keys.size(0), c.keys.size(1), 0, c.keys.size(3)},
                  c.keys.options().dtype(quantized ? at::kFloat : c.keys.scalar_type()));
    update_(c.keys, c.values, empty, empty,
            at::zeros({}, c.keys.options().dtype(at::kInt)), scale_arg(c.k_scale),
            scale_arg(c.v_scale), c.positions, c.sinks);
  }
  const int64_t batch = cache.keys.size(0);
  // Every slot moves: select_rows_ over lengths of the whole capacity, the
  // scales first as (..., capacity, 1) caches (select_rows_kv_layer_cache's
  // order: a call that fails raises before either writes).
  const at::Tensor full =
      at::full({}, cache.capacity(), cache.length.options().dtype(at::kInt));
  if (cache.quantized()) {
    at::Tensor ks = cache.k_scale.unsqueeze(-1);
    at::Tensor vs = cache.v_scale.unsqueeze(-1);
    select_rows_(ks, vs, full, index);
  }
  at::Tensor keys = cache.keys, values = cache.values;
  const at::Tensor ok = select_rows_(keys, values, full, index).ge(0);
  const at::Tensor safe = index.clamp(0, std::max<int64_t>(batch - 1, 0)).to(at::kLong);
  at::Tensor positions = cache.positions;
  positions.copy_(at::where(ok, positions.index_select(0, safe), positions));
  at::Tensor length = cache.length;
  const at::Tensor moved = length.dim() == 1 ? length.index_select(0, safe) : length.clone();
  length.copy_(at::where(ok, moved, at::full({}, -1, length.options())));
}

void reset_rows_ring_layer_cache(const RingLayerCache& cache, const at::Tensor& rows) {
  TORCH_CHECK_VALUE(cache.length.dim() == 1,
                    "reset_rows_ring_layer_cache needs a per-row length of shape (batch,), got a ",
                    cache.length.dim(), "-D length");
  check_length_writable(cache.length);
  // Every row checked by reset_rows before anything is written; the rows
  // emptied are those whose length of 1 becomes 0 (none on CUDA's all -1).
  const at::Tensor length = reset_rows(cache.length, rows);
  const at::Tensor emptied = reset_rows(at::ones_like(cache.length), rows).eq(0);
  at::Tensor positions = cache.positions;
  positions.masked_fill_(emptied.view({-1, 1}), -1);
  at::Tensor l = cache.length;
  l.copy_(length);
}

// ---- Paged caches -----------------------------------------------------------

void paged_write_(at::Tensor& key_pages, at::Tensor& value_pages, const at::Tensor& key,
                  const at::Tensor& value, const at::Tensor& slot_mapping,
                  const std::optional<at::Tensor>& key_scales,
                  const std::optional<at::Tensor>& value_scales) {
  static const auto op =
      typed_op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                 const at::Tensor&, const std::optional<at::Tensor>&,
                 const std::optional<at::Tensor>&)>("kvcache::paged_write_", "");
  op.call(key_pages, value_pages, key, value, slot_mapping, key_scales, value_scales);
}

at::Tensor paged_attend(const at::Tensor& q, const at::Tensor& key_pages,
                        const at::Tensor& value_pages, const at::Tensor& block_table,
                        const at::Tensor& context_lens, const at::Tensor& cu_seqlens_q,
                        const PagedAttendOptions& options) {
  static const auto op = typed_op<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, std::optional<double>, int64_t, double,
      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&)>("kvcache::paged_attend", "");
  return op.call(q, key_pages, value_pages, block_table, context_lens, cu_seqlens_q,
                 options.scale, options.window, options.softcap, options.key_scales,
                 options.value_scales, options.sink_logits);
}

at::Tensor attend(const at::Tensor& q, const PagedKV& kv, const AttendOptions& options) {
  TORCH_CHECK_VALUE(!options.kv_start.has_value() && !options.positions.has_value() &&
                        options.sinks == 0,
                    "attend over pages: kv_start, positions and sinks do not apply to pages "
                    "(a sequence's slots are its pages; its first position is 0)");
  TORCH_CHECK_VALUE(!options.k_scale.has_value() && !options.v_scale.has_value(),
                    "attend over pages: the scales come from kv.key_scales / kv.value_scales");
  PagedAttendOptions o;
  o.scale = options.scale;
  o.window = options.window;
  o.softcap = options.softcap;
  o.sink_logits = options.sink_logits;
  if (kv.key_scales.defined()) o.key_scales = kv.key_scales;
  if (kv.value_scales.defined()) o.value_scales = kv.value_scales;
  return paged_attend(q, kv.key_pages, kv.value_pages, kv.block_table, kv.context_lens,
                      kv.cu_seqlens_q, o);
}

BlockAllocator::BlockAllocator(int64_t num_blocks, int64_t block_size)
    : num_blocks_(num_blocks), block_size_(block_size) {
  TORCH_CHECK_VALUE(num_blocks >= 1 && block_size >= 1,
                    "num_blocks and block_size must be >= 1, got ", num_blocks, ", ",
                    block_size);
  // Slots and lengths are int32 in the block-table ops.
  TORCH_CHECK_VALUE(num_blocks <= std::numeric_limits<int32_t>::max() / block_size,
                    "num_blocks * block_size must be <= 2**31 - 1 slots, got ", num_blocks, " * ",
                    block_size);
  // Handed out lowest first (free_ is popped from the back), as the Python allocator.
  free_.reserve(static_cast<size_t>(num_blocks));  // never reallocated: rollback and free do not throw
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
  refs_.assign(static_cast<size_t>(num_blocks), 0);
}

int64_t BlockAllocator::take() {
  const int64_t b = free_.back();
  free_.pop_back();
  refs_[b] = 1;
  return b;
}

void BlockAllocator::release(std::vector<int64_t>::const_iterator first,
                             std::vector<int64_t>::const_iterator last) {
  // No allocation: free_ never holds more than num_blocks, its capacity.
  for (; first != last; ++first) {
    if (--refs_[*first] == 0) free_.push_back(*first);
  }
}

std::vector<int64_t>& BlockAllocator::add_sequence(int64_t seq, int64_t length) {
  auto it = tables_.emplace(seq, std::vector<int64_t>{}).first;
  try {
    lengths_.emplace(seq, length);
  } catch (...) {
    tables_.erase(it);
    throw;
  }
  return it->second;
}

const std::vector<int64_t>& BlockAllocator::table_of(int64_t seq) const {
  auto it = tables_.find(seq);
  TORCH_CHECK_VALUE(it != tables_.end(), "unknown sequence ", seq);
  return it->second;
}

at::Tensor BlockAllocator::append(int64_t seq, int64_t n) {
  TORCH_CHECK_VALUE(n >= 0, "n must be >= 0, got ", n);
  auto it = tables_.find(seq);
  const bool is_new = it == tables_.end();
  static const std::vector<int64_t> kNone;
  const std::vector<int64_t>& table = is_new ? kNone : it->second;
  const int64_t length = is_new ? 0 : lengths_.at(seq);
  if (is_new) {
    TORCH_CHECK_VALUE(n <= std::numeric_limits<int32_t>::max(), "n must keep sequence ", seq,
                      " within 2**31 - 1 tokens, got ", n);
  } else {
    TORCH_CHECK_VALUE(n <= std::numeric_limits<int32_t>::max() - length, "n must keep sequence ",
                      seq, " within 2**31 - 1 tokens, got ", length, " + ", n);
  }
  const int64_t need =
      (length + n + block_size_ - 1) / block_size_ - static_cast<int64_t>(table.size());
  if (need > free_blocks()) {
    throw std::runtime_error("out of pages: sequence " + std::to_string(seq) + " needs " +
                             std::to_string(need) + " more blocks, " +
                             std::to_string(free_blocks()) + " are free");
  }
  TORCH_CHECK_VALUE(length % block_size_ == 0 || refs_[table.back()] == 1,
                    "the last block of sequence ", seq, " is shared; fork() gives a copy");
  // Everything that allocates comes first, so that an allocation failure
  // leaves the allocator as it was: the grown table (over the blocks take()
  // hands out next, the free list's last `need`), the slots, a new
  // sequence's two entries (both or neither).
  std::vector<int64_t> grown(table);
  grown.insert(grown.end(), free_.rbegin(), free_.rbegin() + need);
  at::Tensor slots = at::empty({n}, at::kLong);
  int64_t* out = slots.data_ptr<int64_t>();
  for (int64_t p = length; p < length + n; ++p) {
    out[p - length] = grown[p / block_size_] * block_size_ + p % block_size_;
  }
  std::vector<int64_t>& mine = is_new ? add_sequence(seq, 0) : it->second;
  for (int64_t i = 0; i < need; ++i) take();  // nothing below throws
  mine.swap(grown);
  lengths_.at(seq) += n;
  return slots;
}

void BlockAllocator::rollback(int64_t seq, int64_t n) {
  const std::vector<int64_t>& table = table_of(seq);
  const int64_t length = lengths_.at(seq);
  TORCH_CHECK_VALUE(n >= 0, "n must be >= 0, got ", n);
  TORCH_CHECK_VALUE(n <= length, "cannot roll back more tokens than sequence ", seq,
                    " holds: n=", n, ", length=", length);
  const int64_t new_length = length - n;
  const size_t keep = static_cast<size_t>((new_length + block_size_ - 1) / block_size_);
  TORCH_CHECK_VALUE(n == 0 || new_length % block_size_ == 0 || refs_[table[keep - 1]] == 1,
                    "rolling sequence ", seq, " back to ", new_length,
                    " tokens would leave its last block, partly filled, shared with another "
                    "sequence (forked at a later token): roll back to a multiple of block_size=",
                    block_size_, ", or no further than the length it was forked at");
  std::vector<int64_t>& mine = tables_.at(seq);
  release(mine.begin() + static_cast<std::ptrdiff_t>(keep), mine.end());
  mine.resize(keep);
  lengths_.at(seq) = new_length;
}

void BlockAllocator::free(int64_t seq) {
  const std::vector<int64_t>& table = table_of(seq);
  release(table.begin(), table.end());
  tables_.erase(seq);
  lengths_.erase(seq);
}

void BlockAllocator::fork(int64_t parent, int64_t child, const std::vector<at::Tensor>& pages) {
  TORCH_CHECK_VALUE(!contains(child), "sequence ", child, " already exists");
  const std::vector<int64_t> table = table_of(parent);
  const int64_t length = lengths_.at(parent);
  const bool partial = length % block_size_ != 0;
  for (size_t i = 0; i < pages.size(); ++i) {
    const at::Tensor& t = pages[i];
    TORCH_CHECK_VALUE(t.defined() && t.dim() >= 2 && t.size(0) == num_blocks_ &&
                          t.size(1) == block_size_,
                      "pages[", i, "] must be (num_blocks=", num_blocks_,
                      ", block_size=", block_size_, ", ...) (pages or their scales), got ",
                      t.defined() ? t.sizes() : at::IntArrayRef{});
    TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes,
                      "pages[", i, "] cannot be written in place (an expand()-ed view)");
  }
  if (partial && free_.empty()) {
    throw std::runtime_error("out of pages: fork needs one block for the partial last block");
  }
  // Nothing changes until every copy and every allocation is done (a throw,
  // std::bad_alloc included, leaves the allocator as it was): the child's
  // table over the page take() hands out next, its two entries (both or
  // neither), then the take and the counts, which do not throw.
  const size_t shared = table.size() - (partial ? 1 : 0);
  std::vector<int64_t> mine(table.begin(), table.begin() + static_cast<std::ptrdiff_t>(shared));
  if (partial) {
    const int64_t copy = free_.back();
    for (const at::Tensor& t : pages) t.select(0, copy).copy_(t.select(0, table.back()));
    mine.push_back(copy);
  }
  std::vector<int64_t>& table_c = add_sequence(child, length);
  if (partial) take();
  for (size_t i = 0; i < shared; ++i) ++refs_[mine[i]];
  table_c.swap(mine);
}

at::Tensor BlockAllocator::block_table(const std::vector<int64_t>& seqs,
                                       int64_t max_blocks) const {
  TORCH_CHECK_VALUE(max_blocks != 0, "max_blocks must be >= 1 (or negative: the longest table), got 0");
  int64_t width = max_blocks;
  if (width < 0) {
    width = 1;
    for (int64_t s : seqs) width = std::max<int64_t>(width, table_of(s).size());
  }
  at::Tensor out = at::full({static_cast<int64_t>(seqs.size()), width}, -1, at::kInt);
  int32_t* p = out.data_ptr<int32_t>();
  for (size_t i = 0; i < seqs.size(); ++i) {
    const std::vector<int64_t>& t = table_of(seqs[i]);
    TORCH_CHECK_VALUE(static_cast<int64_t>(t.size()) <= width, "sequence ", seqs[i], " has ",
                      t.size(), " blocks, more than max_blocks=", width);
    for (size_t j = 0; j < t.size(); ++j) p[i * width + j] = static_cast<int32_t>(t[j]);
  }
  return out;
}

at::Tensor BlockAllocator::context_lens(const std::vector<int64_t>& seqs) const {
  at::Tensor out = at::empty({static_cast<int64_t>(seqs.size())}, at::kInt);
  int32_t* p = out.data_ptr<int32_t>();
  for (size_t i = 0; i < seqs.size(); ++i) {
    table_of(seqs[i]);  // an unknown seq: ValueError
    p[i] = static_cast<int32_t>(lengths_.at(seqs[i]));
  }
  return out;
}

}  // namespace kvcache
