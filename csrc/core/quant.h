// The quantized cache formats, written once for host and device code.
//
// A quantized cache stores keys and values as int8 or float8 e4m3 (fn:
// finite, no infinities) and, in their own float32 tensors of shape
// (batch, num_kv_heads, max_len), one scale per (row, KV head, slot):
//
//   int8  scale = max(absmax / 127, kScaleFloor), q = clamp(round(x / scale),
//         -127, 127) with round half away from zero; x ~ q * scale.
//   fp8   scale = max(absmax / 448, kScaleFloor), q = e4m3(clamp(x / scale,
//         -448, 448)) rounded to nearest even; the clamp is the explicit
//         saturation (e4m3fn has no infinity: an unclamped overflow would be
//         NaN). x ~ float(q) * scale.
//
// absmax is the largest |x| over the head_dim elements of the slot, in
// float32. The floor keeps the scale of an all-zero slot positive, so zeros
// stay exactly zero and no division by zero happens. A NaN element is
// ignored by absmax and quantized to 0; an infinite one gives an infinite
// scale (the slot then dequantizes to non-finite values, as its input was).
// Because scales are indexed like the slots, moving, dropping or reusing
// slots never re-quantizes anything.
#pragma once

#include <cstdint>

#include "params.h"

namespace kvcache {
namespace detail {

enum class KvFormat : int32_t { kPlain = 0, kInt8 = 1, kFp8 = 2 };
// The element type of the new keys and values a quantized write reads.
enum class FloatDtype : int32_t { kFloat32, kBFloat16, kFloat16 };

// Largest magnitude of each format (the scale maps absmax onto it).
constexpr float kInt8Max = 127.f;
constexpr float kFp8Max = 448.f;
// Smallest scale: FLT_MIN (the smallest normal float32).
constexpr float kScaleFloor = 1.17549435082228750797e-38f;

KVCACHE_HOST_DEVICE uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  __builtin_memcpy(&u, &x, 4);
  return u;
#endif
}

KVCACHE_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  __builtin_memcpy(&x, &u, 4);
  return x;
#endif
}

KVCACHE_HOST_DEVICE float format_max(KvFormat f) {
  return f == KvFormat::kInt8 ? kInt8Max : kFp8Max;
}

// absmax update that skips NaN (a comparison with NaN is false).
KVCACHE_HOST_DEVICE float absmax_step(float m, float x) {
  const float a = x < 0.f ? -x : x;
  return a > m ? a : m;
}

KVCACHE_HOST_DEVICE float slot_scale(float absmax, KvFormat f) {
  const float s = absmax / format_max(f);
  return s > kScaleFloor ? s : kScaleFloor;
}

// x / scale, clamped to the format's range; NaN becomes 0.
KVCACHE_HOST_DEVICE float scaled_clamped(float x, float scale, KvFormat f) {
  float y = x / scale;
  const float hi = format_max(f);
  if (!(y == y)) y = 0.f;
  if (y > hi) y = hi;
  if (y < -hi) y = -hi;
  return y;
}

// int8: round half away from zero of an already clamped value.
KVCACHE_HOST_DEVICE int8_t to_int8(float y) {
  const float a = y < 0.f ? -y : y;
  // floor(a + 0.5) in float could round a + 0.5 up (a = 0.49999997): add in
  // two steps that are exact instead. t = trunc(a) is exact, a - t in [0, 1).
  const float t = static_cast<float>(static_cast<int32_t>(a));
  const int32_t r = static_cast<int32_t>(t) + (a - t >= 0.5f ? 1 : 0);
  return static_cast<int8_t>(y < 0.f ? -r : r);
}

// float32 -> e4m3fn bits, round to nearest even, for |y| <= 448 (clamped by
// scaled_clamped; never NaN). e4m3fn: 1 sign, 4 exponent bits (bias 7),
// 3 mantissa bits; subnormals below 2^-6, steps of 2^-9.
KVCACHE_HOST_DEVICE uint8_t to_e4m3_bits(float y) {
  uint32_t u = float_bits(y);
  const uint32_t sign = (u >> 24) & 0x80u;
  u &= 0x7fffffffu;
  uint32_t out;
  if (u < 0x3c800000u) {  // |y| < 2^-6: subnormal (or zero) in e4m3
    // Steps of 2^-9: round |y| * 2^9 (exact, a power of two) to an integer,
    // nearest even, by adding and removing 1.5 * 2^23 (whose ulp is 1).
    const float scaled = bits_float(u) * 512.f;
    const float magic = 12582912.f;  // 1.5 * 2^23: ulp 1
    const float r = (scaled + magic) - magic;
    out = static_cast<uint32_t>(r);  // 0..8 (8 = the smallest normal)
  } else {
    // Normal: keep 3 mantissa bits of 23, nearest even, re-bias 127 -> 7.
    const uint32_t odd = (u >> 20) & 1u;
    u += 0x7ffffu + odd;
    out = (u >> 20) - (120u << 3);
  }
  return static_cast<uint8_t>(out | sign);
}

// e4m3fn bits -> float32 (exact). Our writes never produce the NaN bytes (0x7f, 0xff), but pages
// written elsewhere (vLLM, a NaN input) may hold them: NaN, as c10's conversion and CUDA read them.
KVCACHE_HOST_DEVICE float from_e4m3_bits(uint8_t b) {
  const uint32_t mag = b & 0x7fu;
  const uint32_t e = mag >> 3, m = mag & 7u;
  float v;
  if (mag == 0x7fu) {
    v = bits_float(0x7fc00000u);
  } else if (e == 0) {
    v = static_cast<float>(m) * (1.f / 512.f);
  } else {
    v = bits_float(((e + 120u) << 23) | (m << 20));
  }
  return (b & 0x80u) ? -v : v;
}

}  // namespace detail
}  // namespace kvcache
