// One task of the CPU attend kernel, written once for any vector flavour.
//
// NOT a normal header: attend.cpp includes it once per ISA, each time inside
// its own namespace that first defines `Vec` (VecGeneric; VecAvx2 inside a
// `#pragma GCC target("avx2,fma,f16c")` region; VecAvx512 inside an
// AVX-512 F/BW/VL one) so that every function here is compiled for that
// ISA. Vectors hold Vec::kLanes floats (8, or 16 for AVX-512); head_dim is
// padded to a multiple of it, and register tiles are sized by Vec::kAcc,
// the accumulators the ISA's register file holds (8 of 16 ymm, 16 of 32
// zmm). It includes nothing itself; attend_plan.h and
// attend_vec.h come first.
//
// A task (attend_plan.h) is a row b, a KV head, a tile of query positions
// and a range of slots. Its query rows are the group's query heads at each
// position of the tile (row r = position * group + head in group), so every
// cached key and value is read once per group. Slots go by blocks of kBlock:
//
//   S = Q . K^T        dot-product micro-kernel (R query rows x C slots,
//                      vectorized along head_dim, keys read in place);
//   online softmax     per row, in base 2: running max m, sum l, weights
//                      P = 2^(S - m) in S, rescale factor alpha;
//   O = alpha O + P V  broadcast micro-kernel (R rows x 16 to 64 columns
//                      of head_dim, values read in place).
//
// An int8 cache read with bf16/fp16 queries on AVX2/AVX-512 (Plan::scores, Loops::kInt16)
// runs both products on integers instead: qk_block and pv_block over the Int16Scores and Int16Weights formats.
//
// Only slots some query of the task may see are read: [kv_start, length)
// at most, cut to the queries' causal and window limits. A slot another
// row of the block sees but this row does not gets weight exactly 0.

// s[r * lds + c] = the sum of the lanes of acc[r * C + c] (times scale
// with kScale): the end of a score tile, by one hsum16 or hsum8 where the
// tile's sums fill one.
template <int R, int C, bool kScale = false>
inline void store_tile_sums(const typename Vec::V* acc, float scale, float* s, int64_t lds) {
  float out[R * C];
  if constexpr (R * C == 16 && Vec::kLanes == 16) {
    Vec::hsum16(acc, out);
  } else if constexpr (R * C == 8 && Vec::kLanes == 8) {
    Vec::hsum8(acc, out);
  } else {
#pragma GCC unroll 16
    for (int x = 0; x < R * C; ++x) out[x] = Vec::reduce_add(acc[x]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) s[r * lds + c] = kScale ? out[r * C + c] * scale : out[r * C + c];
  }
}

template <int R, int C, typename TK>
inline void qk_tile(const float* q, int64_t ldq, const TK* k, int64_t ldk,
                    int64_t dim, float* s, int64_t lds) {
  using V = typename Vec::V;
  V acc[R * C];
#pragma GCC unroll 16
  for (int x = 0; x < R * C; ++x) acc[x] = Vec::zero();
  for (int64_t d = 0; d < dim; d += Vec::kLanes) {
    V kv[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) kv[c] = Vec::load(k + c * ldk + d);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      V qv = Vec::load(q + r * ldq + d);
      Vec::pin(qv);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[r * C + c] = Vec::fma(qv, kv[c], acc[r * C + c]);
    }
  }
  store_tile_sums<R, C>(acc, 1.f, s, lds);
}

// Rows of the next block to prefetch while this one is scored, and the
// row geometry of the streams read in place (row_bytes 0: none; the float
// loops prefetch their own block's rows with it when there is no next block).
struct Ahead {
  const char* k = nullptr;  // nullptr: no next block to prefetch
  const char* v = nullptr;
  int64_t ldk = 0, ldv = 0;  // bytes between rows
  int64_t row_bytes = 0;
  int64_t rows = 0;
  const char* v_cur = nullptr;  // this block's values (asked for while its keys are scored)
  int64_t pv_chunk = kBlock;    // slots per chunk of the weight pass (value_chunk_slots when streaming)
  // > 0 (the float and bf16 score loops): ask for rows [0, spread) of k and
  // v evenly over the pass's tiles, instead of a stream ahead of them.
  int64_t spread = 0;
};

// A spread by address (qk_piece_bf16): rows [0, n) of k and v to ask for
// beside a score pass, `bytes` from each row's address (whole slots).
template <typename E>
struct SpreadRows {
  const E* const* k = nullptr;
  const E* const* v = nullptr;
  int64_t n = 0;
  int64_t bytes = 0;
};

// The rows a micro-kernel reads: a pointer and a stride, or PointerRows.
// row_at: row j's address (for a pointer the k + j * ld the tiles always
// computed, so their strided instantiations compile as they did);
// rows_from: the rows from j on; cols_from: d elements into every row.
template <typename E>
__attribute__((always_inline)) inline const E* row_at(const E* k, int64_t ld, int64_t j) {
  return k + j * ld;
}
template <typename E>
__attribute__((always_inline)) inline const E* row_at(const PointerRows<E>& k, int64_t /*ld*/, int64_t j) {
  return k.ptr[j] + k.off;
}
template <typename E>
__attribute__((always_inline)) inline PointerRows<E> rows_from(const PointerRows<E>& k, int64_t j) {
  return {k.ptr + j, k.off};
}
template <typename E>
__attribute__((always_inline)) inline PointerRows<E> cols_from(const PointerRows<E>& k, int64_t d) {
  return {k.ptr, k.off + d};
}

// One cache line asked for, into L2 (see kStreamAhead). On x86 as an asm statement the compiler must
// keep: written as __builtin_prefetch calls, the stream loops below came out
// of GCC 12 with no prefetch at all (no prefetcht0 in the library) and ran
// 1.4x slower than the per-tile prefetch they replaced.
inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

inline void prefetch_rows(const char* base, int64_t ld, int64_t j0, int64_t j1, int64_t bytes) {
  if (ld == bytes && j0 < j1) {
    // Contiguous rows (a contiguous cache): one run of lines, one loop. A
    // row loop around a line loop cost int8 decode (one line a row) a
    // fifth of its time in loop bookkeeping. (Written as the same nested
    // loop run once: GCC 12 deletes a separate pointer loop of prefetches
    // after splitting it out of this function.)
    bytes = (j1 - j0) * ld;
    j1 = j0 + 1;
  }
  for (int64_t j = j0; j < j1; ++j) {
    for (int64_t off = 0; off < bytes; off += 64) prefetch_line(base + j * ld + off);
  }
}

// Rows [r0, r1) of a spread by address.
template <typename E>
__attribute__((always_inline)) inline void prefetch_spread(const SpreadRows<E>& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    prefetch_rows(reinterpret_cast<const char*>(a.k[r]), 0, 0, 1, a.bytes);
    prefetch_rows(reinterpret_cast<const char*>(a.v[r]), 0, 0, 1, a.bytes);
  }
}

// The float loops read keys (score pass) and values (weight pass) in place
// and ask for them as one stream: each key row kStreamAhead bytes before the
// score tiles reach it (continuing into the next block's rows near a
// block's end), and each value row of the block beside the key row of the
// same slot, so the values arrive while the keys are scored. The weight
// pass then asks for its values kStreamAhead bytes ahead again (lines
// already present cost one issue slot). A whole next block asked for in one
// burst (what the integer loops do) outruns the fill buffers and leaves
// memory idle through the other pass. The distance trades late lines (too
// short: the tiles wait on memory) against lines evicted before use (too
// long). The lines go into L2 (prefetcht1), not L1: an L1 has fewer miss
// buffers than an L2, and the loads then hit L2. Re-tune with
// benchmarks/bench_attend.py --cases decode --filled 4096 16384 (it prints
// the fraction of a streaming read reached), with --isa avx2 and
// --isa avx512.
constexpr int64_t kStreamAhead = 3072;
// A task whose keys and values exceed this many bytes (more than an L2
// holds) streams them from further out: its weight pass goes by chunks of
// about kPvChunkBytes of values (at least 8 slots: 8 at fp32 head_dim 64 to
// 256 and bf16 128, 16 at bf16 64), reading the values as a forward stream instead of
// once per 16 columns down the whole block. Smaller tasks keep one pass a
// block: a block in cache gains nothing from chunks, and each chunk reloads
// the output rows. Re-tune with benchmarks/bench_attend.py --cases decode
// --filled 256 4096 16384 --head-dims 64 128.
constexpr int64_t kStreamChunkBytes = int64_t(512) << 10;
constexpr int64_t kPvChunkBytes = 2048;
inline int64_t value_chunk_slots(int64_t row_bytes) {
  return std::clamp<int64_t>(kPvChunkBytes / std::max<int64_t>(1, row_bytes), 8, kBlock);
}

// The row geometry of a task's in-place key and value streams over
// `visible` slots (of any layout), set once per task; each
// block adds its own v_cur and next-block rows.
template <typename TKV>
inline Ahead stream_geometry(const AttendParams& p, int64_t dim, int64_t visible) {
  Ahead a;
  a.ldk = p.k_stride[2] * int64_t(sizeof(TKV));
  a.ldv = p.v_stride[2] * int64_t(sizeof(TKV));
  a.row_bytes = dim * int64_t(sizeof(TKV));
  if (visible * 2 * a.row_bytes > kStreamChunkBytes) a.pv_chunk = value_chunk_slots(a.row_bytes);
  return a;
}

// Rows of the stream ahead of the pass's current ones: the block's own rows
// (`cur`, n of them) and after them the next block's (a.k / a.v).
inline int64_t stream_distance(const Ahead& a) {
  return std::max<int64_t>(1, kStreamAhead / std::max<int64_t>(1, a.row_bytes));
}
inline void prefetch_stream(const char* cur, const char* next, int64_t ld_cur, int64_t ld_next,
                            int64_t n, int64_t next_rows, int64_t j0, int64_t j1, int64_t bytes) {
  if (j0 < n) {
    prefetch_rows(cur, ld_cur, j0, std::min(j1, n), bytes);
    j0 = n;
  }
  if (next != nullptr && j0 < j1) prefetch_rows(next, ld_next, j0 - n, std::min(j1 - n, next_rows), bytes);
}

// The next block's key rows, then its value rows, asked for (into L2) a few
// cache lines at a time: issue(n) asks for the next n lines. The chunk
// kernels (qk_gemm) spread a block's lines over their tiles, so the packing
// of the next block finds its keys in L2 instead of waiting on memory.
class Trickle {
 public:
  explicit Trickle(const Ahead& a) : a_(a) {
    if (a.k != nullptr) total_ = 2 * a.rows * ((a.row_bytes + 63) / 64);
  }
  int64_t total() const { return total_; }
  // Lines per call of step() to ask for all of them in `calls` calls.
  void spread_over(int64_t calls) { per_ = calls > 0 ? (total_ + calls - 1) / calls : total_; }
  void step() { issue(per_); }
  void issue(int64_t n) {
    for (; n > 0 && done_ < total_; --n, ++done_) {
      const bool values = row_ >= a_.rows;
      const char* base = values ? a_.v : a_.k;
      const int64_t ld = values ? a_.ldv : a_.ldk;
      __builtin_prefetch(base + (values ? row_ - a_.rows : row_) * ld + off_, 0, 2);
      off_ += 64;
      if (off_ >= a_.row_bytes) {
        off_ = 0;
        ++row_;
      }
    }
  }

 private:
  const Ahead& a_;
  int64_t total_ = 0, done_ = 0, row_ = 0, off_ = 0, per_ = 0;
};

// Decode scores on bf16 pairs (Loops::kBf16Pairs scores: bf16 queries over a bf16
// cache on AVX512-BF16): S[r, c] = qscale * (q[r] . k[c]) with q the bf16
// query rows as given and k bf16 keys read in place, 32 elements of both a
// vdpbf16ps (Dot: Bf16DotAvx512), without widening either to float32:
// half the multiply instructions of qk_tile on the widened keys, and none
// of its conversions. The products are exact in float32, as the widened
// ones are; only the scaling moves after the sum. dim: a multiple of 32.
template <typename Dot, int R, int C, typename KR>
inline void qk_tile_bf16(const c10::BFloat16* q, int64_t ldq, KR k, int64_t ldk,
                         int64_t dim, float qscale, float* s, int64_t lds) {
  using V = typename Vec::V;
  using W = typename Dot::W;
  V acc[R * C];
#pragma GCC unroll 16
  for (int x = 0; x < R * C; ++x) acc[x] = Vec::zero();
  for (int64_t d = 0; d < dim; d += 2 * Vec::kLanes) {
    W kv[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) kv[c] = Dot::load_row(row_at(k, ldk, c) + d);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      W qv = Dot::load_row(q + r * ldq + d);
      Dot::pin(qv);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[r * C + c] = Dot::dot(acc[r * C + c], qv, kv[c]);
    }
  }
  store_tile_sums<R, C, true>(acc, qscale, s, lds);
}

// int8 scores by integer dot products (Dot: I8DotAvx2, see attend_vec.h):
// S[r, c] = qs[r] * (q16[r] . k[c]) with q16 the task's query rows rounded
// to int16 (round_queries_i16) and k a block of int8 keys read in place; the
// key scales are applied to the columns afterwards, as on the float path.
// qsv[r * C + c] = qs[r]: the rows' scales laid out as the tile's sums.
template <typename Dot, int R, int C>
__attribute__((always_inline)) inline void qk_tile_i8(const int16_t* q, int64_t ldq,
                                                      const int8_t* k, int64_t ldk, int64_t dim,
                                                      const float* qsv, float* s, int64_t lds) {
  // Accumulators in groups of eight, one hsum8 a group; those past R * C
  // stay zero.
  constexpr int N = R * C, NP = (N + 7) / 8 * 8;
  using VI = typename Dot::VI;
  VI acc[NP];
#pragma GCC unroll 32
  for (int x = 0; x < NP; ++x) acc[x] = Dot::zero();
  for (int64_t d = 0; d < dim; d += Dot::kLanes) {
    if constexpr (Vec::kAcc >= 16) {
      // AVX-512: the R query vectors stay in registers while each key
      // vector is widened once and used by all R rows: R * C + R + 1
      // registers (28 of 32 for a 3 x 8 tile; holding C keys instead would
      // need 33 and spill).
      VI qv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        qv[r] = Dot::load_q(q + r * ldq + d);
        if constexpr (C > 1) Dot::pin(qv[r]);  // one load, not one per use
      }
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const VI kv = Dot::load_k(k + c * ldk + d);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          acc[r * C + c] = Dot::dot_acc(acc[r * C + c], qv[r], kv);
          if constexpr (R * C > 8) Dot::pin(acc[r * C + c]);
        }
      }
    } else {
      // AVX2 (tiles of at most 8 sums): the C widened keys held, each query
      // vector loaded once for them: with 16 registers this order keeps
      // fewer values live than the one above (compare the two with
      // benchmarks/bench_attend.py --dtypes int8 --isa avx2).
      VI kv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) kv[c] = Dot::load_k(k + c * ldk + d);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        VI qv = Dot::load_q(q + r * ldq + d);
        if constexpr (C > 1) Dot::pin(qv);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r * C + c] = Dot::dot_acc(acc[r * C + c], qv, kv[c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < NP; g += 8) {
    if constexpr (C == 8) {  // a group is one row's eight scores
      Dot::hsum8(acc + g, qsv + g, s + (g / 8) * lds);
    } else {
      float out[8];
      Dot::hsum8(acc + g, qsv + g, out);
#pragma GCC unroll 8
      for (int x = 0; x < 8; ++x) {
        if (g + x < N) s[(g + x) / C * lds + (g + x) % C] = out[x];
      }
    }
  }
}

// O = alpha O + P V for int8 values (Dot: I8DotAvx2) with the weights of
// each row rounded to int16: wq[r, j] = round(P[r, j] / ws[r]), ws[r] the
// row's largest weight of the block / kQMax (2^-16 of it at most, finer than
// the bf16 rounding of weights a bf16 GEMM makes). Slots go in pairs, one
// vpmaddwd per pair, row and 8 columns; the int32 sums are exact (at most
// kBlock / 2 pairs of 2 * 32767 * 128). R rows x 16 W columns a tile: the
// weight pairs broadcast once per pair serve W column blocks.
template <typename Dot, int R, int W>
__attribute__((always_inline)) inline void pv_tile_i8(const int16_t* wq, int64_t ldw,
                                                      const int8_t* v, int64_t ldv, int64_t n,
                                                      float* o, int64_t ldo, const float* alpha,
                                                      const float* ws) {
  using VI = typename Dot::VI;
  VI acc[2 * R * W];
#pragma GCC unroll 32
  for (int x = 0; x < 2 * R * W; ++x) acc[x] = Dot::zero();
  // One step: the R rows' weight pairs at column j times the W value blocks
  // that load(b, lo, hi) widens (a slot pair, or the last slot and zero).
  auto step = [&](int64_t j, auto load) __attribute__((always_inline)) {
    VI w[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) w[r] = Dot::load_w_pair(wq + r * ldw + j);
#pragma GCC unroll 8
    for (int b = 0; b < W; ++b) {
      VI lo, hi;
      load(b, lo, hi);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[(r * W + b) * 2] = Dot::dot_acc(acc[(r * W + b) * 2], lo, w[r]);
        acc[(r * W + b) * 2 + 1] = Dot::dot_acc(acc[(r * W + b) * 2 + 1], hi, w[r]);
        if constexpr (R * W > 4) {  // as in qk_tile_i8: or the accumulators spill
          Dot::pin(acc[(r * W + b) * 2]);
          Dot::pin(acc[(r * W + b) * 2 + 1]);
        }
      }
    }
  };
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    step(j, [&](int b, VI& lo, VI& hi) __attribute__((always_inline)) {
      Dot::load_v_pair(v + j * ldv + 16 * b, v + (j + 1) * ldv + 16 * b, lo, hi);
    });
  }
  if (j < n) {  // wq[r, n] is 0 (pv_block)
    step(j, [&](int b, VI& lo, VI& hi) __attribute__((always_inline)) {
      Dot::load_v_one(v + j * ldv + 16 * b, lo, hi);
    });
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int b = 0; b < W; ++b) {
      const float a = alpha != nullptr ? alpha[r] : 1.f;  // nullptr: no rescale (a later run)
      Dot::finish(o + r * ldo + 16 * b, acc[(r * W + b) * 2], a, ws[r]);
      Dot::finish(o + r * ldo + 16 * b + 8, acc[(r * W + b) * 2 + 1], a, ws[r]);
    }
  }
}

// Whether the integer loops round a row of largest magnitude amax > 0 (a
// query row, or a row of a block's weights) exactly: they multiply it by
// kQMax / amax, round to int16 and scale the int32 sums back by
// amax / kQMax. Both factors are exact-enough float32 numbers (the first
// finite, the second normal: no bits lost to subnormal rounding, and the
// product of the sums and it normal too) exactly when
// amax >= kQMax * FLT_MIN (3.9e-34). Below that (value scales or queries
// under ~4e-34, or weights 2^-110 under the row's running max) the float
// loops run instead: they hold any float32 product, so the answer does not
// depend on which loops ran. One comparison per row and block: the integer
// loops' per-element work is unchanged.
template <typename Dot>
inline bool i16_exact(float amax) {
  return amax >= float(Dot::kQMax) * std::numeric_limits<float>::min();
}

// The task's scaled query rows (sc.q, float) rounded to int16 for
// the Int16Scores loops: row r becomes sc.q16[r * dim + :] * sc.qs[r], with
// qs[r] = absmax / kQMax. A row with a NaN or infinite element gets a NaN
// scale, so its scores are NaN as on the float path. Returns false, the
// rounding unfinished, when a row is too small to round exactly
// (i16_exact): the task then scores on the float queries (sc.q16_ok).
template <typename Dot>
inline bool round_queries_i16(const Plan& plan, int64_t rows, Scratch& sc) {
  const int64_t D = plan.dim, Dp = plan.dim_pad;
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = sc.q.data() + r * Dp;
    int16_t* dst = sc.q16.data() + r * D;
    float amax = 0.f;
    bool finite = true;
    for (int64_t d = 0; d < D; ++d) {
      finite = finite && std::isfinite(src[d]);
      amax = std::max(amax, std::fabs(src[d]));
    }
    if (!finite || amax == 0.f) {
      std::fill(dst, dst + D, int16_t{0});
      sc.qs[r] = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    if (!i16_exact<Dot>(amax)) return false;  // tiny queries: float scores
    const float inv = float(Dot::kQMax) / amax;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<int16_t>(std::nearbyint(src[d] * inv));
    sc.qs[r] = amax / float(Dot::kQMax);
  }
  return true;
}

// o[r, :LW] = alpha[r] * o[r, :LW] + sum_j p[r, j] * v[j, :LW] for R rows
// (L = Vec::kLanes); alpha nullptr: no rescale (a later chunk of a block).
template <int R, int W, typename TV>
inline void pv_tile(const float* p, int64_t ldp, const TV* v, int64_t ldv,
                    int64_t n, float* o, int64_t ldo, const float* alpha) {
  using V = typename Vec::V;
  V acc[R * W];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const V a = Vec::set1(alpha != nullptr ? alpha[r] : 1.f);
#pragma GCC unroll 16
    for (int w = 0; w < W; ++w) acc[r * W + w] = Vec::mul(Vec::load(o + r * ldo + Vec::kLanes * w), a);
  }
  for (int64_t j = 0; j < n; ++j) {
    V vv[W];
#pragma GCC unroll 16
    for (int w = 0; w < W; ++w) vv[w] = Vec::load(v + j * ldv + Vec::kLanes * w);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V pb = Vec::set1(p[r * ldp + j]);
#pragma GCC unroll 16
      for (int w = 0; w < W; ++w) acc[r * W + w] = Vec::fma(pb, vv[w], acc[r * W + w]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int w = 0; w < W; ++w) Vec::store(o + r * ldo + Vec::kLanes * w, acc[r * W + w]);
  }
}

// The weight pass's chunks [j, e) of `chunk` slots over n values read in
// place: before each, the value stream asked for kStreamAhead bytes ahead
// (continuing into the next block's rows, ahead.v), then f(j, e).
template <typename TV, typename F>
inline void for_value_chunks(const TV* v, int64_t ldv, int64_t n, const Ahead& ahead, int64_t chunk,
                             F&& f) {
  const char* const vc = reinterpret_cast<const char*>(v);
  const int64_t ldvb = ldv * int64_t(sizeof(TV));
  const int64_t dist = stream_distance(ahead);
  for (int64_t j = 0; j < n; j += chunk) {
    const int64_t e = std::min(n, j + chunk);
    prefetch_stream(vc, ahead.v, ldvb, ahead.ldv, n, ahead.rows, j + dist, e + dist, ahead.row_bytes);
    f(j, e);
  }
}

// ---- Decode weights on bf16 pairs (Loops::kBf16Pairs weights) ------------------------
//
// O = alpha O + P V over bf16 values read in place, two slots a vdpbf16ps
// (Dot: Bf16DotAvx512): each weight row is rounded to bf16 once per block
// (pb), two value rows are paired in registers (Dot::pair_rows) and one
// instruction adds both slots' products to 16 columns. Against pv_tile on
// the widened values that is half the multiply instructions and none of the
// conversions. The rounding of the weights (relative 2^-9, as the chunk
// loops' pv_gemm) is below the bf16 output's own. The accumulators hold
// their columns in pair_rows' order; O is reordered on the way in and out
// (Dot::to_pair_order, from_pair_order), once per tile and block.

// O[r, :32 W] = alpha[r] O[r, :32 W] + sum_j pb[r, j] v[j, :32 W] for R rows
// over n slots (n odd: the last slot pairs with 0; pb[r, n] is not read);
// alpha nullptr: no rescale (a later chunk of a block).
template <typename Dot, int R, int W, typename VR>
inline void pv_tile_bf16(const c10::BFloat16* pb, int64_t ldp, VR v, int64_t ldv,
                         int64_t n, float* o, int64_t ldo, const float* alpha) {
  using V = typename Vec::V;
  using PW = typename Dot::W;
  V acc[R * 2 * W];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      V x = Vec::load(o + r * ldo + 2 * Vec::kLanes * w);
      V y = Vec::load(o + r * ldo + 2 * Vec::kLanes * w + Vec::kLanes);
      if (alpha != nullptr) {
        const V a = Vec::set1(alpha[r]);
        x = Vec::mul(x, a);
        y = Vec::mul(y, a);
      }
      Dot::to_pair_order(x, y, acc[(r * W + w) * 2], acc[(r * W + w) * 2 + 1]);
    }
  }
  // One slot pair: lo/hi[w] the paired values of columns [32 w, 32 w + 32),
  // weight(r) row r's weight pair.
  auto step = [&](const PW* lo, const PW* hi, auto weight) __attribute__((always_inline)) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const PW pw = weight(r);
#pragma GCC unroll 8
      for (int w = 0; w < W; ++w) {
        acc[(r * W + w) * 2] = Dot::dot(acc[(r * W + w) * 2], lo[w], pw);
        acc[(r * W + w) * 2 + 1] = Dot::dot(acc[(r * W + w) * 2 + 1], hi[w], pw);
      }
    }
  };
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    PW lo[W], hi[W];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      const int64_t d = 2 * Vec::kLanes * w;
      Dot::pair_rows(Dot::load_row(row_at(v, ldv, j) + d), Dot::load_row(row_at(v, ldv, j + 1) + d), lo[w], hi[w]);
    }
    step(lo, hi, [&](int r) { return Dot::set1(pb + r * ldp + j); });
  }
  if (j < n) {  // the last slot of an odd n, paired with zeros (never row n)
    PW lo[W], hi[W];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      Dot::pair_rows(Dot::load_row(row_at(v, ldv, j) + 2 * Vec::kLanes * w), Dot::zero(), lo[w], hi[w]);
    }
    step(lo, hi, [&](int r) { return Dot::set1_lo(pb + r * ldp + j); });
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      V x, y;
      Dot::from_pair_order(acc[(r * W + w) * 2], acc[(r * W + w) * 2 + 1], x, y);
      Vec::store(o + r * ldo + 2 * Vec::kLanes * w, x);
      Vec::store(o + r * ldo + 2 * Vec::kLanes * w + Vec::kLanes, y);
    }
  }
}

// Widens n cached rows (any element stride) to float32, dim_pad apart
// (the padding columns were zeroed when the scratch was made).
template <typename T>
void pack_rows(const T* src, int64_t row_stride, int64_t elem_stride,
               int64_t n, int64_t dim, int64_t dim_pad, float* dst) {
  for (int64_t j = 0; j < n; ++j) {
    const T* row = src + j * row_stride;
    float* out = dst + j * dim_pad;
    for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(row[d * elem_stride]);
  }
}

// As pack_rows, vectorized where rows are contiguous and dim a multiple of
// Vec::kLanes (a chunk's value block, widened once for all its query rows
// instead of once per row tile).
template <typename T>
void widen_rows(const T* src, int64_t row_stride, int64_t elem_stride, int64_t n, int64_t dim,
                int64_t dim_pad, float* dst) {
  if (elem_stride != 1 || dim % Vec::kLanes != 0) {
    pack_rows(src, row_stride, elem_stride, n, dim, dim_pad, dst);
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t d = 0; d < dim; d += Vec::kLanes) {
      Vec::store(dst + j * dim_pad + d, Vec::load(src + j * row_stride + d));
    }
  }
}

// ---- Chunks: both products as GEMM micro-kernels (Chunks::kFloat) --------
//
// A task with many query rows (a chunk: speculative verification, chunked
// prefill) runs S = Q K^T in the broadcast form of a GEMM: the block's keys
// are packed once, widened to float32 and transposed (kt[d * kBlock + j]),
// and a tile of kGemmRows query rows x 2 vectors of slots accumulates
// q[r, d] * kt[d, :] over d, with no horizontal sums. Packing costs one pass
// over the block for all its rows; the dot-product form (qk_block) reads the
// keys once per 4 rows and ends every tile with horizontal sums, and widens
// 16-bit keys every time. Values of a 16-bit or quantized cache are widened
// once per block (widen_rows) for the same reason, and O = alpha O + P V
// runs kGemmRows-row tiles (pv_gemm).
//
// 12 accumulators on AVX2 (6 rows x 2 vectors, of 16 ymm registers: two for
// the keys, one for the broadcast query) give two FMA units of latency 4
// enough independent chains; 24 (12 x 2) of 32 zmm registers on AVX-512.
constexpr int kGemmRows = Vec::kAcc >= 16 ? 12 : 6;

// kt[c * kBlock + j] = src[j * lds + c] for j < n and c < cols (a multiple
// of 8), and 0 for n <= j < n_pad: a block's rows transposed by 8 x 8 tiles
// of 32-bit words (floats, or pairs of bf16 for pack_kt_pairs: the tiles
// move bits, unchanged). Nothing past row n is read.
inline void transpose_rows(const float* src, int64_t lds, int64_t n, int64_t n_pad, int64_t cols,
                           float* kt) {
  const int64_t full = n / 8 * 8;
  for (int64_t j = 0; j < full; j += 8) {
    for (int64_t c = 0; c < cols; c += 8) Vec::transpose8x8(src + j * lds + c, lds, kt + c * kBlock + j, kBlock);
  }
  if (full < n) {  // the last rows, through a zero-padded tile
    float tail[8 * 8];
    for (int64_t c = 0; c < cols; c += 8) {
      std::fill(tail, tail + 64, 0.f);
      for (int64_t j = full; j < n; ++j) std::memcpy(tail + (j - full) * 8, src + j * lds + c, 8 * sizeof(float));
      Vec::transpose8x8(tail, 8, kt + c * kBlock + full, kBlock);
    }
  }
  const int64_t zero_from = (n + 7) / 8 * 8;
  if (zero_from < n_pad) {
    for (int64_t c = 0; c < cols; ++c) std::fill(kt + c * kBlock + zero_from, kt + c * kBlock + n_pad, 0.f);
  }
}

// kt[d * kBlock + j] = key j's element d as float32, for j < n and d < dim
// (dim a multiple of 8), and 0 for n <= j < n_pad (n_pad <= kBlock: the
// score tiles' padded columns). k: n rows ldk apart, element stride es. kb:
// kBlock x dim_pad floats of scratch for widened or partial rows.
template <typename TK>
void pack_kt(const TK* k, int64_t ldk, int64_t es, int64_t n, int64_t n_pad, int64_t dim,
             int64_t dim_pad, float* kb, float* kt) {
  if constexpr (std::is_same_v<TK, float>) {
    if (es == 1) {
      transpose_rows(k, ldk, n, n_pad, dim, kt);
      return;
    }
    pack_rows(k, ldk, es, n, dim, dim_pad, kb);
  } else {
    widen_rows(k, ldk, es, n, dim, dim_pad, kb);
  }
  transpose_rows(kb, dim_pad, n, n_pad, dim, kt);
}

// S[r, :W L] = sum_d q[r, d] kt[d, :W L] for R rows (L = Vec::kLanes).
template <int R, int W>
inline void qk_gemm_tile(const float* q, int64_t ldq, const float* kt, int64_t dim, float* s,
                         int64_t lds) {
  using V = typename Vec::V;
  V acc[R * W];
#pragma GCC unroll 32
  for (int x = 0; x < R * W; ++x) acc[x] = Vec::zero();
  for (int64_t d = 0; d < dim; ++d) {
    static_assert(W == 1 || W == 2, "one or two vectors of slots");
    // Named, not an array: pinning an array element makes GCC store it.
    V k0 = Vec::load(kt + d * kBlock);
    V k1 = k0;
    if constexpr (W == 2) k1 = Vec::load(kt + d * kBlock + Vec::kLanes);
    Vec::pin(k0);
    if constexpr (W == 2) Vec::pin(k1);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const V qb = Vec::set1(q[r * ldq + d]);
      acc[r * W] = Vec::fma(qb, k0, acc[r * W]);
      if constexpr (W == 2) acc[r * W + 1] = Vec::fma(qb, k1, acc[r * W + 1]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) Vec::store(s + r * lds + w * Vec::kLanes, acc[r * W + w]);
  }
}

// f(std::integral_constant<int, rows>) for 1 <= rows <= R: a tile of the
// last rows of a gemm product, fewer than kGemmRows, sized at compile time.
template <int R, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (R >= 1) {
    if (rows == R) {
      f(std::integral_constant<int, R>{});
    } else {
      with_rows<R - 1>(rows, f);
    }
  }
}

// The tile walk of both gemm products (qk_gemm, pv_gemm): `rows`
// rows by `cols` columns (a multiple of Vec::kLanes) in tiles of kGemmRows
// rows x 2 vectors, a last strip of 1 vector where cols is odd in vectors
// and a last row tile of fewer rows, sized at compile time. Column strips
// outside, row tiles inside: a strip of the right-hand operand (packed
// keys or a block's values) stays in L1 for all the rows, and the rows
// stream from L2. Each tile first asks for a few lines of the next block
// (pf.step()). tile(W, R, r, c) with W, R std::integral_constants.
template <typename F>
inline void for_gemm_tiles(int64_t rows, int64_t cols, Trickle& pf, F&& tile) {
  constexpr int L = Vec::kLanes;
  auto strip = [&](auto wc, int64_t c) {
    int64_t r = 0;
    for (; r + kGemmRows <= rows; r += kGemmRows) {
      pf.step();
      tile(wc, std::integral_constant<int, kGemmRows>{}, r, c);
    }
    with_rows<kGemmRows - 1>(rows - r, [&](auto rc) {
      pf.step();
      tile(wc, rc, r, c);
    });
  };
  int64_t c = 0;
  for (; c + 2 * L <= cols; c += 2 * L) strip(std::integral_constant<int, 2>{}, c);
  if (c < cols) strip(std::integral_constant<int, 1>{}, c);
}

// The number of tiles for_gemm_tiles(rows, cols) visits (the pf.step()
// calls), for Trickle::spread_over.
inline int64_t gemm_tiles(int64_t rows, int64_t cols) {
  return (cols + 2 * Vec::kLanes - 1) / (2 * Vec::kLanes) * ((rows + kGemmRows - 1) / kGemmRows);
}

// ---- Chunks on bf16 pairs (Vec::kBf16Dot, bf16 queries and cache) -----
//
// With AVX512-BF16 a bf16 chunk's products take vdpbf16ps, two bf16
// products per float32 lane and instruction, twice the work of a float32
// FMA: S = Q K^T over pairs of head_dim elements, O += P V over pairs of
// slots. The queries stay the bf16 the caller gave (sc.qh, unscaled; the
// scores are scaled in float32 as they are stored), the keys are packed as
// 32-bit words of their rows (kt2[p * kBlock + j] = key j's elements 2p and
// 2p + 1), the weights are rounded to bf16 once per block (sc.pb; the
// softmax sums keep the float32 weights) and the values are packed as pairs
// of slots (vt2[i * dim + d] = values 2i and 2i + 1 at element d). The tile
// walk and the prefetch pacing are the float32 loops' (for_gemm_tiles).

// kt2 as above for j < n, 0 for n <= j < n_pad. k: n rows ldk apart (ldk
// even, unit element stride), dim a multiple of 16.
inline void pack_kt_pairs(const c10::BFloat16* k, int64_t ldk, int64_t n, int64_t n_pad, int64_t dim,
                          uint32_t* kt2) {
  transpose_rows(reinterpret_cast<const float*>(k), ldk / 2, n, n_pad, dim / 2,
                 reinterpret_cast<float*>(kt2));
}

// S[r, :W L] = qscale * sum_p q[r, 2p:2p+2] . kt2[p, :W L] for R rows.
template <typename Dot, int R, int W>
inline void qk_tile_pairs(const c10::BFloat16* q, int64_t ldq, const uint32_t* kt2, int64_t dw,
                          float qscale, float* s, int64_t lds) {
  using V = typename Vec::V;
  V acc[R * W];
#pragma GCC unroll 32
  for (int x = 0; x < R * W; ++x) acc[x] = Vec::zero();
  for (int64_t w = 0; w < dw; ++w) {
    typename Dot::W k0 = Dot::load(kt2 + w * kBlock);
    typename Dot::W k1 = k0;
    if constexpr (W == 2) k1 = Dot::load(kt2 + w * kBlock + Vec::kLanes);
    Dot::pin(k0);
    if constexpr (W == 2) Dot::pin(k1);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const typename Dot::W qb = Dot::set1(q + r * ldq + 2 * w);
      acc[r * W] = Dot::dot(acc[r * W], qb, k0);
      if constexpr (W == 2) acc[r * W + 1] = Dot::dot(acc[r * W + 1], qb, k1);
    }
  }
  const V sc = Vec::set1(qscale);
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) Vec::store(s + r * lds + w * Vec::kLanes, Vec::mul(acc[r * W + w], sc));
  }
}

// O[r, :W L] = alpha[r] O[r, :W L] + sum_i p[r, 2i:2i+2] . vt2[i, :W L] for
// R rows over n2 slot pairs.
template <typename Dot, int R, int W>
inline void pv_tile_pairs(const c10::BFloat16* p, int64_t ldp, const uint32_t* vt2, int64_t ldv,
                          int64_t n2, float* o, int64_t ldo, const float* alpha) {
  using V = typename Vec::V;
  V acc[R * W];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) {
    const V a = Vec::set1(alpha[r]);
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) acc[r * W + w] = Vec::mul(Vec::load(o + r * ldo + w * Vec::kLanes), a);
  }
  for (int64_t i = 0; i < n2; ++i) {
    typename Dot::W v0 = Dot::load(vt2 + i * ldv);
    typename Dot::W v1 = v0;
    if constexpr (W == 2) v1 = Dot::load(vt2 + i * ldv + Vec::kLanes);
    Dot::pin(v0);
    if constexpr (W == 2) Dot::pin(v1);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const typename Dot::W pb = Dot::set1(p + r * ldp + 2 * i);
      acc[r * W] = Dot::dot(acc[r * W], pb, v0);
      if constexpr (W == 2) acc[r * W + 1] = Dot::dot(acc[r * W + 1], pb, v1);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) Vec::store(o + r * ldo + w * Vec::kLanes, acc[r * W + w]);
  }
}

// ---- Formats: one driver per product, a traits row per format ----------
//
// What differs between the float, bf16-pair and integer loops is what they
// read (float32 scaled queries, bf16 queries as given, queries rounded to
// int16; float32 weights, weights rounded to bf16 or to int16), their tile
// micro-kernel, their register tile sizes and how they ask for the streams
// ahead. Each format states those in one traits row (FloatScores,
// Bf16Scores, Int16Scores; FloatWeights, Bf16Weights, Int16Weights), and
// one driver per product walks the rows and slots for all of them: qk_block
// (S = Q K^T), pv_block (O = alpha O + P V), and for chunk blocks qk_gemm and
// pv_gemm (FloatScores / Bf16Scores, FloatWeights / Bf16Weights: the
// GEMM-form tiles over packed keys). A new format is a new row.

// f(): out of line, so that the register allocator sees the body on its own
// (the integer tiles on AVX-512: inlined into run_task, their 3 x 8 tile's
// accumulators and key pointers spilled to the stack).
template <typename F>
__attribute__((noinline)) void outlined(const F& f) {
  f();
}

// Float32 query rows (sc.q, scaled) over keys of any float type, widened in
// registers (qk_tile). Register tiles of R rows x cols<R>() slots; the key
// stream asked for kStreamAhead bytes ahead of the tiles (kBurst false).
struct FloatScores {
  using Q = float;
  static constexpr bool kBurst = false;    // next block's rows in one burst (else a stream)
  static constexpr bool kRowScales = false;  // a scale per query row (int16 rounding)
  static constexpr bool kOutline = false;
  template <int R>
  static constexpr int cols() { return R == 1 ? Vec::kAcc : R == 2 ? Vec::kAcc / 2 : Vec::kAcc / 4; }
  template <int R, int C, typename TK>
  static void tile(const Q* q, int64_t ldq, const TK* k, int64_t ldk, int64_t dim, float /*qscale*/,
                   const float* /*qsv*/, float* s, int64_t lds) {
    qk_tile<R, C>(q, ldq, k, ldk, dim, s, lds);
  }
};

// bf16 query rows as given (sc.qh) over bf16 keys on bf16 pairs
// (qk_tile_bf16; Dot: Bf16DotAvx512), scaled by qscale as the sums are stored.
template <typename D>
struct Bf16Scores {
  using Dot = D;
  using Q = c10::BFloat16;
  static constexpr bool kBurst = false, kRowScales = false, kOutline = false;
  template <int R>
  static constexpr int cols() { return FloatScores::cols<R>(); }
  template <int R, int C, typename KR>
  static void tile(const Q* q, int64_t ldq, KR k, int64_t ldk, int64_t dim, float qscale,
                   const float* /*qsv*/, float* s, int64_t lds) {
    qk_tile_bf16<Dot, R, C>(q, ldq, k, ldk, dim, qscale, s, lds);
  }
};

// int16 query rows (sc.q16, a scale per row: round_queries_i16) over int8
// keys by integer dot products (qk_tile_i8; Dot: I8DotAvx2 and kin). R * C
// accumulators, C widened keys and R query vectors in the ISA's registers:
// 8 accumulators of 16 registers (AVX2), 24 of 32 (AVX-512, where a tile of
// 3 rows (a GQA group of 3) x 8 slots amortises the query loads and the
// horizontal sums over 8 slots instead of 2). The next block's keys and
// values asked for between the tiles (kBurst); out of line on AVX-512
// (outlined). AVX2's small tiles stay inline: they fit its registers, and a
// call per row of tiles costs more than it saves (bench_attend.py --dtypes
// int8 --isa avx2 compares).
template <typename D>
struct Int16Scores {
  using Dot = D;
  using Q = int16_t;
  static constexpr bool kBurst = true, kRowScales = true, kOutline = Vec::kAcc >= 16;
  template <int R>
  static constexpr int cols() { return std::min(8, (Vec::kAcc >= 16 ? 24 : 8) / R); }
  template <int R, int C>
  static void tile(const Q* q, int64_t ldq, const int8_t* k, int64_t ldk, int64_t dim, float /*qscale*/,
                   const float* qsv, float* s, int64_t lds) {
    qk_tile_i8<Dot, R, C>(q, ldq, k, ldk, dim, qsv, s, lds);
  }
};

// S[r, :n] = (q[r] . k[:n]) for `rows` query rows of format Fmt (ldq apart;
// qs: their scales, Fmt::kRowScales) over n keys ldk apart, by groups of 4
// rows and the remainder, each group by register tiles of Fmt::cols<R>()
// slots. ahead: the streams to ask for (Fmt::kBurst: the next block's rows
// beside the tiles; else the key stream kStreamAhead bytes ahead and this
// block's values beside their keys), carried by the first group only.
//
// Out of line (as pv_block): run_task calls it per run of a block, and
// inlined there its register tiles were compiled among run_task's live
// values (a decode over a contiguous fp32 cache ran 1.1x slower when GCC
// inlined pv_block into a larger run_task).
template <typename Fmt, typename TK>
__attribute__((noinline))
void qk_block(const typename Fmt::Q* q, int64_t ldq, const float* qs, const TK* k, int64_t ldk, int64_t dim,
              int64_t rows, int64_t n, float* s, int64_t lds, const Ahead* ahead, float qscale = 1.f) {
  if (ahead != nullptr && (Fmt::kBurst ? ahead->k == nullptr : ahead->row_bytes == 0)) ahead = nullptr;
  const char* const kc = reinterpret_cast<const char*>(k);
  const int64_t ldkb = ldk * int64_t(sizeof(TK));
  auto group = [&](auto rc, int64_t r, const Ahead* a) __attribute__((always_inline)) {
    constexpr int R = decltype(rc)::value;
    constexpr int C = Fmt::template cols<R>();
    const typename Fmt::Q* const qr = q + r * ldq;
    float* const sr = s + r * lds;
    // kRowScales: the rows' scales laid out as a tile's sums (qsv) and as a
    // one-slot tile's (qs1); zeros past them.
    float qsv[32] = {}, qs1[8] = {};
    if constexpr (Fmt::kRowScales) {
      for (int x = 0; x < R; ++x) {
        for (int c = 0; c < C; ++c) qsv[x * C + c] = qs[r + x];
        qs1[x] = qs[r + x];
      }
    }
    const int64_t dist = a != nullptr && !Fmt::kBurst ? stream_distance(*a) : 0;
    int64_t c = 0;
    for (; c + C <= n; c += C) {
      if (a != nullptr) {
        if constexpr (Fmt::kBurst) {
          if (c < a->rows) {
            const int64_t e = std::min<int64_t>(c + C, a->rows);
            prefetch_rows(a->k, a->ldk, c, e, a->row_bytes);
            prefetch_rows(a->v, a->ldv, c, e, a->row_bytes);
          }
        } else if (a->spread > 0) {
          const int64_t r0 = c * a->spread / n, r1 = (c + C) * a->spread / n;
          prefetch_rows(a->k, a->ldk, r0, r1, a->row_bytes);
          prefetch_rows(a->v, a->ldv, r0, r1, a->row_bytes);
        } else {
          prefetch_stream(kc, a->k, ldkb, a->ldk, n, a->rows, c + dist, c + dist + C, a->row_bytes);
          if (a->v_cur != nullptr) prefetch_rows(a->v_cur, a->ldv, c, c + C, a->row_bytes);
        }
      }
      Fmt::template tile<R, C>(qr, ldq, k + c * ldk, ldk, dim, qscale, qsv, sr + c, lds);
    }
    if (!Fmt::kBurst && a != nullptr && a->spread > 0 && c < n) {  // the tail tiles' share
      const int64_t r0 = c * a->spread / n;
      prefetch_rows(a->k, a->ldk, r0, a->spread, a->row_bytes);
      prefetch_rows(a->v, a->ldv, r0, a->spread, a->row_bytes);
    }
    if constexpr (Fmt::kBurst) {
      if (a != nullptr && c < a->rows) {
        prefetch_rows(a->k, a->ldk, c, a->rows, a->row_bytes);
        prefetch_rows(a->v, a->ldv, c, a->rows, a->row_bytes);
      }
    }
    for (; c < n; ++c) Fmt::template tile<R, 1>(qr, ldq, k + c * ldk, ldk, dim, qscale, qs1, sr + c, lds);
  };
  auto run = [&](auto rc, int64_t r) {
    const Ahead* a = r == 0 ? ahead : nullptr;
    if constexpr (Fmt::kOutline) {
      outlined([&] { group(rc, r, a); });
    } else {
      group(rc, r, a);
    }
  };
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) run(std::integral_constant<int, 4>{}, r);
  with_rows<3>(rows - r, [&](auto rc) { run(rc, r); });
}

// Float32 weights (S as the softmax left them) over values of any float
// type, widened in registers (pv_tile): tiles of R rows x width<R>()
// vectors of head_dim. Fewer rows take wider tiles: each accumulator is one
// FMA dependency chain through the slot loop, and two FMA units with a
// latency of 4 need about 8 chains to stay busy; at most 8 vectors (128
// columns of AVX2) per tile.
struct FloatWeights {
  using P = float;
  static constexpr int64_t kCols = Vec::kLanes;  // columns per tile vector
  static constexpr bool kChunks = true;          // values in place go by chunks (for_value_chunks)
  template <int R>
  static constexpr int width() {
    constexpr int w = R == 1 ? Vec::kAcc : R == 2 ? Vec::kAcc / 2 : Vec::kAcc / 4;
    return w > 8 ? 8 : w;
  }
  template <int R, int W, typename TV>
  static void tile(const P* p, int64_t ldp, const TV* v, int64_t ldv, int64_t n, float* o, int64_t ldo,
                   const float* alpha, const float* /*ws*/) {
    pv_tile<R, W>(p, ldp, v, ldv, n, o, ldo, alpha);
  }
};

// Weights rounded to bf16 once per block (pw) over bf16 values on bf16
// pairs (pv_tile_bf16; Dot: Bf16DotAvx512): 32 columns a pair vector, tiles
// of 4 x 32 columns for 1-2 rows, 2 x 32 for 3-4 (at most 16 accumulators,
// each one vdpbf16ps chain through the slot loop). Chunks of an even number
// of slots, so only a block's last chunk can end on an unpaired slot.
template <typename D>
struct Bf16Weights {
  using Dot = D;
  using P = c10::BFloat16;
  static constexpr int64_t kCols = 2 * Vec::kLanes;
  static constexpr bool kChunks = true;
  template <int R>
  static constexpr int width() { return R <= 2 ? 4 : 2; }
  template <int R, int W, typename VR>
  static void tile(const P* p, int64_t ldp, VR v, int64_t ldv, int64_t n, float* o,
                   int64_t ldo, const float* alpha, const float* /*ws*/) {
    pv_tile_bf16<Dot, R, W>(p, ldp, v, ldv, n, o, ldo, alpha);
  }
};

// Weights rounded to int16 with a scale per row (pw, ws) over int8 values by
// integer dot products (pv_tile_i8): 16 columns a block; 2 R W
// accumulators, R weight pairs and one value pair in the ISA's registers:
// 8 + 4 + 2 of 16 (AVX2: one column block), 24 + 4 + 2 of 32 (AVX-512: up
// to 4 column blocks, head_dim 64 in one pass). One pass a block (the
// scores' tiles asked for the values already).
template <typename D>
struct Int16Weights {
  using Dot = D;
  using P = int16_t;
  static constexpr int64_t kCols = 16;
  static constexpr bool kChunks = false;
  template <int R>
  static constexpr int width() { return Vec::kAcc >= 16 ? (R == 4 ? 3 : 4) : 1; }
  template <int R, int W>
  static void tile(const P* p, int64_t ldp, const int8_t* v, int64_t ldv, int64_t n, float* o, int64_t ldo,
                   const float* alpha, const float* ws) {
    pv_tile_i8<Dot, R, W>(p, ldp, v, ldv, n, o, ldo, alpha, ws);
  }
};

// O[:rows] = alpha O + P V over n slots (alpha nullptr: no rescale, a later
// run of a block), the weights P (rows x n, ldp apart) taken into format
// Fmt first: as they are (float), rounded to bf16 into pw (rows x kBlock),
// or to int16 into pw (rows x (kBlock + 2)) with a scale per row in ws.
// Returns false, having done nothing, when Int16 cannot take the block: a
// row's weights not all finite (NaN data, or an infinite scale; the float
// loops then give the IEEE result) or too small for int16 rounding to be
// exact (i16_exact). Rows by groups of 4 and the remainder, head_dim by
// tiles of Fmt::width<R>() vectors of Fmt::kCols columns, then narrower
// ones. Values read in place (ahead: their row geometry and the next
// block's rows) go by chunks of ahead->pv_chunk slots, each asking for the
// value stream kStreamAhead bytes ahead (Fmt::kChunks); a packed block
// (ahead nullptr) in one pass.
template <typename Fmt, typename TV>
__attribute__((noinline))
bool pv_block(const float* p, int64_t ldp, const TV* v, int64_t ldv, int64_t n, float* o, int64_t ldo,
              const float* alpha, int64_t rows, int64_t dim, const Ahead* ahead = nullptr,
              typename Fmt::P* pw = nullptr, float* ws = nullptr) {
  using P = typename Fmt::P;
  const P* w = nullptr;
  int64_t ldw = 0;
  if constexpr (std::is_same_v<P, float>) {
    w = p;
    ldw = ldp;
  } else if constexpr (std::is_same_v<P, c10::BFloat16>) {
    // By whole vectors: up to the next multiple of Vec::kLanes, columns
    // that are never used.
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < n; j += Vec::kLanes) Fmt::Dot::round16(p + r * ldp + j, pw + r * kBlock + j);
    }
    w = pw;
    ldw = kBlock;
  } else {
    ldw = kBlock + 2;
    for (int64_t r = 0; r < rows; ++r) {
      const float* pr = p + r * ldp;
      float wmax = 0.f;
      if (!Fmt::Dot::finite_max(pr, n, wmax)) return false;
      if (wmax > 0.f && !i16_exact<typename Fmt::Dot>(wmax)) return false;  // tiny weights: float loops
      int16_t* wr = pw + r * ldw;
      if (wmax > 0.f) {
        Fmt::Dot::round_to_i16(pr, n, float(Fmt::Dot::kQMax) / wmax, wr);
        ws[r] = wmax / float(Fmt::Dot::kQMax);
      } else {
        std::fill(wr, wr + n, int16_t{0});
        ws[r] = 0.f;
      }
      wr[n] = 0;  // an odd n's last slot pairs with weight 0
    }
    w = pw;
  }
  // Slots [j, e) for every row, alpha applied (al nullptr: none).
  auto pass = [&](int64_t j, int64_t e, const float* al) {
    auto group = [&](auto rc, int64_t r) {
      constexpr int R = decltype(rc)::value;
      constexpr int W = Fmt::template width<R>();
      constexpr int64_t L = Fmt::kCols;
      const P* const wr = w + r * ldw + j;
      const TV* const vj = v + j * ldv;
      float* const orow = o + r * ldo;
      const float* const a = al != nullptr ? al + r : nullptr;
      const float* const sr = ws != nullptr ? ws + r : nullptr;
      int64_t d = 0;
      for (; d + L * W <= dim; d += L * W) Fmt::template tile<R, W>(wr, ldw, vj + d, ldv, e - j, orow + d, ldo, a, sr);
      if constexpr (W > 4) {
        for (; d + 4 * L <= dim; d += 4 * L) Fmt::template tile<R, 4>(wr, ldw, vj + d, ldv, e - j, orow + d, ldo, a, sr);
      }
      if constexpr (W > 2) {
        for (; d + 2 * L <= dim; d += 2 * L) Fmt::template tile<R, 2>(wr, ldw, vj + d, ldv, e - j, orow + d, ldo, a, sr);
      }
      for (; d < dim; d += L) Fmt::template tile<R, 1>(wr, ldw, vj + d, ldv, e - j, orow + d, ldo, a, sr);
    };
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) group(std::integral_constant<int, 4>{}, r);
    with_rows<3>(rows - r, [&](auto rc) { group(rc, r); });
  };
  if (!Fmt::kChunks || ahead == nullptr || ahead->row_bytes == 0) {
    pass(0, n, alpha);
    return true;
  }
  int64_t chunk = ahead->pv_chunk;
  if constexpr (std::is_same_v<P, c10::BFloat16>) chunk = std::max<int64_t>(2, chunk & ~int64_t(1));
  // alpha rescales O once, with the block's first chunk.
  for_value_chunks(v, ldv, n, *ahead, chunk, [&](int64_t j, int64_t e) { pass(j, e, j == 0 ? alpha : nullptr); });
  return true;
}

// The bf16 pair loops over a piece of a grouped block by its rows'
// addresses (grouped_block_bf16; k, v: PointerRows, so the rows may cross
// pages): qk_block's and pv_block's tiles (Bf16Scores, Bf16Weights).
// The scores ask for the spread's rows (the next piece, SpreadRows) beside
// their tiles; the weights go in one pass (the spread brought them).
// Separate from qk_block and pv_block, whose instantiations for the other
// loops (fp32 grouped decode above all) compile as they did: carried
// through those, an accessor changed GCC's code for them by 5-10%.
template <typename D>
__attribute__((noinline)) void qk_piece_bf16(const c10::BFloat16* q, int64_t ldq,
                                             PointerRows<c10::BFloat16> k, int64_t dim, int64_t rows,
                                             int64_t n, float* s, int64_t lds, const SpreadRows<c10::BFloat16>& ahead,
                                             float qscale) {
  auto group = [&](auto rc, int64_t r) __attribute__((always_inline)) {
    constexpr int R = decltype(rc)::value;
    constexpr int C = Bf16Scores<D>::template cols<R>();
    const bool ask = r == 0 && ahead.n > 0;
    int64_t c = 0;
    for (; c + C <= n; c += C) {
      if (ask) prefetch_spread(ahead, c * ahead.n / n, (c + C) * ahead.n / n);
      qk_tile_bf16<D, R, C>(q + r * ldq, ldq, rows_from(k, c), 0, dim, qscale, s + r * lds + c, lds);
    }
    if (ask) prefetch_spread(ahead, c * ahead.n / n, ahead.n);
    for (; c < n; ++c) {
      qk_tile_bf16<D, R, 1>(q + r * ldq, ldq, rows_from(k, c), 0, dim, qscale, s + r * lds + c, lds);
    }
  };
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) group(std::integral_constant<int, 4>{}, r);
  with_rows<3>(rows - r, [&](auto rc) { group(rc, r); });
}

template <typename D>
__attribute__((noinline)) void pv_piece_bf16(const float* p, int64_t ldp, PointerRows<c10::BFloat16> v,
                                             int64_t n, float* o, int64_t ldo, const float* alpha,
                                             int64_t rows, int64_t dim, c10::BFloat16* pw) {
  // The weights rounded to bf16 as pv_block rounds them.
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; j += Vec::kLanes) D::round16(p + r * ldp + j, pw + r * kBlock + j);
  }
  auto group = [&](auto rc, int64_t r) __attribute__((always_inline)) {
    constexpr int R = decltype(rc)::value;
    constexpr int W = Bf16Weights<D>::template width<R>();
    constexpr int64_t L = Bf16Weights<D>::kCols;
    const c10::BFloat16* const wr = pw + r * kBlock;
    float* const orow = o + r * ldo;
    const float* const a = alpha != nullptr ? alpha + r : nullptr;
    int64_t d = 0;
    for (; d + L * W <= dim; d += L * W) pv_tile_bf16<D, R, W>(wr, kBlock, cols_from(v, d), 0, n, orow + d, ldo, a);
    if constexpr (W > 2) {
      for (; d + 2 * L <= dim; d += 2 * L) pv_tile_bf16<D, R, 2>(wr, kBlock, cols_from(v, d), 0, n, orow + d, ldo, a);
    }
    for (; d < dim; d += L) pv_tile_bf16<D, R, 1>(wr, kBlock, cols_from(v, d), 0, n, orow + d, ldo, a);
  };
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) group(std::integral_constant<int, 4>{}, r);
  with_rows<3>(rows - r, [&](auto rc) { group(rc, r); });
}

// A chunk block's scores in GEMM form over its keys packed once (Fmt
// FloatScores: widened to float32 and transposed into kt by pack_kt, tiles
// qk_gemm_tile over float32 query rows; Bf16Scores: 32-bit words of bf16
// pairs into kt2 by pack_kt_pairs, tiles qk_tile_pairs over the bf16 query
// rows as given, scaled by qscale as stored): S[r, :n_pad] for `rows` rows
// (ldq apart) over n keys (ldk apart, element stride es); columns past n are
// 0 . q = 0 (the softmax masks them). A strip of the packed keys is 2
// vectors x dim floats, 8 KB at head_dim 128. kb: kBlock x dim_pad floats of
// scratch for widened keys.
template <typename Fmt, typename TK>
void qk_gemm(const typename Fmt::Q* q, int64_t ldq, const TK* k, int64_t ldk, int64_t es, int64_t n,
             int64_t n_pad, int64_t dim, int64_t dim_pad, float qscale, int64_t rows, float* s, int64_t lds,
             float* kb, float* kt, Trickle& pf) {
  if constexpr (std::is_same_v<typename Fmt::Q, float>) {
    pf.spread_over(gemm_tiles(rows, n_pad) + gemm_tiles(rows, dim_pad));
    pack_kt(k, ldk, es, n, n_pad, dim, dim_pad, kb, kt);
    for_gemm_tiles(rows, n_pad, pf, [&](auto wc, auto rc, int64_t r, int64_t c) {
      qk_gemm_tile<decltype(rc)::value, decltype(wc)::value>(q + r * ldq, ldq, kt + c, dim, s + r * lds + c, lds);
    });
  } else {
    using Dot = typename Fmt::Dot;
    uint32_t* const kt2 = reinterpret_cast<uint32_t*>(kt);
    pf.spread_over(gemm_tiles(rows, n_pad) + gemm_tiles(rows, dim));
    pack_kt_pairs(k, ldk, n, n_pad, dim, kt2);
    for_gemm_tiles(rows, n_pad, pf, [&](auto wc, auto rc, int64_t r, int64_t c) {
      qk_tile_pairs<Dot, decltype(rc)::value, decltype(wc)::value>(q + r * ldq, ldq, kt2 + c, dim / 2, qscale,
                                                                   s + r * lds + c, lds);
    });
  }
}

// A chunk block's O = alpha O + P V in GEMM form: for_gemm_tiles over rows x
// head_dim (dim a multiple of Vec::kLanes). FloatWeights: pv_tile over
// float32 values (in place, or widened once into vb; a strip is kBlock x 2
// vectors, 4 KB); Bf16Weights: the weights rounded into pw (rows x kBlock
// bf16) and the values packed as slot pairs into vt2 (kBlock / 2 x dim
// words), tiles pv_tile_pairs. Weights past n are exactly 0 (softmax_row),
// so an odd block's last pair needs no mask; its value pair's second half
// is 0.
template <typename Fmt, typename TV>
void pv_gemm(const float* p, int64_t ldp, const TV* v, int64_t ldv, int64_t n, int64_t n8, int64_t rows,
             int64_t dim, float* o, int64_t ldo, const float* alpha, typename Fmt::P* pw, uint32_t* vt2,
             Trickle& pf) {
  if constexpr (std::is_same_v<typename Fmt::P, float>) {
    for_gemm_tiles(rows, dim, pf, [&](auto wc, auto rc, int64_t r, int64_t d) {
      pv_tile<decltype(rc)::value, decltype(wc)::value>(p + r * ldp, ldp, v + d, ldv, n, o + r * ldo + d, ldo,
                                                        alpha + r);
    });
  } else {
    using Dot = typename Fmt::Dot;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < n8; j += Vec::kLanes) Dot::round16(p + r * ldp + j, pw + r * kBlock + j);
    }
    const int64_t n2 = (n + 1) / 2;
    for (int64_t i = 0; i < n2; ++i) {
      const c10::BFloat16* a = v + 2 * i * ldv;
      const c10::BFloat16* b = 2 * i + 1 < n ? a + ldv : nullptr;
      for (int64_t d = 0; d < dim; d += Vec::kLanes) {
        Dot::interleave16(a + d, b == nullptr ? nullptr : b + d, vt2 + i * dim + d);
      }
    }
    for_gemm_tiles(rows, dim, pf, [&](auto wc, auto rc, int64_t r, int64_t d) {
      pv_tile_pairs<Dot, decltype(rc)::value, decltype(wc)::value>(pw + r * kBlock, kBlock, vt2 + d, dim, n2,
                                                                   o + r * ldo + d, ldo, alpha + r);
    });
  }
  pf.issue(pf.total());  // whatever the tiles left
}

// Online-softmax step of one row over a block of n slots, of which [a, e)
// are visible to it. s holds the row's scores (n8 = n rounded up to
// Vec::kLanes columns; the columns past n are scratch) and gets the weights.
// `vis` (rings; nullptr: none) marks the slots of [a, e) the row sees;
// the others get weight exactly 0, like those outside [a, e).
inline void softmax_row(float* s, int64_t a, int64_t e, int64_t n8, float cap,
                        float& m, float& l, float& alpha,
                        const unsigned char* vis = nullptr) {
  using V = typename Vec::V;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (a >= e) {  // this row sees none of the block: weights 0, no rescale
    for (int64_t j = 0; j < n8; j += Vec::kLanes) Vec::store(s + j, Vec::zero());
    alpha = 1.f;
    return;
  }
  if (cap > 0.f) {
    const V c = Vec::set1(cap);
    for (int64_t j = 0; j < n8; j += Vec::kLanes) Vec::store(s + j, Vec::mul(c, Vec::tanh(Vec::load(s + j))));
  }
  for (int64_t j = 0; j < a; ++j) s[j] = kNegInf;
  for (int64_t j = e; j < n8; ++j) s[j] = kNegInf;
  if (vis != nullptr) {
    for (int64_t j = a; j < e; ++j) {
      if (!vis[j]) s[j] = kNegInf;
    }
  }
  V mx = Vec::set1(kNegInf);
  for (int64_t j = 0; j < n8; j += Vec::kLanes) mx = Vec::max(mx, Vec::load(s + j));
  const float block_max = Vec::reduce_max(mx);
  const float m_new = std::max(m, block_max);
  alpha = std::exp2(m - m_new);  // 0 on the row's first block (m = -inf)
  const V mv = Vec::set1(m_new);
  V sum = Vec::zero();
  for (int64_t j = 0; j < n8; j += Vec::kLanes) {
    const V w = Vec::exp2(Vec::sub(Vec::load(s + j), mv));
    Vec::store(s + j, w);
    sum = Vec::add(sum, w);
  }
  l = l * alpha + Vec::reduce_add(sum);
  m = m_new;
}

// Multiplies columns [0, n) of rows [ra, rb) of S by the slot scales at
// `scale` (element stride `stride`): a quantized cache's key scales on the
// scores, its value scales on the probabilities (after the row sums).
inline void scale_columns(float* S, int64_t ra, int64_t rb, int64_t n,
                          const float* scale, int64_t stride) {
  float col[kBlock];
  for (int64_t c = 0; c < n; ++c) col[c] = scale[c * stride];
  for (int64_t r = ra; r < rb; ++r) {
    float* row = S + r * kBlock;
    for (int64_t c = 0; c < n; ++c) row[c] *= col[c];
  }
}

// Whether an int8 cache's in-place blocks take the integer loops
// (Int16Scores, Int16Weights) on this ISA, when the plan chose Loops::kInt16.
template <typename TKV>
constexpr bool kI8Dot = std::is_same_v<TKV, int8_t> && Vec::kI8Dot;

// Whether a task of queries T over a cache TKV can take the bf16 pair loops
// (block_pairs) on this ISA, when the plan chose Chunks::kBf16Pairs.
template <typename T, typename TKV>
constexpr bool kBf16Pairs =
    Vec::kBf16Dot && std::is_same_v<T, c10::BFloat16> && std::is_same_v<TKV, c10::BFloat16>;

// A task's start, for every layout: its queries (the G heads
// of each KV head t.kvh + h at positions [t.i0, t.i1), rows h * R + ti * G + g)
// scaled into sc.q where a block may read them (Plan::f32_queries(); rounded
// into sc.q16 for the integer loops), copied as given into sc.qh for the
// bf16 pair loops, and the online-softmax state (output, running max,
// running sum) reset.
template <typename T, typename TKV>
inline void start_task(const Plan& plan, const Task& t, Scratch& sc) {
  const AttendParams& p = *plan.p;
  const int64_t G = plan.group, D = plan.dim, Dp = plan.dim_pad;
  const int64_t nt = t.i1 - t.i0;
  const int64_t R = G * nt;
  const int64_t rows = R * t.heads;
  const T* qbase = static_cast<const T*>(p.q) + t.b * p.q_stride[0] +
                    p.first_token(t.b) * p.q_stride[2];
  auto query = [&](int64_t r) {  // the query of scratch row r
    const int64_t h = r / R, ti = (r % R) / G, g = r % G;
    return qbase + ((t.kvh + h) * G + g) * p.q_stride[1] + (t.i0 + ti) * p.q_stride[2];
  };
  // Rows of unit element stride and whole vectors are widened by vectors.
  const bool vec_rows = p.q_stride[3] == 1 && D % Vec::kLanes == 0;
  if (plan.f32_queries()) {
    const typename Vec::V qs = Vec::set1(plan.qscale);
    for (int64_t r = 0; r < rows; ++r) {
      const T* src = query(r);
      float* dst = sc.q.data() + r * Dp;
      if (vec_rows) {
        for (int64_t d = 0; d < D; d += Vec::kLanes) Vec::store(dst + d, Vec::mul(Vec::load(src + d), qs));
      } else {
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d * p.q_stride[3]]) * plan.qscale;
      }
    }
  }
  if constexpr (kI8Dot<TKV>) {
    if (plan.scores == Loops::kInt16) sc.q16_ok = round_queries_i16<typename Vec::I8>(plan, rows, sc);
  }
  if constexpr (kBf16Pairs<T, TKV>) {
    if (plan.bf16_queries()) {  // the bf16 queries as given (qk_tile_pairs, qk_tile_bf16)
      for (int64_t r = 0; r < rows; ++r) {
        const T* src = query(r);
        c10::BFloat16* dst = sc.qh.data() + r * D;
        if (p.q_stride[3] == 1) {
          std::memcpy(dst, src, size_t(D) * sizeof(c10::BFloat16));
        } else {
          for (int64_t d = 0; d < D; ++d) dst[d] = src[d * p.q_stride[3]];
        }
      }
    }
  }
  std::fill(sc.o.data(), sc.o.data() + rows * Dp, 0.f);
  std::fill(sc.m.data(), sc.m.data() + rows, -std::numeric_limits<float>::infinity());
  std::fill(sc.l.data(), sc.l.data() + rows, 0.f);
}

// S = Q K^T for the task's rows [ra, rb) over n keys read in place
// (Plan::keys_in_place()): the integer loops (when the task's queries were rounded
// exactly: sc.q16_ok) or the bf16 pair loops where they apply, else the
// float ones.
template <typename T, typename TKV>
inline void score_in_place(const Plan& plan, Scratch& sc, int64_t ra, int64_t rb, const TKV* k,
                           int64_t ldk, int64_t n, const Ahead* ahead, int64_t col) {
  float* const S = sc.s.data() + ra * kBlock + col;
  if constexpr (kBf16Pairs<T, TKV>) {
    if (plan.scores == Loops::kBf16Pairs) {
      qk_block<Bf16Scores<typename Vec::Bf16>>(sc.qh.data() + ra * plan.dim, plan.dim, nullptr, k, ldk,
                                               plan.dim, rb - ra, n, S, kBlock, ahead, plan.qscale);
      return;
    }
  }
  if constexpr (kI8Dot<TKV>) {
    if (plan.scores == Loops::kInt16 && sc.q16_ok) {
      qk_block<Int16Scores<typename Vec::I8>>(sc.q16.data() + ra * plan.dim, plan.dim, sc.qs.data() + ra, k,
                                              ldk, plan.dim, rb - ra, n, S, kBlock, ahead);
      return;
    }
  }
  qk_block<FloatScores>(sc.q.data() + ra * plan.dim_pad, plan.dim_pad, nullptr, k, ldk, plan.dim, rb - ra, n,
                        S, kBlock, ahead);
}

// O = alpha O + P V for the task's rows [ra, rb) over n values read in place
// (Plan::values_in_place()), the weights of block columns [col, col + n): the bf16 pair
// loops or the integer loops (when the block's weights are finite) where
// they apply, else the float ones. alpha: the rows' rescale (sc.alpha + ra
// for a block's first run; nullptr, none, for the others).
template <typename T, typename TKV>
inline void weigh_in_place(const Plan& plan, Scratch& sc, int64_t ra, int64_t rb, const TKV* v,
                           int64_t ldv, int64_t n, const Ahead* ahead, int64_t col,
                           const float* alpha) {
  const float* const P = sc.s.data() + ra * kBlock + col;
  float* const O = sc.o.data() + ra * plan.dim_pad;
  if constexpr (kBf16Pairs<T, TKV>) {
    if (plan.weights == Loops::kBf16Pairs) {
      pv_block<Bf16Weights<typename Vec::Bf16>>(P, kBlock, v, ldv, n, O, plan.dim_pad, alpha, rb - ra,
                                                plan.dim, ahead, sc.pb.data() + ra * kBlock);
      return;
    }
  }
  if constexpr (kI8Dot<TKV>) {
    if (plan.weights == Loops::kInt16 &&
        pv_block<Int16Weights<typename Vec::I8>>(P, kBlock, v, ldv, n, O, plan.dim_pad, alpha, rb - ra,
                                                 plan.dim, ahead, sc.wq.data(), sc.ws.data())) {
      return;
    }
  }
  pv_block<FloatWeights>(P, kBlock, v, ldv, n, O, plan.dim_pad, alpha, rb - ra, plan.dim, ahead);
}

// The online softmax of a block's scores for the task's rows [ra, rb)
// (head rows from h0: position (r - h0) / group), each over its visible
// columns of [c0, c1): [lo, hi) of its position, or a ring's marks (vis).
inline void softmax_rows(const Plan& plan, Scratch& sc, int64_t h0, int64_t ra, int64_t rb,
                         int64_t c0, int64_t c1, int64_t n8) {
  for (int64_t r = ra; r < rb; ++r) {
    const int64_t ti = (r - h0) / plan.group;
    if (plan.layout == Layout::kRing) {  // the slots the block's vis marks
      const int64_t e = sc.seen_block[ti] > 0 ? c1 - c0 : 0;
      softmax_row(sc.s.data() + r * kBlock, 0, e, n8, plan.cap, sc.m[r], sc.l[r], sc.alpha[r],
                  sc.vis.data() + ti * kBlock);
      continue;
    }
    const int64_t a = std::clamp(sc.lo[ti], c0, c1) - c0;
    const int64_t e = std::clamp(sc.hi[ti], c0, c1) - c0;
    softmax_row(sc.s.data() + r * kBlock, a, e, n8, plan.cap, sc.m[r], sc.l[r], sc.alpha[r]);
  }
}

// A decode block [c0, c1) of a grouped task (every KV head of a sequence,
// slots holding them side by side: pages, token-major rows) on the bf16
// pair loops: the block's slot addresses once (head 0's rows of the task;
// head h is h head strides further), then each piece of `piece` slots in
// one call per head (qk_piece_bf16, pv_piece_bf16) wherever its pages lie,
// each head's score pass asking for its share of the next piece's whole
// slots (slot_bytes each): this block's next piece, else the next block's
// first ([next, next_end), next < 0 none), whose addresses follow the
// block's. Rows of head h: [h * rows + ta * group, h * rows + tb * group).
// Out of run_task (as qk_block is), so that run_task's own code for the
// other paths stays as it was: inlined there, bf16 decode over 64-slot
// pages ran 5-8% slower.
template <typename TKV>
__attribute__((noinline)) void grouped_block_bf16(const Plan& plan, Scratch& sc, const SlotRows<TKV>& K,
                                                  const SlotRows<TKV>& V, int64_t heads, int64_t rows, int64_t ta,
                                                  int64_t tb, int64_t c0, int64_t c1, int64_t n8, int64_t piece,
                                                  int64_t slot_bytes, int64_t next, int64_t next_end) {
  using Bf16 = typename Vec::Bf16;
  const AttendParams& p = *plan.p;
  const int64_t D = plan.dim, Dp = plan.dim_pad;
  float* const S = sc.s.data();
  auto head_rows = [&](int64_t h) {
    return std::pair<int64_t, int64_t>{h * rows + ta * plan.group, h * rows + tb * plan.group};
  };
  // Slot addresses: the block's [c0, c1) from 0, then the next block's
  // first piece from c1 - c0, so the piece after [a, e) starts at e - c0.
  const TKV* kptr[2 * kBlock];
  const TKV* vptr[2 * kBlock];
  auto fill = [&](int64_t j0, int64_t j1, int64_t at) {
    for (int64_t j = j0, je; j < j1; j = je) {
      je = j + std::min(j1 - j, K.run(j));
      const TKV* const kr = K.at(j);
      const TKV* const vr = V.at(j);
      for (int64_t i = 0; i < je - j; ++i) {
        kptr[at + j - j0 + i] = kr + i * K.ld;
        vptr[at + j - j0 + i] = vr + i * V.ld;
      }
    }
  };
  fill(c0, c1, 0);
  if (next >= 0) fill(next, std::min(next_end, next + piece), c1 - c0);
  for (int64_t a = c0, e; a < c1; a = e) {
    e = std::min(c1, a + piece);
    const int64_t m = e < c1 ? std::min(piece, c1 - e) : next < 0 ? 0 : std::min(piece, next_end - next);
    for (int64_t h = 0; h < heads; ++h) {
      const auto [ra, rb] = head_rows(h);
      const int64_t r0 = h * m / heads, r1 = (h + 1) * m / heads;
      const SpreadRows<TKV> ahead{kptr + (e - c0) + r0, vptr + (e - c0) + r0, r1 - r0, slot_bytes};
      qk_piece_bf16<Bf16>(sc.qh.data() + ra * D, D, PointerRows<TKV>{kptr + (a - c0), h * p.k_stride[1]}, D,
                          rb - ra, e - a, S + ra * kBlock + (a - c0), kBlock, ahead, plan.qscale);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const auto [ra, rb] = head_rows(h);
    softmax_rows(plan, sc, h * rows, ra, rb, c0, c1, n8);
  }
  // The weights in one pass a piece (the spread brought their values); a
  // head's first piece rescales its output.
  for (int64_t a = c0, e; a < c1; a = e) {
    e = std::min(c1, a + piece);
    for (int64_t h = 0; h < heads; ++h) {
      const auto [ra, rb] = head_rows(h);
      pv_piece_bf16<Bf16>(S + ra * kBlock + (a - c0), kBlock, PointerRows<TKV>{vptr + (a - c0), h * p.v_stride[1]},
                          e - a, sc.o.data() + ra * Dp, Dp, a == c0 ? sc.alpha.data() + ra : nullptr, rb - ra, D,
                          sc.pb.data() + ra * kBlock);
    }
  }
}

// T: the queries' and output's dtype; TKV: the cache's (T, or int8_t /
// Float8_e4m3fn for a quantized cache, whose scales p.k_scale / p.v_scale
// are applied per slot).
template <typename T, typename TKV = T>
void run_task(const Plan& plan, const Task& t, Scratch& sc) {
  constexpr bool kQuantized =
      std::is_same_v<TKV, int8_t> || std::is_same_v<TKV, c10::Float8_e4m3fn>;
  const AttendParams& p = *plan.p;
  const int64_t G = plan.group, D = plan.dim, Dp = plan.dim_pad;
  const int64_t nt = t.i1 - t.i0;
  const int64_t rows = G * nt;
  const int64_t len = p.host_lengths[t.b];
  const int64_t first = p.host_kv_start ? p.host_kv_start[t.b] : 0;
  float* const Q = sc.q.data();
  float* const O = sc.o.data();
  float* const S = sc.s.data();
  float* const m = sc.m.data();
  float* const l = sc.l.data();
  float* const alpha = sc.alpha.data();
  int64_t* const lo = sc.lo.data();
  int64_t* const hi = sc.hi.data();

  // The task's slots [task_lo, task_hi) and which of them each query
  // position sees. Linear and paged rows: the slots themselves; position
  // ti sees [lo[ti], hi[ti]) (cut to the task's range), and their union is
  // contiguous (both ends grow with the position). A ring: the task's
  // visible slots of [j0, j1) (some query of the tile sees them: tile_sees)
  // in slot order, read through SlotRows::sel; each block marks which of
  // them each position sees (vis), since a ring's order of slots is not the
  // order of positions. Empty or stale slots are never read, not even with
  // weight 0 (0 * NaN is NaN). The order of the work depends only on which
  // slots are visible (a position has one slot), so a ring that reached the
  // same visible content by another route (a rollback after a wrap) gives
  // bit-identical results.
  const bool ring = plan.layout == Layout::kRing;
  int64_t task_lo = t.j1, task_hi = t.j0;
  int64_t p_lo = 0;  // rings: the tile's first query position
  if (ring) {
    p_lo = len - p.seq_of(t.b) + t.i0;
    const int64_t p_hi = p_lo + nt - 1;
    const int32_t* pos = p.positions + t.b * p.pos_stride[0];
    int64_t n_sel = 0;
    for (int64_t j = t.j0; j < t.j1; ++j) {
      const int64_t q = pos[j * p.pos_stride[1]];
      if (q >= 0 && detail::tile_sees(q, p_lo, p_hi, first, p.window, p.sinks)) {
        sc.sel[n_sel] = j;
        sc.sel_pos[n_sel] = q;
        ++n_sel;
      }
    }
    for (int64_t c = n_sel - 1; c >= 0; --c) {
      sc.sel_run[c] = c + 1 < n_sel && sc.sel[c + 1] == sc.sel[c] + 1 ? sc.sel_run[c + 1] + 1 : 1;
    }
    task_lo = 0;
    task_hi = n_sel;
    std::fill(lo, lo + nt, int64_t{0});
    std::fill(hi, hi + nt, n_sel);
    std::fill(sc.seen.data(), sc.seen.data() + nt, int64_t{0});
  } else {
    for (int64_t ti = 0; ti < nt; ++ti) {
      const int64_t pos = len - p.seq_of(t.b) + t.i0 + ti;
      int64_t a = first;
      if (p.window > 0) a = std::max(a, pos - p.window + 1);
      a = std::max(a, t.j0);
      const int64_t e = std::min(pos + 1, t.j1);
      lo[ti] = a;
      hi[ti] = std::max(a, e);
      if (a < e) {
        task_lo = std::min(task_lo, a);
        task_hi = std::max(task_hi, e);
      }
    }
  }

  start_task<T, TKV>(plan, t, sc);

  // The row's keys, values and scales, wherever the layout keeps them (of
  // KV head t.kvh; head t.kvh + h is h head strides further in each slot).
  SlotRows<TKV> K = slot_rows(p, static_cast<const TKV*>(p.k), p.k_stride, t.b, t.kvh);
  SlotRows<TKV> V = slot_rows(p, static_cast<const TKV*>(p.v), p.v_stride, t.b, t.kvh);
  SlotRows<float> KS, VS;
  if constexpr (kQuantized) {
    KS = slot_rows(p, p.k_scale, p.ks_stride, t.b, t.kvh);
    VS = slot_rows(p, p.v_scale, p.vs_stride, t.b, t.kvh);
  }
  if (ring) {
    K.select(sc.sel.data(), sc.sel_run.data());
    V.select(sc.sel.data(), sc.sel_run.data());
    KS.select(sc.sel.data(), sc.sel_run.data());
    VS.select(sc.sel.data(), sc.sel_run.data());
  }
  // A block: at most kBlock slots. In a task whose blocks may take the
  // GEMM loops (enough rows), consecutive in memory (cut at page ends) when
  // the pages hold a block or more; over smaller pages (16-slot pages, and
  // transformers' gathered context read as pages of one slot) it spans
  // pages and its GEMM block widens each run into the block's scratch
  // first (`gathered` below), one GEMM call a block instead of one a page
  // (pages of one slot ran GEMM calls of one column). The bf16 pair GEMMs
  // read a block in place within one page; the plan takes the float GEMMs
  // over pages smaller than a block (make_plan).
  // Otherwise a block may span pages, and its scores and weights go run by
  // run (the consecutive slots of one page) while the softmax and the
  // output update stay once a block: small pages cost no more rescales
  // than big ones.
  const bool gemm_task = plan.chunks != Chunks::kNone && rows >= plan.gemm_rows;
  const bool gather_runs = gemm_task && plan.chunks != Chunks::kBf16Pairs && K.table != nullptr &&
                           K.block_size < kBlock;
  const bool one_run = gemm_task && !gather_runs;
  auto block_end = [&](int64_t c0) {
    return c0 + std::min({kBlock, task_hi - c0, one_run ? K.run(c0) : kBlock});
  };
  if (plan.values_in_place() && task_lo < task_hi) {  // the first run's values, read after its scores
    for (int64_t h = 0; h < t.heads; ++h) {
      prefetch_rows(reinterpret_cast<const char*>(V.at(task_lo) + h * p.v_stride[1]),
                    V.ld * int64_t(sizeof(TKV)), 0,
                    std::min(block_end(task_lo) - task_lo, V.run(task_lo)),
                    D * int64_t(sizeof(TKV)));
    }
  }
  const Ahead streams = stream_geometry<TKV>(p, D, (task_hi - task_lo) * t.heads);
  // The streams of head h's run [j, je) of a block ending at c1 (and
  // cend), read in place (kStreamAhead: the float loops ask for the keys
  // ahead of the score tiles and this run's values beside them), and the
  // rows after it: the block's next run, else the next block's first (the
  // integer loops ask for them between their score tiles; the GEMM loops
  // spread them over their tiles).
  // A grouped task (Task::heads > 1) whose heads sit side by side in each
  // slot (pages, token-major rows) asks for whole slots, every head's strip
  // as one stream, instead of each head walking a strided stream of strips:
  // with the float and bf16 score loops each head's score pass over a piece
  // asks for its share of the next piece (`spread`: the traffic runs beside
  // every head's work; measured against the first head asking for all of
  // it, bench_paged bf16 16-slot pages 1.45 -> 1.25x head-major, the other
  // rows equal or better within the spread), with the integer loops the
  // first head's pass asks for the next rows in bursts. Later passes find
  // the piece in L1.
  // Slots per piece of a run (below): about kPieceBytes of every head's
  // key rows, which stay in L1 from the first head's pass over the piece to
  // the last's. One head a task: the whole run.
  constexpr int64_t kPieceBytes = 12288;
  const int64_t piece =
      t.heads > 1 ? std::max<int64_t>(4, kPieceBytes / (t.heads * streams.row_bytes)) : kBlock;
  const bool whole_slots = t.heads > 1 && p.k_stride[1] == D && p.v_stride[1] == D;
  Ahead slot_streams = streams;
  slot_streams.row_bytes = streams.row_bytes * t.heads;
  // The float and bf16 score loops take the spread form below; the integer
  // loops ask for the next rows in bursts between their tiles (kBurst).
  const bool spread = whole_slots && (plan.scores == Loops::kFloat || plan.scores == Loops::kBf16Pairs);
  auto run_ahead = [&](int64_t h, int64_t j, int64_t je, int64_t c1, int64_t cend, bool scores = true) {
    Ahead a;
    if (!(plan.keys_in_place() && plan.values_in_place())) return a;
    // The rows after [j, je): [next, stop), of which K.run(next) are consecutive.
    const int64_t next = je < c1 ? je : cend < task_hi ? cend : -1;
    const int64_t stop = next < 0 ? -1 : je < c1 ? c1 : block_end(cend);
    if (spread) {
      // Every head's score pass over this piece asks for its share of the
      // next piece's whole slots (keys and values), so that the memory
      // traffic runs beside all heads' work, not in bursts during the first
      // head's; the weight passes find the values in L2.
      if (!scores || next < 0) return a;
      const int64_t m = std::min({piece, stop - next, K.run(next)});
      const int64_t s0 = next + h * m / t.heads, s1 = next + (h + 1) * m / t.heads;
      if (s0 >= s1) return a;
      a = slot_streams;
      a.k = reinterpret_cast<const char*>(K.at(s0));
      a.v = reinterpret_cast<const char*>(V.at(s0));
      a.spread = s1 - s0;
      return a;
    }
    if (whole_slots && h > 0) return a;  // the first head's pass brought the piece's slots to L1
    a = whole_slots ? slot_streams : streams;
    a.v_cur = reinterpret_cast<const char*>(V.at(j) + h * p.v_stride[1]);
    if (next >= 0) {
      a.k = reinterpret_cast<const char*>(K.at(next) + h * p.k_stride[1]);
      a.v = reinterpret_cast<const char*>(V.at(next) + h * p.v_stride[1]);
      a.rows = std::min(stop - next, K.run(next));
    }
    return a;
  };
  for (int64_t c0 = task_lo, cend = task_lo; c0 < task_hi; c0 = cend) {
    cend = block_end(c0);
    // Positions that see part of [c0, cend): a contiguous run [ta, tb).
    int64_t ta = nt, tb = 0, c1 = c0;
    for (int64_t ti = 0; ti < nt; ++ti) {
      if (lo[ti] < hi[ti] && lo[ti] < cend && hi[ti] > c0) {
        ta = std::min(ta, ti);
        tb = ti + 1;
        c1 = std::max(c1, std::min(hi[ti], cend));
      }
    }
    if (ta >= tb) continue;
    const int64_t n = c1 - c0;
    const int64_t n8 = (n + Vec::kLanes - 1) / Vec::kLanes * Vec::kLanes;
    if (ring) {  // which of the block's slots each position sees
      for (int64_t ti = 0; ti < nt; ++ti) {
        unsigned char* v = sc.vis.data() + ti * kBlock;
        int64_t count = 0;
        for (int64_t j = 0; j < n; ++j) {
          v[j] = detail::sees(sc.sel_pos[c0 + j], p_lo + ti, first, p.window, p.sinks) ? 1 : 0;
          count += v[j];
        }
        sc.seen_block[ti] = count;
        sc.seen[ti] += count;
      }
    }
    // Runs of consecutive slots in [c0, c1): [j, run_end(j)).
    auto run_end = [&](int64_t j) { return j + std::min(c1 - j, K.run(j)); };
    // f(j, len) for each run [j, j + len) of [c0, c1).
    auto each_run = [&](auto&& f) {
      for (int64_t j = c0, je; j < c1; j = je) {
        je = run_end(j);
        f(j, je - j);
      }
    };
    // Rows [ra, rb) of the block's columns times head h's scales (KS or
    // VS, head stride hs), run by run.
    auto scale_runs = [&](const SlotRows<float>& XS, int64_t hs, int64_t h, int64_t ra, int64_t rb) {
      each_run([&](int64_t j, int64_t len) {
        scale_columns(S + (j - c0), ra, rb, len, XS.at(j) + h * hs, XS.ld);
      });
    };

    // A chunk's block (one run, or runs gathered): GEMM micro-kernels over
    // packed keys (and widened values) shared by all its rows, head by head.
    if (plan.chunks != Chunks::kNone && (tb - ta) * G >= plan.gemm_rows) {
      const bool gathered = gather_runs && K.run(c0) < n;
      for (int64_t h = 0; h < t.heads; ++h) {
        const int64_t ra = h * rows + ta * G, rb = h * rows + tb * G;
        const Ahead ahead = run_ahead(h, c0, c1, c1, cend);
        const TKV* const kc = K.at(c0) + h * p.k_stride[1];
        const TKV* const vc = V.at(c0) + h * p.v_stride[1];
        Trickle pf(ahead);  // the next block's lines, over this block's tiles
        // bf16 chunks on AVX512-BF16: both products on bf16 pairs.
        const bool pairs = kBf16Pairs<T, TKV> && plan.chunks == Chunks::kBf16Pairs;
        if (gathered) {
          // Each run's keys and values widened to float32 rows Dp apart (the
          // widened-values layout of the last branch below), then the float
          // GEMMs over them; each run's scales on its columns.
          float* const kg = sc.kb.data();
          float* const vg = sc.vb.data();
          each_run([&](int64_t j, int64_t len) {
            widen_rows(K.at(j) + h * p.k_stride[1], K.ld, p.k_stride[3], len, D, Dp, kg + (j - c0) * Dp);
          });
          qk_gemm<FloatScores>(Q + ra * Dp, Dp, static_cast<const float*>(kg), Dp, 1, n, n8, D, Dp, 1.f, rb - ra,
                               S + ra * kBlock, kBlock, nullptr, sc.kt.data(), pf);
          if constexpr (kQuantized) scale_runs(KS, p.ks_stride[1], h, ra, rb);
          softmax_rows(plan, sc, h * rows, ra, rb, c0, c1, n8);
          if constexpr (kQuantized) scale_runs(VS, p.vs_stride[1], h, ra, rb);
          each_run([&](int64_t j, int64_t len) {
            widen_rows(V.at(j) + h * p.v_stride[1], V.ld, p.v_stride[3], len, D, Dp, vg + (j - c0) * Dp);
          });
          pv_gemm<FloatWeights>(S + ra * kBlock, kBlock, static_cast<const float*>(vg), Dp, n, n8, rb - ra, Dp,
                                O + ra * Dp, Dp, alpha + ra, nullptr, nullptr, pf);
          continue;
        }
        if (pairs) {
          if constexpr (kBf16Pairs<T, TKV>) {
            qk_gemm<Bf16Scores<typename Vec::Bf16>>(sc.qh.data() + ra * D, D, kc, K.ld, 1, n, n8, D, Dp,
                                                    plan.qscale, rb - ra, S + ra * kBlock, kBlock,
                                                    sc.kb.data(), sc.kt.data(), pf);
          }
        } else {
          qk_gemm<FloatScores>(Q + ra * Dp, Dp, kc, K.ld, p.k_stride[3], n, n8, D, Dp, 1.f, rb - ra,
                               S + ra * kBlock, kBlock, sc.kb.data(), sc.kt.data(), pf);
        }
        if constexpr (kQuantized) scale_columns(S, ra, rb, n, KS.at(c0) + h * p.ks_stride[1], KS.ld);
        softmax_rows(plan, sc, h * rows, ra, rb, c0, c1, n8);
        if constexpr (kQuantized) scale_columns(S, ra, rb, n, VS.at(c0) + h * p.vs_stride[1], VS.ld);
        if (pairs) {
          if constexpr (kBf16Pairs<T, TKV>) {
            pv_gemm<Bf16Weights<typename Vec::Bf16>>(S + ra * kBlock, kBlock, vc, V.ld, n, n8, rb - ra, D,
                                                     O + ra * Dp, Dp, alpha + ra, sc.pb.data(),
                                                     reinterpret_cast<uint32_t*>(sc.vb.data()), pf);
          }
        } else if (std::is_same_v<TKV, float> && plan.values_in_place()) {
          pv_gemm<FloatWeights>(S + ra * kBlock, kBlock, vc, V.ld, n, n8, rb - ra, D, O + ra * Dp, Dp,
                                alpha + ra, nullptr, nullptr, pf);
        } else {
          widen_rows(vc, V.ld, p.v_stride[3], n, D, Dp, sc.vb.data());
          pv_gemm<FloatWeights>(S + ra * kBlock, kBlock, static_cast<const float*>(sc.vb.data()), Dp, n, n8,
                                rb - ra, Dp, O + ra * Dp, Dp, alpha + ra, nullptr, nullptr, pf);
        }
      }
      continue;
    }
    // Otherwise run by run (the consecutive slots of one page), each run
    // by pieces of at most `piece` slots, and within a piece head by head:
    // a grouped task's heads share each slot's lines (Task::heads), and a
    // piece of every head's rows stays in L1 from the first head's pass to
    // the last's (a whole block of them, heads x kBlock slots, does not).
    // Head h's rows: [h * rows + ta * G, h * rows + tb * G); its widened
    // keys and values (not read in place): kBlock x Dp floats at h.
    auto head_rows = [&](int64_t h) {
      return std::pair<int64_t, int64_t>{h * rows + ta * G, h * rows + tb * G};
    };
    // A grouped block on the bf16 pair loops goes by its slots' addresses
    // (grouped_block_bf16): a piece is one call per head wherever its
    // pages lie. Cut at page ends (the per-run path below), bf16 decode
    // over 16-slot pages had run 1.21-1.26x contiguous (32-slot pieces: a
    // score and a weight call per head per page, each weight call
    // reloading and storing its output rows); by address it runs 1.0-1.1x,
    // and over 64- and 256-slot pages and token-major rows 5-12% faster
    // than the per-run path too (bench_quickset-style A/B, Zen 4). The
    // float loops (fp32; bf16 without AVX512-BF16; fp16) keep the per-run
    // path: carried through their instantiations of run_task, a path like
    // this one made fp32 grouped decode 5-10% slower (GCC's inlining
    // decisions in run_task).
    if constexpr (kBf16Pairs<T, TKV>) {
      if (spread && plan.scores == Loops::kBf16Pairs && plan.weights == Loops::kBf16Pairs) {
        grouped_block_bf16(plan, sc, K, V, t.heads, rows, ta, tb, c0, c1, n8, piece, slot_streams.row_bytes,
                           cend < task_hi ? cend : -1, cend < task_hi ? block_end(cend) : -1);
        continue;
      }
    }
    auto pieces = [&](auto&& f) {
      each_run([&](int64_t j, int64_t len) {
        for (int64_t a = j, e; a < j + len; a = e) {
          e = std::min(j + len, a + piece);
          f(a, e);
        }
      });
    };
    // Scores: read in place, or widened into the block's scratch rows and
    // scored once.
    pieces([&](int64_t a, int64_t e) {
      for (int64_t h = 0; h < t.heads; ++h) {
        const auto [ra, rb] = head_rows(h);
        if (plan.keys_in_place()) {
          const Ahead ahead = run_ahead(h, a, e, c1, cend);
          score_in_place<T>(plan, sc, ra, rb, K.at(a) + h * p.k_stride[1], K.ld, e - a,
                            &ahead, a - c0);
          if constexpr (kQuantized) {
            scale_columns(S + (a - c0), ra, rb, e - a, KS.at(a) + h * p.ks_stride[1], KS.ld);
          }
        } else {
          pack_rows(K.at(a) + h * p.k_stride[1], K.ld, p.k_stride[3], e - a, D, Dp,
                    sc.kb.data() + (h * kBlock + a - c0) * Dp);
        }
      }
    });
    for (int64_t h = 0; h < t.heads; ++h) {
      const auto [ra, rb] = head_rows(h);
      if (!plan.keys_in_place()) {
        qk_block<FloatScores>(Q + ra * Dp, Dp, nullptr, static_cast<const float*>(sc.kb.data()) + h * kBlock * Dp,
                              Dp, Dp, rb - ra, n, S + ra * kBlock, kBlock, nullptr);
        if constexpr (kQuantized) scale_runs(KS, p.ks_stride[1], h, ra, rb);
      }
      softmax_rows(plan, sc, h * rows, ra, rb, c0, c1, n8);
    }
    // Weights, the same way; a head's first piece rescales its output.
    pieces([&](int64_t a, int64_t e) {
      for (int64_t h = 0; h < t.heads; ++h) {
        const auto [ra, rb] = head_rows(h);
        if constexpr (kQuantized) {
          scale_columns(S + (a - c0), ra, rb, e - a, VS.at(a) + h * p.vs_stride[1], VS.ld);
        }
        if (plan.values_in_place()) {
          const Ahead ahead = run_ahead(h, a, e, c1, cend, false);
          weigh_in_place<T>(plan, sc, ra, rb, V.at(a) + h * p.v_stride[1], V.ld, e - a,
                            &ahead, a - c0, a == c0 ? alpha + ra : nullptr);
        } else {
          pack_rows(V.at(a) + h * p.v_stride[1], V.ld, p.v_stride[3], e - a, D, Dp,
                    sc.vb.data() + (h * kBlock + a - c0) * Dp);
        }
      }
    });
    if (!plan.values_in_place()) {
      for (int64_t h = 0; h < t.heads; ++h) {
        const auto [ra, rb] = head_rows(h);
        pv_block<FloatWeights>(S + ra * kBlock, kBlock, static_cast<const float*>(sc.vb.data()) + h * kBlock * Dp,
                               Dp, n, O + ra * Dp, Dp, alpha + ra, rb - ra, Dp);
      }
    }
  }

  const int64_t all_rows = rows * t.heads;
  if (t.part >= 0) {  // a split of the row: keep the unnormalized state
    float* part = plan.partial + t.part * plan.part_stride;
    std::copy(O, O + all_rows * Dp, part);
    std::copy(m, m + all_rows, part + all_rows * Dp);
    std::copy(l, l + all_rows, part + all_rows * Dp + all_rows);
    return;
  }
  T* obase = static_cast<T*>(p.out) + t.b * p.out_stride[0] +
              p.first_token(t.b) * p.out_stride[2];
  for (int64_t r = 0; r < all_rows; ++r) {
    const int64_t h = r / rows, ti = (r % rows) / G, g = r % G;
    const int64_t head = (t.kvh + h) * G + g;
    // A query that sees no slot (left padding, an empty ring) gets zeros.
    const bool saw = ring ? sc.seen[ti] > 0 : lo[ti] < hi[ti];
    const float inv = saw ? 1.f / with_sink(p, head, m[r], l[r]) : 0.f;
    T* dst = obase + head * p.out_stride[1] + (t.i0 + ti) * p.out_stride[2];
    const float* src = O + r * Dp;
    for (int64_t d = 0; d < D; ++d) dst[d * p.out_stride[3]] = static_cast<T>(src[d] * inv);
  }
}
