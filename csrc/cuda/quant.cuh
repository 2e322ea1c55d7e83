// The CUDA quantizer of one slot, shared by the linear quantized writes
// (update.cu) and the quantized ring write (ring.cu): one warp reads the
// slot's head_dim elements, a shuffle reduction gives the absmax, then each
// lane writes its quantized elements and lane 0 the scale (formats in
// csrc/core/quant.h). Every lane of the warp must call it.
#pragma once

#include <cstdint>

#include "../core/quant.h"

namespace kvcache {
namespace cuda {

template <typename T, detail::KvFormat F>
__device__ __forceinline__ void quantize_slot(const char* row, int64_t src_elem,
                                              char* out, int64_t dst_elem,
                                              float* scale, int64_t head_dim,
                                              int lane) {
  float m = 0.f;
  for (int64_t d = lane; d < head_dim; d += 32) {
    m = detail::absmax_step(m, static_cast<float>(*reinterpret_cast<const T*>(row + d * src_elem)));
  }
  for (int off = 16; off > 0; off /= 2) {
    m = detail::absmax_step(m, __shfl_xor_sync(0xffffffffu, m, off));
  }
  const float sc = detail::slot_scale(m, F);
  for (int64_t d = lane; d < head_dim; d += 32) {
    const float y = detail::scaled_clamped(
        static_cast<float>(*reinterpret_cast<const T*>(row + d * src_elem)), sc, F);
    *reinterpret_cast<uint8_t*>(out + d * dst_elem) =
        F == detail::KvFormat::kInt8 ? static_cast<uint8_t>(detail::to_int8(y))
                                     : detail::to_e4m3_bits(y);
  }
  if (lane == 0) *scale = sc;
}

}  // namespace cuda
}  // namespace kvcache
