// Boxed kernels that make the kvcache operators behave like PyTorch's own
// in-place operators above the backend: one function each, shared by every
// operator, registered in csrc/schema.cpp.
//
//  * Autograd: the operators have no backward (a KV cache is an inference
//    structure). With grad mode on, a tensor argument that requires grad is
//    refused with a ValueError naming it, instead of being silently detached.
//  * ADInplaceOrView: after a write, the version counter of every mutated
//    tensor is bumped, so autograd detects a saved tensor that changed.
//  * Conjugate / Negative: a lazily conjugated or negated tensor that would
//    be written is refused before anything is written (torch's fallback
//    would write into a temporary copy, after a partial write of the other
//    buffer); one that is only read is materialized, as the fallback does.
#pragma once

#include <torch/library.h>

namespace kvcache {
namespace detail {

torch::CppFunction autograd_guard();
torch::CppFunction inplace_version_bump();
torch::CppFunction math_bits_guard();

}  // namespace detail
}  // namespace kvcache
