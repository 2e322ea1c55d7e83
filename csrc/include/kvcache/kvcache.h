// kvcache: KV-cache operators for LibTorch programs.
//
// Every function here calls the registered operator through the PyTorch
// dispatcher, so the same call runs the CPU or CUDA kernel by the tensors'
// device, exactly as torch.ops.kvcache.* does from Python. Link the program
// against the kvcache library (libkvcache.so) so the operators register.
#pragma once

#include "kvcache/export.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace kvcache {

/// KV cache buffers for one attention layer (keys after RoPE rotation, in
/// KV-head layout).
///
/// keys:   (batch, num_kv_heads, max_len, head_dim).
/// values: same shape and dtype as keys, separate storage.
/// length: int32 tensor on the cache's device; 0-D, or (batch,) after a
///         ragged update. Number of valid positions.
struct KVLayerCache {
  at::Tensor keys;
  at::Tensor values;
  at::Tensor length;

  /// Maximum number of tokens the cache can hold.
  int64_t max_len() const { return keys.size(2); }
};

// ---- The operators (thin typed wrappers over the dispatcher) -------------

/// kvcache::init_layer_cache: zero-filled keys and values of shape
/// (batch_size, num_kv_heads, max_len, head_dim) and an int32 0-D length of 0.
/// Throws c10::ValueError for a negative size.
KVCACHE_API std::tuple<at::Tensor, at::Tensor, at::Tensor> init_layer_cache(
    int64_t batch_size, int64_t num_kv_heads, int64_t head_dim,
    int64_t max_len, at::ScalarType dtype, c10::Device device = c10::kCPU);

/// kvcache::update_: writes keys_new / values_new (batch, num_kv_heads,
/// chunk, head_dim) into keys / values at [start, start + chunk) of dim 2, in
/// place. Throws c10::ValueError ("KV cache overflow: ...", shape, device or
/// aliasing errors) or c10::TypeError (dtype mismatch) before any write.
/// Returns the new length, start + chunk, as an int32 0-D tensor.
KVCACHE_API at::Tensor update_(at::Tensor& keys, at::Tensor& values,
                               const at::Tensor& keys_new,
                               const at::Tensor& values_new, int64_t start);

/// kvcache::update_at_: as update_, with the start read on the device from
/// `positions` (int32/int64, 0-D or (batch,)). No host synchronization.
/// Returns positions + chunk as int32, of the positions' shape.
KVCACHE_API at::Tensor update_at_(at::Tensor& keys, at::Tensor& values,
                                  const at::Tensor& keys_new,
                                  const at::Tensor& values_new,
                                  const at::Tensor& positions);

// ---- The API of the original module ---------------------------------------

/// Creates a zero-filled KVLayerCache with length 0.
KVCACHE_API KVLayerCache init_kv_layer_cache(int64_t batch_size, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t max_len,
                                 at::ScalarType dtype,
                                 c10::Device device = c10::kCPU);

/// Writes new keys/values into `cache` at [start, start + chunk), in place.
/// Returns a cache sharing cache's buffers, with length = start + chunk.
KVCACHE_API KVLayerCache update_kv_layer_cache(const KVLayerCache& cache,
                                   const at::Tensor& keys_new,
                                   const at::Tensor& values_new,
                                   int64_t start);

/// As above with device positions (0-D or (batch,)); the returned length is
/// positions + chunk as int32, of the positions' shape.
KVCACHE_API KVLayerCache update_kv_layer_cache(const KVLayerCache& cache,
                                   const at::Tensor& keys_new,
                                   const at::Tensor& values_new,
                                   const at::Tensor& positions);

/// Creates one empty KVLayerCache per layer (distinct buffers).
KVCACHE_API std::vector<KVLayerCache> init_decoder_kv_caches(
    int64_t num_layers, int64_t batch_size, int64_t num_kv_heads,
    int64_t head_dim, int64_t max_len, at::ScalarType dtype,
    c10::Device device = c10::kCPU);

}  // namespace kvcache
