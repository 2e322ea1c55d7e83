// Ring caches: a row of `capacity` slots holding the last window + R - 1
// positions of a sequence (plus `sinks` first positions that stay), each
// slot recording the logical position it holds (positions, (batch,
// capacity) int32, -1: empty). See csrc/core/visibility.h for the slot of a
// position and what a query sees.
//
// update_.Tensor with positions (the ring's write; ring_write below) writes
// keys_new / values_new (batch, heads, chunk, head_dim) at the logical
// positions [start_b, start_b + chunk) of each row, and the positions of
// the slots it writes, in one pass (one CUDA launch after the start check),
// and returns start + chunk. A chunk longer than the ring
// writes only what the ring keeps (ring_keeps), so each slot is written at
// most once. attend reads a ring with its `positions` argument.
//
// With k_scale / v_scale (keyword-only, both or neither) the same write is
// the one of a quantized ring (int8 / float8_e4m3fn keys and values with
// float32 scales (batch, heads, capacity), formats in csrc/core/quant.h):
// each kept position of the float32 / bfloat16 / float16 new data is
// quantized straight into its slot and its scale next to it, with the plain
// write's positions, slot rule and results and update_'s checks of the data
// and scales (csrc/ops/update.h), in one pass (one CUDA launch after the
// start check) instead of a staging buffer and two ring copies. The format
// comes from the cache's dtype and the scales, as for update_.
//
// ring_update_ and ring_update_quantized_ are deprecated aliases (kept for
// one release) of update_.Tensor with positions (and the scales):
// CompositeImplicitAutograd kernels that call it through the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <vector>

#include "../core/device_stub.h"
#include "../core/params.h"
#include "../core/quant.h"
#include "../core/tensor_params.h"
#include "update.h"
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

// The parameters of both ring writes (`starts`: the checked host starts,
// empty when they stay on the device; `length` receives start + chunk).
// Shared with the emulated CUDA tests.
inline RingUpdateParams ring_update_params(at::Tensor& keys, at::Tensor& values,
                                           const at::Tensor& positions, const at::Tensor& keys_new,
                                           const at::Tensor& values_new, const at::Tensor& start,
                                           int64_t sinks, const std::vector<int64_t>& starts,
                                           const at::Tensor& length) {
  RingUpdateParams p;
  p.dst[0] = dst_rows(keys);
  p.dst[1] = dst_rows(values);
  p.src[0] = src_rows(keys_new);
  p.src[1] = src_rows(values_new);
  p.positions = positions.mutable_data_ptr<int32_t>();  // the schema's (e!)
  p.pos_stride[0] = positions.stride(0);
  p.pos_stride[1] = positions.stride(1);
  p.batch = keys.size(0);
  p.heads = keys.size(1);
  p.capacity = keys.size(2);
  p.head_dim = keys.size(3);
  p.chunk = keys_new.size(2);
  p.sinks = sinks;
  p.elem = static_cast<int64_t>(keys.element_size());
  p.starts = int_rows(start);
  p.host_starts = starts.empty() ? nullptr : starts.data();
  p.lengths_out = int_rows(length);
  p.device_index = keys.device().index();
  return p;
}

using RingUpdateFn = void (*)(const RingUpdateParams&);
extern DeviceStub<RingUpdateFn> ring_update_stub;

// The quantized ring write: `ring` as for ring_update_, its dst the int8 /
// fp8 buffers (one byte per element), its src the new data in `src_dtype`
// (ring.elem: bytes per source element); the scale of each written (row,
// head, slot) goes to scale[0] (keys) / scale[1] (values), float32 (batch,
// heads, capacity) with element strides.
struct RingQuantUpdateParams {
  RingUpdateParams ring;
  KvFormat format = KvFormat::kInt8;
  FloatDtype src_dtype = FloatDtype::kFloat32;
  float* scale[2] = {nullptr, nullptr};
  int64_t scale_stride[2][3] = {};
};

using RingQuantUpdateFn = void (*)(const RingQuantUpdateParams&);
extern DeviceStub<RingQuantUpdateFn> ring_update_quantized_stub;

// A ring's positions tensor: int32, (batch, capacity), on `device`.
KVCACHE_API void check_positions(const at::Tensor& positions,
                                 const c10::SymInt& batch,
                                 const c10::SymInt& capacity,
                                 const at::Device& device);

// Checks shared with the fake kernel (values_known false while tracing).
// Returns the checked starts when they can be read here (CPU, eager).
// k_scale / v_scale: as check_update's (csrc/ops/update.h), plus: no byte
// shared with positions.
KVCACHE_API std::vector<int64_t> check_ring_update(
    const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& positions, const at::Tensor& keys_new,
    const at::Tensor& values_new, const at::Tensor& start, int64_t sinks,
    bool values_known, const std::optional<at::Tensor>& k_scale = std::nullopt,
    const std::optional<at::Tensor>& v_scale = std::nullopt);

// update_.Tensor's checks: a ring's (positions given) or a linear cache's
// (which refuses sinks other than 0: sinks apply to a ring only).
// Returns the checked starts when they can be read here (CPU, eager).
KVCACHE_API std::vector<int64_t> check_device_start_write(
    const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& keys_new, const at::Tensor& values_new,
    const at::Tensor& start, bool values_known,
    const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& positions, int64_t sinks);

// The checked ring write (update_.Tensor with positions): returns start +
// chunk (int32, the start's shape).
at::Tensor ring_write(at::Tensor& keys, at::Tensor& values,
                      const at::Tensor& positions, const at::Tensor& keys_new,
                      const at::Tensor& values_new, const at::Tensor& start,
                      int64_t sinks, const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale);

// The checks with the schemas' arguments, as the fake kernels run them.
inline void trace_check_update_tensor_(
    const at::Tensor& keys, const at::Tensor& values, const at::Tensor& keys_new,
    const at::Tensor& values_new, const at::Tensor& start,
    const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& positions, int64_t sinks) {
  check_device_start_write(keys, values, keys_new, values_new, start, false,
                           k_scale, v_scale, positions, sinks);
}
inline void trace_check_ring_update_(const at::Tensor& keys,
                                     const at::Tensor& values,
                                     const at::Tensor& positions,
                                     const at::Tensor& keys_new,
                                     const at::Tensor& values_new,
                                     const at::Tensor& start, int64_t sinks,
                                     const std::optional<at::Tensor>& k_scale,
                                     const std::optional<at::Tensor>& v_scale) {
  check_ring_update(keys, values, positions, keys_new, values_new, start,
                    sinks, false, k_scale, v_scale);
}

// The deprecated alias's checks: ring_update_'s with both scales given.
inline void trace_check_ring_update_quantized_(
    const at::Tensor& keys, const at::Tensor& values, const at::Tensor& k_scale,
    const at::Tensor& v_scale, const at::Tensor& positions,
    const at::Tensor& keys_new, const at::Tensor& values_new,
    const at::Tensor& start, int64_t sinks) {
  check_ring_update(keys, values, positions, keys_new, values_new, start,
                    sinks, false, k_scale, v_scale);
}

// update_.Tensor's stub column in operators.h: device work on a backend
// when both formats of both layouts (linear, ring) have a kernel there.
struct DeviceStartStubs {};
inline constexpr DeviceStartStubs device_start_stubs{};
inline bool has_cuda_work(DeviceStartStubs) {
  return has_cuda_work(update_stubs) && ring_update_stub.cuda != nullptr &&
         ring_update_quantized_stub.cuda != nullptr;
}

}  // namespace detail

namespace ops {

// The deprecated aliases (CompositeImplicitAutograd): update_.Tensor
// through the dispatcher with positions (and the scales) given.
at::Tensor ring_update_(at::Tensor& keys, at::Tensor& values,
                        at::Tensor& positions, const at::Tensor& keys_new,
                        const at::Tensor& values_new, const at::Tensor& start,
                        int64_t sinks, const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale);
at::Tensor ring_update_quantized_(at::Tensor& keys, at::Tensor& values,
                                  at::Tensor& k_scale, at::Tensor& v_scale,
                                  at::Tensor& positions,
                                  const at::Tensor& keys_new,
                                  const at::Tensor& values_new,
                                  const at::Tensor& start, int64_t sinks);

}  // namespace ops
}  // namespace kvcache
