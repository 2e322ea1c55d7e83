// The operators as the dispatcher sees them: schemas, kernels, boxed calls.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <sstream>

#include "catch.h"
#include "kvcache/build_info.h"

namespace {

std::string schema_of(const char* name) {
  auto op = c10::Dispatcher::singleton().findSchema({name, ""});
  REQUIRE(op.has_value());
  std::ostringstream os;
  os << op->schema();
  return os.str();
}

}  // namespace

TEST_CASE("schemas are registered with mutation annotations", "[dispatcher]") {
  REQUIRE(schema_of("kvcache::update_") ==
          "kvcache::update_(Tensor(a!) keys, Tensor(b!) values, Tensor keys_new, "
          "Tensor values_new, SymInt start) -> Tensor");
  REQUIRE(schema_of("kvcache::update_at_") ==
          "kvcache::update_at_(Tensor(a!) keys, Tensor(b!) values, Tensor keys_new, "
          "Tensor values_new, Tensor positions) -> Tensor");
  REQUIRE(schema_of("kvcache::init_layer_cache") ==
          "kvcache::init_layer_cache(SymInt batch_size, SymInt num_kv_heads, SymInt head_dim, "
          "SymInt max_len, *, ScalarType? dtype=None, Device? device=None) -> "
          "(Tensor, Tensor, Tensor)");
}

TEST_CASE("CPU kernels are registered", "[dispatcher]") {
  for (const char* name : {"kvcache::update_", "kvcache::update_at_"}) {
    auto op = c10::Dispatcher::singleton().findSchema({name, ""});
    REQUIRE(op.has_value());
    REQUIRE(op->hasKernelForDispatchKey(c10::DispatchKey::CPU));
    REQUIRE(op->hasKernelForDispatchKey(c10::DispatchKey::CUDA) == kvcache::build_info().with_cuda);
  }
}

TEST_CASE("a boxed call through the dispatcher writes both buffers", "[dispatcher]") {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kvcache::update_", "");
  auto keys = at::zeros({1, 2, 8, 4});
  auto values = at::zeros({1, 2, 8, 4});
  auto kn = at::randn({1, 2, 2, 4});
  auto vn = at::randn({1, 2, 2, 4});
  torch::jit::Stack stack{keys, values, kn, vn, c10::IValue(int64_t{3})};
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
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kvcache::update_at_", "");
  auto keys = at::zeros({1, 2, 8, 4});
  auto values = at::zeros({1, 2, 8, 4});
  torch::jit::Stack stack{keys, values, at::randn({1, 2, 2, 4}), at::randn({1, 2, 2, 4}),
                          at::tensor(7)};
  REQUIRE_THROWS_AS(op.callBoxed(&stack), c10::ValueError);
  REQUIRE(keys.count_nonzero().item<int64_t>() == 0);
  REQUIRE(values.count_nonzero().item<int64_t>() == 0);
}
