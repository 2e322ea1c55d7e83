// The operators as the dispatcher sees them: schemas, kernels, boxed calls.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <sstream>
#include <string>
#include <vector>

#include "catch.h"
#include "kvcache/build_info.h"
#include "ops/operators.h"

namespace {

std::string schema_of(const char* name, const char* overload = "") {
  auto op = c10::Dispatcher::singleton().findSchema({name, overload});
  REQUIRE(op.has_value());
  std::ostringstream os;
  os << op->schema();
  return os.str();
}

}  // namespace

TEST_CASE("schemas are registered with mutation annotations", "[dispatcher]") {
  REQUIRE(schema_of("kvcache::update_") ==
          "kvcache::update_(Tensor(a!) keys, Tensor(b!) values, Tensor keys_new, "
          "Tensor values_new, SymInt start, *, Tensor(c!)? k_scale=None, "
          "Tensor(d!)? v_scale=None) -> Tensor");
  REQUIRE(schema_of("kvcache::update_", "Tensor") ==
          "kvcache::update_.Tensor(Tensor(a!) keys, Tensor(b!) values, Tensor keys_new, "
          "Tensor values_new, Tensor start, *, Tensor(c!)? k_scale=None, "
          "Tensor(d!)? v_scale=None, Tensor(e!)? positions=None, int sinks=0) -> Tensor");
  REQUIRE(schema_of("kvcache::append_") ==
          "kvcache::append_(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) lengths, "
          "Tensor keys_new, Tensor values_new, *, Tensor(d!)? k_scale=None, "
          "Tensor(e!)? v_scale=None) -> ()");
  REQUIRE(schema_of("kvcache::attend") ==
          "kvcache::attend(Tensor q, Tensor keys, Tensor values, Tensor lengths, *, "
          "Tensor? kv_start=None, float? scale=None, int window=0, float softcap=0., "
          "Tensor? positions=None, int sinks=0, Tensor? k_scale=None, Tensor? v_scale=None, "
          "Tensor? sink_logits=None) -> Tensor");
  REQUIRE(schema_of("kvcache::ring_update_") ==
          "kvcache::ring_update_(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) positions, "
          "Tensor keys_new, Tensor values_new, Tensor start, *, int sinks=0, "
          "Tensor(d!)? k_scale=None, Tensor(e!)? v_scale=None) -> Tensor");
  REQUIRE(schema_of("kvcache::ring_update_quantized_") ==
          "kvcache::ring_update_quantized_(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) k_scale, "
          "Tensor(d!) v_scale, Tensor(e!) positions, Tensor keys_new, Tensor values_new, Tensor start, *, "
          "int sinks=0) -> Tensor");
  REQUIRE(schema_of("kvcache::update_quantized_", "Tensor") ==
          "kvcache::update_quantized_.Tensor(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) k_scale, "
          "Tensor(d!) v_scale, Tensor keys_new, Tensor values_new, Tensor start) -> Tensor");
  REQUIRE(schema_of("kvcache::update_quantized_") ==
          "kvcache::update_quantized_(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) k_scale, "
          "Tensor(d!) v_scale, Tensor keys_new, Tensor values_new, SymInt start) -> Tensor");
  REQUIRE(schema_of("kvcache::append_quantized_") ==
          "kvcache::append_quantized_(Tensor(a!) keys, Tensor(b!) values, Tensor(c!) k_scale, "
          "Tensor(d!) v_scale, Tensor(e!) lengths, Tensor keys_new, Tensor values_new) -> ()");
  REQUIRE(schema_of("kvcache::rollback") ==
          "kvcache::rollback(Tensor lengths, Tensor n, *, Tensor? kv_start=None) -> Tensor");
  REQUIRE(schema_of("kvcache::select_rows_") ==
          "kvcache::select_rows_(Tensor(a!) keys, Tensor(b!) values, Tensor lengths, "
          "Tensor index) -> Tensor");
  REQUIRE(schema_of("kvcache::append_returning_") ==
          "kvcache::append_returning_(Tensor(a!) keys, Tensor(b!) values, Tensor lengths, "
          "Tensor keys_new, Tensor values_new, *, Tensor(c!)? k_scale=None, "
          "Tensor(d!)? v_scale=None) -> Tensor");
  REQUIRE(schema_of("kvcache::reset_rows") ==
          "kvcache::reset_rows(Tensor lengths, Tensor rows) -> Tensor");
  REQUIRE(schema_of("kvcache::init_layer_cache") ==
          "kvcache::init_layer_cache(SymInt batch_size, SymInt num_kv_heads, SymInt head_dim, "
          "SymInt max_len, *, ScalarType? dtype=None, Device? device=None) -> "
          "(Tensor, Tensor, Tensor)");
}

TEST_CASE("kernels are registered for the backends and the guards", "[dispatcher]") {
  // Every operator with device work in the one list (csrc/ops/operators.h).
  std::vector<std::string> names;
#define KVCACHE_NAME(id, name, kind, stub, schema) \
  if (std::string(#kind) == "Write" || std::string(#kind) == "Read") names.push_back(name);
  KVCACHE_OPERATORS(KVCACHE_NAME)
#undef KVCACHE_NAME
  REQUIRE(names.size() >= 6);
  for (const auto& full : names) {
    const auto dot = full.find('.');
    const std::string name = "kvcache::" + full.substr(0, dot);
    const std::string overload = dot == std::string::npos ? "" : full.substr(dot + 1);
    CAPTURE(full);
    auto op = c10::Dispatcher::singleton().findSchema({name, overload});
    REQUIRE(op.has_value());
    for (auto key : {c10::DispatchKey::CPU, c10::DispatchKey::CUDA, c10::DispatchKey::SparseCPU,
                     c10::DispatchKey::Autograd, c10::DispatchKey::Conjugate}) {
      REQUIRE(op->hasKernelForDispatchKey(key));
    }
  }
}

TEST_CASE("a boxed call through the dispatcher writes both buffers", "[dispatcher]") {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kvcache::update_", "");
  auto keys = at::zeros({1, 2, 8, 4});
  auto values = at::zeros({1, 2, 8, 4});
  auto kn = at::randn({1, 2, 2, 4});
  auto vn = at::randn({1, 2, 2, 4});
  // A boxed stack holds every argument, the keyword-only scales too (None: a plain write).
  torch::jit::Stack stack{keys, values, kn, vn, c10::IValue(int64_t{3}), c10::IValue(), c10::IValue()};
  op.callBoxed(&stack);
  REQUIRE(stack.size() == 1);  // returns the new length, start + chunk
  REQUIRE(stack[0].toTensor().scalar_type() == at::kInt);
  REQUIRE(stack[0].toTensor().item<int32_t>() == 5);
  REQUIRE(at::equal(keys.narrow(2, 3, 2), kn));
  REQUIRE(at::equal(values.narrow(2, 3, 2), vn));
  REQUIRE(keys.narrow(2, 0, 3).count_nonzero().item<int64_t>() == 0);
  REQUIRE(keys.narrow(2, 5, 3).count_nonzero().item<int64_t>() == 0);

  auto init = c10::Dispatcher::singleton().findSchemaOrThrow("kvcache::init_layer_cache", "");
  torch::jit::Stack s2{c10::IValue(int64_t{1}), c10::IValue(int64_t{2}), c10::IValue(int64_t{4}),
                       c10::IValue(int64_t{8}), c10::IValue(at::kHalf), c10::IValue()};
  init.callBoxed(&s2);
  REQUIRE(s2.size() == 3);
  REQUIRE(s2[0].toTensor().scalar_type() == at::kHalf);
  REQUIRE(s2[0].toTensor().sizes() == at::IntArrayRef({1, 2, 8, 4}));
  REQUIRE(s2[2].toTensor().scalar_type() == at::kInt);
}

TEST_CASE("a boxed call with bad arguments raises ValueError and writes nothing", "[dispatcher]") {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kvcache::update_", "Tensor");
  auto keys = at::zeros({1, 2, 8, 4});
  auto values = at::zeros({1, 2, 8, 4});
  torch::jit::Stack stack{keys, values, at::randn({1, 2, 2, 4}), at::randn({1, 2, 2, 4}),
                          at::tensor(7), c10::IValue(), c10::IValue(), c10::IValue(),
                          c10::IValue(int64_t{0})};
  REQUIRE_THROWS_AS(op.callBoxed(&stack), c10::ValueError);
  REQUIRE(keys.count_nonzero().item<int64_t>() == 0);
  REQUIRE(values.count_nonzero().item<int64_t>() == 0);
}

TEST_CASE("the deprecated writes are composite aliases of the new writes", "[dispatcher]") {
  // An alias has one CompositeImplicitAutograd kernel and no backend kernel of its own: tracing and
  // the dispatcher decompose it into the write it names (its kernels, guards and fake kernel).
  std::vector<std::string> aliases;
#define KVCACHE_ALIAS_NAME(id, name, kind, stub, schema) \
  if (std::string(#kind) == "Alias") aliases.push_back(name);
  KVCACHE_OPERATORS(KVCACHE_ALIAS_NAME)
#undef KVCACHE_ALIAS_NAME
  REQUIRE(aliases == std::vector<std::string>{"update_quantized_", "update_quantized_.Tensor",
                                              "append_quantized_", "ring_update_",
                                              "ring_update_quantized_"});
  for (const auto& full : aliases) {
    const auto dot = full.find('.');
    const std::string name = "kvcache::" + full.substr(0, dot);
    const std::string overload = dot == std::string::npos ? "" : full.substr(dot + 1);
    CAPTURE(full);
    auto op = c10::Dispatcher::singleton().findSchema({name, overload});
    REQUIRE(op.has_value());
    REQUIRE(op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd));
    for (auto key : {c10::DispatchKey::CPU, c10::DispatchKey::CUDA, c10::DispatchKey::Autograd}) {
      REQUIRE_FALSE(op->hasKernelForDispatchKey(key));
    }
  }

  // A boxed call of the alias writes what the new write with scales writes, byte for byte.
  auto alias = c10::Dispatcher::singleton().findSchemaOrThrow("kvcache::update_quantized_", "");
  auto write = c10::Dispatcher::singleton().findSchemaOrThrow("kvcache::update_", "");
  auto opts = at::TensorOptions().dtype(at::kChar);
  auto k1 = at::zeros({1, 2, 8, 4}, opts), v1 = at::zeros({1, 2, 8, 4}, opts);
  auto k2 = at::zeros({1, 2, 8, 4}, opts), v2 = at::zeros({1, 2, 8, 4}, opts);
  auto ks1 = at::ones({1, 2, 8}), vs1 = at::ones({1, 2, 8});
  auto ks2 = at::ones({1, 2, 8}), vs2 = at::ones({1, 2, 8});
  auto kn = at::randn({1, 2, 3, 4}), vn = at::randn({1, 2, 3, 4});
  torch::jit::Stack a{k1, v1, ks1, vs1, kn, vn, c10::IValue(int64_t{2})};
  alias.callBoxed(&a);
  torch::jit::Stack b{k2, v2, kn, vn, c10::IValue(int64_t{2}), ks2, vs2};
  write.callBoxed(&b);
  REQUIRE(a[0].toTensor().item<int32_t>() == 5);
  REQUIRE(b[0].toTensor().item<int32_t>() == 5);
  REQUIRE(at::equal(k1, k2));
  REQUIRE(at::equal(v1, v2));
  REQUIRE(at::equal(ks1, ks2));
  REQUIRE(at::equal(vs1, vs2));
  REQUIRE(k1.narrow(2, 2, 3).count_nonzero().item<int64_t>() > 0);
}
