// The CUDA kernels of ring_update_ (see csrc/ops/ring.h), plain and
// quantized, and the host code that launches them over a runtime `Rt` (see
// paged_kernels.cuh): ring.cu passes the CUDA one,
// tests/cpp/test_ring_cuda_emulated.cpp the CPU emulator's.
//
// Two launches, as update_.Tensor: a one-block validation pass reads every
// row's start; if any is negative or start + chunk would pass int32, it
// writes -1 into every entry of the returned lengths, else start + chunk.
// Then one kernel writes keys, values and positions: block x = one
// (buffer, batch row, head) slab, blocks y tile the chunk's tokens (at most
// 65535 of them, the grid's y limit: a longer chunk's tiles are taken in a
// grid-stride loop, so any chunk length is written, as on the CPU); a token
// the ring does not keep (ring_keeps) is skipped, so each slot is written
// by one thread group only. The blocks of buffer 0, head 0 also write the
// positions of their tokens. A row whose returned length is out of range
// (-1) writes nothing: one bad row stops every write, with no host sync
// (CUDA-graph safe).
//
// ring_update_ with scales (a quantized ring): the same validation pass, then
// one kernel: one
// warp per (buffer, batch row, head, token) quantizes the token straight
// into its slot and writes its scale (cuda::quantize_slot, the quantizer of
// update_ with scales); tokens the ring does not keep are skipped, and the
// warps of buffer 0, head 0 write the positions.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "../core/visibility.h"
#include "../ops/ring.h"
#include "launch.cuh"
#include "quant.cuh"

namespace kvcache {
namespace ring_kernels {

using detail::IntRows;
using detail::RingUpdateParams;

constexpr int kTokensPerBlock = 8;
constexpr int kLanes = 32;  // threads along a token's head_dim

static __global__ void ring_validate_kernel(const IntRows starts,
                                     const IntRows lengths_out, int64_t n,
                                     int64_t chunk) {
  const int64_t last_start = INT32_MAX - chunk;
  int bad = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t s = detail::read_row(starts, i);
    bad |= (s < 0) | (s > last_start);
  }
  bad = __syncthreads_or(bad);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    detail::write_row(lengths_out, i,
                      bad ? detail::kPoisonLength
                          : detail::read_row(starts, i) + chunk);
  }
}

struct RingArgs {
  detail::DstRows dst[2];
  detail::SrcRows src[2];
  int32_t* positions;
  int64_t pos_stride[2];
  unsigned slabs;  // batch * heads
  unsigned heads;
  int64_t chunk, head_dim, capacity, sinks, elem;
  IntRows lengths_out;
};

template <typename E>
__device__ __forceinline__ void copy_token(char* dst, int64_t dst_elem,
                                           const char* src, int64_t src_elem,
                                           int64_t n) {
  for (int64_t d = threadIdx.x; d < n; d += kLanes) {
    *reinterpret_cast<E*>(dst + d * dst_elem) =
        *reinterpret_cast<const E*>(src + d * src_elem);
  }
}

static __global__ void ring_copy_kernel(const RingArgs a) {
  const unsigned slab = blockIdx.x;
  const unsigned which = slab >= a.slabs ? 1u : 0u;
  const unsigned bh = slab - which * a.slabs;
  const unsigned b = bh / a.heads;
  const unsigned h = bh - b * a.heads;
  const int64_t end = detail::read_row(a.lengths_out, b);
  if (end < a.chunk || end > INT32_MAX) return;  // -1: a bad start somewhere
  const int64_t start = end - a.chunk;
  const detail::DstRows d = which ? a.dst[1] : a.dst[0];
  const detail::SrcRows s = which ? a.src[1] : a.src[0];
  // Token t of the chunk is row threadIdx.y of tile t / kTokensPerBlock;
  // the grid's blockIdx.y covers gridDim.y tiles per step.
  const int64_t step = static_cast<int64_t>(gridDim.y) * kTokensPerBlock;
  for (int64_t t = static_cast<int64_t>(blockIdx.y) * kTokensPerBlock + threadIdx.y;
       t < a.chunk; t += step) {
    const int64_t p = start + t;
    if (!detail::ring_keeps(p, end, a.sinks, a.capacity)) continue;
    const int64_t slot = detail::ring_slot(p, a.sinks, a.capacity);
    char* dp = d.data + b * d.stride[0] + h * d.stride[1] + slot * d.stride[2];
    const char* sp = s.data + b * s.stride[0] + h * s.stride[1] + t * s.stride[2];
    switch (a.elem) {
      case 1: copy_token<uint8_t>(dp, d.stride[3], sp, s.stride[3], a.head_dim); break;
      case 2: copy_token<uint16_t>(dp, d.stride[3], sp, s.stride[3], a.head_dim); break;
      case 4: copy_token<uint32_t>(dp, d.stride[3], sp, s.stride[3], a.head_dim); break;
      case 8: copy_token<uint64_t>(dp, d.stride[3], sp, s.stride[3], a.head_dim); break;
      default:  // other sizes (complex128): byte by byte
        for (int64_t x = threadIdx.x; x < a.head_dim * a.elem; x += kLanes) {
          const int64_t e = x / a.elem, byte = x - e * a.elem;
          dp[e * d.stride[3] + byte] = sp[e * s.stride[3] + byte];
        }
    }
    if (which == 0 && h == 0 && threadIdx.x == 0) {
      a.positions[b * a.pos_stride[0] + slot * a.pos_stride[1]] = static_cast<int32_t>(p);
    }
  }
}

template <typename Rt>
void run_ring_update(const RingUpdateParams& p, Rt& rt) {
  const int64_t n = p.lengths_out.numel;
  const int64_t slabs = p.batch * p.heads;
  cuda::check_copy_slabs(slabs);  // before any launch: nothing written
  if (n > 0) {
    rt.launch(ring_validate_kernel, dim3(1), dim3(cuda::check_threads(n)), 0, p.starts,
              p.lengths_out, n, p.chunk);
  }
  // heads == 0 still writes positions? No slab, no token: nothing to write
  // but the lengths (a cache without heads holds nothing).
  if (slabs == 0 || p.chunk == 0) return;
  RingArgs a;
  for (int w = 0; w < 2; ++w) {
    a.dst[w] = p.dst[w];
    a.src[w] = p.src[w];
  }
  a.positions = p.positions;
  a.pos_stride[0] = p.pos_stride[0];
  a.pos_stride[1] = p.pos_stride[1];
  a.slabs = static_cast<unsigned>(slabs);
  a.heads = static_cast<unsigned>(p.heads);
  a.chunk = p.chunk;
  a.head_dim = p.head_dim;
  a.capacity = p.capacity;
  a.sinks = p.sinks;
  a.elem = p.elem;
  a.lengths_out = p.lengths_out;
  // Tiles of kTokensPerBlock tokens along grid y, at most its limit 65535;
  // the kernel loops over the rest (int64 token indices: any chunk).
  const int64_t tiles = (p.chunk + kTokensPerBlock - 1) / kTokensPerBlock;
  rt.launch(ring_copy_kernel,
            dim3(static_cast<unsigned>(2 * slabs),
                 static_cast<unsigned>(tiles < 65535 ? tiles : 65535)),
            dim3(kLanes, kTokensPerBlock), 0, a);
}

constexpr int kQuantWarps = 8;  // tokens per block (one warp each)

struct RingQuantArgs {
  cuda::QuantSides<4, 4> io;  // strides: batch, head, slot, element (scales: no element)
  int32_t* positions;
  int64_t pos_stride[2];
  unsigned slabs;  // batch * heads
  unsigned heads;
  int64_t chunk, head_dim, capacity, sinks;
  IntRows lengths_out;
};

template <typename T, detail::KvFormat F>
__global__ void ring_quant_kernel(const RingQuantArgs a) {
  const unsigned slab = blockIdx.x;
  const unsigned which = slab >= a.slabs ? 1u : 0u;
  const unsigned bh = slab - which * a.slabs;
  const unsigned b = bh / a.heads;
  const unsigned h = bh - b * a.heads;
  const int64_t end = detail::read_row(a.lengths_out, b);
  if (end < a.chunk || end > INT32_MAX) return;  // -1: a bad start somewhere
  const int64_t start = end - a.chunk;
  const auto s = cuda::quant_side(a.io, which);
  const char* src = s.src + b * s.ss[0] + h * s.ss[1];
  char* dst = s.dst + b * s.ds[0] + h * s.ds[1];
  float* scale = s.scale + b * s.cs[0] + h * s.cs[1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int64_t t = static_cast<int64_t>(blockIdx.y) * kQuantWarps + warp;
       t < a.chunk; t += static_cast<int64_t>(gridDim.y) * kQuantWarps) {
    const int64_t p = start + t;
    if (!detail::ring_keeps(p, end, a.sinks, a.capacity)) continue;  // warp-uniform
    const int64_t slot = detail::ring_slot(p, a.sinks, a.capacity);
    if (a.head_dim > 0) {  // warp-uniform: no scale for an empty slot (as CPU)
      cuda::quantize_slot<T, F>(src + t * s.ss[2], s.ss[3], dst + slot * s.ds[2], s.ds[3],
                                scale + slot * s.cs[2], a.head_dim, lane);
    }
    if (which == 0 && h == 0 && lane == 0) {
      a.positions[b * a.pos_stride[0] + slot * a.pos_stride[1]] = static_cast<int32_t>(p);
    }
  }
}

template <typename Rt>
void run_ring_update_quantized(const detail::RingQuantUpdateParams& q, Rt& rt) {
  const RingUpdateParams& p = q.ring;
  const int64_t n = p.lengths_out.numel;
  const int64_t slabs = p.batch * p.heads;
  cuda::check_copy_slabs(slabs);  // before any launch: nothing written
  if (n > 0) {
    rt.launch(ring_validate_kernel, dim3(1), dim3(cuda::check_threads(n)), 0, p.starts,
              p.lengths_out, n, p.chunk);
  }
  // No slab or no token: nothing to write but the lengths. head_dim == 0:
  // positions only, no scale (as update_ with scales writes none); the warps
  // still run for the positions.
  if (slabs == 0 || p.chunk == 0) return;
  RingQuantArgs a{};
  a.io = cuda::slab_sides(p.src, p.dst, q.scale, q.scale_stride);
  a.positions = p.positions;
  a.pos_stride[0] = p.pos_stride[0];
  a.pos_stride[1] = p.pos_stride[1];
  a.slabs = static_cast<unsigned>(slabs);
  a.heads = static_cast<unsigned>(p.heads);
  a.chunk = p.chunk;
  a.head_dim = p.head_dim;
  a.capacity = p.capacity;
  a.sinks = p.sinks;
  a.lengths_out = p.lengths_out;
  const int64_t tiles = (p.chunk + kQuantWarps - 1) / kQuantWarps;
  const dim3 grid(static_cast<unsigned>(2 * slabs),
                  static_cast<unsigned>(tiles < 65535 ? tiles : 65535));
  const dim3 block(kQuantWarps * 32);
  cuda::with_quant_types(q.src_dtype, q.format, [&](auto t, auto f) {
    rt.launch(ring_quant_kernel<decltype(t), decltype(f)::value>, grid, block, 0, a);
  });
}

}  // namespace ring_kernels
}  // namespace kvcache
