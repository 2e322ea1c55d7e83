// Records what nvcc compiled this library for (see build_facts.h).
#include <cuda_runtime_api.h>

#include "build_facts.h"

#define KVCACHE_STR2(...) #__VA_ARGS__
#define KVCACHE_STR(...) KVCACHE_STR2(__VA_ARGS__)

namespace kvcache {
namespace detail {
namespace {

// nvcc defines __CUDA_ARCH_LIST__ (the virtual architectures of every
// -gencode, e.g. 800,900) in host and device passes alike.
#ifdef __CUDA_ARCH_LIST__
constexpr const char* kArchList = KVCACHE_STR(__CUDA_ARCH_LIST__);
#else
constexpr const char* kArchList = "";
#endif

const CudaBuildFacts kFacts{CUDART_VERSION, kArchList};

const bool kRegistered = [] {
  cuda_build_facts = &kFacts;
  return true;
}();

}  // namespace
}  // namespace detail
}  // namespace kvcache
