#include "memory.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvcache {
namespace detail {
namespace {

// The kernel's transparent huge page size (2 MB on x86-64; 32 MB or 512 MB
// on arm64 kernels with 16 KB / 64 KB base pages), read once.
uintptr_t huge_page_bytes() {
  static const uintptr_t bytes = [] {
    uintptr_t v = 0;
#if defined(__linux__)
    if (FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", "r")) {
      unsigned long long n = 0;
      if (std::fscanf(f, "%llu", &n) == 1) v = static_cast<uintptr_t>(n);
      std::fclose(f);
    }
#endif
    // A power of two, or the x86-64 size.
    return v != 0 && (v & (v - 1)) == 0 ? v : uintptr_t{2} << 20;
  }();
  return bytes;
}

}  // namespace

bool huge_pages_enabled() {
  const char* v = std::getenv("KVCACHE_HUGE_PAGES");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

bool advise_huge_pages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t huge = huge_page_bytes();
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  if (p == nullptr || bytes < huge) return false;
  // Overflow-free: start + bytes is one past a live allocation, and user
  // addresses lie far below 2^64 - huge.
  const uintptr_t lo = (start + huge - 1) & ~(huge - 1);
  const uintptr_t hi = (start + bytes) & ~(huge - 1);
  if (hi <= lo) return false;
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
  advise_huge_pages(t.data_ptr(), t.nbytes());
  return t.zero_();
}

}  // namespace detail
}  // namespace kvcache
