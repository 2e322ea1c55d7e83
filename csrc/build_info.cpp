#include "kvcache/build_info.h"

#include <torch/version.h>

// The build (setup.py or CMakeLists.txt) defines these for a CUDA build.
#ifndef KVCACHE_CUDA_VERSION
#define KVCACHE_CUDA_VERSION ""
#endif
#ifndef KVCACHE_CUDA_ARCHS
#define KVCACHE_CUDA_ARCHS ""
#endif

namespace kvcache {

BuildInfo build_info() {
  BuildInfo info;
#ifdef KVCACHE_WITH_CUDA
  info.with_cuda = true;
#else
  info.with_cuda = false;
#endif
  info.torch_version = TORCH_VERSION;
  info.cuda_version = KVCACHE_CUDA_VERSION;
  info.cuda_archs = KVCACHE_CUDA_ARCHS;
  return info;
}

}  // namespace kvcache
