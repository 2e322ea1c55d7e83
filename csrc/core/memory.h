// Cache buffers in transparent huge pages (CPU, Linux).
//
// A decode step reads every filled slot of the cache once: at thousands of
// tokens per sequence that is tens of MB per layer, spread over 4 KB pages
// (and, for paged caches, over pages of the pool in the block table's
// order). Each 4 KB page costs a TLB fill, and a page walk that misses the
// caches when the pages are visited out of order. Buffers in 2 MB pages
// need 512 times fewer: benchmarks/bench_paged.py's --huge-pages A/B
// measures the difference.
//
// cache_zeros allocates a zero-filled buffer like at::zeros, and on the CPU
// asks the kernel (madvise(MADV_HUGEPAGE)) for huge pages over the huge-page
// aligned part of it before the fill first touches it, so the fill faults
// it in as huge pages. Where the kernel has transparent huge pages off
// ("never"), or on other systems, the advice is a no-op and the buffer is
// what at::zeros gives. Memory use does not change: the buffer is filled,
// so every page of it is resident either way. KVCACHE_HUGE_PAGES=0 in the
// environment turns the advice off (an A/B switch).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/core/TensorOptions.h>

#include <cstddef>

#include "kvcache/export.h"

namespace kvcache {
namespace detail {

// Zero-filled tensor of `shape` with `opts` (contiguous), in huge pages
// where the advice applies (CPU, concrete sizes, at least one huge page:
// 2 MB on x86-64, the kernel's hpage_pmd_size).
KVCACHE_API at::Tensor cache_zeros(c10::SymIntArrayRef shape, const at::TensorOptions& opts);

// Advises huge pages for the huge-page-aligned part of [p, p + bytes),
// before it is first touched; true when the kernel took the advice.
KVCACHE_API bool advise_huge_pages(void* p, size_t bytes);

// Whether KVCACHE_HUGE_PAGES leaves the advice on (unset, or not "0").
KVCACHE_API bool huge_pages_enabled();

}  // namespace detail
}  // namespace kvcache
