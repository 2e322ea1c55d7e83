// The write operators of a contiguous cache: update_ (host start),
// update_.Tensor (start read on the device), append_ (start = the caller's
// lengths, advanced in place) and append_returning_ (append_ that returns
// the new lengths).
//
// All of them copy keys_new / values_new (batch, heads, chunk, head_dim)
// into rows [start_b, start_b + chunk) of keys / values (batch, heads,
// max_len, head_dim), both buffers in one pass. The format of the write
// comes from the cache's dtype and the optional k_scale / v_scale (one
// schema per kind of start, not per format):
//   no scales       a plain write: keys_new has the cache's dtype, copied
//                   bit for bit (any dtype, int8 and float8_e4m3fn too: a
//                   plain int8 cache holds what it is given);
//   both scales     a quantized write: int8 / float8_e4m3fn keys and values,
//                   float32 / bfloat16 / float16 new data quantized per (row,
//                   head, slot), its float32 scales written into k_scale /
//                   v_scale (batch, heads, max_len) (formats in core/quant.h).
// They share one set of checks (check_update_*, also run by the fake
// kernels while tracing) and one device stub per format and backend.
//
// update_quantized_, update_quantized_.Tensor and append_quantized_ are
// deprecated aliases of these writes with the scales given (kept for one
// release): CompositeImplicitAutograd kernels that call the new operator
// through the dispatcher, so tracing sees only the new one.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <vector>

#include "../core/checks.h"
#include "../core/device_stub.h"
#include "kvcache/export.h"
#include "../core/params.h"
#include "../core/quant.h"
#include "../core/tensor_params.h"

namespace kvcache {
namespace detail {

struct UpdateParams {
  DstRows dst[2];  // keys, values
  SrcRows src[2];  // keys_new, values_new
  int64_t batch = 0;
  int64_t num_kv_heads = 0;
  int64_t chunk = 0;
  int64_t head_dim = 0;
  int64_t max_len = 0;
  int64_t elem = 0;  // bytes per element
  // Where row b starts. CPU: host_starts (checked; one entry, or one per
  // row). CUDA: `starts` on the device when present (update_.Tensor's
  // start, append_'s lengths; checked by the kernel), else `start`.
  int64_t start = 0;
  IntRows starts;
  const int64_t* host_starts = nullptr;
  // Receives start_b + chunk: the op's new length tensor (update_,
  // update_.Tensor) or the caller's lengths, in place (append_).
  IntRows lengths_out;
  // The tensors' device index (CUDA: the device the kernels run on).
  int device_index = -1;
};

// A write's parameters but its start fields (start / starts / host_starts /
// lengths_out, which each entry sets): keys_new / values_new (batch,
// num_kv_heads, chunk, head_dim) into keys / values at each row's start.
inline UpdateParams update_params(at::Tensor& keys, at::Tensor& values,
                                  const at::Tensor& keys_new, const at::Tensor& values_new) {
  UpdateParams p;
  p.dst[0] = dst_rows(keys);
  p.dst[1] = dst_rows(values);
  p.src[0] = src_rows(keys_new);
  p.src[1] = src_rows(values_new);
  p.batch = keys.size(0);
  p.num_kv_heads = keys.size(1);
  p.max_len = keys.size(2);
  p.head_dim = keys.size(3);
  p.chunk = keys_new.size(2);
  p.elem = static_cast<int64_t>(keys.element_size());
  p.device_index = keys.device().index();
  return p;
}

using UpdateFn = void (*)(const UpdateParams&);
extern DeviceStub<UpdateFn> update_stub;

// The quantized format of the writes (k_scale / v_scale given; formats in
// core/quant.h): `base` as for a plain write, its
// dst the int8/fp8 buffers and its src the new data in `src_dtype`; each
// (row, head, slot) of the chunk also gets its scale in scale[0] (keys) /
// scale[1] (values), float32 (batch, heads, max_len) with element strides.
struct QuantUpdateParams {
  UpdateParams base;
  KvFormat format = KvFormat::kInt8;
  FloatDtype src_dtype = FloatDtype::kFloat32;
  float* scale[2] = {nullptr, nullptr};
  int64_t scale_stride[2][3] = {};
};
using QuantUpdateFn = void (*)(const QuantUpdateParams&);
extern DeviceStub<QuantUpdateFn> quant_update_stub;

// Checks shared by eager kernels and fake kernels. `values_known` is false
// while tracing: a device tensor's values are then checked by the kernel.
// k_scale / v_scale: both absent (a plain write: keys_new / values_new of
// the cache's dtype) or both present (a quantized write: an int8 /
// float8_e4m3fn cache, float32 / bfloat16 / float16 new data of one dtype,
// and scales that are writable float32 (batch, num_kv_heads, max_len) on the
// cache's device sharing no byte with themselves, each other, keys, values,
// the new data or a start/lengths tensor). Anything else raises
// c10::ValueError / c10::TypeError naming the argument.
KVCACHE_API void check_update(const at::Tensor& keys, const at::Tensor& values,
                              const at::Tensor& keys_new,
                              const at::Tensor& values_new,
                              const c10::SymInt& start,
                              const std::optional<at::Tensor>& k_scale = std::nullopt,
                              const std::optional<at::Tensor>& v_scale = std::nullopt);
KVCACHE_API std::vector<int64_t> check_update_tensor(
    const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& keys_new, const at::Tensor& values_new,
    const at::Tensor& start, bool values_known,
    const std::optional<at::Tensor>& k_scale = std::nullopt,
    const std::optional<at::Tensor>& v_scale = std::nullopt);
KVCACHE_API std::vector<int64_t> check_append(
    const at::Tensor& keys, const at::Tensor& values, const at::Tensor& lengths,
    const at::Tensor& keys_new, const at::Tensor& values_new, bool values_known,
    const std::optional<at::Tensor>& k_scale = std::nullopt,
    const std::optional<at::Tensor>& v_scale = std::nullopt);

// The checks with each schema's arguments, as a fake kernel runs them
// (values unknown: a start or lengths tensor is checked by the kernel).
inline void trace_check_update_(const at::Tensor& keys, const at::Tensor& values,
                                const at::Tensor& keys_new,
                                const at::Tensor& values_new, c10::SymInt start,
                                const std::optional<at::Tensor>& k_scale,
                                const std::optional<at::Tensor>& v_scale) {
  check_update(keys, values, keys_new, values_new, start, k_scale, v_scale);
}
// (update_.Tensor's, which also takes a ring's positions: csrc/ops/ring.h.)
inline void trace_check_append_returning_(
    const at::Tensor& keys, const at::Tensor& values, const at::Tensor& lengths,
    const at::Tensor& keys_new, const at::Tensor& values_new,
    const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale) {
  check_append(keys, values, lengths, keys_new, values_new, false, k_scale,
               v_scale);
}
inline void trace_check_append_(const at::Tensor& keys, const at::Tensor& values,
                                const at::Tensor& lengths,
                                const at::Tensor& keys_new,
                                const at::Tensor& values_new,
                                const std::optional<at::Tensor>& k_scale,
                                const std::optional<at::Tensor>& v_scale) {
  check_append(keys, values, lengths, keys_new, values_new, false, k_scale,
               v_scale);
}

// The deprecated aliases' checks: the new writes' with both scales given.
inline void trace_check_update_quantized_(
    const at::Tensor& keys, const at::Tensor& values, const at::Tensor& k_scale,
    const at::Tensor& v_scale, const at::Tensor& keys_new,
    const at::Tensor& values_new, c10::SymInt start) {
  check_update(keys, values, keys_new, values_new, start, k_scale, v_scale);
}
inline void trace_check_update_quantized_tensor_(
    const at::Tensor& keys, const at::Tensor& values, const at::Tensor& k_scale,
    const at::Tensor& v_scale, const at::Tensor& keys_new,
    const at::Tensor& values_new, const at::Tensor& start) {
  check_update_tensor(keys, values, keys_new, values_new, start, false, k_scale,
                      v_scale);
}
inline void trace_check_append_quantized_(
    const at::Tensor& keys, const at::Tensor& values, const at::Tensor& k_scale,
    const at::Tensor& v_scale, const at::Tensor& lengths,
    const at::Tensor& keys_new, const at::Tensor& values_new) {
  check_append(keys, values, lengths, keys_new, values_new, false, k_scale,
               v_scale);
}

// The stub column of the writes in operators.h: a write has device work on
// a backend when both of its formats (plain, quantized) have a kernel there.
struct UpdateStubs {};
inline constexpr UpdateStubs update_stubs{};
inline bool has_cuda_work(UpdateStubs) {
  return update_stub.cuda != nullptr && quant_update_stub.cuda != nullptr;
}

// The fields a quantized write adds to its device params (QuantUpdateParams,
// RingQuantUpdateParams: the same names), from checked tensors: the cache's
// format, the new data's dtype and both scales' pointers and strides.
template <typename Q>
void fill_quant_fields(Q& q, const at::Tensor& keys, const at::Tensor& keys_new,
                       const at::Tensor& k_scale, const at::Tensor& v_scale) {
  q.format = format_of(keys.scalar_type());
  q.src_dtype = float_dtype_of(keys_new.scalar_type());
  const at::Tensor* sc[2] = {&k_scale, &v_scale};
  for (int w = 0; w < 2; ++w) {
    q.scale[w] = sc[w]->mutable_data_ptr<float>();
    for (int k = 0; k < 3; ++k) q.scale_stride[w][k] = sc[w]->stride(k);
  }
}

}  // namespace detail

// Operator entry points (registered in csrc/schema.cpp). k_scale /
// v_scale: see check_update.
namespace ops {

at::Tensor update_(at::Tensor& keys, at::Tensor& values,
                   const at::Tensor& keys_new, const at::Tensor& values_new,
                   int64_t start, const std::optional<at::Tensor>& k_scale,
                   const std::optional<at::Tensor>& v_scale);
// update_.Tensor: with positions, the write of a ring (csrc/ops/ring.h).
at::Tensor update_tensor_(at::Tensor& keys, at::Tensor& values,
                          const at::Tensor& keys_new,
                          const at::Tensor& values_new, const at::Tensor& start,
                          const std::optional<at::Tensor>& k_scale,
                          const std::optional<at::Tensor>& v_scale,
                          const std::optional<at::Tensor>& positions,
                          int64_t sinks);
void append_(at::Tensor& keys, at::Tensor& values, at::Tensor& lengths,
             const at::Tensor& keys_new, const at::Tensor& values_new,
             const std::optional<at::Tensor>& k_scale,
             const std::optional<at::Tensor>& v_scale);
at::Tensor append_returning_(at::Tensor& keys, at::Tensor& values,
                             const at::Tensor& lengths,
                             const at::Tensor& keys_new,
                             const at::Tensor& values_new,
                             const std::optional<at::Tensor>& k_scale,
                             const std::optional<at::Tensor>& v_scale);

// The deprecated aliases (CompositeImplicitAutograd kernels): each calls
// the write above through the dispatcher with k_scale / v_scale given.
at::Tensor update_quantized_(at::Tensor& keys, at::Tensor& values,
                             at::Tensor& k_scale, at::Tensor& v_scale,
                             const at::Tensor& keys_new,
                             const at::Tensor& values_new, c10::SymInt start);
at::Tensor update_quantized_tensor_(at::Tensor& keys, at::Tensor& values,
                                    at::Tensor& k_scale, at::Tensor& v_scale,
                                    const at::Tensor& keys_new,
                                    const at::Tensor& values_new,
                                    const at::Tensor& start);
void append_quantized_(at::Tensor& keys, at::Tensor& values,
                       at::Tensor& k_scale, at::Tensor& v_scale,
                       at::Tensor& lengths, const at::Tensor& keys_new,
                       const at::Tensor& values_new);

}  // namespace ops
}  // namespace kvcache
