// CUDA kernels for kvcache::update_ and kvcache::update_at_.
//
// One launch writes keys and values together. Block (x) = one (buffer, batch,
// head) slab, blocks (y) tile its chunk * head_dim bytes. Copies move 16
// bytes per thread when every pointer and stride allows it, else the widest
// unit that does, else one element at a time through byte strides: any dtype
// takes the same path by element size. Offsets are 64-bit.
//
// Device positions are read on the device, so update_at_ needs no host sync
// and can be captured in a CUDA graph. If any position is out of range
// (negative, or position + chunk > max_len), every block sees it and the
// launch writes nothing at all: no out-of-bounds write, no partial update.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "../strided_rows.h"
#include "../validate.h"

namespace kvcache {
namespace {

using detail::DstRows;
using detail::SrcRows;
using detail::UpdateGeometry;

constexpr int kMaxThreads = 256;
constexpr int64_t kMaxGridY = 65535;

// stride_d of each StridedRows below holds the byte step between copy units
// (sizeof(Unit) for a contiguous row, the element stride otherwise).
struct UpdateParams {
  DstRows dst[2];
  SrcRows src[2];
  int64_t batch;
  int64_t heads;
  int64_t chunk;
  int64_t max_len;
  int64_t units_per_row;  // copy units per (position, head) row
  int64_t start;          // host start, used when positions == nullptr
  const void* positions;  // int32/int64, 0-D (stride 0) or (batch,)
  int64_t pos_stride;
  int32_t* length;        // out: start + chunk, one value per position
  int64_t num_lengths;    // 1 for a host start or 0-D positions, else batch
};

template <typename PosT>
__device__ __forceinline__ int64_t position_of(const UpdateParams& p,
                                               int64_t b) {
  return static_cast<int64_t>(
      static_cast<const PosT*>(p.positions)[b * p.pos_stride]);
}

template <typename Unit, typename PosT>
__global__ void update_kernel(const UpdateParams p) {
  // The new length is written even when the positions are out of range:
  // then it exceeds max_len, which is how a caller can see the skipped write.
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    for (int64_t i = threadIdx.x; i < p.num_lengths; i += blockDim.x) {
      const int64_t s =
          p.positions != nullptr ? position_of<PosT>(p, i) : p.start;
      p.length[i] = static_cast<int32_t>(s + p.chunk);
    }
  }
  if (p.positions != nullptr) {
    // Every block validates every row, so one bad row stops all writes.
    int bad = 0;
    for (int64_t b = threadIdx.x; b < p.batch; b += blockDim.x) {
      const int64_t s = position_of<PosT>(p, b);
      bad |= (s < 0) | (s + p.chunk > p.max_len);
    }
    if (__syncthreads_or(bad)) {
      return;
    }
  }
  const int64_t slabs_per_buffer = p.batch * p.heads;
  const int64_t slab = blockIdx.x;
  const int which = slab >= slabs_per_buffer ? 1 : 0;
  const int64_t bh = slab - which * slabs_per_buffer;
  const int64_t b = bh / p.heads;
  const int64_t h = bh - b * p.heads;
  const int64_t start =
      p.positions != nullptr ? position_of<PosT>(p, b) : p.start;

  // Select by value: indexing the parameter array with a runtime index would
  // copy the whole parameter block to local memory.
  const DstRows d = which ? p.dst[1] : p.dst[0];
  const SrcRows s = which ? p.src[1] : p.src[0];
  char* dst = d.data + b * d.stride_b + h * d.stride_h + start * d.stride_t;
  const char* src = s.data + b * s.stride_b + h * s.stride_h;

  const int64_t units = p.chunk * p.units_per_row;
  const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
       i < units; i += step) {
    const int64_t t = i / p.units_per_row;
    const int64_t u = i - t * p.units_per_row;
    *reinterpret_cast<Unit*>(dst + t * d.stride_t + u * d.stride_d) =
        *reinterpret_cast<const Unit*>(src + t * s.stride_t + u * s.stride_d);
  }
}

template <typename Rows>
bool allows_unit(const Rows& r, int64_t unit, int64_t elem) {
  return r.stride_d == elem &&
         reinterpret_cast<uintptr_t>(r.data) % unit == 0 &&
         r.stride_b % unit == 0 && r.stride_h % unit == 0 &&
         r.stride_t % unit == 0;
}

template <typename PosT>
void launch(UpdateParams p, int64_t unit, int64_t grid_x, int64_t grid_y,
            int threads, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
  switch (unit) {
    case 16: update_kernel<uint4, PosT><<<grid, threads, 0, stream>>>(p); break;
    case 8: update_kernel<uint2, PosT><<<grid, threads, 0, stream>>>(p); break;
    case 4: update_kernel<uint32_t, PosT><<<grid, threads, 0, stream>>>(p); break;
    case 2: update_kernel<uint16_t, PosT><<<grid, threads, 0, stream>>>(p); break;
    default: update_kernel<uint8_t, PosT><<<grid, threads, 0, stream>>>(p); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Writes both buffers and fills `length`, in one launch.
void write_both(at::Tensor& keys, at::Tensor& values,
                const at::Tensor& keys_new, const at::Tensor& values_new,
                const UpdateGeometry& g, int64_t start,
                const at::Tensor* positions, at::Tensor& length) {
  const c10::cuda::CUDAGuard guard(keys.device());
  if (g.batch == 0 || g.heads == 0 || g.chunk == 0 || g.head_dim == 0) {
    // Nothing to copy: only the length, with ordinary stream-ordered ops.
    if (positions != nullptr) {
      length.copy_(*positions + g.chunk);
    } else {
      length.fill_(start + g.chunk);
    }
    return;
  }
  const int64_t elem = keys.element_size();
  const int64_t row_bytes = g.head_dim * elem;
  UpdateParams p{};
  p.dst[0] = detail::dst_rows(keys);
  p.dst[1] = detail::dst_rows(values);
  p.src[0] = detail::src_rows(keys_new);
  p.src[1] = detail::src_rows(values_new);

  // Widest unit every tensor allows; element by element (at its stride) if
  // some row is not contiguous. Element sizes are 1, 2, 4, 8 or 16 bytes.
  int64_t unit = elem;
  for (int64_t candidate : {16, 8, 4, 2}) {
    if (candidate < elem || row_bytes % candidate != 0) continue;
    if (allows_unit(p.dst[0], candidate, elem) &&
        allows_unit(p.dst[1], candidate, elem) &&
        allows_unit(p.src[0], candidate, elem) &&
        allows_unit(p.src[1], candidate, elem)) {
      unit = candidate;
      break;
    }
  }
  const bool rows_dense = allows_unit(p.dst[0], elem, elem) &&
                          allows_unit(p.dst[1], elem, elem) &&
                          allows_unit(p.src[0], elem, elem) &&
                          allows_unit(p.src[1], elem, elem);
  if (rows_dense) {
    for (auto& r : p.dst) r.stride_d = unit;
    for (auto& r : p.src) r.stride_d = unit;
    p.units_per_row = row_bytes / unit;
  } else {
    unit = elem;
    p.units_per_row = g.head_dim;
  }
  p.batch = g.batch;
  p.heads = g.heads;
  p.chunk = g.chunk;
  p.max_len = g.max_len;
  p.start = start;
  p.positions = positions ? positions->const_data_ptr() : nullptr;
  p.pos_stride = (positions && positions->dim() == 1) ? positions->stride(0) : 0;
  p.length = length.mutable_data_ptr<int32_t>();
  p.num_lengths = length.numel();

  const int64_t units = g.chunk * p.units_per_row;
  const int threads = static_cast<int>(
      std::min<int64_t>(kMaxThreads, ((units + 31) / 32) * 32));
  const int64_t grid_x = 2 * g.batch * g.heads;
  TORCH_CHECK_VALUE(grid_x <= std::numeric_limits<int32_t>::max(),
                    "batch * num_kv_heads is too large for one launch: ",
                    g.batch, " * ", g.heads);
  const int64_t grid_y = std::min<int64_t>(kMaxGridY, (units + threads - 1) / threads);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (positions != nullptr && positions->scalar_type() == at::kInt) {
    launch<int32_t>(p, unit, grid_x, grid_y, threads, stream);
  } else {
    launch<int64_t>(p, unit, grid_x, grid_y, threads, stream);
  }
}

at::Tensor update_cuda(at::Tensor& keys, at::Tensor& values,
                       const at::Tensor& keys_new,
                       const at::Tensor& values_new, int64_t start) {
  const auto g =
      detail::check_update_tensors(keys, values, keys_new, values_new);
  detail::check_start(start, g);
  at::Tensor length = at::empty({}, keys.options().dtype(at::kInt));
  write_both(keys, values, keys_new, values_new, g, start, nullptr, length);
  return length;
}

at::Tensor update_at_cuda(at::Tensor& keys, at::Tensor& values,
                          const at::Tensor& keys_new,
                          const at::Tensor& values_new,
                          const at::Tensor& positions) {
  const auto g =
      detail::check_update_tensors(keys, values, keys_new, values_new);
  detail::check_positions_meta(positions, keys, g);
  // Values are not read on the host (that would be a sync); the kernel
  // guards them and writes nothing if any is out of range.
  at::Tensor length =
      at::empty(positions.sizes(), keys.options().dtype(at::kInt));
  write_both(keys, values, keys_new, values_new, g, 0, &positions, length);
  return length;
}

}  // namespace
}  // namespace kvcache

TORCH_LIBRARY_IMPL(kvcache, CUDA, m) {
  m.impl("update_", &kvcache::update_cuda);
  m.impl("update_at_", &kvcache::update_at_cuda);
}
