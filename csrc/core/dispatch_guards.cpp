#include "dispatch_guards.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>

#include <c10/util/SmallVector.h>

#include "checks.h"

namespace kvcache {
namespace detail {
namespace {

// The op's own arguments: the last schema.arguments().size() stack slots.
size_t first_arg(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  return stack->size() - op.schema().arguments().size();
}

void autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                     torch::jit::Stack* stack) {
  if (c10::GradMode::is_enabled()) {
    const auto& args = op.schema().arguments();
    const size_t first = first_arg(op, stack);
    for (size_t i = 0; i < args.size(); ++i) {
      const c10::IValue& v = (*stack)[first + i];
      if (v.isTensor() && v.toTensor().defined()) {
        TORCH_CHECK_VALUE(
            !v.toTensor().requires_grad(), op.schema().name(), ": ",
            args[i].name(),
            " requires grad, but kvcache operators have no backward (a KV "
            "cache is an inference structure): run under torch.no_grad() or "
            "torch.inference_mode() (also around torch.export / "
            "torch.compile tracing), or pass ", args[i].name(), ".detach()");
      }
    }
  }
  op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
}

void version_bump_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                         torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = first_arg(op, stack);
  c10::SmallVector<at::Tensor, 4> written;  // no heap allocation per call
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = (*stack)[first + i];
    if (args[i].alias_info() != nullptr && args[i].alias_info()->isWrite() &&
        v.isTensor() && v.toTensor().defined()) {
      written.push_back(v.toTensor());
    }
  }
  op.redispatchBoxed(ks & c10::after_ADInplaceOrView_keyset, stack);
  for (auto& t : written) {
    t.unsafeGetTensorImpl()->bump_version();
  }
}

void math_bits_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                      torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = first_arg(op, stack);
  for (size_t i = 0; i < args.size(); ++i) {
    c10::IValue& v = (*stack)[first + i];
    if (!v.isTensor() || !v.toTensor().defined()) continue;
    const at::Tensor& t = v.toTensor();
    if (!t.is_conj() && !t.is_neg()) continue;
    if (args[i].alias_info() != nullptr && args[i].alias_info()->isWrite()) {
      check_writable(t, args[i].name().c_str());  // raises for the bit
    }
    v = t.resolve_conj().resolve_neg();
  }
  op.redispatchBoxed(
      ks.remove(c10::DispatchKey::Conjugate).remove(c10::DispatchKey::Negative),
      stack);
}

}  // namespace

torch::CppFunction autograd_guard() {
  return torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>();
}

torch::CppFunction inplace_version_bump() {
  return torch::CppFunction::makeFromBoxedFunction<&version_bump_kernel>();
}

torch::CppFunction math_bits_guard() {
  return torch::CppFunction::makeFromBoxedFunction<&math_bits_kernel>();
}

}  // namespace detail
}  // namespace kvcache
