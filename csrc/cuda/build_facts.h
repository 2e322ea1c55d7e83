// Facts about the CUDA compilation, recorded by the CUDA compiler itself
// (csrc/cuda/build_facts.cu) so that every build (setup.py, CMake, any
// other) reports the same thing without passing macros. Plain C++: read by
// csrc/build_info.cpp, which the host compiler builds.
#pragma once

namespace kvcache {
namespace detail {

struct CudaBuildFacts {
  int cudart_version;      // CUDART_VERSION: 1000 * major + 10 * minor
  const char* arch_list;   // nvcc's __CUDA_ARCH_LIST__, e.g. "800,900"
};

// Set by build_facts.cu while the library loads; nullptr in a build without
// the CUDA sources. (Constant-initialized, so no initialization-order issue.)
extern const CudaBuildFacts* cuda_build_facts;

}  // namespace detail
}  // namespace kvcache
