// The C++ API of include/kvcache/kvcache.h, calling through the dispatcher.
#include "kvcache/kvcache.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace kvcache {
namespace {

// Looked up once: findSchemaOrThrow takes a lock and a hash lookup.
const auto& init_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvcache::init_layer_cache", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt,
              std::optional<at::ScalarType>, std::optional<at::Device>)>();
  return op;
}

const auto& update_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvcache::update_", "")
          .typed<at::Tensor(at::Tensor&, at::Tensor&, const at::Tensor&,
                            const at::Tensor&, c10::SymInt)>();
  return op;
}

const auto& update_at_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvcache::update_at_", "")
          .typed<at::Tensor(at::Tensor&, at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&)>();
  return op;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> init_layer_cache(
    int64_t batch_size, int64_t num_kv_heads, int64_t head_dim,
    int64_t max_len, at::ScalarType dtype, c10::Device device) {
  return init_op().call(c10::SymInt(batch_size), c10::SymInt(num_kv_heads),
                        c10::SymInt(head_dim), c10::SymInt(max_len), dtype,
                        device);
}

at::Tensor update_(at::Tensor& keys, at::Tensor& values,
                   const at::Tensor& keys_new, const at::Tensor& values_new,
                   int64_t start) {
  return update_op().call(keys, values, keys_new, values_new,
                          c10::SymInt(start));
}

at::Tensor update_at_(at::Tensor& keys, at::Tensor& values,
                      const at::Tensor& keys_new, const at::Tensor& values_new,
                      const at::Tensor& positions) {
  return update_at_op().call(keys, values, keys_new, values_new, positions);
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
                                   const at::Tensor& positions) {
  KVLayerCache out = cache;
  out.length = update_at_(out.keys, out.values, keys_new, values_new, positions);
  return out;
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
