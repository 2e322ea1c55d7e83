// Host-side launch rules shared by the CUDA kernels' host code: the
// threads of the one-block validation passes and the 32-bit grid bound of
// the copy launches. No CUDA runtime call (runtime.cuh has those), so the
// kernel headers that use it also compile under the host tests' emulator.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>

#include "../core/params.h"

namespace kvcache {
namespace cuda {

// Threads of the one-block validation passes: enough to read a few
// thousand per-row integers in a handful of steps.
constexpr int kCheckThreads = 512;

inline unsigned check_threads(int64_t n) {
  const int64_t warps = (n + 31) / 32;
  const int64_t t = warps * 32;
  return static_cast<unsigned>(t < 32 ? 32 : (t > kCheckThreads ? kCheckThreads : t));
}

// The copy kernels give each (buffer, batch row, KV head) slab of keys and
// values one block along grid x: 2 * slabs blocks must fit a 32-bit grid
// index. Raised before anything is launched, so nothing is written.
inline void check_copy_slabs(int64_t slabs) {
  TORCH_CHECK_VALUE(2 * slabs <= std::numeric_limits<int32_t>::max(),
                    "kvcache: batch * num_kv_heads = ", slabs,
                    " is too large for one CUDA launch (at most 2^30 - 1)");
}

}  // namespace cuda
}  // namespace kvcache
