// init_layer_cache has no tensor argument, so the dispatcher cannot pick a
// backend from its inputs. It is registered once as CompositeExplicitAutograd:
// at::zeros routes to the backend named by `device` (CPU, CUDA, Meta, ...),
// and on CUDA the fill is an async memset on the current stream.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

namespace kvcache {
namespace {

void check_non_negative(const c10::SymInt& v, const char* name) {
  TORCH_CHECK_VALUE(v.sym_ge(0).guard_bool(__FILE__, __LINE__), name,
                    " must be >= 0, got ", v);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> init_layer_cache(
    c10::SymInt batch_size, c10::SymInt num_kv_heads, c10::SymInt head_dim,
    c10::SymInt max_len, std::optional<at::ScalarType> dtype,
    std::optional<at::Device> device) {
  check_non_negative(batch_size, "batch_size");
  check_non_negative(num_kv_heads, "num_kv_heads");
  check_non_negative(head_dim, "head_dim");
  check_non_negative(max_len, "max_len");
  const auto scalar_type =
      dtype.value_or(c10::typeMetaToScalarType(at::get_default_dtype()));
  TORCH_CHECK_TYPE(!c10::isQIntType(scalar_type),
                   "dtype must not be a quantized type, got torch.",
                   std::get<0>(c10::getDtypeNames(scalar_type)));
  const auto opts =
      at::TensorOptions().dtype(scalar_type).device(device.value_or(at::kCPU));
  const std::vector<c10::SymInt> shape{batch_size, num_kv_heads, max_len,
                                       head_dim};
  // Two allocations on purpose: the caches are updated in place, so a shared
  // buffer (as in the JAX original) would make keys and values alias.
  at::Tensor keys = at::zeros_symint(shape, opts);
  at::Tensor values = at::zeros_symint(shape, opts);
  at::Tensor length = at::zeros({}, opts.dtype(at::kInt));
  return {std::move(keys), std::move(values), std::move(length)};
}

}  // namespace
}  // namespace kvcache

TORCH_LIBRARY_IMPL(kvcache, CompositeExplicitAutograd, m) {
  m.impl("init_layer_cache", &kvcache::init_layer_cache);
}
