// How the kvcache op library was built; plain C++ (no torch headers) so the
// pybind11 module that reports it compiles quickly.
#pragma once

#include "kvcache/export.h"

#include <string>

namespace kvcache {

struct BuildInfo {
  bool with_cuda;             // CUDA kernels compiled in
  std::string torch_version;  // torch the library was compiled against
  std::string cuda_version;   // CUDA toolkit version, "" without CUDA
  std::string cuda_archs;     // TORCH_CUDA_ARCH_LIST used, "" without CUDA
};

/// Returns how this library was built.
KVCACHE_API BuildInfo build_info();

}  // namespace kvcache
