// A kvcache operator's typed dispatcher handle, for C++ code that calls an
// operator through the dispatcher (the C++ API, and the deprecated aliases
// whose kernels must decompose into the new operator under tracing).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace kvcache {
namespace detail {

// The handle of operator `name` (e.g. "kvcache::update_") and `overload`
// ("" for none), typed Sig. Callers keep it in a function-local static:
// findSchemaOrThrow takes a lock and a hash lookup. Sig must match the
// schema (csrc/ops/operators.h), else the first call throws.
template <typename Sig>
c10::TypedOperatorHandle<Sig> typed_op(const char* name, const char* overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).template typed<Sig>();
}

}  // namespace detail
}  // namespace kvcache
