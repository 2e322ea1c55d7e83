#include "kvcache/build_info.h"

#include <torch/version.h>

#include <string>

#include "cuda/build_facts.h"
#include "ops/attend.h"
#include "ops/init_layer_cache.h"
#include "ops/operators.h"
#include "ops/ring.h"
#include "ops/paged.h"
#include "ops/rows.h"
#include "ops/update.h"

namespace kvcache {
namespace detail {

const CudaBuildFacts* cuda_build_facts = nullptr;

}  // namespace detail

namespace {

// "800,900" (nvcc's __CUDA_ARCH_LIST__) -> "8.0;9.0", the spelling of
// TORCH_CUDA_ARCH_LIST. Entries such as 1000 or 900a keep every digit but
// the last as the major version: "10.0", "9.0a".
std::string arch_list(const char* nvcc_list) {
  std::string out;
  std::string item;
  auto flush = [&] {
    size_t digits = 0;
    while (digits < item.size() && item[digits] >= '0' && item[digits] <= '9') {
      ++digits;
    }
    if (digits >= 3) {
      // Three or more digits: major, minor, and a trailing 0.
      const std::string major = item.substr(0, digits - 2);
      const std::string minor = item.substr(digits - 2, 1);
      if (!out.empty()) out += ';';
      out += major + "." + minor + item.substr(digits);
    }
    item.clear();
  };
  for (const char* c = nvcc_list; *c != '\0'; ++c) {
    if (*c == ',') {
      flush();
    } else if (*c != ' ') {
      item += *c;
    }
  }
  flush();
  return out;
}

}  // namespace

BuildInfo build_info() {
  BuildInfo info;
  const detail::CudaBuildFacts* facts = detail::cuda_build_facts;
  // CUDA counts as built in only if the CUDA objects are linked (they set
  // the facts) and every operator's CUDA work is registered.
  info.with_cuda = facts != nullptr;
#define KVCACHE_HAS_CUDA(id, name, kind, stub, schema) \
  info.with_cuda = info.with_cuda && detail::has_cuda_work(detail::stub);
  KVCACHE_OPERATORS(KVCACHE_HAS_CUDA)
#undef KVCACHE_HAS_CUDA
  info.torch_version = TORCH_VERSION;
  if (facts != nullptr) {
    info.cuda_version = std::to_string(facts->cudart_version / 1000) + "." +
                        std::to_string(facts->cudart_version % 1000 / 10);
    info.cuda_archs = arch_list(facts->arch_list);
  }
  return info;
}

}  // namespace kvcache
