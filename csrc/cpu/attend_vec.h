// Float vector primitives for the CPU attend kernel
// (csrc/cpu/attend_kernel.h): a portable flavour and an AVX2/FMA/F16C one of
// eight floats, and an AVX-512 F/BW/VL one of sixteen.
//
// The build compiles every CPU file for the baseline x86-64 ISA (SSE2), so
// the AVX2 and AVX-512 flavours are compiled under `#pragma GCC target`
// regions and only called after a runtime check (__builtin_cpu_supports,
// see attend.cpp).
// at::vec::Vectorized is not used: in this extension it is compiled for the
// baseline ISA, whatever the machine can do.
//
// Every flavour has the same members:
//   kLanes (floats per V), kAcc (accumulators a register tile may use),
//   V zero(), set1(float), load(const float*|BFloat16*|Half*|int8_t*|
//   Float8_e4m3fn*) (widening to float32; int8 and e4m3 are the quantized
//   caches' elements, exact in float32), store(float*, V), add, sub, mul,
//   fma(a, b, c) = a * b + c, max,
//   reduce_add, reduce_max, hsum8(const V[8], float*) and hsum16(const V[16],
//   float*) (out[k] = sum of the lanes of in[k]), exp2 (exact 0 below 2^-126, so a -inf score gives an
//   exact 0 weight; NaN propagates), tanh, transpose8x8(src, lds, dst, ldd)
//   (dst[c * ldd + r] = src[r * lds + c] for an 8 x 8 float tile: the chunk
//   kernels' key packing, whatever kLanes is); and kI8Dot / I8, whether int8
//   caches with 16-bit queries take integer dot products, and their
//   primitives (I8DotAvx2, for AVX2 and AVX-512; I8DotAvx512Vnni with
//   AVX512-VNNI; void for the portable flavour);
//   kBf16Dot / Bf16, whether bf16 tasks over a bf16 cache take bf16 pair dot
//   products and their primitives (Bf16DotAvx512, for VecAvx512Bf16 only;
//   void elsewhere).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "../core/quant.h"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define KVCACHE_ATTEND_X86 1
#include <immintrin.h>
#else
#define KVCACHE_ATTEND_X86 0
#endif

namespace kvcache {
namespace attend_cpu {

// Portable: GCC/Clang vector extensions (eight floats; two SSE2 or NEON
// registers), the same algorithms as VecAvx2 in plain vector arithmetic.
// The kernel on machines without AVX2 (aarch64 included), and a second
// implementation the tests can force (KVCACHE_ATTEND_ISA=generic).
// 32-byte vectors passed by value between inline functions: the ABI note
// GCC gives for them without AVX does not apply (nothing crosses a library
// boundary).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
struct VecGeneric {
  typedef float V __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(32)));
  static constexpr const char* kName = "generic";
  static constexpr int kLanes = 8;
  static constexpr int kAcc = 8;
  static constexpr bool kI8Dot = false;  // int8 caches take the float loops
  using I8 = void;
  static constexpr bool kBf16Dot = false;  // bf16 chunks widen to float32
  using Bf16 = void;

  static inline V zero() { return set1(0.f); }
  static inline V set1(float x) { return V{x, x, x, x, x, x, x, x}; }
  static inline V load(const float* p) {
    V r;
    std::memcpy(&r, p, sizeof(r));
    return r;
  }
  static inline V load(const c10::BFloat16* p) {
    uint16_t h[8];
    std::memcpy(h, p, sizeof(h));
    const I w = I{h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]} << 16;  // the top half of a float32
    return (V)w;
  }
  static inline V load(const c10::Half* p) {
    V r;
    for (int i = 0; i < 8; ++i) r[i] = static_cast<float>(p[i]);
    return r;
  }
  static inline V load(const int8_t* p) {
    V r;
    for (int i = 0; i < 8; ++i) r[i] = static_cast<float>(p[i]);
    return r;
  }
  static inline V load(const c10::Float8_e4m3fn* p) {
    V r;
    for (int i = 0; i < 8; ++i) r[i] = detail::from_e4m3_bits(p[i].x);
    return r;
  }
  static inline void store(float* p, V a) { std::memcpy(p, &a, sizeof(a)); }
  static inline void pin(V&) {}
  static inline void transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
    for (int r = 0; r < 8; ++r) {
      for (int c = 0; c < 8; ++c) dst[c * ldd + r] = src[r * lds + c];
    }
  }
  static inline V add(V a, V b) { return a + b; }
  static inline V sub(V a, V b) { return a - b; }
  static inline V mul(V a, V b) { return a * b; }
  static inline V fma(V a, V b, V c) { return a * b + c; }
  // Lanes of b where the mask (all ones / all zeros) is set, else of a.
  static inline V select(I mask, V b, V a) { return (V)(((I)b & mask) | ((I)a & ~mask)); }
  static inline V max(V a, V b) { return select(a < b, b, a); }
  static inline float reduce_add(V a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
  }
  static inline float reduce_max(V a) {
    float m = a[0];
    for (int i = 1; i < 8; ++i) m = m < a[i] ? a[i] : m;
    return m;
  }
  static inline void hsum8(const V* in, float* out) {
    for (int k = 0; k < 8; ++k) out[k] = reduce_add(in[k]);
  }
  static inline void hsum16(const V* in, float* out) {
    hsum8(in, out);
    hsum8(in + 8, out + 8);
  }
  // As VecAvx2::exp2; round-to-nearest by adding and removing 1.5 * 2^23.
  static inline V exp2(V x) {
    const V lo = set1(-126.f), hi = set1(127.f), magic = set1(12582912.f);
    const I under = x < lo;
    V xc = select(x < lo, lo, x);  // NaN compares false and stays
    xc = select(xc > hi, hi, xc);
    const V shifted = xc + magic;
    const V n = shifted - magic;
    const V f = xc - n;
    V p = set1(1.5252733804059838e-05f);
    p = p * f + set1(1.5403530393381606e-04f);
    p = p * f + set1(1.3333558146428441e-03f);
    p = p * f + set1(9.618129107628477e-03f);
    p = p * f + set1(5.5504108664821576e-02f);
    p = p * f + set1(2.402265069591007e-01f);
    p = p * f + set1(6.931471805599453e-01f);
    p = p * f + set1(1.f);
    const I e = (((I)shifted - (I)magic) + 127) << 23;
    return (V)((I)(p * (V)e) & ~under);
  }
  // As VecAvx2::tanh.
  static inline V tanh(V x) {
    const I sign = (I)set1(-0.f);
    const V ax = (V)((I)x & ~sign);
    const V one = set1(1.f);
    const V e = exp2(ax * set1(-2.8853900817779268f));
    const V big = (one - e) / (one + e);
    const V x2 = ax * ax;
    V p = set1(-1382.f / 155925.f);
    p = p * x2 + set1(62.f / 2835.f);
    p = p * x2 + set1(-17.f / 315.f);
    p = p * x2 + set1(2.f / 15.f);
    p = p * x2 + set1(-1.f / 3.f);
    p = p * x2 + one;
    const V r = select(ax < set1(0.3f), p * ax, big);
    return (V)((I)r | ((I)x & sign));
  }
};
#pragma GCC diagnostic pop

#if KVCACHE_ATTEND_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// Integer dot products of int8 keys with int16 queries (AVX2): a quantized
// int8 cache's scores without widening every key to float32. vpmaddwd takes
// sixteen int16 pairs a uop (one int8 -> int16 widening a key vector,
// shared by the task's query rows), where the float path spends a widening,
// a conversion and two FMAs per eight elements. Each query row is rounded
// to int16 with its own scale (absmax / 32767, a relative error near 1e-5,
// far below the keys' int8 rounding); the int32 sums are exact while
// head_dim * 32767 * 128 < 2^31 (head_dim <= kMaxDim).
struct I8DotAvx2 {
  using VI = __m256i;
  static constexpr int kLanes = 16;      // int16 per vector
  static constexpr int kMaxDim = 256;    // exact int32 sums, with margin
  static constexpr int kQMax = 32767;    // queries' int16 range

  static inline VI zero() { return _mm256_setzero_si256(); }
  static inline VI load_k(const int8_t* p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline VI load_q(const int16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  // acc + pairwise products of q and k, summed in pairs into int32 lanes.
  static inline VI dot_acc(VI acc, VI q, VI k) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(q, k));
  }
  // Ends an accumulator's update here: without it GCC hoists all of a
  // tile's vpmaddwd above their vpaddd, each product needs a register of
  // its own and a 3 x 8 tile's accumulators spill to the stack. ("v": any
  // vector register the target has, ymm16-31 too on AVX-512.)
  static inline void pin(VI& a) { asm("" : "+v"(a)); }
  // Values, two slots at a time: the int16 pairs (a[d], b[d]) of the rows
  // a and b at columns [0, 8) into lo and [8, 16) into hi, so that one
  // vpmaddwd with a broadcast weight pair (wa, wb) gives
  // wa * a[d] + wb * b[d] in int32 lane d.
  static inline void load_v_pair(const int8_t* a, const int8_t* b, VI& lo, VI& hi) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
    const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    lo = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x, y));
    hi = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(x, y));
  }
  // The last slot of an odd count: its pair partner is zero.
  static inline void load_v_one(const int8_t* a, VI& lo, VI& hi) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
    const __m128i z = _mm_setzero_si128();
    lo = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x, z));
    hi = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(x, z));
  }
  // Two int16 weights (w[0], w[1]) in every int32 lane.
  static inline VI load_w_pair(const int16_t* w) {
    int32_t x;
    std::memcpy(&x, w, sizeof(x));
    return _mm256_set1_epi32(x);
  }
  // The largest of p[0, n) (weights: >= 0, or not finite from NaN data or
  // an infinite scale); false if any is NaN or infinite.
  static inline bool finite_max(const float* p, int64_t n, float& mx) {
    __m256 m = _mm256_setzero_ps();
    __m256 bad = _mm256_setzero_ps();
    const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 x = _mm256_loadu_ps(p + j);
      m = _mm256_max_ps(m, x);
      // |x| == inf or x unordered (NaN): not finite.
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(x, absmask), inf, _CMP_NLT_UQ));
    }
    float out[8];
    _mm256_storeu_ps(out, m);
    float r = 0.f;
    for (int i = 0; i < 8; ++i) r = std::max(r, out[i]);
    bool ok = _mm256_movemask_ps(bad) == 0;
    for (; j < n; ++j) {
      ok = ok && std::isfinite(p[j]);
      r = std::max(r, p[j]);
    }
    mx = r;
    return ok;
  }
  // w[j] = round(p[j] * inv) (to nearest even, as std::nearbyint) for
  // j < n; the results fit int16 (p[j] * inv <= kQMax).
  static inline void round_to_i16(const float* p, int64_t n, float inv, int16_t* w) {
    const __m256 f = _mm256_set1_ps(inv);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + j), f));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + j + 8), f));
      // packs works within 128-bit lanes: a0-3 b0-3 a4-7 b4-7, then reorder.
      const __m256i ab = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + j), ab);
    }
    for (; j < n; ++j) w[j] = static_cast<int16_t>(std::nearbyint(p[j] * inv));
  }
  // o[0, 8) = o * alpha + float(acc) * ws.
  static inline void finish(float* o, VI acc, float alpha, float ws) {
    const __m256 f = _mm256_cvtepi32_ps(acc);
    _mm256_storeu_ps(o, _mm256_fmadd_ps(f, _mm256_set1_ps(ws),
                                        _mm256_mul_ps(_mm256_loadu_ps(o), _mm256_set1_ps(alpha))));
  }
  // out[x] = float(sum of the int32 lanes of in[x]) * scale[x] for eight
  // accumulators (as VecAvx2::hsum8).
  static inline void hsum8(const VI* in, const float* scale, float* out) {
    const __m256i t0 = _mm256_hadd_epi32(in[0], in[1]);
    const __m256i t1 = _mm256_hadd_epi32(in[2], in[3]);
    const __m256i t2 = _mm256_hadd_epi32(in[4], in[5]);
    const __m256i t3 = _mm256_hadd_epi32(in[6], in[7]);
    const __m256i u0 = _mm256_hadd_epi32(t0, t1);
    const __m256i u1 = _mm256_hadd_epi32(t2, t3);
    const __m256i r = _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                                       _mm256_permute2x128_si256(u0, u1, 0x31));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(r), _mm256_loadu_ps(scale)));
  }
};

struct VecAvx2 {
  using V = __m256;
  static constexpr const char* kName = "avx2";
  static constexpr int kLanes = 8;
  static constexpr int kAcc = 8;  // of 16 ymm registers
  static constexpr bool kI8Dot = true;  // int8 scores by I8DotAvx2
  using I8 = I8DotAvx2;
  static constexpr bool kBf16Dot = false;
  using Bf16 = void;

  static inline V zero() { return _mm256_setzero_ps(); }
  static inline V set1(float x) { return _mm256_set1_ps(x); }
  static inline V load(const float* p) { return _mm256_loadu_ps(p); }
  static inline V load(const c10::BFloat16* p) {
    // bfloat16 is the top half of a float32.
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline V load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline V load(const int8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
  // e4m3fn -> float16 bits by moving the 7 exponent/mantissa bits under
  // float16's (same mantissa top, exponent bias 15 instead of 7: the value
  // times 2^-8, subnormals included), F16C to float32, times 2^8: exact.
  // The NaN bytes (magnitude 0x7f, which the move would make 480) become
  // float16 NaN (all ones), as from_e4m3_bits reads them.
  static inline V load(const c10::Float8_e4m3fn* p) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i m7 = _mm_and_si128(w, _mm_set1_epi16(0x7f));
    const __m128i nan = _mm_cmpeq_epi16(m7, _mm_set1_epi16(0x7f));
    const __m128i sgn = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
    const __m128i h = _mm_or_si128(_mm_or_si128(_mm_slli_epi16(m7, 7), sgn), nan);
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
  }
  static inline void store(float* p, V a) { _mm256_storeu_ps(p, a); }
  // Unpacks pair rows (0,1), (2,3).. lane by lane, shuffles the pairs into
  // quads, then swaps 128-bit halves: 24 shuffles for 64 elements.
  static inline void transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    // r[0..3]: columns 0,1,2,3 of rows 0-3 (low half) and columns 4-7 (high
    // half); r[4..7] the same for rows 4-7.
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
      _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
  }
  // Keeps a loaded vector in a register: GCC otherwise folds the load into
  // every FMA that uses it, one load per use, and the loop becomes load-bound.
  static inline void pin(V& a) { asm("" : "+x"(a)); }
  static inline V add(V a, V b) { return _mm256_add_ps(a, b); }
  static inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static inline V max(V a, V b) { return _mm256_max_ps(a, b); }
  static inline float reduce_add(V a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static inline float reduce_max(V a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // Eight horizontal sums at once: hadd pairs, then add the 128-bit halves.
  static inline void hsum8(const V* in, float* out) {
    const __m256 t0 = _mm256_hadd_ps(in[0], in[1]);
    const __m256 t1 = _mm256_hadd_ps(in[2], in[3]);
    const __m256 t2 = _mm256_hadd_ps(in[4], in[5]);
    const __m256 t3 = _mm256_hadd_ps(in[6], in[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1);  // lanes: in0..3 low, in0..3 high
    const __m256 u1 = _mm256_hadd_ps(t2, t3);
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                        _mm256_permute2f128_ps(u0, u1, 0x31)));
  }
  static inline void hsum16(const V* in, float* out) {
    hsum8(in, out);
    hsum8(in + 8, out + 8);
  }
  // 2^x: x = n + f with n = round(x), |f| <= 1/2; 2^f by its degree-7
  // Taylor polynomial (relative error < 1e-8 before rounding), 2^n from the
  // exponent bits. Below -126 (and -inf) the result is exactly 0.
  static inline V exp2(V x) {
    const __m256 lo = _mm256_set1_ps(-126.f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    // Operand order keeps a NaN x (max/min return their second operand).
    const __m256 xc = _mm256_min_ps(_mm256_set1_ps(127.f), _mm256_max_ps(lo, x));
    const __m256 n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(xc, n);
    __m256 p = _mm256_set1_ps(1.5252733804059838e-05f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428441e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129107628477e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821576e-02f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402265069591007e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471805599453e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
  // tanh: an odd Taylor polynomial below |x| = 0.3 (where (1 - e) / (1 + e)
  // would cancel), (1 - e) / (1 + e) with e = exp(-2|x|) above; sign restored.
  static inline V tanh(V x) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256 ax = _mm256_andnot_ps(sign, x);
    const __m256 e = exp2(_mm256_mul_ps(ax, _mm256_set1_ps(-2.8853900817779268f)));
    const __m256 one = _mm256_set1_ps(1.f);
    const __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 x2 = _mm256_mul_ps(ax, ax);
    __m256 p = _mm256_set1_ps(-1382.f / 155925.f);
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(62.f / 2835.f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-17.f / 315.f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(2.f / 15.f));
    p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-1.f / 3.f));
    p = _mm256_fmadd_ps(p, x2, one);
    const __m256 small = _mm256_mul_ps(p, ax);
    const __m256 r = _mm256_blendv_ps(big, small, _mm256_cmp_ps(ax, _mm256_set1_ps(0.3f), _CMP_LT_OQ));
    return _mm256_or_ps(r, _mm256_and_ps(sign, x));
  }
};

#pragma GCC pop_options

// AVX-512 F/BW/VL: the same algorithms on sixteen floats and 32 registers.
// Compiled on every x86-64 build, run only where the CPU has the three
// extensions (and KVCACHE_ATTEND_ISA does not force a lower path).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

struct VecAvx512 {
  using V = __m512;
  static constexpr const char* kName = "avx512";
  static constexpr int kLanes = 16;
  static constexpr int kAcc = 16;  // of 32 zmm registers
  // int8 scores by I8DotAvx2's 256-bit loops (the same code the AVX2 path
  // runs and the tests check on AVX2 machines).
  static constexpr bool kI8Dot = true;
  using I8 = I8DotAvx2;
  static constexpr bool kBf16Dot = false;  // VecAvx512Bf16 has them
  using Bf16 = void;

  static inline V zero() { return _mm512_setzero_ps(); }
  static inline V set1(float x) { return _mm512_set1_ps(x); }
  static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  // 256-bit: the same code as the AVX2 flavour's (a 16-lane flavour still
  // packs keys by 8 x 8 tiles).
  static inline void transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
    VecAvx2::transpose8x8(src, lds, dst, ldd);
  }
  static inline V load(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline V load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline V load(const int8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
  // As VecAvx2's e4m3fn load, sixteen at a time.
  static inline V load(const c10::Float8_e4m3fn* p) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i m7 = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
    const __m256i nan = _mm256_cmpeq_epi16(m7, _mm256_set1_epi16(0x7f));
    const __m256i sgn = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
    const __m256i h = _mm256_or_si256(_mm256_or_si256(_mm256_slli_epi16(m7, 7), sgn), nan);
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
  }
  static inline void store(float* p, V a) { _mm512_storeu_ps(p, a); }
  static inline void pin(V& a) { asm("" : "+v"(a)); }
  static inline V add(V a, V b) { return _mm512_add_ps(a, b); }
  static inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static inline V max(V a, V b) { return _mm512_max_ps(a, b); }
  static inline float reduce_add(V a) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    return VecAvx2::reduce_add(h);
  }
  static inline float reduce_max(V a) {
    const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(a),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    return VecAvx2::reduce_max(h);
  }
  static inline void hsum8(const V* in, float* out) {
    for (int k = 0; k < 8; ++k) out[k] = reduce_add(in[k]);
  }
  // Sixteen horizontal sums at once, by halving: each step adds the upper
  // half of every vector's partial sums to its lower half and packs two
  // vectors' halves into one (256-bit halves, then 128-bit quarters, then
  // pairs and single lanes within each quarter): 30 shuffles and 15 adds
  // where sixteen reduce_add calls take 16 x 8 dependent operations (the
  // decode score tiles end in sixteen sums every 4 slots).
  static inline void hsum16(const V* in, float* out) {
    V c[8], d[4], e[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {  // c[i]: 8 partials of in[2i], then 8 of in[2i + 1]
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(in[2 * i], in[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(in[2 * i], in[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // quarter k of d[i]: 4 partials of in[4i + k]
      d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {  // quarter k of e[i]: 2 partials of in[8i + k], 2 of in[8i + 4 + k]
      e[i] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    // Lane 4k + m of f: the sum of in[4m + k]; the permutation puts it at 4m + k.
    const V f = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(idx, f));
  }
  // As VecAvx2::exp2: below -126 (and -inf) exactly 0, NaN propagates.
  static inline V exp2(V x) {
    const __m512 lo = _mm512_set1_ps(-126.f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    const __m512 xc = _mm512_min_ps(_mm512_set1_ps(127.f), _mm512_max_ps(lo, x));
    const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(xc, n);
    __m512 p = _mm512_set1_ps(1.5252733804059838e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428441e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821576e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    const __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under),
                               _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
  }
  // As VecAvx2::tanh.
  static inline V tanh(V x) {
    const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    const __m512i xi = _mm512_castps_si512(x);
    const __m512 ax = _mm512_castsi512_ps(_mm512_andnot_si512(sign, xi));
    const __m512 e = exp2(_mm512_mul_ps(ax, _mm512_set1_ps(-2.8853900817779268f)));
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512 x2 = _mm512_mul_ps(ax, ax);
    __m512 p = _mm512_set1_ps(-1382.f / 155925.f);
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(62.f / 2835.f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-17.f / 315.f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.f / 15.f));
    p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-1.f / 3.f));
    p = _mm512_fmadd_ps(p, x2, one);
    const __m512 small = _mm512_mul_ps(p, ax);
    const __mmask16 is_small = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.3f), _CMP_LT_OQ);
    const __m512 r = _mm512_mask_blend_ps(is_small, big, small);
    return _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(r), _mm512_and_si512(sign, xi)));
  }
};

#pragma GCC pop_options

// AVX512-VNNI (vpdpwssd: the int16 pair products summed into each int32
// lane and added to it, one instruction): I8DotAvx2's loops with each
// vpmaddwd + vpaddd fused, in the same 256-bit registers. The sums are the
// same integers (the pair sums fit int32, see I8DotAvx2), so the results
// are bit-identical to the avx512 path's; the integer loops' body loses
// nearly half its instructions (the key widening and loads stay).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

struct I8DotAvx512Vnni : I8DotAvx2 {
  static inline VI dot_acc(VI acc, VI q, VI k) { return _mm256_dpwssd_epi32(acc, q, k); }
};

// VecAvx512 with the fused integer loops for int8 caches (I8DotAvx512Vnni):
// the kernel path on CPUs with AVX512-VNNI (attend.cpp instantiates only the
// int8-cache tasks of 16-bit queries for it; every other task runs VecAvx512).
struct VecAvx512Vnni : VecAvx512 {
  static constexpr const char* kName = "avx512vnni";
  using I8 = I8DotAvx512Vnni;
};

#pragma GCC pop_options

// AVX512-BF16 (vdpbf16ps: two bf16 products summed into each float32 lane):
// the primitives of the bf16 chunk loops (attend_kernel.h, "Chunks on bf16
// pairs"). A W holds 16 pairs, one 32-bit word each, the lower-addressed
// bf16 in the low half (the order of a bf16 row in memory).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,avx2,fma,f16c")

struct Bf16DotAvx512 {
  using V = __m512;
  using W = __m512i;
  static inline W load(const uint32_t* p) { return _mm512_loadu_si512(p); }
  // 32 consecutive bf16 of a row: 16 pairs.
  static inline W load_row(const c10::BFloat16* p) { return _mm512_loadu_si512(p); }
  // The pair at p (two consecutive bf16) in every lane.
  static inline W set1(const c10::BFloat16* p) {
    int32_t w;
    std::memcpy(&w, p, sizeof(w));
    return _mm512_set1_epi32(w);
  }
  static inline void pin(W& a) { asm("" : "+v"(a)); }
  // acc[i] + a[2i] b[2i] + a[2i+1] b[2i+1] per lane (the products are exact
  // in float32; bf16 denormals count as 0).
  static inline V dot(V acc, W a, W b) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
  }
  // dst[0, 16) = src[0, 16) rounded to bf16 (to nearest even; NaN stays NaN).
  static inline void round16(const float* src, c10::BFloat16* dst) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<__m256i>(h));
  }
  static inline W zero() { return _mm512_setzero_si512(); }
  // The bf16 at p paired with 0, in every lane (an odd block's last slot).
  static inline W set1_lo(const c10::BFloat16* p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof(h));
    return _mm512_set1_epi32(h);
  }
  // Two slots' 32 values a[0, 32), b[0, 32) as pairs (a[c], b[c]) in two W
  // without a trip through memory: vpunpcklwd / vpunpckhwd stay in their
  // 128-bit lanes, so lo holds the columns 8L + [0, 4) of each lane L and hi
  // the columns 8L + [4, 8): the order to_pair_order puts float32 columns in.
  static inline void pair_rows(W a, W b, W& lo, W& hi) {
    lo = _mm512_unpacklo_epi16(a, b);
    hi = _mm512_unpackhi_epi16(a, b);
  }
  // x, y: float32 columns [0, 16) and [16, 32); lo, hi: the same columns in
  // pair_rows' order (lo = x[0:4] x[8:12] y[0:4] y[8:12], hi the rest).
  static inline void to_pair_order(V x, V y, V& lo, V& hi) {
    lo = _mm512_shuffle_f32x4(x, y, 0x88);  // 128-bit lanes x0 x2 y0 y2
    hi = _mm512_shuffle_f32x4(x, y, 0xdd);  // x1 x3 y1 y3
  }
  // The inverse of to_pair_order.
  static inline void from_pair_order(V lo, V hi, V& x, V& y) {
    const V a = _mm512_shuffle_f32x4(lo, hi, 0x44);  // lo0 lo1 hi0 hi1
    const V b = _mm512_shuffle_f32x4(lo, hi, 0xee);  // lo2 lo3 hi2 hi3
    x = _mm512_shuffle_f32x4(a, a, 0xd8);            // lo0 hi0 lo1 hi1
    y = _mm512_shuffle_f32x4(b, b, 0xd8);            // lo2 hi2 lo3 hi3
  }
  // dst[d] = (a[d], b[d]) for d < 16: two slots' values as 16 pairs; b
  // nullptr: (a[d], 0).
  static inline void interleave16(const c10::BFloat16* a, const c10::BFloat16* b, uint32_t* dst) {
    W w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
    if (b != nullptr) {
      const W hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
      w = _mm512_or_si512(w, _mm512_slli_epi32(hi, 16));
    }
    _mm512_storeu_si512(dst, w);
  }
};

// VecAvx512Vnni with the bf16 pair loops for bf16 tasks (Bf16DotAvx512):
// the kernel path on CPUs with AVX512-BF16 and AVX512-VNNI (every CPU with
// the first has the second; attend.cpp instantiates only the bf16-cache
// tasks for it; int8 caches run VecAvx512Vnni, every other dtype VecAvx512).
struct VecAvx512Bf16 : VecAvx512Vnni {
  static constexpr const char* kName = "avx512bf16";
  static constexpr bool kBf16Dot = true;
  using Bf16 = Bf16DotAvx512;
};

#pragma GCC pop_options
#endif  // KVCACHE_ATTEND_X86

}  // namespace attend_cpu
}  // namespace kvcache
