// The CUDA kernels of attend (linear caches and rings), executed on the CPU:
// csrc/cuda/attend_kernels.cuh compiled as C++ under cuda_emulator.h, on
// the parameters the library's entry builds (attend_params) with lengths
// and kv_start left on the "device" (check_attend(values_known = false)),
// so bad rows reach the kernels. Results against a float64 reference in
// plain ATen over each query's visible slots, under several schedules that
// must agree bit for bit (see test_paged_cuda_emulated.cpp for what the
// emulator shows and what it cannot).
#include "emulated_runtime.h"  // first: the emulator, then the kernels
#include "cuda/attend_kernels.cuh"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "catch.h"

namespace {

using kvcache::attn_cuda::DeviceLimits;
using kvcache::testing::EmulatedRuntime;
using kvcache::testing::kBigGpu;
using kvcache::testing::kSmallGpu;

// A cache (batch, num_kv_heads, max_len, head_dim) and the queries (batch,
// num_heads, seq, head_dim) of one attend call.
struct Call {
  at::Tensor q, keys, values, lengths;
  std::optional<at::Tensor> kv_start, positions, k_scale, v_scale, sink_logits;
  double scale = 0.;
  int64_t window = 0;
  double softcap = 0.;
  int64_t sinks = 0;
};

Call make_call(int64_t batch, int64_t heads, int64_t kv_heads, int64_t seq, int64_t max_len,
               int64_t D, std::vector<int32_t> lengths, at::ScalarType dtype,
               at::ScalarType kv_dtype, uint64_t seed = 0) {
  at::manual_seed(seed);
  Call c;
  c.q = at::randn({batch, heads, seq, D}).to(dtype);
  const std::vector<int64_t> shape{batch, kv_heads, max_len, D};
  if (kv_dtype == at::kChar) {
    c.keys = at::randint(-127, 128, shape, at::kChar);
    c.values = at::randint(-127, 128, shape, at::kChar);
  } else if (kv_dtype == at::kFloat8_e4m3fn) {
    c.keys = (at::randn(shape) * 40).to(kv_dtype);
    c.values = (at::randn(shape) * 40).to(kv_dtype);
  } else {
    c.keys = at::randn(shape).to(kv_dtype);
    c.values = at::randn(shape).to(kv_dtype);
  }
  if (kv_dtype == at::kChar || kv_dtype == at::kFloat8_e4m3fn) {
    c.k_scale = at::rand({batch, kv_heads, max_len}) * 0.02 + 0.001;
    c.v_scale = at::rand({batch, kv_heads, max_len}) * 0.02 + 0.001;
  }
  c.lengths = at::tensor(lengths, at::kInt);
  c.scale = 1.0 / std::sqrt(static_cast<double>(D));
  return c;
}

// Whether the slot holding position `key` is visible to the query at
// position p (the rule csrc/ops/attend.h states: [first, p], within the
// window, sinks always).
bool visible(int64_t key, int64_t p, int64_t first, int64_t window, int64_t sinks) {
  return key >= first && key <= p && (window <= 0 || key < sinks || p - key < window);
}

// float64 attention over each query's visible slots; a query that sees none
// gets zeros.
at::Tensor reference(const Call& c) {
  const int64_t B = c.q.size(0), H = c.q.size(1), S = c.q.size(2), D = c.q.size(3);
  const int64_t kvh = c.keys.size(1), L = c.keys.size(2), group = H / kvh;
  at::Tensor K = c.keys.to(at::kDouble), V = c.values.to(at::kDouble);
  if (c.k_scale.has_value()) {
    K = K * c.k_scale->to(at::kDouble).unsqueeze(-1);
    V = V * c.v_scale->to(at::kDouble).unsqueeze(-1);
  }
  at::Tensor out = at::zeros({B, H, S, D}, at::kDouble);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = c.lengths[b].item<int64_t>();
    const int64_t first = c.kv_start.has_value() ? (*c.kv_start)[b].item<int64_t>() : 0;
    for (int64_t i = 0; i < S; ++i) {
      const int64_t p = len - S + i;
      std::vector<int64_t> seen;
      for (int64_t j = 0; j < L; ++j) {
        const int64_t key = c.positions.has_value() ? (*c.positions)[b][j].item<int64_t>() : j;
        if (visible(key, p, first, c.window, c.sinks)) seen.push_back(j);
      }
      if (seen.empty()) continue;
      const at::Tensor idx = at::tensor(seen, at::kLong);
      for (int64_t h = 0; h < H; ++h) {
        const at::Tensor k = K[b][h / group].index_select(0, idx);  // (n, D)
        const at::Tensor v = V[b][h / group].index_select(0, idx);
        at::Tensor sc = at::matmul(k, c.q[b][h][i].to(at::kDouble)) * c.scale;  // (n,)
        if (c.softcap > 0) sc = at::tanh(sc / c.softcap) * c.softcap;
        if (c.sink_logits.has_value()) {
          sc = at::cat({sc, (*c.sink_logits)[h].to(at::kDouble).reshape({1})});
        }
        at::Tensor w = at::softmax(sc, 0).slice(0, 0, static_cast<int64_t>(seen.size()));
        out[b][h][i].copy_(at::matmul(w, v));
      }
    }
  }
  return out;
}

// attend's CUDA code on the emulator: the entry's checks without reading
// values, its output layout ((batch, seq, heads, head_dim) memory), its
// parameters.
at::Tensor emulated(const Call& c, EmulatedRuntime& rt) {
  const auto rows = kvcache::detail::check_attend(
      c.q, c.keys, c.values, c.lengths, c.kv_start, c.scale, c.window, c.softcap, false,
      c.positions, c.sinks, c.k_scale, c.v_scale, c.sink_logits);
  at::Tensor out =
      at::empty({c.q.size(0), c.q.size(2), c.q.size(1), c.q.size(3)}, c.q.options()).transpose(1, 2);
  const kvcache::detail::AttendParams p = kvcache::detail::attend_params(
      c.q, out, c.keys, c.values, c.lengths, c.kv_start, c.scale, c.window, c.softcap,
      c.positions, c.sinks, c.k_scale, c.v_scale, c.sink_logits, rows);
  kvcache::attend_kernels::run_attend(p, rt);
  return out;
}

void check(const Call& c, DeviceLimits device, int min_launches = 1) {
  kvcache::testing::check_schedules([&](EmulatedRuntime& rt) { return emulated(c, rt); },
                                    reference(c), device, min_launches);
}

}  // namespace

TEST_CASE("emulated CUDA attend: decode over linear caches, split and merged", "[cuda-emulated]") {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    INFO("dtype " << dt);
    const Call c = make_call(3, 8, 2, 1, 200, 64, {200, 1, 77}, dt, dt);
    check(c, kBigGpu, 2);   // few blocks: the slots split, attend_combine_kernel merges
    check(c, kSmallGpu, 1);  // one split
  }
}

TEST_CASE("emulated CUDA attend: chunks and prefill (several row tiles), kv_start, window, softcap, sink logits", "[cuda-emulated]") {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    INFO("dtype " << dt);
    Call c = make_call(2, 4, 1, 5, 96, 32, {96, 40}, dt, dt);
    check(c, kBigGpu);
    c.kv_start = at::tensor(std::vector<int32_t>{10, 0}, at::kInt);
    c.window = 13;
    c.softcap = 4.0;
    c.sink_logits = at::randn({4});
    check(c, kBigGpu);
    check(c, kSmallGpu);
    // 33 queries x group 4 = 132 rows: 16-row tiles, the last one partial.
    check(make_call(1, 4, 1, 33, 48, 16, {40}, dt, dt, 1), kSmallGpu);
  }
}

TEST_CASE("emulated CUDA attend: head_dim 128 and 256 under a small shared-memory limit, 16 query heads a KV head", "[cuda-emulated]") {
  const DeviceLimits small{48 * 1024, 4};
  for (int64_t D : {int64_t{128}, int64_t{256}}) {
    INFO("head_dim " << D);
    check(make_call(2, 4, 2, 1, 90, D, {90, 33}, at::kHalf, at::kHalf), small);
  }
  // 3 queries x 16 heads: row tiles cross query positions.
  check(make_call(1, 16, 1, 3, 40, 32, {40}, at::kFloat, at::kFloat), kSmallGpu);
}

TEST_CASE("emulated CUDA attend: strided caches and odd head_dim take element loads", "[cuda-emulated]") {
  // Keys and values viewed out of a wider buffer: rows 20 floats apart, not
  // a multiple of 16 bytes.
  Call c = make_call(2, 2, 2, 2, 24, 16, {24, 9}, at::kFloat, at::kFloat);
  c.keys = at::randn({2, 2, 24, 20}).slice(3, 2, 18);
  c.values = at::randn({2, 2, 24, 20}).slice(3, 1, 17);
  check(c, kBigGpu);
  check(make_call(2, 3, 1, 1, 30, 6, {30, 11}, at::kBFloat16, at::kBFloat16), kBigGpu);
}

TEST_CASE("emulated CUDA attend: int8 and fp8 caches read with their scales", "[cuda-emulated]") {
  for (at::ScalarType kv : {at::kChar, at::kFloat8_e4m3fn}) {
    for (at::ScalarType dt : {at::kFloat, at::kHalf}) {
      INFO("cache " << kv << " dtype " << dt);
      check(make_call(2, 4, 2, 2, 80, 32, {80, 17}, dt, kv), kBigGpu);
    }
  }
}

TEST_CASE("emulated CUDA attend: a ring with sinks, read by slot position", "[cuda-emulated]") {
  // 40 slots: positions 0-3 (sinks) in slots 0-3, the latest 36 positions
  // (64-99) wrapped over slots 4-39; the 3 queries (97-99) see their 20-slot
  // window and the sinks, all present.
  Call c = make_call(1, 4, 2, 3, 40, 32, {100}, at::kFloat, at::kFloat);
  std::vector<int32_t> pos(40);
  for (int32_t s = 0; s < 4; ++s) pos[s] = s;
  for (int32_t p = 64; p < 100; ++p) pos[4 + (p - 4) % 36] = p;
  c.positions = at::tensor(pos, at::kInt).reshape({1, 40});
  c.sinks = 4;
  c.window = 20;
  check(c, kBigGpu);
  check(c, kSmallGpu);
}

TEST_CASE("emulated CUDA attend: a bad row gives NaN, the others are right", "[cuda-emulated]") {
  for (const DeviceLimits& dev : {kBigGpu, kSmallGpu}) {
    // Row 1: a length beyond max_len, below seq, or a kv_start past its length.
    for (int bad = 0; bad < 3; ++bad) {
      INFO("case " << bad);
      Call c = make_call(3, 4, 2, 2, 64, 16, {64, 30, 9}, at::kFloat, at::kFloat);
      const at::Tensor want = reference(c);
      if (bad == 0) c.lengths[1] = 65;
      if (bad == 1) c.lengths[1] = 1;
      if (bad == 2) c.kv_start = at::tensor(std::vector<int32_t>{0, 31, 0}, at::kInt);
      EmulatedRuntime rt;
      rt.device = dev;
      const at::Tensor got = emulated(c, rt).to(at::kDouble);
      CHECK(got[1].isnan().all().item<bool>());
      CHECK(at::allclose(got[0], want[0], 1e-4, 1e-5));
      CHECK(at::allclose(got[2], want[2], 1e-4, 1e-5));
    }
  }
}
