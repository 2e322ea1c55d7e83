// What every CUDA stub of kvcache does around its launches: run on the
// tensors' device (a device guard: the dispatcher sets none for custom ops)
// and on the current stream (so the work is ordered with the caller's and
// can be captured in a CUDA graph); check every launch.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

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

}  // namespace cuda
}  // namespace kvcache
