#include "validate.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>

namespace kvcache {
namespace detail {
namespace {

// Python spelling of a dtype ("torch.float32"), as users write it.
std::string py_dtype(at::ScalarType t) {
  return "torch." + std::string(std::get<0>(c10::getDtypeNames(t)));
}

void check_dense(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a defined tensor");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, name,
                    " must be a strided (dense) tensor, got layout ",
                    t.layout());
  TORCH_CHECK_TYPE(!t.is_quantized(), name,
                   " must not be a quantized tensor, got dtype ",
                   py_dtype(t.scalar_type()));
}

void check_rank4(const at::Tensor& t, const char* name, const char* dims) {
  TORCH_CHECK_VALUE(t.dim() == 4, name, " must be a 4-D tensor of shape ",
                    dims, ", got ", t.dim(), "-D shape ", t.sizes());
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) {
    return false;
  }
  const auto status = at::get_overlap_status(a, b);
  return status == at::MemOverlapStatus::Full ||
         status == at::MemOverlapStatus::Partial;
}

}  // namespace

UpdateGeometry check_update_tensors(const at::Tensor& keys,
                                    const at::Tensor& values,
                                    const at::Tensor& keys_new,
                                    const at::Tensor& values_new) {
  check_dense(keys, "keys");
  check_dense(values, "values");
  check_dense(keys_new, "keys_new");
  check_dense(values_new, "values_new");
  check_rank4(keys, "keys", "(batch, num_kv_heads, max_len, head_dim)");
  check_rank4(values, "values", "(batch, num_kv_heads, max_len, head_dim)");
  check_rank4(keys_new, "keys_new", "(batch, num_kv_heads, chunk, head_dim)");
  check_rank4(values_new, "values_new",
              "(batch, num_kv_heads, chunk, head_dim)");

  TORCH_CHECK_VALUE(values.sizes() == keys.sizes(),
                    "values must have the same shape as keys ", keys.sizes(),
                    ", got ", values.sizes());
  const UpdateGeometry g{keys.size(0), keys.size(1), keys_new.size(2),
                         keys.size(3), keys.size(2)};
  TORCH_CHECK_VALUE(
      keys_new.size(0) == g.batch && keys_new.size(1) == g.heads &&
          keys_new.size(3) == g.head_dim,
      "keys_new must have shape (batch=", g.batch, ", num_kv_heads=", g.heads,
      ", chunk, head_dim=", g.head_dim, ") to match the cache, got ",
      keys_new.sizes());
  TORCH_CHECK_VALUE(values_new.sizes() == keys_new.sizes(),
                    "values_new must have the same shape as keys_new ",
                    keys_new.sizes(), ", got ", values_new.sizes());

  // No implicit casts: a cast would hide a model/cache dtype mismatch and
  // cost an extra pass over the data.
  TORCH_CHECK_TYPE(values.scalar_type() == keys.scalar_type(),
                   "values must have the same dtype as keys (",
                   py_dtype(keys.scalar_type()), "), got ",
                   py_dtype(values.scalar_type()));
  TORCH_CHECK_TYPE(keys_new.scalar_type() == keys.scalar_type(),
                   "keys_new must have the cache dtype ",
                   py_dtype(keys.scalar_type()), " (no implicit casts), got ",
                   py_dtype(keys_new.scalar_type()));
  TORCH_CHECK_TYPE(values_new.scalar_type() == keys.scalar_type(),
                   "values_new must have the cache dtype ",
                   py_dtype(keys.scalar_type()), " (no implicit casts), got ",
                   py_dtype(values_new.scalar_type()));

  const auto dev = keys.device();
  TORCH_CHECK_VALUE(values.device() == dev,
                    "values must be on the same device as keys (", dev,
                    "), got ", values.device());
  TORCH_CHECK_VALUE(keys_new.device() == dev,
                    "keys_new must be on the cache's device (", dev, "), got ",
                    keys_new.device());
  TORCH_CHECK_VALUE(values_new.device() == dev,
                    "values_new must be on the cache's device (", dev,
                    "), got ", values_new.device());

  // Writes into memory that aliases itself or the other buffer would race
  // (parallel copies) or silently clobber data (the JAX original shared one
  // zeros buffer between keys and values).
  TORCH_CHECK_VALUE(at::has_internal_overlap(keys) != at::MemOverlap::Yes,
                    "keys must not have internally overlapping memory (for "
                    "example an expand()ed tensor)");
  TORCH_CHECK_VALUE(at::has_internal_overlap(values) != at::MemOverlap::Yes,
                    "values must not have internally overlapping memory (for "
                    "example an expand()ed tensor)");
  // Full/Partial are the overlaps that can be proven cheaply (same or
  // intersecting dense ranges). Interleaved views of one buffer, such as a
  // fused (..., 2, head_dim) KV layout, are "TooHard" and stay allowed.
  TORCH_CHECK_VALUE(!overlaps(keys, values),
                    "keys and values must not share memory: give each its "
                    "own buffer");
  for (const at::Tensor* dst : {&keys, &values}) {
    TORCH_CHECK_VALUE(!overlaps(*dst, keys_new) && !overlaps(*dst, values_new),
                      "keys_new and values_new must not share memory with "
                      "the cache buffers");
  }
  return g;
}

void check_start(int64_t start, const UpdateGeometry& g) {
  TORCH_CHECK_VALUE(start >= 0, "start must be >= 0, got ", start);
  const int64_t end = start + g.chunk;
  TORCH_CHECK_VALUE(end <= g.max_len, "KV cache overflow: end=", end,
                    " exceeds max_len=", g.max_len);
}

void check_positions_meta(const at::Tensor& positions, const at::Tensor& keys,
                          const UpdateGeometry& g) {
  TORCH_CHECK_VALUE(positions.defined(), "positions must be a defined tensor");
  TORCH_CHECK_TYPE(positions.scalar_type() == at::kInt ||
                       positions.scalar_type() == at::kLong,
                   "positions must be an int32 or int64 tensor, got dtype ",
                   py_dtype(positions.scalar_type()));
  TORCH_CHECK_VALUE(positions.layout() == at::kStrided,
                    "positions must be a strided (dense) tensor, got layout ",
                    positions.layout());
  TORCH_CHECK_VALUE(
      positions.dim() == 0 ||
          (positions.dim() == 1 && positions.size(0) == g.batch),
      "positions must be a 0-D tensor (one start for every row) or have "
      "shape (batch=",
      g.batch, ",), got shape ", positions.sizes());
  TORCH_CHECK_VALUE(positions.device() == keys.device(),
                    "positions must be on the cache's device (", keys.device(),
                    "), got ", positions.device());
}

namespace {
template <typename T>
std::vector<int64_t> read_checked(const at::Tensor& positions,
                                  const UpdateGeometry& g) {
  const T* p = positions.const_data_ptr<T>();
  const int64_t n = positions.numel();
  const int64_t stride = positions.dim() == 0 ? 0 : positions.stride(0);
  std::vector<int64_t> out(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = static_cast<int64_t>(p[i * stride]);
    TORCH_CHECK_VALUE(start >= 0, "positions must be >= 0, got ", start,
                      " at index ", i);
    const int64_t end = start + g.chunk;
    TORCH_CHECK_VALUE(end <= g.max_len, "KV cache overflow: end=", end,
                      " exceeds max_len=", g.max_len, " (positions[", i,
                      "]=", start, ", chunk=", g.chunk, ")");
    out[i] = start;
  }
  return out;
}
}  // namespace

std::vector<int64_t> read_positions_cpu(const at::Tensor& positions,
                                        const UpdateGeometry& g) {
  return positions.scalar_type() == at::kInt
             ? read_checked<int32_t>(positions, g)
             : read_checked<int64_t>(positions, g);
}

}  // namespace detail
}  // namespace kvcache
