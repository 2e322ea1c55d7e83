// The CUDA kernels of update_ (host start), update_.Tensor (start read on
// the device) and append_ (start = the caller's lengths, advanced in place),
// plain and quantized, and the host code that launches them over a runtime
// `Rt` (see paged_kernels.cuh): update.cu passes the CUDA one,
// tests/cpp/test_update_cuda_emulated.cpp the CPU emulator's. See
// csrc/ops/update.h. The operator entry has checked every argument that
// the host can see; what only the device holds (the starts) is checked here.
//
// Device starts: a one-block validation pass reads every row's start; if
// any is negative or past max_len - chunk (never start + chunk > max_len:
// that sum overflows for a start near 2^63), it writes -1 into every entry
// of lengths_out, else start + chunk. For append_, lengths_out IS the start
// tensor: every entry is read before any is written (a block barrier in
// between). The copy kernel then reads its own row's entry of lengths_out
// (O(1) per block) and copies at lengths_out[b] - chunk, or nothing when it
// is out of range. So one bad row stops every write (all or nothing), the
// check costs O(batch) reads, not O(batch^2 x heads), no host sync is
// needed, and both launches can be captured in a CUDA graph.
//
// Host start: already checked; one launch, whose first thread also writes
// the 0-D length.
//
// The copy: one kernel writes keys and values. Block (x) = one (buffer,
// batch, head) slab, blocks (y) tile its chunk rows; threads x run along a
// row's copy units, threads y along rows. The copy unit is planned per
// source/destination pair (csrc/cuda/copy.cuh).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../core/quant.h"
#include "../core/rules.h"
#include "../ops/update.h"
#include "copy.cuh"
#include "launch.cuh"
#include "quant.cuh"

namespace kvcache {
namespace update_kernels {

using cuda::CopyPlan;
using detail::IntRows;
using detail::UpdateParams;

// Writes start + chunk (or -1 everywhere if any start is out of range) for
// each of the n entries of `starts` into `lengths_out` (possibly the same
// memory). One block.
static __global__ void validate_starts_kernel(const IntRows starts,
                                       const IntRows lengths_out, int64_t n,
                                       int64_t chunk, int64_t max_len) {
  int bad = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    bad |= !detail::start_fits(detail::read_row(starts, i), chunk, max_len);
  }
  // Barrier: every read above happens before any write below.
  bad = __syncthreads_or(bad);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    // Entry i is written only by this thread, after its own read.
    detail::write_row(lengths_out, i,
                      bad ? detail::kPoisonLength
                          : detail::read_row(starts, i) + chunk);
  }
}

struct CopyArgs {
  CopyPlan pair[2];  // keys <- keys_new, values <- values_new
  unsigned slabs;    // batch * heads (per buffer)
  unsigned heads;
  int64_t chunk;
  int64_t max_len;
  bool device_starts;  // rows start at lengths_out[b] - chunk
  int64_t host_start;  // else every row starts here
  IntRows lengths_out;
  bool copy;  // false: nothing to copy (only the host length to write)
};

static __global__ void update_copy_kernel(const CopyArgs a) {
  if (!a.device_starts && blockIdx.x == 0 && blockIdx.y == 0 &&
      threadIdx.x == 0 && threadIdx.y == 0) {
    detail::write_row(a.lengths_out, 0, a.host_start + a.chunk);
  }
  if (!a.copy) return;
  // 32-bit: the grid has at most 2^31 - 1 slabs (checked on the host).
  const unsigned slab = blockIdx.x;
  const unsigned which = slab >= a.slabs ? 1u : 0u;
  const unsigned bh = slab - which * a.slabs;
  const unsigned b = bh / a.heads;
  const unsigned h = bh - b * a.heads;
  int64_t start = a.host_start;
  if (a.device_starts) {
    // Written by validate_starts_kernel: start + chunk, or -1. Checked
    // again (O(1)) so that no value can make this block write out of range.
    const int64_t end = detail::read_row(a.lengths_out, b);
    if (end < a.chunk || end > a.max_len) return;
    start = end - a.chunk;
  }
  // Select by value: indexing the parameter array with a runtime index
  // would copy the whole parameter block to local memory.
  const CopyPlan p = which ? a.pair[1] : a.pair[0];
  char* dst = p.dst.data + b * p.dst.stride[0] + h * p.dst.stride[1] +
              start * p.dst.stride[2];
  const char* src = p.src.data + b * p.src.stride[0] + h * p.src.stride[1];
  cuda::copy_rows_planned(p, dst, src, a.chunk);
}

template <typename Rt>
void run_update(const UpdateParams& p, Rt& rt) {
  const bool device_starts = p.starts.data != nullptr;

  // A copy happens only if there is something to copy and it can fit
  // (chunk <= max_len; a device start then still decides per launch).
  const int64_t slabs = p.batch * p.num_kv_heads;
  const bool copy = slabs > 0 && p.chunk > 0 && p.head_dim > 0 &&
                    p.chunk <= p.max_len;
  CopyArgs a;
  a.chunk = p.chunk;
  a.max_len = p.max_len;
  a.device_starts = device_starts;
  a.host_start = p.start;
  a.lengths_out = p.lengths_out;
  a.copy = copy;
  a.slabs = 0;
  a.heads = 1;
  cuda::CopyBlock block;
  unsigned grid_x = 1;
  unsigned grid_y = 1;
  if (copy) {
    cuda::check_copy_slabs(slabs);  // before any launch: nothing written
    const int64_t dst_size[4] = {p.batch, p.num_kv_heads, p.max_len, p.head_dim};
    const int64_t src_size[4] = {p.batch, p.num_kv_heads, p.chunk, p.head_dim};
    for (int w = 0; w < 2; ++w) {
      a.pair[w] = cuda::plan_copy(p.dst[w].data, p.dst[w].stride, dst_size,
                                  p.src[w].data, p.src[w].stride, src_size,
                                  p.head_dim, p.elem);
    }
    a.slabs = static_cast<unsigned>(slabs);
    a.heads = static_cast<unsigned>(p.num_kv_heads);
    // One block shape for both pairs: the one with more units per row.
    const int64_t units =
        a.pair[0].units > a.pair[1].units ? a.pair[0].units : a.pair[1].units;
    block = cuda::copy_block_shape(units, p.chunk);
    grid_x = static_cast<unsigned>(2 * slabs);
    grid_y = cuda::copy_grid_y(p.chunk, block);
  }

  if (device_starts) {
    const int64_t n = p.lengths_out.numel;
    if (n > 0) {
      rt.launch(validate_starts_kernel, dim3(1), dim3(cuda::check_threads(n)), 0, p.starts,
                p.lengths_out, n, p.chunk, p.max_len);
    }
    if (!copy) return;
  }
  rt.launch(update_copy_kernel, dim3(grid_x, grid_y), dim3(block.x, block.y), 0, a);
}

// ---- The quantized format of the writes (update_*, append_* with scales) --
//
// Same positions and failure rule as above (validate_starts_kernel for
// device starts, then one write kernel that reads its row's checked end).
// The write: one warp per (buffer, batch, head, slot), quantized by
// cuda::quantize_slot (quant.cuh, shared with the quantized ring write).
constexpr int kQuantWarps = 8;

struct QuantArgs {
  cuda::QuantSides<4, 4> io;  // strides: batch, head, slot, element (scales: no element)
  unsigned slabs, heads;
  int64_t chunk, head_dim, max_len;
  bool device_starts;
  int64_t host_start;
  IntRows lengths_out;
  bool write;
};

template <typename T, detail::KvFormat F>
__global__ void quant_update_kernel(const QuantArgs a) {
  if (!a.device_starts && blockIdx.x == 0 && blockIdx.y == 0 &&
      threadIdx.x == 0) {
    detail::write_row(a.lengths_out, 0, a.host_start + a.chunk);
  }
  if (!a.write) return;
  const unsigned slab = blockIdx.x;
  const unsigned which = slab >= a.slabs ? 1u : 0u;
  const unsigned bh = slab - which * a.slabs;
  const unsigned b = bh / a.heads;
  const unsigned h = bh - b * a.heads;
  int64_t start = a.host_start;
  if (a.device_starts) {
    const int64_t end = detail::read_row(a.lengths_out, b);
    if (end < a.chunk || end > a.max_len) return;  // a bad row: write nothing
    start = end - a.chunk;
  }
  const auto s = cuda::quant_side(a.io, which);
  const char* src = s.src + b * s.ss[0] + h * s.ss[1];
  char* dst = s.dst + b * s.ds[0] + h * s.ds[1] + start * s.ds[2];
  float* scale = s.scale + b * s.cs[0] + h * s.cs[1] + start * s.cs[2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int64_t t = static_cast<int64_t>(blockIdx.y) * kQuantWarps + warp;
       t < a.chunk; t += static_cast<int64_t>(gridDim.y) * kQuantWarps) {
    cuda::quantize_slot<T, F>(src + t * s.ss[2], s.ss[3], dst + t * s.ds[2], s.ds[3],
                              scale + t * s.cs[2], a.head_dim, lane);
  }
}

template <typename Rt>
void run_quant_update(const detail::QuantUpdateParams& q, Rt& rt) {
  const UpdateParams& p = q.base;
  const bool device_starts = p.starts.data != nullptr;
  const int64_t slabs = p.batch * p.num_kv_heads;
  const bool write = slabs > 0 && p.chunk > 0 && p.head_dim > 0 &&
                     p.chunk <= p.max_len;
  QuantArgs a{};
  a.io = cuda::slab_sides(p.src, p.dst, q.scale, q.scale_stride);
  a.slabs = 0;
  a.heads = 1;
  a.chunk = p.chunk;
  a.head_dim = p.head_dim;
  a.max_len = p.max_len;
  a.device_starts = device_starts;
  a.host_start = p.start;
  a.lengths_out = p.lengths_out;
  a.write = write;
  dim3 grid(1, 1);
  if (write) {
    cuda::check_copy_slabs(slabs);  // before any launch: nothing written
    a.slabs = static_cast<unsigned>(slabs);
    a.heads = static_cast<unsigned>(p.num_kv_heads);
    const int64_t tiles = (p.chunk + kQuantWarps - 1) / kQuantWarps;
    grid = dim3(static_cast<unsigned>(2 * slabs),
                static_cast<unsigned>(tiles < 65535 ? tiles : 65535));
  }
  if (device_starts) {
    const int64_t n = p.lengths_out.numel;
    if (n > 0) {
      rt.launch(validate_starts_kernel, dim3(1), dim3(cuda::check_threads(n)), 0, p.starts,
                p.lengths_out, n, p.chunk, p.max_len);
    }
    if (!write) return;
  }
  const dim3 block(kQuantWarps * 32);
  cuda::with_quant_types(q.src_dtype, q.format, [&](auto t, auto f) {
    rt.launch(quant_update_kernel<decltype(t), decltype(f)::value>, grid, block, 0, a);
  });
}

}  // namespace update_kernels
}  // namespace kvcache
