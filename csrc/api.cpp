// The C++ API of include/kvcache/kvcache.h, calling through the dispatcher.
//
// Each typed handle must match its schema in csrc/schema.cpp: a mismatch
// throws at the first call ("wrong signature"), and tests/cpp/test_api.cpp
// calls every function here, so a drift fails the C++ tests.
#include "kvcache/kvcache.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace kvcache {
namespace {

// Looked up once: findSchemaOrThrow takes a lock and a hash lookup.
template <typename Sig>
c10::TypedOperatorHandle<Sig> typed(const char* name, const char* overload) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(name, overload)
      .template typed<Sig>();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> init_layer_cache(
    int64_t batch_size, int64_t num_kv_heads, int64_t head_dim,
    int64_t max_len, at::ScalarType dtype, c10::Device device) {
  static const auto op = typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt,
      std::optional<at::ScalarType>, std::optional<at::Device>)>(
      "kvcache::init_layer_cache", "");
  return op.call(c10::SymInt(batch_size), c10::SymInt(num_kv_heads),
                 c10::SymInt(head_dim), c10::SymInt(max_len), dtype, device);
}

at::Tensor update_(at::Tensor& keys, at::Tensor& values,
                   const at::Tensor& keys_new, const at::Tensor& values_new,
                   int64_t start) {
  static const auto op =
      typed<at::Tensor(at::Tensor&, at::Tensor&, const at::Tensor&,
                       const at::Tensor&, c10::SymInt)>("kvcache::update_", "");
  return op.call(keys, values, keys_new, values_new, c10::SymInt(start));
}

at::Tensor update_(at::Tensor& keys, at::Tensor& values,
                   const at::Tensor& keys_new, const at::Tensor& values_new,
                   const at::Tensor& start) {
  static const auto op =
      typed<at::Tensor(at::Tensor&, at::Tensor&, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&)>(
          "kvcache::update_", "Tensor");
  return op.call(keys, values, keys_new, values_new, start);
}

void append_(at::Tensor& keys, at::Tensor& values, at::Tensor& lengths,
             const at::Tensor& keys_new, const at::Tensor& values_new) {
  static const auto op =
      typed<void(at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                 const at::Tensor&)>("kvcache::append_", "");
  op.call(keys, values, lengths, keys_new, values_new);
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& keys,
                  const at::Tensor& values, const at::Tensor& lengths,
                  const AttendOptions& options) {
  static const auto op = typed<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const std::optional<at::Tensor>&,
      std::optional<double>, int64_t, double)>("kvcache::attend", "");
  return op.call(q, keys, values, lengths, options.kv_start, options.scale,
                 options.window, options.softcap);
}

at::Tensor rollback(const at::Tensor& lengths, const at::Tensor& n,
                    const std::optional<at::Tensor>& kv_start) {
  static const auto op =
      typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                       const std::optional<at::Tensor>&)>("kvcache::rollback", "");
  return op.call(lengths, n, kv_start);
}

at::Tensor select_rows_(at::Tensor& keys, at::Tensor& values,
                        const at::Tensor& lengths, const at::Tensor& index) {
  static const auto op =
      typed<at::Tensor(at::Tensor&, at::Tensor&, const at::Tensor&,
                       const at::Tensor&)>("kvcache::select_rows_", "");
  return op.call(keys, values, lengths, index);
}

at::Tensor reset_rows(const at::Tensor& lengths, const at::Tensor& rows) {
  static const auto op =
      typed<at::Tensor(const at::Tensor&, const at::Tensor&)>(
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

KVLayerCache update_kv_layer_cache(const KVLayerCache& cache,
                                   const at::Tensor& keys_new,
                                   const at::Tensor& values_new,
                                   int64_t start) {
  KVLayerCache out = cache;  // shares the buffers: the update is in place
  out.length = update_(out.keys, out.values, keys_new, values_new, start);
  return out;
}

KVLayerCache update_kv_layer_cache(const KVLayerCache& cache,
                                   const at::Tensor& keys_new,
                                   const at::Tensor& values_new,
                                   const at::Tensor& start) {
  KVLayerCache out = cache;
  out.length = update_(out.keys, out.values, keys_new, values_new, start);
  return out;
}

KVLayerCache append_kv_layer_cache(const KVLayerCache& cache,
                                   const at::Tensor& keys_new,
                                   const at::Tensor& values_new) {
  KVLayerCache c = cache;  // the same tensors: written in place
  append_(c.keys, c.values, c.length, keys_new, values_new);
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
  return attend(q, cache.keys, cache.values, cache.length, options);
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

}  // namespace kvcache
