#include "overlap.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <utility>

namespace kvcache {
namespace detail {
namespace {

// The byte set of a box in a canonical form: dims of size 1 and of stride 0
// dropped (they add no byte), the rest sorted by stride, ascending.
struct Canon {
  int64_t offset = 0;
  int64_t elem = 0;  // 0: the box is empty
  int n = 0;
  int64_t size[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};
};

Canon canon(const Box& b) {
  Canon c;
  c.offset = b.offset;
  c.elem = b.elem;
  for (int k = 0; k < b.ndim; ++k) {
    if (b.size[k] == 0) {
      c.elem = 0;
      c.n = 0;
      return c;
    }
    if (b.size[k] > 1 && b.stride[k] != 0) {
      c.size[c.n] = b.size[k];
      c.stride[c.n] = b.stride[k];
      ++c.n;
    }
  }
  // Insertion sort: at most kMaxDims entries.
  for (int i = 1; i < c.n; ++i) {
    for (int j = i; j > 0 && c.stride[j] < c.stride[j - 1]; --j) {
      std::swap(c.stride[j], c.stride[j - 1]);
      std::swap(c.size[j], c.size[j - 1]);
    }
  }
  return c;
}

// [lo, hi) bytes covered.
std::pair<int64_t, int64_t> bounds(const Canon& c) {
  int64_t hi = c.offset + c.elem;
  for (int k = 0; k < c.n; ++k) {
    hi += (c.size[k] - 1) * c.stride[k];
  }
  return {c.offset, hi};
}

// Merges the innermost dims that continue a contiguous run. Returns the run
// length in bytes; `first_outer` is the first dim that does not.
int64_t run_length(const Canon& c, int* first_outer) {
  int64_t run = c.elem;
  int k = 0;
  while (k < c.n && c.stride[k] == run) {
    run *= c.size[k];
    ++k;
  }
  *first_outer = k;
  return run;
}

// Start addresses of the runs, sorted. False if there are more than
// `budget` runs.
bool list_runs(const Canon& c, int64_t budget, std::vector<int64_t>* starts,
               int64_t* run) {
  int first = 0;
  *run = run_length(c, &first);
  int64_t count = 1;
  for (int k = first; k < c.n; ++k) {
    if (c.size[k] > budget / count) {
      return false;
    }
    count *= c.size[k];
  }
  starts->clear();
  starts->reserve(static_cast<size_t>(count));
  int64_t idx[kMaxDims] = {};
  int64_t addr = c.offset;
  for (int64_t r = 0; r < count; ++r) {
    starts->push_back(addr);
    // Odometer over the outer dims, innermost (smallest stride) fastest.
    for (int k = first; k < c.n; ++k) {
      if (++idx[k] < c.size[k]) {
        addr += c.stride[k];
        break;
      }
      addr -= (c.size[k] - 1) * c.stride[k];
      idx[k] = 0;
    }
  }
  if (!std::is_sorted(starts->begin(), starts->end())) {
    std::sort(starts->begin(), starts->end());
  }
  return true;
}

bool same_geometry(const Canon& a, const Canon& b) {
  if (a.elem != b.elem || a.n != b.n) {
    return false;
  }
  for (int k = 0; k < a.n; ++k) {
    if (a.size[k] != b.size[k] || a.stride[k] != b.stride[k]) {
      return false;
    }
  }
  return true;
}

// Is there an index difference m (|m_k| < size_k) with |r + sum m_k s_k| <
// run, over dims first..n-1 searched from the largest stride down?
// `reach[k]` bounds what dims below k can still add. Returns 1 (yes), 0
// (no) or -1 (too many candidates: undecided).
int lattice_hit(const Canon& c, int k, int first, int64_t r, int64_t run,
                const int64_t* reach, int* budget) {
  if (k < first) {
    return std::llabs(r) < run ? 1 : 0;
  }
  const int64_t s = c.stride[k];
  const int64_t limit = run + reach[k];  // |r + m s| must stay below this
  const int64_t lim_m = c.size[k] - 1;
  // m with -limit < r + m s < limit.
  auto floor_div = [](int64_t x, int64_t y) {
    return x / y - ((x % y != 0) && ((x < 0) != (y < 0)));
  };
  int64_t lo = floor_div(-limit - r, s) + 1;
  int64_t hi = -floor_div(-(limit - r), s) - 1;  // ceil((limit - r)/s) - 1
  lo = std::max(lo, -lim_m);
  hi = std::min(hi, lim_m);
  for (int64_t m = lo; m <= hi; ++m) {
    if (--*budget < 0) {
      return -1;
    }
    const int hit = lattice_hit(c, k - 1, first, r + m * s, run, reach, budget);
    if (hit != 0) {
      return hit;
    }
  }
  return 0;
}

// Exact overlap of two boxes of the same geometry, offsets `delta` apart.
// -1 if undecided within the search budget.
int lattice_overlap(const Canon& c, int64_t delta) {
  int first = 0;
  const int64_t run = run_length(c, &first);
  int64_t reach[kMaxDims] = {};
  int64_t acc = 0;
  for (int k = first; k < c.n; ++k) {
    reach[k] = acc;
    acc += (c.size[k] - 1) * c.stride[k];
  }
  int budget = 4096;
  return lattice_hit(c, c.n - 1, first, delta, run, reach, &budget);
}

}  // namespace

Box box_of(const at::Tensor& t) {
  Box b;
  TORCH_INTERNAL_ASSERT(t.dim() <= kMaxDims);
  b.ndim = static_cast<int>(t.dim());
  b.elem = static_cast<int64_t>(t.element_size());
  if (!t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    // Eager tensors: plain sizes and strides (the per-call cost of every
    // update's checks; SymInt accessors cost more).
    const auto sizes = t.sizes();
    const auto strides = t.strides();
    for (int k = 0; k < b.ndim; ++k) {
      b.size[k] = sizes[k];
      b.stride[k] = strides[k] * b.elem;
    }
    if (!t.has_storage()) {
      b.known = false;
      return b;
    }
    const void* base = t.storage().data();
    if (base != nullptr) {
      b.offset = reinterpret_cast<intptr_t>(base) + t.storage_offset() * b.elem;
    } else {
      b.storage = t.storage().unsafeGetStorageImpl();
      b.offset = t.storage_offset() * b.elem;
    }
    return b;
  }
  for (int k = 0; k < b.ndim; ++k) {
    const auto size = t.sym_size(k).maybe_as_int();
    const auto stride = t.sym_stride(k).maybe_as_int();
    if (!size || !stride) {
      b.known = false;
      return b;
    }
    b.size[k] = *size;
    b.stride[k] = *stride * b.elem;
  }
  if (!t.has_storage()) {
    b.known = false;
    return b;
  }
  const auto offset = t.sym_storage_offset().maybe_as_int();
  if (!offset) {
    b.known = false;
    return b;
  }
  const void* base = t.storage().data();
  if (base != nullptr) {
    b.offset = reinterpret_cast<intptr_t>(base) + *offset * b.elem;
  } else {
    // Fake/meta tensors have no memory: compare by storage identity.
    b.storage = t.storage().unsafeGetStorageImpl();
    b.offset = *offset * b.elem;
  }
  return b;
}

Box slice_box(Box b, int dim, int64_t start, int64_t len) {
  if (!b.known) {
    return b;
  }
  b.offset += start * b.stride[dim];
  b.size[dim] = len;
  return b;
}

bool overlaps(const Box& a, const Box& b) {
  if (!a.known || !b.known || a.storage != b.storage) {
    return false;
  }
  // Disjoint byte bounds (separate allocations: nearly every call) decide it
  // without sorting dims. Strides are never negative.
  auto raw_bounds = [](const Box& x, int64_t* lo, int64_t* hi) {
    *lo = x.offset;
    *hi = x.offset + x.elem;
    for (int k = 0; k < x.ndim; ++k) {
      if (x.size[k] == 0) return false;  // no bytes
      *hi += (x.size[k] - 1) * x.stride[k];
    }
    return true;
  };
  int64_t alo0, ahi0, blo0, bhi0;
  if (!raw_bounds(a, &alo0, &ahi0) || !raw_bounds(b, &blo0, &bhi0) ||
      ahi0 <= blo0 || bhi0 <= alo0) {
    return false;
  }
  const Canon ca = canon(a);
  const Canon cb = canon(b);
  if (ca.elem == 0 || cb.elem == 0) {
    return false;
  }
  const auto [alo, ahi] = bounds(ca);
  const auto [blo, bhi] = bounds(cb);
  if (ahi <= blo || bhi <= alo) {
    return false;
  }
  if (same_geometry(ca, cb)) {
    const int hit = lattice_overlap(ca, ca.offset - cb.offset);
    if (hit >= 0) {
      return hit == 1;
    }
  }
  std::vector<int64_t> ra, rb;
  int64_t la = 0, lb = 0;
  if (!list_runs(ca, kMaxRuns, &ra, &la) || !list_runs(cb, kMaxRuns, &rb, &lb)) {
    return true;  // too fragmented to decide cheaply: refuse
  }
  size_t i = 0, j = 0;
  while (i < ra.size() && j < rb.size()) {
    const int64_t a_end = ra[i] + la;
    const int64_t b_end = rb[j] + lb;
    if (ra[i] < b_end && rb[j] < a_end) {
      return true;
    }
    if (a_end <= b_end) {
      ++i;
    } else {
      ++j;
    }
  }
  return false;
}

bool self_overlaps(const at::Tensor& t) {
  // Cached by the tensor: true for every contiguous or permuted-dense cache.
  if (!t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() &&
      t.is_non_overlapping_and_dense()) {
    return false;
  }
  return self_overlaps(box_of(t));
}

bool self_overlaps(const Box& a) {
  if (!a.known) {
    return false;
  }
  for (int k = 0; k < a.ndim; ++k) {
    if (a.size[k] == 0) {
      return false;
    }
  }
  for (int k = 0; k < a.ndim; ++k) {
    if (a.size[k] > 1 && a.stride[k] == 0) {
      return true;  // expand()ed: many elements, one address
    }
  }
  const Canon c = canon(a);
  // Nested strides (each dim steps past everything inside it): no overlap.
  int64_t extent = c.elem;
  bool nested = true;
  for (int k = 0; k < c.n; ++k) {
    if (c.stride[k] < extent) {
      nested = false;
      break;
    }
    extent += (c.size[k] - 1) * c.stride[k];
  }
  if (nested) {
    return false;
  }
  std::vector<int64_t> runs;
  int64_t len = 0;
  if (!list_runs(c, kMaxRuns, &runs, &len)) {
    return true;  // too fragmented to decide cheaply: refuse
  }
  for (size_t i = 1; i < runs.size(); ++i) {
    if (runs[i] < runs[i - 1] + len) {
      return true;
    }
  }
  return false;
}

}  // namespace detail
}  // namespace kvcache
