// The CUDA quantizer of one slot, shared by the linear quantized writes
// (update.cu) and the quantized ring write (ring.cu): one warp reads the
// slot's head_dim elements, a shuffle reduction gives the absmax, then each
// lane writes its quantized elements and lane 0 the scale (formats in
// csrc/core/quant.h). Every lane of the warp must call it.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

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

// The key and value sides of a quantized write, as one kernel argument:
// source and destination byte strides (SD and DD of them: slab or page
// geometry), the scales' element strides. A block writes one side.
template <int SD, int DD>
struct QuantSides {
  const char* src[2];
  int64_t ss[2][SD];
  char* dst[2];
  int64_t ds[2][DD];
  float* scale[2];
  int64_t cs[2][3];
};

template <int SD, int DD>
struct QuantSide {
  const char* src;
  int64_t ss[SD];
  char* dst;
  int64_t ds[DD];
  float* scale;
  int64_t cs[3];
};

// Side `which` (0: keys, 1: values), selected by value: indexing the
// parameter arrays with a runtime index would copy the whole parameter
// block to local memory.
template <int SD, int DD>
__device__ __forceinline__ QuantSide<SD, DD> quant_side(const QuantSides<SD, DD>& a,
                                                        bool which) {
  QuantSide<SD, DD> s;
  s.src = which ? a.src[1] : a.src[0];
  s.dst = which ? a.dst[1] : a.dst[0];
  s.scale = which ? a.scale[1] : a.scale[0];
  for (int k = 0; k < SD; ++k) s.ss[k] = which ? a.ss[1][k] : a.ss[0][k];
  for (int k = 0; k < DD; ++k) s.ds[k] = which ? a.ds[1][k] : a.ds[0][k];
  for (int k = 0; k < 3; ++k) s.cs[k] = which ? a.cs[1][k] : a.cs[0][k];
  return s;
}

// The sides from each side's (0: keys, 1: values) pointers and strides: SD
// source and DD destination byte strides, 3 scale element strides.
template <int SD, int DD>
QuantSides<SD, DD> quant_sides(const char* const (&src)[2], const int64_t* const (&ss)[2],
                               char* const (&dst)[2], const int64_t* const (&ds)[2],
                               float* const (&scale)[2], const int64_t* const (&cs)[2]) {
  QuantSides<SD, DD> a{};
  for (int w = 0; w < 2; ++w) {
    a.src[w] = src[w];
    a.dst[w] = dst[w];
    a.scale[w] = scale[w];
    for (int k = 0; k < SD; ++k) a.ss[w][k] = ss[w][k];
    for (int k = 0; k < DD; ++k) a.ds[w][k] = ds[w][k];
    for (int k = 0; k < 3; ++k) a.cs[w][k] = cs[w][k];
  }
  return a;
}

// The sides of a write into (batch, heads, slots, head_dim) slabs: a linear
// cache's or a ring's (ops/update.h, ops/ring.h: src/dst rows with byte
// strides, scales with element strides).
template <typename Src, typename Dst>
QuantSides<4, 4> slab_sides(const Src (&src)[2], const Dst (&dst)[2], float* const (&scale)[2],
                            const int64_t (&scale_stride)[2][3]) {
  return quant_sides<4, 4>({src[0].data, src[1].data}, {src[0].stride, src[1].stride},
                           {dst[0].data, dst[1].data}, {dst[0].stride, dst[1].stride}, scale,
                           {scale_stride[0], scale_stride[1]});
}

// Calls f(T{}, Format{}) for a quantized write's source element type T and
// its format (Format::value: kInt8, or kFp8): the host's choice of kernel
// instance.
template <typename Fn>
void with_quant_types(detail::FloatDtype dtype, detail::KvFormat format, Fn&& f) {
  auto with_format = [&](auto t) {
    if (format == detail::KvFormat::kInt8) {
      f(t, std::integral_constant<detail::KvFormat, detail::KvFormat::kInt8>{});
    } else {
      f(t, std::integral_constant<detail::KvFormat, detail::KvFormat::kFp8>{});
    }
  };
  switch (dtype) {
    case detail::FloatDtype::kFloat32: return with_format(float{});
    case detail::FloatDtype::kBFloat16: return with_format(c10::BFloat16{});
    case detail::FloatDtype::kFloat16: return with_format(c10::Half{});
  }
}

}  // namespace cuda
}  // namespace kvcache
