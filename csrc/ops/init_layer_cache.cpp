#include "init_layer_cache.h"

#include <ATen/ops/zeros.h>
#include <c10/core/DefaultDtype.h>
#include <c10/util/Exception.h>

#include <vector>

#include "../core/checks.h"
#include "../core/memory.h"

namespace kvcache {
namespace detail {

at::ScalarType check_init(const c10::SymInt& batch_size,
                          const c10::SymInt& num_kv_heads,
                          const c10::SymInt& head_dim,
                          const c10::SymInt& max_len,
                          std::optional<at::ScalarType> dtype) {
  for (const auto& [v, name] :
       {std::pair<const c10::SymInt&, const char*>{batch_size, "batch_size"},
        {num_kv_heads, "num_kv_heads"},
        {head_dim, "head_dim"},
        {max_len, "max_len"}}) {
    TORCH_CHECK_VALUE(holds(v.sym_ge(0)), name, " must be >= 0, got ",
                      shown(v));
  }
  TORCH_CHECK_VALUE(holds(max_len.sym_le(kMaxLen)),
                    "max_len must be <= ", kMaxLen,
                    " (lengths are int32), got ", shown(max_len));
  const auto scalar_type =
      dtype.value_or(c10::typeMetaToScalarType(c10::get_default_dtype()));
  TORCH_CHECK_TYPE(!c10::isQIntType(scalar_type),
                   "dtype must not be a quantized type, got ",
                   py_dtype(scalar_type));
  // The element count must fit int64 bytes (at::zeros would fail later,
  // with a less clear message, or not at all on a lazy allocator).
  if (auto b = batch_size.maybe_as_int()) {
    auto h = num_kv_heads.maybe_as_int();
    auto d = head_dim.maybe_as_int();
    auto t = max_len.maybe_as_int();
    if (h && d && t) {
      int64_t n = static_cast<int64_t>(c10::elementSize(scalar_type));
      const bool overflow = __builtin_mul_overflow(n, *b, &n) ||
                            __builtin_mul_overflow(n, *h, &n) ||
                            __builtin_mul_overflow(n, *d, &n) ||
                            __builtin_mul_overflow(n, *t, &n);
      TORCH_CHECK_VALUE(!overflow, "a cache of shape (", *b, ", ", *h, ", ",
                        *t, ", ", *d, ") is too large: its size in bytes "
                        "does not fit in 64 bits");
    }
  }
  return scalar_type;
}

}  // namespace detail

namespace ops {

std::tuple<at::Tensor, at::Tensor, at::Tensor> init_layer_cache(
    c10::SymInt batch_size, c10::SymInt num_kv_heads, c10::SymInt head_dim,
    c10::SymInt max_len, std::optional<at::ScalarType> dtype,
    std::optional<at::Device> device) {
  const auto scalar_type =
      detail::check_init(batch_size, num_kv_heads, head_dim, max_len, dtype);
  const auto opts =
      at::TensorOptions().dtype(scalar_type).device(device.value_or(at::kCPU));
  const std::vector<c10::SymInt> shape{batch_size, num_kv_heads, max_len,
                                       head_dim};
  // Two allocations on purpose: the caches are updated in place, so a shared
  // buffer (as in the JAX original) would make keys and values alias. On the
  // CPU in huge pages (core/memory.h).
  at::Tensor keys = detail::cache_zeros(shape, opts);
  at::Tensor values = detail::cache_zeros(shape, opts);
  at::Tensor length = at::zeros({}, opts.dtype(at::kInt));
  return {std::move(keys), std::move(values), std::move(length)};
}

}  // namespace ops
}  // namespace kvcache
