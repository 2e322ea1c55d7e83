// The kvcache operator library: every schema, and which kernel serves each
// dispatch key, derived from the one operator list (csrc/ops/operators.h).
// The only TORCH_LIBRARY(kvcache) block: a process that sees two fails to
// load the second.
#include <torch/library.h>

#include "core/dispatch_guards.h"
#include "ops/attend.h"
#include "ops/init_layer_cache.h"
#include "ops/operators.h"
#include "ops/ring.h"
#include "ops/paged.h"
#include "ops/rows.h"
#include "ops/update.h"

namespace {

// Which layers above the backends an operator gets (see operators.h).
enum class Kind { Factory, Write, Read, Alias };
constexpr Kind kFactory = Kind::Factory;
constexpr Kind kWrite = Kind::Write;
constexpr Kind kRead = Kind::Read;
constexpr Kind kAlias = Kind::Alias;

// Whether an operator has kernels of its own per backend and the guard
// layers above them (factories and aliases have one composite kernel).
constexpr bool has_backends(Kind k) { return k == Kind::Write || k == Kind::Read; }

}  // namespace

TORCH_LIBRARY(kvcache, m) {
#define KVCACHE_DEF(id, name, kind, stub, schema) m.def(schema);
  KVCACHE_OPERATORS(KVCACHE_DEF)
#undef KVCACHE_DEF
}

namespace {

// The entry points check, allocate and call the device stub, so one function
// serves every backend. Sparse, quantized, MKLDNN and nested tensors get the
// same entry, whose checks reject them with a ValueError/TypeError naming the
// argument (instead of the dispatcher's "could not run ... with arguments
// from the 'SparseCPU' backend"). Factories have no tensor input and are
// served by one CompositeExplicitAutograd kernel below.
void register_entries(torch::Library& m) {
#define KVCACHE_IMPL(id, name, kind, stub, schema) \
  if (has_backends(k##kind)) m.impl(name, &kvcache::ops::id);
  KVCACHE_OPERATORS(KVCACHE_IMPL)
#undef KVCACHE_IMPL
}

// Above the backends: no autograd (a clear error instead of a silent
// detach), version bumps for what is written, no lazy conj/neg writes.
enum class Layer { Autograd, InplaceOrView, MathBits };

void register_guards(torch::Library& m, Layer layer) {
#define KVCACHE_GUARD(id, name, kind, stub, schema)                         \
  if (has_backends(k##kind)) {                                             \
    if (layer == Layer::Autograd) {                                        \
      m.impl(name, kvcache::detail::autograd_guard());                     \
    } else if (layer == Layer::MathBits) {                                 \
      m.impl(name, kvcache::detail::math_bits_guard());                    \
    } else if (k##kind == Kind::Write) {                                   \
      m.impl(name, kvcache::detail::inplace_version_bump());               \
    }                                                                      \
  }
  KVCACHE_OPERATORS(KVCACHE_GUARD)
#undef KVCACHE_GUARD
}

}  // namespace

TORCH_LIBRARY_IMPL(kvcache, CPU, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, CUDA, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, SparseCPU, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, SparseCUDA, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, SparseCsrCPU, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, SparseCsrCUDA, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, QuantizedCPU, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, QuantizedCUDA, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, MkldnnCPU, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, NestedTensorCPU, m) { register_entries(m); }
TORCH_LIBRARY_IMPL(kvcache, NestedTensorCUDA, m) { register_entries(m); }

TORCH_LIBRARY_IMPL(kvcache, CompositeExplicitAutograd, m) {
#define KVCACHE_FACTORY(id, name, kind, stub, schema) \
  if (k##kind == Kind::Factory) m.impl(name, &kvcache::ops::id);
  KVCACHE_OPERATORS(KVCACHE_FACTORY)
#undef KVCACHE_FACTORY
}

// The deprecated aliases: one kernel above every layer, calling the new
// operator through the dispatcher, so autograd, functionalization, fake
// tensors and torch.compile see (and decompose into) the new operator only.
// No warning: a C++ warning raised while Dynamo traces would reach the
// user once per compile, and the aliases are documented as deprecated.
TORCH_LIBRARY_IMPL(kvcache, CompositeImplicitAutograd, m) {
#define KVCACHE_ALIAS(id, name, kind, stub, schema) \
  if (k##kind == Kind::Alias) m.impl(name, &kvcache::ops::id);
  KVCACHE_OPERATORS(KVCACHE_ALIAS)
#undef KVCACHE_ALIAS
}

TORCH_LIBRARY_IMPL(kvcache, Autograd, m) { register_guards(m, Layer::Autograd); }
TORCH_LIBRARY_IMPL(kvcache, ADInplaceOrView, m) {
  register_guards(m, Layer::InplaceOrView);
}
TORCH_LIBRARY_IMPL(kvcache, Conjugate, m) { register_guards(m, Layer::MathBits); }
TORCH_LIBRARY_IMPL(kvcache, Negative, m) { register_guards(m, Layer::MathBits); }
