#include "ring.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <string>

#include "../core/checks.h"
#include "../core/overlap.h"
#include "../core/tensor_params.h"
#include "kvcache/kvcache.h"
#include "update.h"

namespace kvcache {
namespace detail {

DeviceStub<RingUpdateFn> ring_update_stub;
DeviceStub<RingQuantUpdateFn> ring_update_quantized_stub;

void check_positions(const at::Tensor& positions, const c10::SymInt& batch,
                     const c10::SymInt& capacity, const at::Device& device) {
  check_dense(positions, "positions");
  TORCH_CHECK_TYPE(positions.scalar_type() == at::kInt,
                   "positions must be an int32 tensor, got dtype ",
                   py_dtype(positions.scalar_type()));
  TORCH_CHECK_VALUE(positions.dim() == 2 &&
                        holds(positions.sym_size(0).sym_eq(batch)) &&
                        holds(positions.sym_size(1).sym_eq(capacity)),
                    "positions must have shape (batch=", shown(batch),
                    ", capacity=", shown(capacity),
                    ") to match the cache, got ", shape_str(positions));
  check_device(positions, device, "positions", "the cache's device");
}

std::vector<int64_t> check_ring_update(
    const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& positions, const at::Tensor& keys_new,
    const at::Tensor& values_new, const at::Tensor& start, int64_t sinks,
    bool values_known, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale) {
  // Shapes, dtypes, devices, the start's metadata, the scales (both or
  // neither; their shapes, dtype and aliasing) and the aliasing rules of
  // update_.Tensor (new data may not view the cache at all); not the
  // start's values, whose bound differs (a ring has no end).
  check_update_tensor(keys, values, keys_new, values_new, start, false,
                      k_scale, v_scale);
  const c10::SymInt capacity = keys.sym_size(2);
  check_positions(positions, keys.sym_size(0), capacity, keys.device());
  check_writable(positions, "positions");
  TORCH_CHECK_VALUE(!self_overlaps(positions),
                    "positions must not have internally overlapping memory "
                    "(it is written, one entry per slot)");
  const Box pb = box_of(positions);
  for (const auto& [t, name] :
       {std::pair<const at::Tensor&, const char*>{keys, "keys"},
        {values, "values"},
        {keys_new, "keys_new"},
        {values_new, "values_new"},
        {start, "start"}}) {
    TORCH_CHECK_VALUE(!overlaps(pb, box_of(t)),
                      "positions must not share memory with ", name);
  }
  if (k_scale.has_value()) {  // both: check_update_tensor refused one alone
    TORCH_CHECK_VALUE(!overlaps(pb, box_of(*k_scale)) && !overlaps(pb, box_of(*v_scale)),
                      "positions must not share memory with k_scale or v_scale");
  }
  TORCH_CHECK_VALUE(sinks >= 0, "sinks must be >= 0, got ", sinks);
  TORCH_CHECK_VALUE(holds(capacity.sym_gt(sinks)),
                    "a ring needs more slots than sinks: capacity=",
                    shown(capacity), ", sinks=", sinks);

  std::vector<int64_t> starts;
  if (!values_known || !start.device().is_cpu()) return starts;
  const int64_t chunk = keys_new.size(2);
  const bool shared = start.dim() == 0;
  starts.resize(static_cast<size_t>(start.numel()));
  for (int64_t b = 0; b < start.numel(); ++b) {
    const int64_t s = row_value(start, b);
    const std::string at = shared ? "" : " at index " + std::to_string(b);
    TORCH_CHECK_VALUE(s >= 0, "start must be >= 0, got ", s, at);
    // Never s + chunk > kMaxLen: the sum can overflow for s near 2^63.
    TORCH_CHECK_VALUE(s <= kMaxLen - chunk,
                      "ring overflow: start + chunk must be <= ", kMaxLen,
                      " (positions and lengths are int32), got start=", s,
                      ", chunk=", chunk, at);
    starts[b] = s;
  }
  return starts;
}

std::vector<int64_t> check_device_start_write(
    const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& keys_new, const at::Tensor& values_new,
    const at::Tensor& start, bool values_known,
    const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& positions, int64_t sinks) {
  if (positions.has_value()) {
    return check_ring_update(keys, values, *positions, keys_new, values_new,
                             start, sinks, values_known, k_scale, v_scale);
  }
  TORCH_CHECK_VALUE(sinks == 0, "sinks apply to a ring (positions given): a write without "
                    "positions takes sinks=0, got sinks=", sinks);
  return check_update_tensor(keys, values, keys_new, values_new, start,
                             values_known, k_scale, v_scale);
}

at::Tensor ring_write(at::Tensor& keys, at::Tensor& values,
                      const at::Tensor& positions, const at::Tensor& keys_new,
                      const at::Tensor& values_new, const at::Tensor& start,
                      int64_t sinks, const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale) {
  const auto starts = check_ring_update(keys, values, positions, keys_new,
                                        values_new, start, sinks, true, k_scale,
                                        v_scale);
  at::Tensor length = at::empty(start.sizes(), keys.options().dtype(at::kInt));
  const auto p = ring_update_params(keys, values, positions, keys_new, values_new, start,
                                    sinks, starts, length);
  if (!k_scale.has_value()) {
    ring_update_stub.get(keys.device().type(), "update_.Tensor (a ring)")(p);
    return length;
  }
  RingQuantUpdateParams q;
  q.ring = p;
  q.ring.elem = static_cast<int64_t>(keys_new.element_size());  // source elements
  fill_quant_fields(q, keys, keys_new, *k_scale, *v_scale);
  ring_update_quantized_stub.get(keys.device().type(), "update_.Tensor (a ring)")(q);
  return length;
}

}  // namespace detail

namespace ops {

at::Tensor ring_update_(at::Tensor& keys, at::Tensor& values,
                        at::Tensor& positions, const at::Tensor& keys_new,
                        const at::Tensor& values_new, const at::Tensor& start,
                        int64_t sinks, const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale) {
  // The C++ API's update_.Tensor, through the dispatcher: tracing
  // decomposes the alias into update_.Tensor.
  return kvcache::update_(keys, values, keys_new, values_new, start, k_scale,
                          v_scale, positions, sinks);
}

at::Tensor ring_update_quantized_(at::Tensor& keys, at::Tensor& values,
                                  at::Tensor& k_scale, at::Tensor& v_scale,
                                  at::Tensor& positions,
                                  const at::Tensor& keys_new,
                                  const at::Tensor& values_new,
                                  const at::Tensor& start, int64_t sinks) {
  // The C++ API's update_.Tensor, through the dispatcher: tracing
  // decomposes the alias into update_.Tensor.
  return kvcache::update_(keys, values, keys_new, values_new, start, k_scale,
                          v_scale, positions, sinks);
}

}  // namespace ops
}  // namespace kvcache
