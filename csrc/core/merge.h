// The merge of the splits of one query row (flash-decoding's combine).
//
// The one statement of the rule, for the CPU (csrc/cpu/attend.cpp,
// merge_parts) and CUDA (csrc/cuda/attend.cu, attend_combine_kernel): host
// and device code include this header, so a split row gives what the
// unsplit kernels give on every device, NaN included.
//
// A split (part) s of a row's slots leaves its online-softmax state: m_s,
// the largest score it saw (in the units of `exp`: base 2 on the CPU, e on
// CUDA), l_s = sum of exp(score - m_s) over its slots, and the accumulator
// o_s = sum of exp(score - m_s) v (unnormalized). The row's output is
//
//   out = sum_s w_s o_s / (sum_s w_s l_s + exp(sink - M)),  w_s = exp(m_s - M)
//
// over the parts that saw a slot, M the largest of their m_s; 0 when no
// part saw a slot (a left-padding query). Parts that saw nothing are left
// out: their accumulators are not read.
//
// NaN. A part that saw no slot has l_s == 0 exactly. One that saw a slot
// has l_s >= 1 (its largest score adds exp(0)), or l_s NaN when a score was
// NaN (NaN in a key, a query or a scale: the max then ignores it and m_s
// stays finite or -inf) or +inf (m_s = +inf and inf - inf). So a part is
// merged iff l_s != 0: a NaN part reaches the denominator (and, through
// w_s, the accumulator) and the row's output is NaN, as the unsplit
// kernels give (their 1 / l is NaN). Only l_s == 0 is "saw nothing": a
// part with m_s = -inf and l_s NaN (every score NaN: a NaN query) is
// merged, and its NaN l_s reaches the sum whatever its weight (0 * NaN is
// NaN; with M = -inf too the weight itself is NaN). M ignores NaN maxima
// (never produced, but a NaN m_s still gives w_s = NaN).
#pragma once

#include <cmath>
#include <cstdint>

#include "params.h"

namespace kvcache {
namespace detail {

// Whether a part whose softmax sum is l saw a slot (see above).
KVCACHE_HOST_DEVICE bool part_seen(float l) { return !(l == 0.f); }

// Weight of a part that is left out (it saw no slot): real weights are
// exp(x) >= 0 or NaN, never negative.
KVCACHE_HOST_DEVICE float unmerged_weight() { return -1.f; }

// Whether the part of weight w (from merge_splits) is merged.
KVCACHE_HOST_DEVICE bool merged(float w) { return !(w == unmerged_weight()); }

// The weights of a row's parts, and the factor that normalizes the merged
// accumulators. part(s, &m, &l) reads part s's max and sum (s < parts);
// exp_fn is the kernels' exponential (std::exp2 / expf); sink (used when
// has_sink) is the row's learned sink logit in exp_fn's units. Writes w[s]
// for every part (unmerged_weight() for a part left out) and returns the
// factor f: out[d] = f * sum over merged parts of w[s] * o_s[d]
// (merged_sum). f is 0 when no part saw a slot, NaN when a merged part
// carries a NaN.
template <typename Part, typename Exp>
KVCACHE_HOST_DEVICE float merge_splits(int64_t parts, const Part& part, const Exp& exp_fn,
                                       bool has_sink, float sink, float* w) {
  float mx = -INFINITY;
  bool any = false;
  for (int64_t s = 0; s < parts; ++s) {
    float m, l;
    part(s, &m, &l);
    if (!part_seen(l)) continue;
    any = true;
    if (mx < m) mx = m;  // a NaN m_s never wins (its weight is NaN anyway)
  }
  float sum = 0.f;
  for (int64_t s = 0; s < parts; ++s) {
    float m, l;
    part(s, &m, &l);
    if (!part_seen(l)) {
      w[s] = unmerged_weight();
      continue;
    }
    w[s] = exp_fn(m - mx);
    sum += w[s] * l;
  }
  if (!any) return 0.f;  // no slot seen: zeros (left padding)
  if (has_sink) sum += exp_fn(sink - mx);
  return 1.f / sum;
}

// sum over the merged parts of w[s] * acc(s): the merged accumulator of one
// output element before merge_splits' factor.
template <typename Acc>
KVCACHE_HOST_DEVICE float merged_sum(int64_t parts, const float* w, const Acc& acc) {
  float o = 0.f;
  for (int64_t s = 0; s < parts; ++s) {
    if (merged(w[s])) o += w[s] * acc(s);
  }
  return o;
}

}  // namespace detail
}  // namespace kvcache
