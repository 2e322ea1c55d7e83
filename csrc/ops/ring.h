// Ring caches: a row of `capacity` slots holding the last window + R - 1
// positions of a sequence (plus `sinks` first positions that stay), each
// slot recording the logical position it holds (positions, (batch,
// capacity) int32, -1: empty). See csrc/core/visibility.h for the slot of a
// position and what a query sees.
//
// ring_update_ writes keys_new / values_new (batch, heads, chunk, head_dim)
// at the logical positions [start_b, start_b + chunk) of each row, and the
// positions of the slots it writes, in one pass (one CUDA launch after the
// start check), and returns start + chunk. A chunk longer than the ring
// writes only what the ring keeps (ring_keeps), so each slot is written at
// most once. attend reads a ring with its `positions` argument.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <vector>

#include "../core/device_stub.h"
#include "../core/params.h"
#include "kvcache/export.h"

namespace kvcache {
namespace detail {

struct RingUpdateParams {
  DstRows dst[2];  // keys, values
  SrcRows src[2];  // keys_new, values_new
  int32_t* positions = nullptr;  // (batch, capacity)
  int64_t pos_stride[2] = {};    // elements
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t chunk = 0;
  int64_t head_dim = 0;
  int64_t capacity = 0;
  int64_t sinks = 0;
  int64_t elem = 0;  // bytes per element
  IntRows starts;    // 0-D or (batch,), read on the device (CUDA)
  const int64_t* host_starts = nullptr;  // CPU: checked, one per entry of starts
  IntRows lengths_out;  // start + chunk, or -1 everywhere (CUDA, bad start)
  int device_index = -1;
};

using RingUpdateFn = void (*)(const RingUpdateParams&);
extern DeviceStub<RingUpdateFn> ring_update_stub;

// A ring's positions tensor: int32, (batch, capacity), on `device`.
KVCACHE_API void check_positions(const at::Tensor& positions,
                                 const c10::SymInt& batch,
                                 const c10::SymInt& capacity,
                                 const at::Device& device);

// Checks shared with the fake kernel (values_known false while tracing).
// Returns the checked starts when they can be read here (CPU, eager).
KVCACHE_API std::vector<int64_t> check_ring_update(
    const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& positions, const at::Tensor& keys_new,
    const at::Tensor& values_new, const at::Tensor& start, int64_t sinks,
    bool values_known);

// The checks with the schema's arguments, as the fake kernel runs them.
inline void trace_check_ring_update_(const at::Tensor& keys,
                                     const at::Tensor& values,
                                     const at::Tensor& positions,
                                     const at::Tensor& keys_new,
                                     const at::Tensor& values_new,
                                     const at::Tensor& start, int64_t sinks) {
  check_ring_update(keys, values, positions, keys_new, values_new, start,
                    sinks, false);
}

}  // namespace detail

namespace ops {

at::Tensor ring_update_(at::Tensor& keys, at::Tensor& values,
                        at::Tensor& positions, const at::Tensor& keys_new,
                        const at::Tensor& values_new, const at::Tensor& start,
                        int64_t sinks);

}  // namespace ops
}  // namespace kvcache
