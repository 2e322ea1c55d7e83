// Plain parameter types shared by the device kernels (no ATen in here).
//
// Kernel cores in csrc/cpu/ and csrc/cuda/ see only these: raw pointers,
// byte strides and sizes. Tensors are turned into them once, in
// csrc/core/tensor_params.h, after every argument has been checked.
#pragma once

#include <cstdint>

namespace kvcache {
namespace detail {

// A 4-D (batch, heads, positions, head_dim) tensor: its first byte and the
// byte step along each dimension. 64-bit offsets throughout: caches over
// 2^31 elements are normal.
template <typename Ptr>
struct Strided4 {
  Ptr data = nullptr;
  int64_t stride[4] = {};  // bytes: batch, head, position, element
};
using DstRows = Strided4<char*>;
using SrcRows = Strided4<const char*>;

// A per-row integer tensor (positions, lengths, kv_start, counts, index):
// 0-D (every row reads element 0, stride 0) or (batch,).
struct IntRows {
  void* data = nullptr;  // nullptr: absent
  bool is_int64 = false;
  int64_t stride = 0;    // elements
  int64_t numel = 0;     // 1 for 0-D
};

#if defined(__CUDACC__)
#define KVCACHE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVCACHE_HOST_DEVICE inline
#endif

KVCACHE_HOST_DEVICE int64_t read_row(const IntRows& r, int64_t b) {
  const int64_t i = b * r.stride;
  return r.is_int64 ? static_cast<const int64_t*>(r.data)[i]
                    : static_cast<int64_t>(static_cast<const int32_t*>(r.data)[i]);
}

KVCACHE_HOST_DEVICE void write_row(const IntRows& r, int64_t b, int64_t v) {
  const int64_t i = b * r.stride;
  if (r.is_int64) {
    static_cast<int64_t*>(r.data)[i] = v;
  } else {
    static_cast<int32_t*>(r.data)[i] = static_cast<int32_t>(v);
  }
}

// On CUDA a bad device value cannot raise without a host sync. The kernels
// then write nothing and set every entry of the lengths they produce to
// this value, so one check is always right: (lengths >= 0).all().
constexpr int64_t kPoisonLength = -1;

}  // namespace detail
}  // namespace kvcache
