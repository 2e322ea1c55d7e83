// How the kvcache op library was built; plain C++ (no torch headers) so the
// pybind11 module that reports it compiles quickly.
#pragma once

#include "kvcache/export.h"

#include <string>

namespace kvcache {

// The CUDA fields come from the CUDA compiler itself (CUDART_VERSION and
// nvcc's __CUDA_ARCH_LIST__, recorded by csrc/cuda/build_facts.cu), so
// every build system reports the same facts for the same compilation.
struct BuildInfo {
  // CUDA kernels linked in: the CUDA objects are in the library and every
  // operator's CUDA work is registered.
  bool with_cuda;
  std::string torch_version;  // torch the library was compiled against
  // CUDA runtime headers compiled against, "major.minor" ("" without CUDA).
  std::string cuda_version;
  // Architectures compiled for, as TORCH_CUDA_ARCH_LIST spells them
  // ("8.0;9.0"; "" without CUDA). nvcc reports the virtual architecture of
  // each target, so whether PTX is embedded as well is not shown here.
  std::string cuda_archs;
};

/// Returns how this library was built.
KVCACHE_API BuildInfo build_info();

}  // namespace kvcache
