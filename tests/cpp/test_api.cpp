// The C++ API (include/kvcache/kvcache.h) against plain ATen slicing.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <functional>
#include <optional>
#include <vector>

#include "catch.h"
#include "kvcache/kvcache.h"

namespace {

constexpr int64_t B = 2, H = 3, T = 16, D = 8;

at::Tensor random_of(at::IntArrayRef shape, at::ScalarType dtype) {
  if (dtype == at::kBool) return at::randint(0, 2, shape).to(at::kBool);
  if (at::isIntegralType(dtype, /*includeBool=*/false)) {
    return at::randint(-100, 100, shape).to(dtype);
  }
  return (at::randn(shape) * 4).to(dtype);
}

// Byte-exact comparison: works for every dtype, float8 and NaN included.
bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

// Reference: plain slicing on clones.
std::pair<at::Tensor, at::Tensor> reference(const at::Tensor& keys, const at::Tensor& values,
                                            const at::Tensor& kn, const at::Tensor& vn,
                                            const std::vector<int64_t>& starts) {
  auto k = keys.clone(), v = values.clone();
  const int64_t chunk = kn.size(2);
  for (int64_t b = 0; b < keys.size(0); ++b) {
    k[b].narrow(1, starts[b], chunk).copy_(kn[b]);
    v[b].narrow(1, starts[b], chunk).copy_(vn[b]);
  }
  return {k, v};
}

kvcache::KVLayerCache filled_cache(at::ScalarType dtype) {
  auto cache = kvcache::init_kv_layer_cache(B, H, D, T, dtype);
  cache.keys.copy_(random_of({B, H, T, D}, dtype));
  cache.values.copy_(random_of({B, H, T, D}, dtype));
  return cache;
}

}  // namespace

TEST_CASE("init_kv_layer_cache gives zeros and separate buffers and length 0", "[api]") {
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble, at::kFloat8_e4m3fn,
                     at::kChar, at::kBool}) {
    auto cache = kvcache::init_kv_layer_cache(B, H, D, T, dtype);
    REQUIRE(cache.keys.sizes() == at::IntArrayRef({B, H, T, D}));
    REQUIRE(cache.keys.scalar_type() == dtype);
    REQUIRE(same_bytes(cache.keys, at::zeros({B, H, T, D}, at::TensorOptions().dtype(dtype))));
    REQUIRE(same_bytes(cache.values, at::zeros({B, H, T, D}, at::TensorOptions().dtype(dtype))));
    REQUIRE_FALSE(cache.keys.is_alias_of(cache.values));
    REQUIRE(cache.length.scalar_type() == at::kInt);
    REQUIRE(cache.length.dim() == 0);
    REQUIRE(cache.length.item<int32_t>() == 0);
    REQUIRE(cache.max_len() == T);
  }
}

#if defined(__linux__)
// The VmFlags of the mapping holding address a (/proc/self/smaps), or "".
std::string vm_flags_at(uintptr_t a) {
  std::ifstream f("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(f, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      inside = lo <= a && a < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

TEST_CASE("init_kv_layer_cache advises its CPU buffers into huge pages", "[api]") {
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled").good()) {
    WARN("this kernel has no transparent huge pages");
    return;
  }
  // 64 MB each: glibc maps them afresh (its mmap threshold is at most 32 MB), so the flag is
  // theirs, not an earlier buffer's on reused heap memory.
  auto c = kvcache::init_kv_layer_cache(16, 4, 64, 4096, at::kFloat);
  for (const at::Tensor& t : {c.keys, c.values}) {
    const auto mid = reinterpret_cast<uintptr_t>(t.data_ptr()) + t.nbytes() / 2;
    CHECK(vm_flags_at(mid).find(" hg") != std::string::npos);
    CHECK(at::count_nonzero(t).item<int64_t>() == 0);
  }
}
#endif

TEST_CASE("update_kv_layer_cache with a host start writes from start to start+chunk", "[api]") {
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16, at::kFloat8_e5m2, at::kLong, at::kBool}) {
    for (int64_t start : {0, 5, 13}) {
      auto cache = filled_cache(dtype);
      auto kn = random_of({B, H, 3, D}, dtype);
      auto vn = random_of({B, H, 3, D}, dtype);
      auto [ek, ev] = reference(cache.keys, cache.values, kn, vn, {start, start});
      auto out = kvcache::update_kv_layer_cache(cache, kn, vn, start);
      REQUIRE(same_bytes(cache.keys, ek));
      REQUIRE(same_bytes(cache.values, ev));
      REQUIRE(out.keys.is_same(cache.keys));  // in place, no copy
      REQUIRE(out.length.scalar_type() == at::kInt);
      REQUIRE(out.length.item<int32_t>() == start + 3);
    }
  }
}

TEST_CASE("update_kv_layer_cache with per-row device positions", "[api]") {
  auto cache = filled_cache(at::kFloat);
  auto kn = at::randn({B, H, 2, D});
  auto vn = at::randn({B, H, 2, D});
  auto [ek, ev] = reference(cache.keys, cache.values, kn, vn, {3, 14});
  auto out = kvcache::update_kv_layer_cache(cache, kn, vn, at::tensor({3, 14}, at::kInt));
  REQUIRE(same_bytes(cache.keys, ek));
  REQUIRE(same_bytes(cache.values, ev));
  REQUIRE(out.length.sizes() == at::IntArrayRef({B}));
  REQUIRE(out.length[0].item<int32_t>() == 5);
  REQUIRE(out.length[1].item<int32_t>() == 16);
}

TEST_CASE("transposed inputs and a strided cache", "[api]") {
  auto keys = at::randn({B, T, H, D}).transpose(1, 2);
  auto values = at::randn({B, T, H, D}).transpose(1, 2);
  auto kn = at::randn({B, 4, H, D}).transpose(1, 2);
  auto vn = at::randn({B, 4, H, D}).transpose(1, 2);
  auto [ek, ev] = reference(keys, values, kn, vn, {6, 6});
  REQUIRE(kvcache::update_(keys, values, kn, vn, 6).item<int32_t>() == 10);
  REQUIRE(same_bytes(keys, ek));
  REQUIRE(same_bytes(values, ev));
}

TEST_CASE("prefill then single-token decode steps match the reference", "[api]") {
  auto cache = kvcache::init_kv_layer_cache(B, H, D, T, at::kFloat);
  auto ref_k = at::zeros({B, H, T, D});
  auto ref_v = at::zeros({B, H, T, D});
  auto kn = at::randn({B, H, 5, D}), vn = at::randn({B, H, 5, D});
  cache = kvcache::update_kv_layer_cache(cache, kn, vn, 0);
  ref_k.narrow(2, 0, 5).copy_(kn);
  ref_v.narrow(2, 0, 5).copy_(vn);
  for (int64_t pos = 5; pos < T; ++pos) {
    kn = at::randn({B, H, 1, D});
    vn = at::randn({B, H, 1, D});
    cache = kvcache::update_kv_layer_cache(cache, kn, vn, cache.length);  // device position
    ref_k.narrow(2, pos, 1).copy_(kn);
    ref_v.narrow(2, pos, 1).copy_(vn);
    REQUIRE(same_bytes(cache.keys, ref_k));
    REQUIRE(same_bytes(cache.values, ref_v));
    REQUIRE(cache.length.item<int32_t>() == pos + 1);
  }
}

TEST_CASE("errors are raised before anything is written", "[api][errors]") {
  auto cache = filled_cache(at::kFloat);
  const auto k0 = cache.keys.clone(), v0 = cache.values.clone();
  auto kn = at::randn({B, H, 3, D}), vn = at::randn({B, H, 3, D});

  REQUIRE_THROWS_AS(kvcache::update_kv_layer_cache(cache, kn, vn, 14), c10::ValueError);
  REQUIRE_THROWS_WITH(kvcache::update_kv_layer_cache(cache, kn, vn, 14),
                      KV_CONTAINS("KV cache overflow: end=17 exceeds max_len=16"));
  REQUIRE_THROWS_WITH(kvcache::update_kv_layer_cache(cache, kn, vn, -1),
                      KV_CONTAINS("start must be >= 0, got -1"));
  REQUIRE_THROWS_AS(kvcache::update_kv_layer_cache(cache, kn.to(at::kHalf), vn, 0), c10::TypeError);
  REQUIRE_THROWS_WITH(kvcache::update_kv_layer_cache(cache, kn, vn.to(at::kDouble), 0),
                      KV_CONTAINS("values_new must have the cache dtype torch.float32"));
  REQUIRE_THROWS_WITH(kvcache::update_kv_layer_cache(cache, at::randn({B, H + 1, 3, D}), vn, 0),
                      KV_CONTAINS("keys_new must have shape (batch=2, num_kv_heads=3"));
  REQUIRE_THROWS_WITH(kvcache::update_kv_layer_cache(cache, kn, at::randn({B, H, 2, D}), 0),
                      KV_CONTAINS("values_new must have the same shape as keys_new"));
  REQUIRE_THROWS_WITH(kvcache::update_kv_layer_cache(cache, at::randn({B, H, D}), vn, 0),
                      KV_CONTAINS("keys_new must be a 4-D tensor"));
  REQUIRE_THROWS_AS(kvcache::update_kv_layer_cache(cache, kn, vn, at::tensor({0, 14})), c10::ValueError);
  REQUIRE_THROWS_WITH(kvcache::update_kv_layer_cache(cache, kn, vn, at::tensor({0, 14})),
                      KV_CONTAINS("KV cache overflow: end=17 exceeds max_len=16 (start[1]=14"));
  REQUIRE_THROWS_WITH(kvcache::update_kv_layer_cache(cache, kn, vn, at::tensor({-2, 0})),
                      KV_CONTAINS("start must be >= 0"));
  REQUIRE_THROWS_AS(kvcache::update_kv_layer_cache(cache, kn, vn, at::tensor(1.0)), c10::TypeError);
  REQUIRE_THROWS_WITH(kvcache::update_kv_layer_cache(cache, kn, vn, at::zeros({3}, at::kLong)),
                      KV_CONTAINS("start must be a 0-D tensor"));
  REQUIRE_THROWS_WITH(kvcache::update_(cache.keys, cache.keys, kn, vn, 0),
                      KV_CONTAINS("keys and values must not share memory"));
  REQUIRE_THROWS_AS(kvcache::init_kv_layer_cache(-1, H, D, T, at::kFloat), c10::ValueError);

  REQUIRE(at::equal(cache.keys, k0));
  REQUIRE(at::equal(cache.values, v0));
}

TEST_CASE("init_decoder_kv_caches gives distinct caches", "[api]") {
  auto caches = kvcache::init_decoder_kv_caches(3, B, H, D, T, at::kBFloat16);
  REQUIRE(caches.size() == 3);
  caches[0].keys.fill_(1);
  for (size_t i = 1; i < caches.size(); ++i) {
    REQUIRE(caches[i].keys.count_nonzero().item<int64_t>() == 0);
    REQUIRE_FALSE(caches[i].keys.is_alias_of(caches[0].keys));
  }
  REQUIRE_THROWS_AS(kvcache::init_decoder_kv_caches(-1, B, H, D, T, at::kFloat), c10::ValueError);
}

// Calls every function of the header (a typed handle whose signature drifted
// from csrc/schema.cpp throws here), each against plain ATen.
TEST_CASE("append_, attend, rollback and select_rows_ through the C++ API", "[api]") {
  auto cache = kvcache::init_kv_layer_cache(2, 2, 8, 16, at::kFloat);
  cache.length = at::zeros({2}, at::kInt);
  auto k = at::randn({2, 2, 5, 8}), v = at::randn({2, 2, 5, 8});
  kvcache::append_kv_layer_cache(cache, k, v);
  REQUIRE(at::equal(cache.length, at::full({2}, 5, at::kInt)));
  REQUIRE(at::equal(cache.keys.narrow(2, 0, 5), k));
  auto k1 = at::randn({2, 2, 1, 8}), v1 = at::randn({2, 2, 1, 8});
  kvcache::append_(cache.keys, cache.values, cache.length, k1, v1);
  REQUIRE(at::equal(cache.values.narrow(2, 5, 1), v1));

  // attend: 4 query heads over 2 KV heads, the last 2 positions, causal.
  auto q = at::randn({2, 4, 2, 8});
  auto out = kvcache::attend(q, cache);
  auto keys = at::cat({k, k1}, 2).repeat_interleave(2, 1);  // (2, 4, 6, 8)
  auto values = at::cat({v, v1}, 2).repeat_interleave(2, 1);
  auto scores = at::matmul(q, keys.transpose(2, 3)) / std::sqrt(8.0);
  auto mask = at::ones({2, 6}, at::kBool).tril(4);  // query i sits at slot 4 + i
  auto ref = at::matmul(scores.masked_fill(mask.logical_not(), -INFINITY).softmax(-1), values);
  REQUIRE(at::allclose(out, ref, 1e-5, 1e-5));
  kvcache::AttendOptions opts;
  opts.window = 1;  // each query sees only itself
  REQUIRE(at::allclose(kvcache::attend(q, cache.keys, cache.values, cache.length, opts),
                       values.narrow(2, 4, 2), 1e-5, 1e-5));

  cache.length = kvcache::rollback(cache.length, at::tensor({1, 3}, at::kInt));
  REQUIRE(at::equal(cache.length, at::tensor({5, 3}, at::kInt)));
  REQUIRE_THROWS_WITH(kvcache::rollback(cache.length, at::tensor({6, 0}, at::kInt)),
                      KV_CONTAINS("cannot roll back more tokens than the row holds"));

  auto row0 = cache.keys.select(0, 0).narrow(1, 0, 5).clone();
  cache.length = kvcache::select_rows_(cache.keys, cache.values, cache.length, at::tensor({0, 0}));
  REQUIRE(at::equal(cache.length, at::tensor({5, 5}, at::kInt)));
  REQUIRE(at::equal(cache.keys.select(0, 1).narrow(1, 0, 5), row0));
  REQUIRE_THROWS_AS(kvcache::select_rows_(cache.keys, cache.values, cache.length, at::tensor({0, 2})),
                    c10::ValueError);

  REQUIRE(at::equal(kvcache::reset_rows(at::tensor({5, 3}, at::kInt), at::tensor({1}, at::kInt)),
                    at::tensor({5, 0}, at::kInt)));
  REQUIRE_THROWS_WITH(kvcache::reset_rows(cache.length, at::tensor({-1})),
                      KV_CONTAINS("rows must be in [0, batch=2), got -1 at index 0"));
}

TEST_CASE("rollback_kv_layer_cache and select_rows_kv_layer_cache work in place", "[api]") {
  auto cache = kvcache::init_kv_layer_cache(3, 2, 4, 8, at::kFloat);
  cache.keys.copy_(at::randn({3, 2, 8, 4}));
  cache.values.copy_(at::randn({3, 2, 8, 4}));
  cache.length = at::tensor({5, 8, 2}, at::kInt);
  const auto keys = cache.keys.clone(), values = cache.values.clone();
  const void* length_address = cache.length.data_ptr();

  auto out = kvcache::rollback_kv_layer_cache(cache, at::tensor({2, 0, 1}, at::kInt));
  REQUIRE(out.length.data_ptr() == length_address);  // the caller's tensor, written in place
  REQUIRE(at::equal(cache.length, at::tensor({3, 8, 1}, at::kInt)));
  REQUIRE(at::equal(cache.keys, keys));  // nothing else moves
  REQUIRE_THROWS_AS(kvcache::rollback_kv_layer_cache(cache, at::tensor({4, 0, 0}, at::kInt)),
                    c10::ValueError);
  REQUIRE(at::equal(cache.length, at::tensor({3, 8, 1}, at::kInt)));

  out = kvcache::select_rows_kv_layer_cache(cache, at::tensor({1, 1, 0}, at::kLong));
  REQUIRE(out.length.data_ptr() == length_address);
  REQUIRE(at::equal(cache.length, at::tensor({8, 8, 3}, at::kInt)));
  for (int64_t b = 0; b < 3; ++b) {
    const int64_t src = b < 2 ? 1 : 0;
    const int64_t n = cache.length[b].item<int64_t>();
    REQUIRE(at::equal(cache.keys[b].narrow(1, 0, n), keys[src].narrow(1, 0, n)));
    REQUIRE(at::equal(cache.values[b].narrow(1, 0, n), values[src].narrow(1, 0, n)));
  }
}

TEST_CASE("an expanded cache.length is refused before any row moves", "[api][errors]") {
  auto cache = kvcache::init_kv_layer_cache(2, 1, 4, 8, at::kFloat);
  cache.keys.copy_(at::randn({2, 1, 8, 4}));
  cache.length = at::tensor(5, at::kInt).expand({2});
  const auto keys = cache.keys.clone();
  REQUIRE_THROWS_AS(kvcache::select_rows_kv_layer_cache(cache, at::tensor({1, 0}, at::kLong)),
                    c10::ValueError);
  REQUIRE(at::equal(cache.keys, keys));
  REQUIRE_THROWS_AS(kvcache::rollback_kv_layer_cache(cache, at::tensor(1, at::kInt)), c10::ValueError);
}

TEST_CASE("append_kv_layer_cache returns the cache it advanced", "[api]") {
  auto cache = kvcache::init_kv_layer_cache(1, 1, 4, 8, at::kFloat);
  cache.length = at::tensor({0}, at::kInt);
  auto out = kvcache::append_kv_layer_cache(cache, at::randn({1, 1, 3, 4}), at::randn({1, 1, 3, 4}));
  REQUIRE(out.length.data_ptr() == cache.length.data_ptr());
  REQUIRE(cache.length.item<int>() == 3);
}

TEST_CASE("quantized caches through the C++ API: write, attend, select rows", "[api][quant]") {
  for (auto kv : {at::kChar, at::kFloat8_e4m3fn}) {
    auto cache = kvcache::init_quantized_kv_layer_cache(B, H, D, T, kv);
    REQUIRE(cache.quantized());
    REQUIRE(cache.keys.scalar_type() == kv);
    REQUIRE(cache.k_scale.sizes() == at::IntArrayRef({B, H, T}));
    REQUIRE(cache.k_scale.scalar_type() == at::kFloat);
    cache.length = at::zeros({B}, at::kInt);
    const auto kn = at::randn({B, H, 5, D});
    const auto vn = at::randn({B, H, 5, D});
    kvcache::append_kv_layer_cache(cache, kn, vn);
    REQUIRE(cache.length.equal(at::full({B}, 5, at::kInt)));
    // Scales: absmax / 127 (int8) or / 448 (fp8) of each slot, as the README defines them.
    const double qmax = kv == at::kChar ? 127.0 : 448.0;
    const auto want_scale = (kn.abs().amax(-1) / qmax).clamp_min(1.17549435e-38);
    REQUIRE(cache.k_scale.narrow(2, 0, 5).equal(want_scale));
    // Dequantized keys are within half a step of the originals: int8 steps are one scale; e4m3
    // keeps 3 mantissa bits (relative 2^-4 at most) with subnormal steps of 2^-9 scales.
    const auto deq = cache.keys.narrow(2, 0, 5).to(at::kFloat) * cache.k_scale.narrow(2, 0, 5).unsqueeze(-1);
    const auto s = want_scale.unsqueeze(-1);
    const auto bound = kv == at::kChar ? s * 0.5 : kn.abs() / 16 + s / 512;
    REQUIRE(((deq - kn).abs() <= bound * (1 + 1e-6)).all().item<bool>());
    const auto q = at::randn({B, H, 1, D});
    const auto out = kvcache::attend(q, cache);
    REQUIRE(out.sizes() == at::IntArrayRef({B, H, 1, D}));
    REQUIRE(at::isfinite(out).all().item<bool>());
    // Row 0 takes row 1: data, scales and length.
    const auto row1_scale = cache.k_scale[1].clone();
    kvcache::select_rows_kv_layer_cache(cache, at::tensor({int64_t{1}, int64_t{1}}));
    REQUIRE(cache.k_scale[0].narrow(1, 0, 5).equal(row1_scale.narrow(1, 0, 5)));
    REQUIRE(cache.keys[0].narrow(1, 0, 5).view(at::kByte).equal(cache.keys[1].narrow(1, 0, 5).view(at::kByte)));
    // A float cache is refused by the quantized write (scales given), before anything is written.
    auto plain = kvcache::init_kv_layer_cache(B, H, D, T, at::kFloat);
    auto ks = at::ones({B, H, T}), vs = at::ones({B, H, T});
    REQUIRE_THROWS_AS(kvcache::update_(plain.keys, plain.values, kn, vn, 0, ks, vs), c10::TypeError);
    REQUIRE(plain.keys.abs().sum().item<float>() == 0.f);
    // A quantized cache with float data and no scales, or one scale alone, is refused too.
    auto qc = kvcache::init_quantized_kv_layer_cache(B, H, D, T, kv);
    REQUIRE_THROWS_AS(kvcache::update_(qc.keys, qc.values, kn, vn, 0), c10::TypeError);
    REQUIRE_THROWS_AS(kvcache::update_(qc.keys, qc.values, kn, vn, 0, qc.k_scale, std::nullopt), c10::ValueError);
    REQUIRE(qc.keys.view(at::kByte).count_nonzero().item<int64_t>() == 0);
    REQUIRE(qc.k_scale.equal(at::ones({B, H, T})));
  }
}

TEST_CASE("reset_rows_kv_layer_cache empties the selected rows in place", "[api]") {
  auto cache = kvcache::init_kv_layer_cache(4, 1, 4, 8, at::kFloat);
  cache.length = at::tensor({3, 4, 5, 6}, at::kInt);
  const void* address = cache.length.data_ptr();
  kvcache::reset_rows_kv_layer_cache(cache, at::tensor({1, 0, 1, 0}).to(at::kBool));
  REQUIRE(cache.length.data_ptr() == address);
  REQUIRE(at::equal(cache.length, at::tensor({0, 4, 0, 6}, at::kInt)));
  kvcache::reset_rows_kv_layer_cache(cache, at::tensor({3}, at::kLong));
  REQUIRE(at::equal(cache.length, at::tensor({0, 4, 0, 0}, at::kInt)));
  REQUIRE_THROWS_AS(kvcache::reset_rows_kv_layer_cache(cache, at::tensor({4}, at::kLong)), c10::ValueError);
  REQUIRE_THROWS_AS(kvcache::reset_rows_kv_layer_cache(cache, at::tensor({1}).to(at::kBool)), c10::ValueError);
  REQUIRE(at::equal(cache.length, at::tensor({0, 4, 0, 0}, at::kInt)));
}

TEST_CASE("a ring through the C++ API: wraps, long chunks and rollback match the linear cache", "[api][ring]") {
  // A ring of window 4 (no sinks, max_step 2) against a linear cache read
  // with the same window: decode past three wraps, one chunk longer than the
  // ring, and a rollback of max_step tokens.
  const int64_t window = 4;
  auto ring = kvcache::init_ring_layer_cache(1, 1, D, window, at::kFloat, c10::kCPU, 0, 2);
  REQUIRE(ring.capacity() == 5);
  REQUIRE(at::equal(ring.positions, at::full({1, 5}, -1, at::kInt)));
  auto linear = kvcache::init_kv_layer_cache(1, 1, D, 64, at::kFloat);
  kvcache::AttendOptions opt;
  opt.window = window;
  auto step = [&](int64_t chunk) {
    at::Tensor k = at::randn({1, 1, chunk, D});
    at::Tensor v = at::randn({1, 1, chunk, D});
    at::Tensor q = at::randn({1, 2, chunk, D});
    kvcache::append_kv_layer_cache(linear, k, v);
    auto kv = kvcache::write_ring_layer_cache(ring, k, v);
    at::Tensor got = kvcache::attend(q, kv);
    at::Tensor want = kvcache::attend(q, linear, opt);
    REQUIRE(at::allclose(got, want, 1e-5, 1e-6));
  };
  for (int64_t i = 0; i < 16; ++i) step(1);
  step(9);  // longer than the ring
  step(2);
  kvcache::rollback_ring_layer_cache(ring, 2);
  linear.length.sub_(2);
  for (int64_t i = 0; i < 3; ++i) step(1);
  REQUIRE(ring.length.item<int64_t>() == 16 + 9 + 2 - 2 + 3);
  REQUIRE_THROWS_AS(kvcache::rollback_ring_layer_cache(ring, 3), c10::ValueError);
  at::Tensor bad_start = at::full({}, -1, at::kInt);
  at::Tensor k = at::randn({1, 1, 1, D});
  REQUIRE_THROWS_AS(kvcache::ring_update_(ring.keys, ring.values, ring.positions, k, k.clone(), bad_start),
                    c10::ValueError);
}

TEST_CASE("ring row operations through the C++ API: select and reset rows in place", "[api][ring]") {
  // Three rows of a window-4 ring (capacity 5) after 7 writes: wrapped, different contents.
  auto ring = kvcache::init_ring_layer_cache(3, 2, D, 4, at::kFloat, c10::kCPU, 0, 2);
  ring.length = at::zeros({3}, at::kInt);
  for (int64_t t = 0; t < 7; ++t) {
    at::Tensor k = at::randn({3, 2, 1, D});
    kvcache::write_ring_layer_cache(ring, k, k * 2);
  }
  ring.length.copy_(at::tensor({7, 7, 7}, at::kInt));
  const at::Tensor keys0 = ring.keys.clone(), values0 = ring.values.clone(), pos0 = ring.positions.clone();
  const at::Tensor index = at::tensor({2, 2, 0}, at::kLong);
  kvcache::select_rows_ring_layer_cache(ring, index);
  // Against plain indexing of the saved rows.
  REQUIRE(at::equal(ring.keys, keys0.index_select(0, index)));
  REQUIRE(at::equal(ring.values, values0.index_select(0, index)));
  REQUIRE(at::equal(ring.positions, pos0.index_select(0, index)));
  // An int32 index works; one out of range moves nothing.
  kvcache::select_rows_ring_layer_cache(ring, at::tensor({0, 1, 2}, at::kInt));
  const at::Tensor keys1 = ring.keys.clone(), pos1 = ring.positions.clone(), len1 = ring.length.clone();
  REQUIRE_THROWS_AS(kvcache::select_rows_ring_layer_cache(ring, at::tensor({0, 3, 1}, at::kLong)),
                    c10::ValueError);
  REQUIRE(at::equal(ring.keys, keys1));
  REQUIRE(at::equal(ring.positions, pos1));
  REQUIRE(at::equal(ring.length, len1));

  // reset: row 1 empties (length 0, positions -1); a bad mask changes nothing.
  kvcache::reset_rows_ring_layer_cache(ring, at::tensor({1}, at::kLong));
  REQUIRE(at::equal(ring.length, at::tensor({7, 0, 7}, at::kInt)));
  REQUIRE(at::equal(ring.positions[1], at::full({ring.capacity()}, -1, at::kInt)));
  REQUIRE(at::equal(ring.positions[0], pos1[0]));
  const at::Tensor pos2 = ring.positions.clone();
  REQUIRE_THROWS_AS(kvcache::reset_rows_ring_layer_cache(ring, at::ones({1}, at::kBool)), c10::ValueError);
  REQUIRE_THROWS_AS(kvcache::reset_rows_ring_layer_cache(ring, at::tensor({-1}, at::kLong)), c10::ValueError);
  REQUIRE(at::equal(ring.positions, pos2));
  REQUIRE(at::equal(ring.length, at::tensor({7, 0, 7}, at::kInt)));
  kvcache::reset_rows_ring_layer_cache(ring, at::tensor({1, 0, 1}).to(at::kBool));
  REQUIRE(at::equal(ring.length, at::zeros({3}, at::kInt)));
  REQUIRE(at::equal(ring.positions, at::full_like(ring.positions, -1)));
}

TEST_CASE("a quantized ring through the C++ API matches a quantized linear cache read with the window",
          "[api][ring][quant]") {
  // Both quantize each token the same way (one scale per row, head and slot), so the ring (window
  // 4, one sink, max_step 2) must attend over exactly the linear cache's dequantized values.
  const int64_t window = 4;
  for (auto kv : {at::kChar, at::kFloat8_e4m3fn}) {
    auto ring = kvcache::init_quantized_ring_layer_cache(1, 1, D, window, kv, c10::kCPU, 1, 2);
    REQUIRE(ring.quantized());
    REQUIRE(ring.keys.scalar_type() == kv);
    REQUIRE(ring.k_scale.sizes() == at::IntArrayRef({1, 1, ring.capacity()}));
    auto linear = kvcache::init_quantized_kv_layer_cache(1, 1, D, 64, kv);
    kvcache::AttendOptions lin;
    lin.window = window;
    auto step = [&](int64_t chunk) {
      at::Tensor k = at::randn({1, 1, chunk, D});
      at::Tensor v = at::randn({1, 1, chunk, D});
      at::Tensor q = at::randn({1, 2, chunk, D});
      kvcache::append_kv_layer_cache(linear, k, v);
      auto rkv = kvcache::write_ring_layer_cache(ring, k, v);
      at::Tensor got = kvcache::attend(q, rkv);
      // Reference: float64 attention over the linear cache's dequantized slots with the ring's
      // rule (position 0 is a sink, always visible; the rest within the window).
      const int64_t len = linear.length.item<int64_t>();
      at::Tensor deq_k = linear.keys.narrow(2, 0, len).to(at::kDouble) *
                         linear.k_scale.narrow(2, 0, len).unsqueeze(-1).to(at::kDouble);
      at::Tensor deq_v = linear.values.narrow(2, 0, len).to(at::kDouble) *
                         linear.v_scale.narrow(2, 0, len).unsqueeze(-1).to(at::kDouble);
      at::Tensor want = at::empty({1, 2, chunk, D}, at::kDouble);
      for (int64_t i = 0; i < chunk; ++i) {
        const int64_t p = len - chunk + i;
        at::Tensor mask = at::zeros({len}, at::kBool);
        for (int64_t j = 0; j <= p; ++j) mask[j] = (j < 1) || (p - j < window);
        for (int64_t h = 0; h < 2; ++h) {
          at::Tensor s = at::matmul(deq_k[0][0], q[0][h][i].to(at::kDouble)) / std::sqrt(double(D));
          s = s.masked_fill(~mask, -INFINITY);
          want[0][h][i] = at::matmul(at::softmax(s, 0), deq_v[0][0]);
        }
      }
      REQUIRE(at::allclose(got.to(at::kDouble), want, 1e-4, 1e-5));
    };
    for (int64_t i = 0; i < 12; ++i) step(1);
    step(9);  // longer than the ring (capacity 1 + 4 + 2 - 1 = 6)
    step(2);
    // Bad new data is refused before the ring changes.
    const auto before = ring.keys.clone();
    REQUIRE_THROWS_AS(kvcache::write_ring_layer_cache(ring, at::randn({1, 1, 1, D}).to(at::kDouble),
                                                      at::randn({1, 1, 1, D}).to(at::kDouble)),
                      c10::TypeError);
    REQUIRE(ring.keys.view(at::kByte).equal(before.view(at::kByte)));
  }
  REQUIRE_THROWS_AS(kvcache::init_quantized_ring_layer_cache(1, 1, D, 4, at::kFloat), c10::TypeError);
}

TEST_CASE("ring_update_ with scales through the C++ API: each kept position's quantization at its slot",
          "[api][ring][quant]") {
  // Reference: the chunk quantized by update_ with scales into a linear buffer (the formats' own
  // tests check that bit for bit), then placed by plain slicing at the slots the ring keeps.
  const int64_t cap = 7, sinks = 2, h = 2, d = 8;
  for (auto kv : {at::kChar, at::kFloat8_e4m3fn}) {
    for (int64_t chunk : {int64_t{1}, int64_t{4}, int64_t{16}}) {
      at::Tensor keys = at::zeros({2, h, cap, d}, at::TensorOptions().dtype(kv));
      at::Tensor values = at::zeros({2, h, cap, d}, at::TensorOptions().dtype(kv));
      at::Tensor ks = at::rand({2, h, cap}) + 1, vs = at::rand({2, h, cap}) + 1;
      at::Tensor pos = at::full({2, cap}, -1, at::TensorOptions().dtype(at::kInt));
      at::Tensor kn = at::randn({2, h, chunk, d}), vn = at::randn({2, h, chunk, d});
      at::Tensor start = at::tensor({int64_t{3}, int64_t{11}});
      at::Tensor qk = at::empty({2, h, chunk, d}, keys.options()), qv = at::empty_like(qk);
      at::Tensor sk = at::empty({2, h, chunk}), sv = at::empty_like(sk);
      kvcache::update_(qk, qv, kn, vn, int64_t{0}, sk, sv);
      auto wk = keys.clone(), wv = values.clone(), wks = ks.clone(), wvs = vs.clone(), wp = pos.clone();
      for (int64_t b = 0; b < 2; ++b) {
        const int64_t s = start[b].item<int64_t>(), end = s + chunk;
        for (int64_t t = 0; t < chunk; ++t) {
          const int64_t p = s + t;
          if (!(p < sinks || p >= end - (cap - sinks))) continue;
          const int64_t slot = p < sinks ? p : sinks + (p - sinks) % (cap - sinks);
          wk[b].select(1, slot).copy_(qk[b].select(1, t));
          wv[b].select(1, slot).copy_(qv[b].select(1, t));
          wks[b].select(1, slot).copy_(sk[b].select(1, t));
          wvs[b].select(1, slot).copy_(sv[b].select(1, t));
          wp[b][slot] = p;
        }
      }
      at::Tensor len = kvcache::ring_update_(keys, values, pos, kn, vn, start, sinks, ks, vs);
      REQUIRE(len.scalar_type() == at::kInt);
      REQUIRE(len.equal((start + chunk).to(at::kInt)));
      REQUIRE(same_bytes(keys, wk));
      REQUIRE(same_bytes(values, wv));
      REQUIRE(same_bytes(ks, wks));
      REQUIRE(same_bytes(vs, wvs));
      REQUIRE(same_bytes(pos, wp));
      // A bad start (or a bad scale) throws before anything is written.
      const auto before = std::vector<at::Tensor>{keys.clone(), values.clone(), ks.clone(), vs.clone(), pos.clone()};
      REQUIRE_THROWS_AS(kvcache::ring_update_(keys, values, pos, kn, vn,
                                              at::tensor({int64_t{0}, int64_t{-1}}), sinks, ks, vs),
                        c10::ValueError);
      at::Tensor bad_scale = at::ones({2, h, cap}, at::kDouble);
      REQUIRE_THROWS_AS(kvcache::ring_update_(keys, values, pos, kn, vn, start, sinks, bad_scale, vs),
                        c10::TypeError);
      REQUIRE_THROWS_AS(kvcache::ring_update_(keys, values, pos, kn, vn, start, sinks, ks, ks),
                        c10::ValueError);
      REQUIRE_THROWS_AS(kvcache::ring_update_(keys, values, pos, kn, vn, start, sinks), c10::TypeError);
      const std::vector<at::Tensor> now{keys, values, ks, vs, pos};
      for (size_t i = 0; i < now.size(); ++i) REQUIRE(same_bytes(now[i], before[i]));
    }
  }
}

namespace {

// float64 attention of sequence s's queries over its gathered slots (plain
// ATen): query i sits at position len - q_len + i and sees [0, pos].
at::Tensor paged_reference(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp,
                           const at::Tensor& table, const std::vector<int64_t>& lens,
                           const std::vector<int64_t>& cu) {
  const int64_t bs = kp.size(1), kvh = kp.size(2), dim = kp.size(3), heads = q.size(1);
  at::Tensor out = at::zeros(q.sizes(), at::kDouble);
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    const int64_t len = lens[s], q_len = cu[s + 1] - cu[s];
    if (q_len == 0) continue;
    at::Tensor pos = at::arange(len, at::kLong);
    at::Tensor slots = table[s].to(at::kLong).index_select(0, at::floor_divide(pos, bs)) * bs + pos.remainder(bs);
    at::Tensor K = kp.reshape({-1, kvh, dim}).index_select(0, slots).to(at::kDouble);  // (len, kvh, dim)
    at::Tensor V = vp.reshape({-1, kvh, dim}).index_select(0, slots).to(at::kDouble);
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t p = len - q_len + i;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t g = h / (heads / kvh);
        at::Tensor k = K.narrow(0, 0, p + 1).select(1, g), v = V.narrow(0, 0, p + 1).select(1, g);
        at::Tensor w = at::softmax(at::mv(k, q[cu[s] + i][h].to(at::kDouble)) / std::sqrt(double(dim)), 0);
        out[cu[s] + i][h].copy_(at::mv(v.t(), w));
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("paged caches through the C++ API: allocator, write, attend, fork, free", "[api][paged]") {
  constexpr int64_t kBlocks = 32, kBs = 8, kKvh = 2, kHeads = 4, kDim = 16;
  kvcache::BlockAllocator alloc(kBlocks, kBs);
  at::Tensor kp = at::zeros({kBlocks, kBs, kKvh, kDim}), vp = at::zeros({kBlocks, kBs, kKvh, kDim});
  const std::vector<int64_t> seqs{3, 7, 11}, prompt{20, 5, 37};
  for (size_t i = 0; i < seqs.size(); ++i) {
    at::Tensor slots = alloc.append(seqs[i], prompt[i]);
    REQUIRE(slots.numel() == prompt[i]);
    kvcache::paged_write_(kp, vp, at::randn({prompt[i], kKvh, kDim}), at::randn({prompt[i], kKvh, kDim}), slots);
  }
  REQUIRE(alloc.free_blocks() == kBlocks - (3 + 1 + 5));
  at::Tensor table = alloc.block_table(seqs);
  REQUIRE(table.sizes() == at::IntArrayRef({3, 5}));
  REQUIRE(table[1][1].item<int32_t>() == -1);  // -1 padded
  // A mixed batch: sequence 3 prefills all 20 tokens, 7 decodes one, 11 verifies 3.
  const std::vector<int64_t> cu{0, 20, 21, 24};
  at::Tensor q = at::randn({24, kHeads, kDim});
  at::Tensor out = kvcache::paged_attend(q, kp, vp, table, alloc.context_lens(seqs),
                                         at::tensor({0, 20, 21, 24}, at::kInt));
  REQUIRE(at::allclose(out.to(at::kDouble), paged_reference(q, kp, vp, table, prompt, cu), 1e-5, 1e-5));
  // The same through attend over a PagedKV (one attend for every layout), with a window.
  kvcache::PagedKV pkv{kp, vp, table, alloc.context_lens(seqs), at::tensor({0, 20, 21, 24}, at::kInt), {}, {}};
  REQUIRE(at::equal(kvcache::attend(q, pkv), out));
  kvcache::AttendOptions wopt;
  wopt.window = 5;
  kvcache::PagedAttendOptions popt;
  popt.window = 5;
  REQUIRE(at::equal(kvcache::attend(q, pkv, wopt),
                    kvcache::paged_attend(q, kp, vp, table, pkv.context_lens, pkv.cu_seqlens_q, popt)));
  kvcache::AttendOptions bad;
  bad.kv_start = at::zeros({3}, at::kInt);
  REQUIRE_THROWS_AS(kvcache::attend(q, pkv, bad), c10::ValueError);

  // fork: the full blocks shared, the partial last block (20 = 2 x 8 + 4) copied.
  alloc.fork(3, 4, {kp, vp});
  at::Tensor both = alloc.block_table({3, 4});
  REQUIRE(both[0][0].item<int32_t>() == both[1][0].item<int32_t>());
  REQUIRE(both[0][1].item<int32_t>() == both[1][1].item<int32_t>());
  const int64_t mine = both[1][2].item<int32_t>(), theirs = both[0][2].item<int32_t>();
  REQUIRE(mine != theirs);
  REQUIRE(at::equal(kp[mine], kp[theirs]));
  REQUIRE(at::equal(vp[mine], vp[theirs]));
  // The child diverges without touching the parent's pages.
  const at::Tensor parent_before = kp[theirs].clone();
  at::Tensor slot = alloc.append(4, 1);
  REQUIRE(slot.item<int64_t>() == mine * kBs + 4);
  kvcache::paged_write_(kp, vp, at::randn({1, kKvh, kDim}), at::randn({1, kKvh, kDim}), slot);
  REQUIRE(at::equal(kp[theirs], parent_before));
  REQUIRE(alloc.context_lens({3, 4}).equal(at::tensor({20, 21}, at::kInt)));

  // free: shared blocks return when their last owner frees them.
  const int64_t before = alloc.free_blocks();
  alloc.free(3);
  REQUIRE(alloc.free_blocks() == before + 1);  // only the parent's own partial block
  alloc.free(4);
  REQUIRE(alloc.free_blocks() == before + 4);
  REQUIRE_FALSE(alloc.contains(3));

  // Errors: clear, and nothing written or allocated.
  const at::Tensor k_before = kp.clone();
  REQUIRE_THROWS_AS(kvcache::paged_write_(kp, vp, at::randn({2, kKvh, kDim}), at::randn({2, kKvh, kDim}),
                                          at::tensor({int64_t{0}, kBlocks * kBs})),
                    c10::ValueError);
  REQUIRE_THROWS_AS(kvcache::paged_write_(kp, vp, at::randn({2, kKvh, kDim}), at::randn({2, kKvh, kDim}),
                                          at::tensor({int64_t{5}, int64_t{5}})),
                    c10::ValueError);
  REQUIRE(at::equal(kp, k_before));
  REQUIRE_THROWS_AS(alloc.append(99, kBlocks * kBs), std::runtime_error);
  REQUIRE_FALSE(alloc.contains(99));
  REQUIRE_THROWS_AS(alloc.append(7, -1), c10::ValueError);
  REQUIRE_THROWS_AS(alloc.block_table({42}), c10::ValueError);
  REQUIRE_THROWS_AS(alloc.fork(7, 11), c10::ValueError);
  REQUIRE_THROWS_AS(kvcache::BlockAllocator(0, 8), c10::ValueError);
  REQUIRE_THROWS_AS(kvcache::BlockAllocator(int64_t{1} << 16, int64_t{1} << 16), c10::ValueError);
  // A fork refused for a tensor that is not indexed by block changes nothing.
  {
    kvcache::BlockAllocator a(4, kBs);
    a.append(0, kBs + 3);  // one full block, one partial
    const int64_t free_before = a.free_blocks();
    // Not indexed by block, pages of another block size, an expand()-ed view.
    const at::Tensor page4 = at::randn({4, kBs, 1, 8}), page4_before = page4.clone();
    for (const at::Tensor& bad : {kp.narrow(0, 0, 2), at::zeros({4, kBs + 1, 1, 8}),
                                  at::zeros({1, kBs, 1, 8}).expand({4, kBs, 1, 8})}) {
      REQUIRE_THROWS_AS(a.fork(0, 1, {page4, bad}), c10::ValueError);
      REQUIRE_FALSE(a.contains(1));
      REQUIRE(a.free_blocks() == free_before);
      REQUIRE(at::equal(page4, page4_before));
    }
    REQUIRE_THROWS_AS(a.block_table({0}, 0), c10::ValueError);
    REQUIRE(a.block_table({0}, 3).size(1) == 3);
    // rollback: back into a block shared with a fork is refused; to a block boundary it frees.
    a.fork(0, 1);  // shares block 0, copies the partial block 1
    const int64_t free_forked = a.free_blocks();
    REQUIRE_THROWS_AS(a.rollback(1, 4), c10::ValueError);  // 3 tokens of shared block 0
    REQUIRE_THROWS_AS(a.rollback(1, kBs + 4), c10::ValueError);
    REQUIRE_THROWS_AS(a.rollback(1, -1), c10::ValueError);
    REQUIRE_THROWS_AS(a.rollback(9, 1), c10::ValueError);
    REQUIRE(a.free_blocks() == free_forked);
    REQUIRE(a.context_lens({1}).item<int32_t>() == kBs + 3);
    a.rollback(1, 3);  // kBs tokens: the copied block returns
    REQUIRE(a.free_blocks() == free_forked + 1);
    REQUIRE(a.block_table({1}).size(1) == 1);
    // The next token starts a block of its own (not the parent's second block).
    const int64_t slot = a.append(1, 1).item<int64_t>();
    const auto t1 = a.block_table({1});
    REQUIRE(t1.size(1) == 2);
    REQUIRE(slot == t1[0][1].item<int32_t>() * kBs);
    REQUIRE(t1[0][1].item<int32_t>() != a.block_table({0})[0][1].item<int32_t>());
    a.free(1);
    a.free(0);
    REQUIRE(a.free_blocks() == 4);  // no reference left behind by the refused fork
  }
  // context_lens beyond the table: a ValueError before anything is read.
  REQUIRE_THROWS_AS(kvcache::paged_attend(q.narrow(0, 0, 1), kp, vp, alloc.block_table({7}),
                                          at::tensor({kBs * 2}, at::kInt), at::tensor({0, 1}, at::kInt)),
                    c10::ValueError);
}

// The deprecated forwarding functions of the C++ API still build and write what the new forms write.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
TEST_CASE("the deprecated quantized writes of the C++ API forward to the new writes", "[api][quant]") {
  const int64_t h = 2, d = 8, cap = 7;
  for (auto kv : {at::kChar, at::kFloat8_e4m3fn}) {
    auto opts = at::TensorOptions().dtype(kv);
    const auto kn = at::randn({2, h, 3, d}), vn = at::randn({2, h, 3, d});
    // update_ (host and tensor start) and append_.
    for (int form = 0; form < 3; ++form) {
      CAPTURE(form);
      at::Tensor k[2], v[2], ks[2], vs[2], len[2], out[2];
      for (int i = 0; i < 2; ++i) {
        k[i] = at::zeros({2, h, cap, d}, opts);
        v[i] = at::zeros({2, h, cap, d}, opts);
        ks[i] = at::ones({2, h, cap});
        vs[i] = at::ones({2, h, cap});
        len[i] = at::tensor({int64_t{1}, int64_t{4}});
      }
      if (form == 0) {
        out[0] = kvcache::update_quantized_(k[0], v[0], ks[0], vs[0], kn, vn, int64_t{2});
        out[1] = kvcache::update_(k[1], v[1], kn, vn, int64_t{2}, ks[1], vs[1]);
      } else if (form == 1) {
        out[0] = kvcache::update_quantized_(k[0], v[0], ks[0], vs[0], kn, vn, len[0]);
        out[1] = kvcache::update_(k[1], v[1], kn, vn, len[1], ks[1], vs[1]);
      } else {
        kvcache::append_quantized_(k[0], v[0], ks[0], vs[0], len[0], kn, vn);
        kvcache::append_(k[1], v[1], len[1], kn, vn, ks[1], vs[1]);
        out[0] = len[0];
        out[1] = len[1];
      }
      REQUIRE(out[0].equal(out[1]));
      REQUIRE(same_bytes(k[0], k[1]));
      REQUIRE(same_bytes(v[0], v[1]));
      REQUIRE(same_bytes(ks[0], ks[1]));
      REQUIRE(same_bytes(vs[0], vs[1]));
      REQUIRE_FALSE(ks[1].equal(at::ones({2, h, cap})));  // something was written
    }
    // ring_update_.
    at::Tensor k[2], v[2], ks[2], vs[2], pos[2], out[2];
    for (int i = 0; i < 2; ++i) {
      k[i] = at::zeros({2, h, cap, d}, opts);
      v[i] = at::zeros({2, h, cap, d}, opts);
      ks[i] = at::ones({2, h, cap});
      vs[i] = at::ones({2, h, cap});
      pos[i] = at::full({2, cap}, -1, at::TensorOptions().dtype(at::kInt));
    }
    const auto start = at::tensor({int64_t{5}, int64_t{9}});
    out[0] = kvcache::ring_update_quantized_(k[0], v[0], ks[0], vs[0], pos[0], kn, vn, start, 1);
    out[1] = kvcache::ring_update_(k[1], v[1], pos[1], kn, vn, start, 1, ks[1], vs[1]);
    REQUIRE(out[0].equal(out[1]));
    for (auto* t : {k, v, ks, vs, pos}) REQUIRE(same_bytes(t[0], t[1]));
  }
}
#pragma GCC diagnostic pop

// ---- A user's mistakes with the ring row operations and attend over pages ----

namespace {

// A (3, 2, capacity 6) ring with sinks 1 after 9 single-token writes, rows of different
// contents; quantized when kv is kChar / kFloat8_e4m3fn.
kvcache::RingLayerCache filled_ring(std::optional<at::ScalarType> kv) {
  auto ring = kv ? kvcache::init_quantized_ring_layer_cache(3, 2, D, 4, *kv, c10::kCPU, 1, 2)
                 : kvcache::init_ring_layer_cache(3, 2, D, 4, at::kFloat, c10::kCPU, 1, 2);
  ring.length = at::zeros({3}, at::kInt);
  for (int64_t t = 0; t < 9; ++t) {
    at::Tensor k = at::randn({3, 2, 1, D});
    kvcache::write_ring_layer_cache(ring, k, k * 3);
  }
  return ring;
}

std::vector<at::Tensor> ring_buffers(const kvcache::RingLayerCache& r) {
  std::vector<at::Tensor> out{r.keys, r.values, r.positions, r.length};
  for (const auto& s : {r.k_scale, r.v_scale}) {
    if (s.defined()) out.push_back(s);
  }
  return out;
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.clone());
  return out;
}

void require_unchanged(const kvcache::RingLayerCache& r, const std::vector<at::Tensor>& before) {
  const auto now = ring_buffers(r);
  REQUIRE(now.size() == before.size());
  for (size_t i = 0; i < now.size(); ++i) REQUIRE(same_bytes(now[i], before[i]));
}

template <typename E, typename F>
void require_throws_naming(F&& f, const std::string& needle) {
  bool thrown = false;
  try {
    f();
  } catch (const E& e) {
    thrown = true;
    INFO(e.what());
    REQUIRE(std::string(e.what()).find(needle) != std::string::npos);
  }
  REQUIRE(thrown);
}

}  // namespace

TEST_CASE("select_rows_ring_layer_cache refuses a bad index before anything moves", "[api][ring][mistakes]") {
  for (auto kv : {std::optional<at::ScalarType>{}, std::optional<at::ScalarType>{at::kChar},
                  std::optional<at::ScalarType>{at::kFloat8_e4m3fn}}) {
    auto ring = filled_ring(kv);
    const auto before = clones(ring_buffers(ring));
    require_throws_naming<c10::ValueError>(
        [&] { kvcache::select_rows_ring_layer_cache(ring, at::tensor({0, 1}, at::kLong)); }, "index");
    require_throws_naming<c10::ValueError>(
        [&] { kvcache::select_rows_ring_layer_cache(ring, at::zeros({}, at::kLong)); }, "index");
    require_throws_naming<c10::ValueError>(
        [&] { kvcache::select_rows_ring_layer_cache(ring, at::zeros({3, 1}, at::kLong)); }, "index");
    require_throws_naming<c10::TypeError>(
        [&] { kvcache::select_rows_ring_layer_cache(ring, at::tensor({0.0, 1.0, 2.0})); }, "index");
    require_throws_naming<c10::TypeError>(
        [&] { kvcache::select_rows_ring_layer_cache(ring, at::tensor({0, 1, 1}).to(at::kBool)); }, "index");
    require_throws_naming<c10::ValueError>(
        [&] { kvcache::select_rows_ring_layer_cache(ring, at::tensor({0, -1, 2}, at::kLong)); }, "index");
    require_unchanged(ring, before);
  }
}

TEST_CASE("select_rows_ring_layer_cache: repeated indices, a 0-D length, and a quantized ring's scales move with the slots",
          "[api][ring][mistakes]") {
  for (auto kv : {std::optional<at::ScalarType>{}, std::optional<at::ScalarType>{at::kChar},
                  std::optional<at::ScalarType>{at::kFloat8_e4m3fn}}) {
    for (bool scalar_length : {false, true}) {
      auto ring = filled_ring(kv);
      if (scalar_length) ring.length = at::full({}, 9, at::kInt);
      const auto before = clones(ring_buffers(ring));
      const at::Tensor index = at::tensor({2, 2, 0}, at::kLong);
      kvcache::select_rows_ring_layer_cache(ring, index);
      // Against plain indexing of the saved tensors.
      REQUIRE(same_bytes(ring.keys, before[0].index_select(0, index)));
      REQUIRE(same_bytes(ring.values, before[1].index_select(0, index)));
      REQUIRE(at::equal(ring.positions, before[2].index_select(0, index)));
      if (scalar_length) {
        REQUIRE(ring.length.dim() == 0);
        REQUIRE(ring.length.item<int64_t>() == 9);
      } else {
        REQUIRE(at::equal(ring.length, before[3].index_select(0, index)));
      }
      if (kv) {
        REQUIRE(same_bytes(ring.k_scale, before[4].index_select(0, index)));
        REQUIRE(same_bytes(ring.v_scale, before[5].index_select(0, index)));
      }
    }
  }
}

TEST_CASE("reset_rows_ring_layer_cache refuses a mask or rows of the wrong shape and repeats rows",
          "[api][ring][mistakes]") {
  auto ring = filled_ring(at::kChar);
  const auto before = clones(ring_buffers(ring));
  require_throws_naming<c10::ValueError>(
      [&] { kvcache::reset_rows_ring_layer_cache(ring, at::ones({3, 1}, at::kBool)); }, "rows");
  require_throws_naming<c10::ValueError>(
      [&] { kvcache::reset_rows_ring_layer_cache(ring, at::zeros({3, 1}, at::kLong)); }, "rows");
  require_throws_naming<c10::ValueError>(
      [&] { kvcache::reset_rows_ring_layer_cache(ring, at::tensor({3}, at::kLong)); }, "rows");
  require_throws_naming<c10::TypeError>(
      [&] { kvcache::reset_rows_ring_layer_cache(ring, at::tensor({1.0})); }, "rows");
  require_unchanged(ring, before);
  // Repeated rows: row 1 emptied once, the others untouched (scales and data too).
  kvcache::reset_rows_ring_layer_cache(ring, at::tensor({1, 1}, at::kLong));
  REQUIRE(at::equal(ring.length, at::tensor({9, 0, 9}, at::kInt)));
  REQUIRE(at::equal(ring.positions[1], at::full({ring.capacity()}, -1, at::kInt)));
  REQUIRE(at::equal(ring.positions[0], before[2][0]));
  REQUIRE(at::equal(ring.positions[2], before[2][2]));
  // A 0-D length has no rows to reset.
  ring.length = at::full({}, 9, at::kInt);
  REQUIRE_THROWS_AS(kvcache::reset_rows_ring_layer_cache(ring, at::tensor({0}, at::kLong)), c10::ValueError);
}

TEST_CASE("attend over pages: kv_start, positions, sinks and scales in the options are refused; quantized pages "
          "equal paged_attend with their scales",
          "[api][paged][mistakes]") {
  constexpr int64_t kBlocks = 8, kBs = 4, kKvh = 2, kHeads = 4, kDim = 12;
  for (auto kv : {at::kChar, at::kFloat8_e4m3fn}) {
    kvcache::BlockAllocator alloc(kBlocks, kBs);
    at::Tensor kp = at::zeros({kBlocks, kBs, kKvh, kDim}, at::TensorOptions().dtype(kv));
    at::Tensor vp = at::zeros_like(kp);
    at::Tensor ksc = at::ones({kBlocks, kBs, kKvh}), vsc = at::ones({kBlocks, kBs, kKvh});
    const std::vector<int64_t> seqs{0, 1}, prompt{6, 9};
    for (size_t i = 0; i < seqs.size(); ++i) {
      at::Tensor slots = alloc.append(seqs[i], prompt[i]);
      kvcache::paged_write_(kp, vp, at::randn({prompt[i], kKvh, kDim}), at::randn({prompt[i], kKvh, kDim}), slots,
                            ksc, vsc);
    }
    at::Tensor table = alloc.block_table(seqs);
    at::Tensor cu = at::tensor({0, 6, 7}, at::kInt);
    at::Tensor q = at::randn({7, kHeads, kDim});
    kvcache::PagedKV pkv{kp, vp, table, alloc.context_lens(seqs), cu, ksc, vsc};
    kvcache::PagedAttendOptions popt;
    popt.key_scales = ksc;
    popt.value_scales = vsc;
    REQUIRE(at::equal(kvcache::attend(q, pkv), kvcache::paged_attend(q, kp, vp, table, pkv.context_lens, cu, popt)));
    // Scaled against float pages holding the dequantized values (an independent route).
    at::Tensor fk = kp.to(at::kFloat) * ksc.unsqueeze(-1), fv = vp.to(at::kFloat) * vsc.unsqueeze(-1);
    kvcache::PagedKV fkv{fk, fv, table, pkv.context_lens, cu, {}, {}};
    REQUIRE(at::allclose(kvcache::attend(q, pkv), kvcache::attend(q, fkv), 1e-4, 1e-4));

    kvcache::AttendOptions o1;
    o1.kv_start = at::zeros({2}, at::kInt);
    kvcache::AttendOptions o2;
    o2.positions = at::zeros({2, 8}, at::kInt);
    kvcache::AttendOptions o3;
    o3.sinks = 1;
    kvcache::AttendOptions o4;
    o4.k_scale = ksc;
    o4.v_scale = vsc;
    require_throws_naming<c10::ValueError>([&] { kvcache::attend(q, pkv, o1); }, "kv_start");
    require_throws_naming<c10::ValueError>([&] { kvcache::attend(q, pkv, o2); }, "positions");
    require_throws_naming<c10::ValueError>([&] { kvcache::attend(q, pkv, o3); }, "sinks");
    require_throws_naming<c10::ValueError>([&] { kvcache::attend(q, pkv, o4); }, "scales");
    // Only one of the page scales: the paged operator names it.
    kvcache::PagedKV half{kp, vp, table, pkv.context_lens, cu, ksc, {}};
    REQUIRE_THROWS(kvcache::attend(q, half));
  }
}

TEST_CASE("row selection of a quantized cache or ring with mismatched scales raises naming the scale, nothing moves",
          "[api][ring][quant][mistakes]") {
  // What kvcache.rows refuses in Python (check_scales / check_ring_tensors): scales of the wrong
  // shape, dtype, one without the other, or sharing memory. The C++ functions moved the scales
  // with a plain select_rows_ over (..., max_len, 1) views, which accepted any of these (a longer
  // scale buffer, half scales, the same buffer twice) or threw a bare c10::Error.
  const at::Tensor index = at::tensor({2, 0, 1}, at::kLong);
  auto ring_with = [&](auto&& edit) {
    auto ring = filled_ring(at::kChar);
    edit(ring);
    return ring;
  };
  const int64_t cap = filled_ring(at::kChar).capacity();
  struct Case {
    const char* name;
    std::function<void(kvcache::RingLayerCache&)> edit;
    bool type_error;
    const char* needle;
  };
  const std::vector<Case> cases{
      {"longer scales", [&](auto& r) {
         r.k_scale = at::rand({3, 2, cap + 1});
         r.v_scale = at::rand({3, 2, cap + 1});
       }, false, "k_scale"},
      {"shorter v_scale", [&](auto& r) { r.v_scale = at::rand({3, 2, cap - 1}); }, false, "v_scale"},
      {"half k_scale", [&](auto& r) { r.k_scale = r.k_scale.to(at::kHalf); }, true, "k_scale"},
      {"no v_scale", [&](auto& r) { r.v_scale = at::Tensor(); }, false, "v_scale"},
      {"shared scales", [&](auto& r) { r.v_scale = r.k_scale; }, false, "k_scale and v_scale"},
  };
  for (const auto& c : cases) {
    INFO(c.name);
    auto ring = ring_with(c.edit);
    const auto before = clones(ring_buffers(ring));
    if (c.type_error) {
      require_throws_naming<c10::TypeError>([&] { kvcache::select_rows_ring_layer_cache(ring, index); }, c.needle);
    } else {
      require_throws_naming<c10::ValueError>([&] { kvcache::select_rows_ring_layer_cache(ring, index); }, c.needle);
    }
    require_unchanged(ring, before);

    // The same scales on a linear quantized cache of the ring's shape.
    kvcache::KVLayerCache cache{ring.keys, ring.values, at::tensor({5, 6, 6}, at::kInt), ring.k_scale, ring.v_scale};
    const at::Tensor len0 = cache.length.clone();
    if (c.type_error) {
      require_throws_naming<c10::TypeError>([&] { kvcache::select_rows_kv_layer_cache(cache, index); }, c.needle);
    } else {
      require_throws_naming<c10::ValueError>([&] { kvcache::select_rows_kv_layer_cache(cache, index); }, c.needle);
    }
    require_unchanged(ring, before);
    REQUIRE(at::equal(cache.length, len0));
  }
}

TEST_CASE("a ring whose length is an expand()ed view: the writes and rollback raise naming it, nothing is written",
          "[api][ring][mistakes]") {
  // write_ring_layer_cache advances cache.length by a copy_ after the ring write; an expanded length
  // (entries sharing memory) made that copy_ throw after keys, values and positions were written.
  // kvcache.ring checks it first in Python (check_length_writable).
  for (auto kv : {std::optional<at::ScalarType>{}, std::optional<at::ScalarType>{at::kChar}}) {
    for (int64_t chunk : {1, 5}) {  // within max_step (2), and longer (the concatenated view)
      auto ring = filled_ring(kv);
      ring.length = at::full({1}, 9, at::kInt).expand({3});
      const auto before = clones(ring_buffers(ring));
      at::Tensor k = at::randn({3, 2, chunk, D});
      require_throws_naming<c10::ValueError>([&] { kvcache::write_ring_layer_cache(ring, k, k * 2); },
                                             "cache.length");
      require_unchanged(ring, before);
    }
    auto ring = filled_ring(kv);
    ring.length = at::full({1}, 9, at::kInt).expand({3});
    const auto before = clones(ring_buffers(ring));
    require_throws_naming<c10::ValueError>([&] { kvcache::rollback_ring_layer_cache(ring, 1); }, "cache.length");
    require_unchanged(ring, before);
  }
}

TEST_CASE("a chunk longer than max_step that does not fit the ring raises the write's ValueError/TypeError naming it",
          "[api][ring][mistakes]") {
  // The long-chunk path concatenated the ring with the chunk (at::cat) before the write's own
  // checks ran, so new data of the wrong head_dim / heads / batch raised at::cat's bare c10::Error
  // instead of the ValueError naming keys_new (kvcache.ring runs an empty write first in Python).
  for (auto kv : {std::optional<at::ScalarType>{}, std::optional<at::ScalarType>{at::kChar}}) {
    struct Case {
      std::vector<int64_t> shape;
      const char* needle;
    };
    for (const auto& c : {Case{{3, 2, 5, D + 1}, "keys_new"}, Case{{3, 1, 5, D}, "keys_new"},
                          Case{{2, 2, 5, D}, "keys_new"}}) {
      auto ring = filled_ring(kv);
      const auto before = clones(ring_buffers(ring));
      at::Tensor k = at::randn(c.shape);
      require_throws_naming<c10::ValueError>([&] { kvcache::write_ring_layer_cache(ring, k, k * 2); }, c.needle);
      require_unchanged(ring, before);
    }
    auto ring = filled_ring(kv);
    const auto before = clones(ring_buffers(ring));
    at::Tensor k = at::randn({3, 2, 5, D}).to(at::kDouble);
    require_throws_naming<c10::TypeError>([&] { kvcache::write_ring_layer_cache(ring, k, k * 2); }, "keys_new");
    require_unchanged(ring, before);
  }
}

TEST_CASE("attend over a ring or a quantized cache refuses options the layout sets itself", "[api][ring][mistakes]") {
  // attend(q, RingKV, options) overwrote options.window / positions / sinks / scales with the
  // ring's without a word (a window=5 read of a window-4 ring gave the window-4 answer); Python's
  // kvcache.attend refuses a window other than the ring's, and attend(q, PagedKV) refuses
  // kv_start-less options that do not apply. The same for a quantized KVLayerCache's scales.
  for (auto kvd : {std::optional<at::ScalarType>{}, std::optional<at::ScalarType>{at::kChar}}) {
    auto ring = filled_ring(kvd);
    kvcache::RingKV kv{ring.keys, ring.values, ring.positions, ring.length, ring.window, ring.sinks,
                       ring.k_scale, ring.v_scale};
    at::Tensor q = at::randn({3, 4, 1, D});
    kvcache::AttendOptions same;
    same.window = ring.window;  // the ring's own window: fine
    REQUIRE(at::equal(kvcache::attend(q, kv, same), kvcache::attend(q, kv)));
    kvcache::AttendOptions w;
    w.window = ring.window + 1;
    require_throws_naming<c10::ValueError>([&] { kvcache::attend(q, kv, w); }, "window");
    kvcache::AttendOptions p;
    p.positions = ring.positions.clone();
    require_throws_naming<c10::ValueError>([&] { kvcache::attend(q, kv, p); }, "positions");
    kvcache::AttendOptions s;
    s.sinks = ring.sinks + 1;
    require_throws_naming<c10::ValueError>([&] { kvcache::attend(q, kv, s); }, "sinks");
    kvcache::AttendOptions sc;
    sc.k_scale = at::ones({3, 2, ring.capacity()});
    sc.v_scale = at::ones({3, 2, ring.capacity()});
    require_throws_naming<c10::ValueError>([&] { kvcache::attend(q, kv, sc); }, "scale");
  }
  auto ring = filled_ring(at::kChar);
  kvcache::KVLayerCache cache{ring.keys, ring.values, at::tensor({5, 6, 6}, at::kInt), ring.k_scale, ring.v_scale};
  kvcache::AttendOptions sc;
  sc.k_scale = at::ones({3, 2, ring.capacity()});
  sc.v_scale = at::ones({3, 2, ring.capacity()});
  require_throws_naming<c10::ValueError>([&] { kvcache::attend(at::randn({3, 4, 1, D}), cache, sc); }, "scale");
}
