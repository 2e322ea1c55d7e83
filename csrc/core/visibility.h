// Which cached keys a query sees, and where a position lives in a ring.
//
// The one statement of the rule, for every kernel (CPU plan and tasks, CUDA
// attend, CUDA and CPU ring writes): host and device code include this
// header. Positions are logical token positions (0, 1, 2, ... of a row).
//
//   A query at position p of a row whose first valid position is `first`
//   (kv_start, left padding) sees the key at position q iff
//
//     first <= q <= p  and  (window == 0  or  q < sinks  or  p - q < window)
//
// so the window counts the query itself (window 1: a query sees only
// itself, as transformers' sliding layers), and the first `sinks` positions
// are always visible (StreamingLLM's attention sinks). A linear cache holds
// position q at slot q and has no sinks, so its visible slots are one range
// (visible_range). A ring records each slot's position and reads the rule
// per slot (sees), never from the slot index.
#pragma once

#include <cstdint>

#include "params.h"

namespace kvcache {
namespace detail {

KVCACHE_HOST_DEVICE bool sees(int64_t q, int64_t p, int64_t first,
                              int64_t window, int64_t sinks) {
  return q >= first && q <= p && (window <= 0 || q < sinks || p - q < window);
}

// Whether some query of the consecutive positions [p_lo, p_hi] sees q: the
// union of their visible sets (the latest query reaches furthest forward,
// the earliest furthest back: for q < p_lo the query p_lo is the closest).
KVCACHE_HOST_DEVICE bool tile_sees(int64_t q, int64_t p_lo, int64_t p_hi,
                                   int64_t first, int64_t window,
                                   int64_t sinks) {
  return q >= first && q <= p_hi &&
         (window <= 0 || q < sinks || q >= p_lo || p_lo - q < window);
}

// Linear caches (slot == position, no sinks): the visible slots of the
// query at p are [lo, hi) (lo == hi: none; lo >= first).
KVCACHE_HOST_DEVICE void visible_range(int64_t p, int64_t first, int64_t window,
                                       int64_t* lo, int64_t* hi) {
  int64_t a = first;
  // p - window + 1 >= 2 - 2^63 for the int32 positions used here.
  if (window > 0 && p - window + 1 > a) a = p - window + 1;
  *lo = a;
  *hi = p + 1 > a ? p + 1 : a;
}

// How many positions the query at p sees when every one of them is present:
// |{q : sees(q, p, first, window, sinks)}|. A ring whose visible slots count
// fewer lost a position the query needs (a rollback or chunk beyond the
// ring's bound); attend then outputs NaN for that query instead of a
// silently different answer.
KVCACHE_HOST_DEVICE int64_t visible_count(int64_t p, int64_t first,
                                          int64_t window, int64_t sinks) {
  if (p < first) return 0;
  if (window <= 0) return p + 1 - first;
  // Sinks [first, min(p + 1, sinks)), then the window part
  // [max(first, sinks, p - window + 1), p + 1).
  const int64_t sink_end = p + 1 < sinks ? p + 1 : sinks;
  const int64_t n_sinks = sink_end > first ? sink_end - first : 0;
  int64_t lo = first > sinks ? first : sinks;
  if (p - window + 1 > lo) lo = p - window + 1;
  const int64_t n_window = p + 1 > lo ? p + 1 - lo : 0;
  return n_sinks + n_window;
}

// A ring of `capacity` slots with `sinks` sink slots: position p lives at
// slot p if p < sinks, else sinks + (p - sinks) mod (capacity - sinks).
// capacity > sinks >= 0 and p >= 0 (checked before any kernel runs).
KVCACHE_HOST_DEVICE int64_t ring_slot(int64_t p, int64_t sinks,
                                      int64_t capacity) {
  return p < sinks ? p : sinks + (p - sinks) % (capacity - sinks);
}

// Whether a write of the positions [start, end) into a ring keeps position
// p: the sinks, and the last capacity - sinks positions (earlier ones would
// be overwritten by later ones of the same write, so they are not written:
// each slot is written at most once per call, also on CUDA).
KVCACHE_HOST_DEVICE bool ring_keeps(int64_t p, int64_t end, int64_t sinks,
                                    int64_t capacity) {
  return p < sinks || p >= end - (capacity - sinks);
}

}  // namespace detail
}  // namespace kvcache
