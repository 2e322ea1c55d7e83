// The value rules of the operators, written once for host and device code.
//
// A host check (csrc/ops/*.cpp) raises a ValueError naming the argument
// when a rule fails; a CUDA kernel, which cannot raise without a host sync,
// writes nothing and produces -1 lengths (kPoisonLength). Both decide with
// these functions, so what is accepted is the same on every device. Every
// comparison is arranged so that no intermediate overflows int64.
#pragma once

#include <cstdint>

#include "params.h"

namespace kvcache {
namespace detail {

// A write of `chunk` slots at `start` fits a row of `max_len` slots:
// start >= 0 and start <= max_len - chunk (never start + chunk > max_len,
// which overflows for a start near 2^63; max_len - chunk cannot: both are
// sizes >= 0, and it is negative when the chunk alone exceeds the cache).
KVCACHE_HOST_DEVICE bool start_fits(int64_t start, int64_t chunk,
                                    int64_t max_len) {
  return start >= 0 && start <= max_len - chunk;
}

// A row length (filled slots) of a cache of `max_len` slots.
KVCACHE_HOST_DEVICE bool length_fits(int64_t len, int64_t max_len) {
  return len >= 0 && len <= max_len;
}

// The first visible slot of a row of `len` filled slots.
KVCACHE_HOST_DEVICE bool kv_start_fits(int64_t first, int64_t len) {
  return first >= 0 && first <= len;
}

// Dropping `drop` tokens from a row of `len` slots whose first visible slot
// is `first` keeps it at or above `first` (drop <= len - first, never
// len - drop < first: len - first cannot overflow once the two above hold,
// a drop near 2^63 could).
KVCACHE_HOST_DEVICE bool rollback_fits(int64_t len, int64_t first,
                                       int64_t drop) {
  return len >= 0 && kv_start_fits(first, len) && drop >= 0 &&
         drop <= len - first;
}

// A row index of a batch of `batch` rows.
KVCACHE_HOST_DEVICE bool row_index_fits(int64_t index, int64_t batch) {
  return index >= 0 && index < batch;
}

// attend: the `seq` queries are the last filled slots of a row of `len`
// slots (len >= seq), within the cache, above a valid first slot.
KVCACHE_HOST_DEVICE bool attend_row_fits(int64_t len, int64_t first,
                                         int64_t seq, int64_t max_len) {
  return len >= seq && len <= max_len && kv_start_fits(first, len);
}

}  // namespace detail
}  // namespace kvcache
