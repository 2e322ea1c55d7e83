// kvcache: KV-cache operators for LibTorch programs.
//
// Every function here calls the registered operator through the PyTorch
// dispatcher, so the same call runs the CPU or CUDA kernel by the tensors'
// device, exactly as torch.ops.kvcache.* does from Python. Link the program
// against the kvcache library (libkvcache.so) so the operators register.
//
// Errors: c10::ValueError (Python ValueError) or c10::TypeError, naming the
// argument, raised before anything is read or written.
#pragma once

#include "kvcache/export.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace kvcache {

/// KV cache buffers for one attention layer (keys after RoPE rotation, in
/// KV-head layout).
///
/// keys:   (batch, num_kv_heads, max_len, head_dim).
/// values: same shape and dtype as keys, separate storage.
/// length: int32 tensor on the cache's device; 0-D (every row), or (batch,)
///         (one per row). Number of filled positions.
///
/// A quantized cache (init_kv_layer_cache with a kv_dtype) has int8 or
/// float8_e4m3fn keys/values and k_scale / v_scale: float32 (batch,
/// num_kv_heads, max_len), one scale per slot (undefined for a plain cache).
struct KVLayerCache {
  at::Tensor keys;
  at::Tensor values;
  at::Tensor length;
  at::Tensor k_scale;
  at::Tensor v_scale;

  /// Whether keys/values are quantized (k_scale / v_scale defined).
  bool quantized() const { return k_scale.defined(); }

  /// Maximum number of tokens the cache can hold.
  int64_t max_len() const { return keys.size(2); }
};

/// Optional arguments of attend.
struct AttendOptions {
  /// (batch,) or 0-D int32/int64: first valid slot of each row (left
  /// padding); slots before it are never read. Default: 0.
  std::optional<at::Tensor> kv_start;
  /// Score scale; default head_dim ** -0.5.
  std::optional<double> scale;
  /// > 0: a query at slot p sees only slots (p - window, p].
  int64_t window = 0;
  /// > 0: scores become softcap * tanh(score / softcap).
  double softcap = 0.0;
  /// A ring's (batch, capacity) int32 slot positions (-1: empty): the cache
  /// is read by logical position (see RingLayerCache). Default: linear.
  std::optional<at::Tensor> positions;
  /// With positions: the first `sinks` positions are always visible.
  int64_t sinks = 0;
  /// A quantized cache's scales (both or neither; set by
  /// attend(q, cache, options) from the cache).
  std::optional<at::Tensor> k_scale;
  std::optional<at::Tensor> v_scale;
  /// (num_heads,) float32 learned sink logits (gpt-oss): each head's softmax
  /// counts one more virtual slot of that score and no value.
  std::optional<at::Tensor> sink_logits;
};

// ---- The operators (thin typed wrappers over the dispatcher) -------------

/// kvcache::init_layer_cache: zero-filled keys and values of shape
/// (batch_size, num_kv_heads, max_len, head_dim) and an int32 0-D length of 0.
/// Throws c10::ValueError for a negative size or max_len >= 2^31.
KVCACHE_API std::tuple<at::Tensor, at::Tensor, at::Tensor> init_layer_cache(
    int64_t batch_size, int64_t num_kv_heads, int64_t head_dim,
    int64_t max_len, at::ScalarType dtype, c10::Device device = c10::kCPU);

/// kvcache::update_: writes keys_new / values_new (batch, num_kv_heads,
/// chunk, head_dim) into keys / values (batch, num_kv_heads, max_len,
/// head_dim) at rows [start, start + chunk), in place. Returns the new
/// length, start + chunk, as a new int32 0-D tensor.
///
/// The format comes from the cache's dtype and the scales (both or
/// neither). Without k_scale / v_scale the write is plain: keys_new /
/// values_new have the cache's dtype and are copied as they are. With them
/// the cache is quantized: keys / values are int8 (at::kChar) or
/// float8_e4m3fn, keys_new / values_new float32, bfloat16 or float16 (one
/// dtype), quantized per (row, KV head, slot), their float32 scales written
/// into k_scale / v_scale (batch, num_kv_heads, max_len).
/// Throws c10::ValueError / c10::TypeError, with nothing written, for a bad
/// start, shape, dtype, device or aliasing, one scale without the other,
/// scales with a plain cache or float data for an int8 / fp8 cache without
/// scales.
KVCACHE_API at::Tensor update_(
    at::Tensor& keys, at::Tensor& values, const at::Tensor& keys_new,
    const at::Tensor& values_new, int64_t start,
    const std::optional<at::Tensor>& k_scale = std::nullopt,
    const std::optional<at::Tensor>& v_scale = std::nullopt);

/// kvcache::update_.Tensor: as above, with the start read on the device from
/// `start` (int32/int64, 0-D or (batch,)); no host synchronization. Returns
/// start + chunk as int32, of the start's shape. On CUDA, if any start is
/// out of range nothing is written and every returned length is -1.
///
/// With `positions` ((batch, capacity) int32, the ring's record of the
/// logical position in each slot, -1: empty) the cache is a ring of
/// `capacity` slots whose first `sinks` stay: keys_new / values_new go to
/// the logical positions [start, start + chunk) of each row (position p at
/// slot p if p < sinks, else sinks + (p - sinks) % (capacity - sinks)),
/// recorded in positions, in one pass; a chunk longer than the ring writes
/// only what it keeps; the start is bounded by int32, not the capacity.
/// Scales as above, (batch, num_kv_heads, capacity). sinks without
/// positions: c10::ValueError. One write for both layouts, as attend reads
/// both (attend's `positions`).
KVCACHE_API at::Tensor update_(
    at::Tensor& keys, at::Tensor& values, const at::Tensor& keys_new,
    const at::Tensor& values_new, const at::Tensor& start,
    const std::optional<at::Tensor>& k_scale = std::nullopt,
    const std::optional<at::Tensor>& v_scale = std::nullopt,
    const std::optional<at::Tensor>& positions = std::nullopt, int64_t sinks = 0);

/// kvcache::append_: writes at lengths (0-D or (batch,), int32/int64) and
/// advances lengths by chunk, in place; scales as update_. On CUDA, if any
/// row would overflow nothing is written and every length becomes -1.
KVCACHE_API void append_(at::Tensor& keys, at::Tensor& values,
                         at::Tensor& lengths, const at::Tensor& keys_new,
                         const at::Tensor& values_new,
                         const std::optional<at::Tensor>& k_scale = std::nullopt,
                         const std::optional<at::Tensor>& v_scale = std::nullopt);

/// Deprecated (kept for one release; the operators kvcache::update_quantized_
/// / append_quantized_ are aliases of the writes above): call update_ /
/// append_ with k_scale and v_scale.
[[deprecated("call kvcache::update_ with k_scale and v_scale")]] inline at::Tensor
update_quantized_(at::Tensor& keys, at::Tensor& values, at::Tensor& k_scale,
                  at::Tensor& v_scale, const at::Tensor& keys_new,
                  const at::Tensor& values_new, int64_t start) {
  return update_(keys, values, keys_new, values_new, start, k_scale, v_scale);
}
[[deprecated("call kvcache::update_ with k_scale and v_scale")]] inline at::Tensor
update_quantized_(at::Tensor& keys, at::Tensor& values, at::Tensor& k_scale,
                  at::Tensor& v_scale, const at::Tensor& keys_new,
                  const at::Tensor& values_new, const at::Tensor& start) {
  return update_(keys, values, keys_new, values_new, start, k_scale, v_scale);
}
[[deprecated("call kvcache::append_ with k_scale and v_scale")]] inline void
append_quantized_(at::Tensor& keys, at::Tensor& values, at::Tensor& k_scale,
                  at::Tensor& v_scale, at::Tensor& lengths,
                  const at::Tensor& keys_new, const at::Tensor& values_new) {
  append_(keys, values, lengths, keys_new, values_new, k_scale, v_scale);
}

/// kvcache::attend: attention of q (batch, num_heads, seq, head_dim) over the
/// filled slots [kv_start, lengths) of keys / values; query i of row b sits
/// at slot lengths[b] - seq + i (causal). Returns (batch, num_heads, seq,
/// head_dim) in q's dtype.
KVCACHE_API at::Tensor attend(const at::Tensor& q, const at::Tensor& keys,
                              const at::Tensor& values,
                              const at::Tensor& lengths,
                              const AttendOptions& options = {});

/// kvcache::rollback: returns lengths - n (n: 0-D or lengths' shape), a new
/// tensor. Throws (CPU) if a row would go below kv_start (default 0); on CUDA
/// every returned length is -1 instead.
KVCACHE_API at::Tensor rollback(const at::Tensor& lengths, const at::Tensor& n,
                                const std::optional<at::Tensor>& kv_start = std::nullopt);

/// kvcache::select_rows_: row b of keys and values takes the filled slots of
/// row index[b] ((batch,) int32/int64), in place. Returns the new lengths,
/// lengths[index] (0-D lengths: unchanged).
KVCACHE_API at::Tensor select_rows_(at::Tensor& keys, at::Tensor& values,
                                    const at::Tensor& lengths,
                                    const at::Tensor& index);

/// kvcache::reset_rows: returns lengths ((batch,)) with the rows selected by
/// `rows` set to 0, a new tensor. rows: a (batch,) bool mask, or int32/int64
/// indices in [0, batch). Throws on a bad rows (CPU indices too); on CUDA an
/// index out of range makes every returned length -1 instead.
KVCACHE_API at::Tensor reset_rows(const at::Tensor& lengths,
                                  const at::Tensor& rows);

// ---- The API of the original module, and what a decode loop needs ---------

/// Creates a zero-filled KVLayerCache with length 0. On the CPU under Linux
/// the buffers are advised into transparent huge pages before they are
/// filled (fewer TLB misses when long caches are read; the environment
/// variable KVCACHE_HUGE_PAGES=0 turns that off).
KVCACHE_API KVLayerCache init_kv_layer_cache(int64_t batch_size,
                                             int64_t num_kv_heads,
                                             int64_t head_dim, int64_t max_len,
                                             at::ScalarType dtype,
                                             c10::Device device = c10::kCPU);

/// Creates a zero-filled quantized KVLayerCache: keys/values of kv_dtype
/// (at::kChar for int8, at::kFloat8_e4m3fn for fp8) and float32 scales.
/// Throws c10::TypeError for another kv_dtype.
KVCACHE_API KVLayerCache init_quantized_kv_layer_cache(
    int64_t batch_size, int64_t num_kv_heads, int64_t head_dim,
    int64_t max_len, at::ScalarType kv_dtype, c10::Device device = c10::kCPU);

/// Writes new keys/values into `cache` at [start, start + chunk), in place
/// (quantizing them for a quantized cache).
/// Returns a cache sharing cache's buffers, with length = start + chunk.
KVCACHE_API KVLayerCache update_kv_layer_cache(const KVLayerCache& cache,
                                               const at::Tensor& keys_new,
                                               const at::Tensor& values_new,
                                               int64_t start);

/// As above with a device start (0-D or (batch,)); the returned length is
/// start + chunk as int32, of the start's shape.
KVCACHE_API KVLayerCache update_kv_layer_cache(const KVLayerCache& cache,
                                               const at::Tensor& keys_new,
                                               const at::Tensor& values_new,
                                               const at::Tensor& start);

// Beyond the original module, every operation on one layer's cache is
// <operation>_kv_layer_cache(cache, ...), the Python API's names: it works in
// place (the buffers and the length tensor keep their addresses) and returns
// the cache. Each throws c10::ValueError / c10::TypeError before anything is
// written, including the write of cache.length itself.

/// Writes at cache.length and advances cache.length in place (one op).
/// Returns `cache`.
KVCACHE_API KVLayerCache append_kv_layer_cache(const KVLayerCache& cache,
                                               const at::Tensor& keys_new,
                                               const at::Tensor& values_new);

/// Drops the last n[b] tokens of each row (n: an int32/int64 tensor, 0-D or
/// of cache.length's shape): cache.length becomes length - n, in place;
/// nothing else moves. Throws if a row would go below kv_start (default 0).
/// Returns `cache`.
KVCACHE_API KVLayerCache rollback_kv_layer_cache(
    const KVLayerCache& cache, const at::Tensor& n,
    const std::optional<at::Tensor>& kv_start = std::nullopt);

/// Row b takes the filled slots (and a quantized cache's scales) and length
/// of row index[b] ((batch,) int32/int64: permutations, repeats, subsets),
/// in place. Returns `cache`.
KVCACHE_API KVLayerCache select_rows_kv_layer_cache(const KVLayerCache& cache,
                                                    const at::Tensor& index);

/// Empties the rows `rows` selects (a (batch,) bool mask, or int32/int64
/// indices in [0, batch)): their cache.length becomes 0, in place, O(1) per
/// row (nothing is zeroed). cache.length must be (batch,). Returns `cache`.
KVCACHE_API KVLayerCache reset_rows_kv_layer_cache(const KVLayerCache& cache,
                                                   const at::Tensor& rows);

/// Attention of q over the filled slots of `cache` (see attend above). A
/// quantized cache's scales come from it: options.k_scale / v_scale given
/// too throw c10::ValueError.
KVCACHE_API at::Tensor attend(const at::Tensor& q, const KVLayerCache& cache,
                              const AttendOptions& options = {});

// ---- Ring caches (sliding-window layers with sinks) -------------------------

/// Default R of a ring: the most tokens one write may add and be attended
/// inside the ring, and the deepest exact rollback.
constexpr int64_t kDefaultRingMaxStep = 64;

/// A sliding-window layer's cache as a ring of capacity = sinks + window +
/// max_step - 1 slots. Position p lives at slot p if p < sinks, else at
/// sinks + (p - sinks) % (capacity - sinks); positions records the logical
/// position each slot holds (-1: empty); length is the logical length.
///
/// keys, values: (batch, num_kv_heads, capacity, head_dim).
/// positions:    (batch, capacity) int32.
/// length:       int32, 0-D or (batch,).
/// k_scale, v_scale: a quantized ring's (int8 / float8_e4m3fn keys and
///               values) float32 (batch, num_kv_heads, capacity) per-slot
///               scales; undefined for a plain ring.
struct RingLayerCache {
  at::Tensor keys;
  at::Tensor values;
  at::Tensor positions;
  at::Tensor length;
  int64_t window = 1;
  int64_t sinks = 0;
  int64_t max_step = kDefaultRingMaxStep;
  at::Tensor k_scale;
  at::Tensor v_scale;

  int64_t capacity() const { return keys.size(2); }
  /// Whether keys/values are quantized (k_scale / v_scale defined).
  bool quantized() const { return k_scale.defined(); }
};

/// What a chunk's queries attend over after write_ring_layer_cache: the
/// ring itself, or (a chunk longer than max_step) a temporary concatenation
/// of the ring's slots from before the write and the chunk.
struct RingKV {
  at::Tensor keys;
  at::Tensor values;
  at::Tensor positions;
  at::Tensor length;  // logical length after the write
  int64_t window = 1;
  int64_t sinks = 0;
  at::Tensor k_scale;  // a quantized ring's scales (undefined: plain)
  at::Tensor v_scale;
};

/// Deprecated (kept for one release; the operators kvcache::ring_update_ /
/// ring_update_quantized_ are aliases of update_.Tensor with positions):
/// call update_(keys, values, keys_new, values_new, start, k_scale, v_scale,
/// positions, sinks).
[[deprecated("call kvcache::update_ with positions and sinks")]] inline at::Tensor
ring_update_(at::Tensor& keys, at::Tensor& values, at::Tensor& positions,
             const at::Tensor& keys_new, const at::Tensor& values_new,
             const at::Tensor& start, int64_t sinks = 0,
             const std::optional<at::Tensor>& k_scale = std::nullopt,
             const std::optional<at::Tensor>& v_scale = std::nullopt) {
  return update_(keys, values, keys_new, values_new, start, k_scale, v_scale,
                 positions, sinks);
}
[[deprecated("call kvcache::update_ with positions, sinks, k_scale and v_scale")]] inline at::Tensor
ring_update_quantized_(at::Tensor& keys, at::Tensor& values, at::Tensor& k_scale,
                       at::Tensor& v_scale, at::Tensor& positions,
                       const at::Tensor& keys_new, const at::Tensor& values_new,
                       const at::Tensor& start, int64_t sinks = 0) {
  return update_(keys, values, keys_new, values_new, start, k_scale, v_scale,
                 positions, sinks);
}

/// Creates an empty ring (zero buffers, positions -1, length 0). Throws
/// c10::ValueError for window < 1, sinks < 0, max_step < 1 or a capacity of
/// 2^31 or more.
KVCACHE_API RingLayerCache init_ring_layer_cache(
    int64_t batch_size, int64_t num_kv_heads, int64_t head_dim, int64_t window,
    at::ScalarType dtype, c10::Device device = c10::kCPU, int64_t sinks = 0,
    int64_t max_step = kDefaultRingMaxStep);

/// A quantized ring: keys/values of kv_dtype (at::kChar or
/// at::kFloat8_e4m3fn) with per-slot float32 scales of 1. Throws
/// c10::TypeError for another kv_dtype, else as init_ring_layer_cache.
KVCACHE_API RingLayerCache init_quantized_ring_layer_cache(
    int64_t batch_size, int64_t num_kv_heads, int64_t head_dim, int64_t window,
    at::ScalarType kv_dtype, c10::Device device = c10::kCPU, int64_t sinks = 0,
    int64_t max_step = kDefaultRingMaxStep);

/// Writes a chunk at cache.length (advanced in place) and returns what the
/// chunk's queries attend over (see RingKV): write-then-attend for any
/// chunk length, exact. A quantized ring's write is one
/// update_ with positions and the scales (data, scales and positions in one pass); a chunk
/// longer than max_step is also quantized into a chunk-sized buffer
/// (update_ with scales) for the returned view.
KVCACHE_API RingKV write_ring_layer_cache(const RingLayerCache& cache,
                                          const at::Tensor& keys_new,
                                          const at::Tensor& values_new);

/// Attention of q over a ring by logical position: options.window,
/// positions and sinks (and a quantized ring's scales) come from kv
/// (kv_start, scale, softcap from options). Throws c10::ValueError for
/// options that differ: a window other than 0 or kv.window, positions,
/// sinks, or scales.
KVCACHE_API at::Tensor attend(const at::Tensor& q, const RingKV& kv,
                              const AttendOptions& options = {});

/// Drops the last n tokens of each row (cache.length -= n, in place).
/// Throws c10::ValueError if n > max_step (exactness bound) or n < 0.
KVCACHE_API void rollback_ring_layer_cache(const RingLayerCache& cache,
                                           int64_t n);

/// Row b of the ring takes row index[b]'s slots, positions, length (and a
/// quantized ring's scales), in place: beam search and forking, as
/// select_rows_kv_layer_cache for a linear cache. index: (batch,) int32 /
/// int64 in [0, batch). Throws c10::ValueError (an index out of range,
/// positions not (batch, capacity), a length that cannot be written in
/// place) before anything moves (CPU; on CUDA a bad index moves nothing and
/// every length becomes -1).
KVCACHE_API void select_rows_ring_layer_cache(const RingLayerCache& cache,
                                              const at::Tensor& index);

/// Empties the given rows of the ring: length 0 and every slot's position
/// -1 (keys and values are not zeroed; empty slots are never read). rows: a
/// (batch,) bool mask or int32 / int64 row indices, checked by reset_rows as
/// reset_rows_kv_layer_cache checks them; cache.length must be (batch,).
/// Throws c10::ValueError / c10::TypeError before anything changes.
KVCACHE_API void reset_rows_ring_layer_cache(const RingLayerCache& cache,
                                             const at::Tensor& rows);

/// Creates one empty KVLayerCache per layer (distinct buffers).
KVCACHE_API std::vector<KVLayerCache> init_decoder_kv_caches(
    int64_t num_layers, int64_t batch_size, int64_t num_kv_heads,
    int64_t head_dim, int64_t max_len, at::ScalarType dtype,
    c10::Device device = c10::kCPU);

// ---- Paged caches (continuous batching) -------------------------------------

/// Optional arguments of paged_attend.
struct PagedAttendOptions {
  /// Score scale; default head_dim ** -0.5.
  std::optional<double> scale;
  /// > 0: a query at position p sees only positions (p - window, p].
  int64_t window = 0;
  /// > 0: scores become softcap * tanh(score / softcap).
  double softcap = 0.0;
  /// Quantized pages' float32 (num_blocks, block_size, num_kv_heads) scales
  /// (both or neither).
  std::optional<at::Tensor> key_scales;
  std::optional<at::Tensor> value_scales;
  /// (num_heads,) float32 learned sink logits.
  std::optional<at::Tensor> sink_logits;
};

/// kvcache::paged_write_: token t of key / value (num_tokens, num_kv_heads,
/// head_dim) goes to slot slot_mapping[t] (int32/int64 (num_tokens,); -1
/// skips the token) of key_pages / value_pages (num_blocks, block_size,
/// num_kv_heads, head_dim); slot s is slot s % block_size of page s /
/// block_size. int8 / float8_e4m3fn pages are quantized on write, their
/// float32 (num_blocks, block_size, num_kv_heads) scales beside them. Throws
/// c10::ValueError / c10::TypeError (a slot outside [-1, num_blocks *
/// block_size), a slot given twice, a wrong shape or dtype) with nothing
/// written (on CUDA a bad slot_mapping writes nothing, unchecked on the host).
KVCACHE_API void paged_write_(at::Tensor& key_pages, at::Tensor& value_pages,
                              const at::Tensor& key, const at::Tensor& value,
                              const at::Tensor& slot_mapping,
                              const std::optional<at::Tensor>& key_scales = std::nullopt,
                              const std::optional<at::Tensor>& value_scales = std::nullopt);

/// kvcache::paged_attend: attention of num_seqs sequences' queries, packed
/// in q (total_q, num_heads, head_dim) (sequence s's at tokens
/// [cu_seqlens_q[s], cu_seqlens_q[s + 1])), over their pages: sequence s
/// holds context_lens[s] tokens (this step's included), position j at slot
/// j % block_size of page block_table[s, j / block_size] (int32 (num_seqs,
/// max_blocks), -1 padded). Its queries are its last tokens. Returns (total_q,
/// num_heads, head_dim) in q's dtype; q may end with padding (rows from
/// cu_seqlens_q[num_seqs] on, a batch padded to a fixed size), returned as 0.
/// Throws c10::ValueError for bad
/// metadata (a visible page outside the pool, context_lens beyond the table
/// or below the sequence's query count, cu_seqlens_q not starting at 0,
/// decreasing or ending past q; equal neighbours are a sequence without
/// queries) before anything is read (on CPU; on CUDA the metadata stays on
/// the device and a bad sequence's rows are NaN), c10::TypeError for
/// metadata that is not int32.
KVCACHE_API at::Tensor paged_attend(const at::Tensor& q, const at::Tensor& key_pages,
                                    const at::Tensor& value_pages,
                                    const at::Tensor& block_table,
                                    const at::Tensor& context_lens,
                                    const at::Tensor& cu_seqlens_q,
                                    const PagedAttendOptions& options = {});

/// One layer's paged cache as attend reads it: key / value pages
/// (num_blocks, block_size, num_kv_heads, head_dim), the block table
/// (num_seqs, max_blocks) int32 (-1 padded), context_lens (num_seqs,) and
/// cu_seqlens_q (num_seqs + 1,) (see paged_attend); quantized pages' float32
/// (num_blocks, block_size, num_kv_heads) scales (undefined: plain pages).
struct PagedKV {
  at::Tensor key_pages;
  at::Tensor value_pages;
  at::Tensor block_table;
  at::Tensor context_lens;
  at::Tensor cu_seqlens_q;
  at::Tensor key_scales;
  at::Tensor value_scales;
};

/// Attention of q (total_q, num_heads, head_dim) over pages, as
/// attend(q, cache) over a linear cache or a ring: paged_attend with the
/// pages' scales from kv and scale, window, softcap and sink_logits from
/// options (options.kv_start, positions and sinks do not apply to pages:
/// c10::ValueError if given).
KVCACHE_API at::Tensor attend(const at::Tensor& q, const PagedKV& kv,
                              const AttendOptions& options = {});

/// Hands out pages to sequences (host bookkeeping, no tensor is touched but
/// by fork's copy): each sequence owns a list of blocks; reference counts
/// let a forked sequence share its parent's full blocks, and a block returns
/// to the free list when its last owner frees it. The Python
/// kvcache.paged.BlockAllocator, for C++ programs.
class KVCACHE_API BlockAllocator {
 public:
  /// Throws c10::ValueError unless num_blocks >= 1, block_size >= 1 and
  /// num_blocks * block_size <= 2^31 - 1 (slots are int32 in the ops).
  BlockAllocator(int64_t num_blocks, int64_t block_size);

  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  /// Pages owned by no sequence.
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }
  /// Whether seq is known (appended to or forked, not freed).
  bool contains(int64_t seq) const { return tables_.count(seq) != 0; }

  /// Makes room for n more tokens of seq (a new seq starts empty); returns
  /// their (n,) int64 slot mapping, for paged_write_. Throws c10::ValueError
  /// for n < 0, a length past 2^31 - 1 or a shared last block,
  /// std::runtime_error when out of pages (on any error, std::bad_alloc
  /// included, nothing is allocated and a new seq is not registered).
  at::Tensor append(int64_t seq, int64_t n);
  /// Drops the last n tokens of seq (rejected speculative tokens): its blocks
  /// past the new length return to the pool when no other sequence shares
  /// them. Throws c10::ValueError for an unknown seq, n < 0 or more than it
  /// holds, or a new last block that is partly filled and shared with another
  /// sequence (the next append would write into that sequence's tokens); on
  /// any error the allocator is unchanged.
  void rollback(int64_t seq, int64_t n);
  /// Releases seq's blocks. Throws c10::ValueError for an unknown seq.
  void free(int64_t seq);
  /// child continues from parent's tokens: full blocks shared, a partial
  /// last block copied to a new page of every tensor in pages (each indexed
  /// by block along dimension 0: key / value pages and their scales, of every
  /// layer). Throws c10::ValueError for an unknown parent, an existing child,
  /// a tensor that is not (num_blocks, block_size, ...) or cannot be written
  /// in place (an expand()-ed view), std::runtime_error when out of pages; on
  /// any error the allocator is unchanged.
  void fork(int64_t parent, int64_t child, const std::vector<at::Tensor>& pages = {});
  /// (seqs.size(), max_blocks) int32 block table, -1 padded; max_blocks < 0:
  /// the longest table. Throws c10::ValueError for an unknown seq, max_blocks
  /// 0 or a table longer than max_blocks.
  at::Tensor block_table(const std::vector<int64_t>& seqs, int64_t max_blocks = -1) const;
  /// (seqs.size(),) int32 tokens held per sequence.
  at::Tensor context_lens(const std::vector<int64_t>& seqs) const;

 private:
  int64_t take();
  // Drops one reference to each block of [first, last); a block no sequence
  // holds returns to the free list. Does not throw.
  void release(std::vector<int64_t>::const_iterator first,
               std::vector<int64_t>::const_iterator last);
  // Registers a new sequence of `length` tokens with an empty table (both
  // entries or, when an allocation throws, neither); returns its table.
  std::vector<int64_t>& add_sequence(int64_t seq, int64_t length);
  const std::vector<int64_t>& table_of(int64_t seq) const;

  int64_t num_blocks_, block_size_;
  std::vector<int64_t> free_;
  std::vector<int64_t> refs_;
  std::unordered_map<int64_t, std::vector<int64_t>> tables_;
  std::unordered_map<int64_t, int64_t> lengths_;
};

}  // namespace kvcache
