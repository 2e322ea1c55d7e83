// The CPU quantizer of one (buffer, row, head) run of slots, shared by the
// linear quantized writes (quant_update.cpp) and the slot-mapped ones, ring
// and paged (slot_write.h): each slot's head_dim elements are read once into float32,
// their absmax gives the slot's scale, and they are written quantized next
// to it (formats in csrc/core/quant.h).
#pragma once

#include <cstdint>

#include "../core/quant.h"

namespace kvcache {
namespace cpu {

template <typename T>
inline float load_elem(const char* p) {
  return static_cast<float>(*reinterpret_cast<const T*>(p));
}

// Quantizes `chunk` consecutive slots of head_dim elements at src (byte
// strides) into dst (byte strides) and their scales (element stride).
// `row` is head_dim floats of scratch.
template <typename T, detail::KvFormat F>
void quantize_slab(const char* src, int64_t src_row, int64_t src_elem,
                   char* dst, int64_t dst_row, int64_t dst_elem, float* scale,
                   int64_t scale_stride, int64_t chunk, int64_t dim,
                   float* row) {
  for (int64_t t = 0; t < chunk; ++t) {
    const char* s = src + t * src_row;
    float m = 0.f;
    for (int64_t d = 0; d < dim; ++d) {
      row[d] = load_elem<T>(s + d * src_elem);
      m = detail::absmax_step(m, row[d]);
    }
    const float sc = detail::slot_scale(m, F);
    char* o = dst + t * dst_row;
    for (int64_t d = 0; d < dim; ++d) {
      const float y = detail::scaled_clamped(row[d], sc, F);
      const uint8_t bits = F == detail::KvFormat::kInt8
                               ? static_cast<uint8_t>(detail::to_int8(y))
                               : detail::to_e4m3_bits(y);
      *reinterpret_cast<uint8_t*>(o + d * dst_elem) = bits;
    }
    scale[t * scale_stride] = sc;
  }
}

}  // namespace cpu
}  // namespace kvcache
