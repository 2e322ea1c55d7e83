#include "memory.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvcache {
namespace detail {
namespace {

constexpr uintptr_t kHugePage = uintptr_t{2} << 20;

}  // namespace

bool huge_pages_enabled() {
  const char* v = std::getenv("KVCACHE_HUGE_PAGES");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

bool advise_huge_pages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  // Overflow-free: start + bytes is one past a live allocation.
  const uintptr_t lo = (start + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t hi = (start + bytes) & ~(kHugePage - 1);
  if (p == nullptr || hi <= lo || start + kHugePage - 1 < start) return false;
  return madvise(reinterpret_cast<void*>(lo), static_cast<size_t>(hi - lo), MADV_HUGEPAGE) == 0;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

at::Tensor cache_zeros(c10::SymIntArrayRef shape, const at::TensorOptions& opts) {
  const bool cpu = !opts.has_device() || opts.device().is_cpu();
  if (!cpu || !huge_pages_enabled()) return at::zeros_symint(shape, opts);
  const auto sizes = c10::asIntArrayRefSlowOpt(shape);
  if (!sizes.has_value()) return at::zeros_symint(shape, opts);
  at::Tensor t = at::empty(*sizes, opts);
  if (t.nbytes() >= kHugePage) advise_huge_pages(t.data_ptr(), t.nbytes());
  return t.zero_();
}

}  // namespace detail
}  // namespace kvcache
