// init_layer_cache: zero-filled keys and values and a 0 length.
//
// It has no tensor argument, so the dispatcher cannot pick a backend from
// its inputs: it is one CompositeExplicitAutograd kernel, and the allocation
// routes to the backend named by `device` (CPU, CUDA, ...). On CUDA the fill
// is an async memset on the current stream; on the CPU the buffers are
// advised into huge pages first (core/memory.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>

#include "kvcache/export.h"
#include <tuple>

namespace kvcache {
namespace detail {

// Checks the sizes (shared with the fake kernel); returns the dtype to use.
KVCACHE_API at::ScalarType check_init(const c10::SymInt& batch_size,
                          const c10::SymInt& num_kv_heads,
                          const c10::SymInt& head_dim,
                          const c10::SymInt& max_len,
                          std::optional<at::ScalarType> dtype);


// The checks with the schema's arguments, as a fake kernel runs them.
inline void trace_check_init_layer_cache(c10::SymInt batch_size,
                                         c10::SymInt num_kv_heads,
                                         c10::SymInt head_dim,
                                         c10::SymInt max_len,
                                         std::optional<at::ScalarType> dtype,
                                         std::optional<at::Device> /*device*/) {
  check_init(batch_size, num_kv_heads, head_dim, max_len, dtype);
}

}  // namespace detail

// Operator entry points (registered in csrc/schema.cpp).
namespace ops {

std::tuple<at::Tensor, at::Tensor, at::Tensor> init_layer_cache(
    c10::SymInt batch_size, c10::SymInt num_kv_heads, c10::SymInt head_dim,
    c10::SymInt max_len, std::optional<at::ScalarType> dtype,
    std::optional<at::Device> device);

}  // namespace ops
}  // namespace kvcache
