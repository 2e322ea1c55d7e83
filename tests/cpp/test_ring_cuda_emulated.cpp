// The CUDA kernels of ring_update_ (plain and quantized), executed on the
// CPU: csrc/cuda/ring_kernels.cuh under cuda_emulator.h, on the parameters
// the entry builds (ring_update_params) with the starts left on the
// "device". Results against the ring's rule written out here (position p
// goes to slot p below the sinks, else sinks + (p - sinks) % (capacity -
// sinks); a write keeps the sinks and its last capacity - sinks positions),
// under several schedules.
#include "emulated_runtime.h"  // first: the emulator, then the kernels
#include "cuda/ring_kernels.cuh"

#include <ATen/ATen.h>

#include <vector>

#include "catch.h"

namespace {

using kvcache::testing::EmulatedRuntime;
using kvcache::testing::kSchedules;
using kvcache::testing::Schedule;
using kvcache::testing::use;

struct Ring {
  at::Tensor keys, values, positions, keys_new, values_new;
  std::optional<at::Tensor> k_scale, v_scale;
  int64_t sinks = 0;
};

Ring make_ring(int64_t batch, int64_t kvh, int64_t capacity, int64_t D, int64_t chunk,
               int64_t sinks, at::ScalarType cache, at::ScalarType src) {
  at::manual_seed(3);
  Ring r;
  const bool quant = cache == at::kChar || cache == at::kFloat8_e4m3fn;
  r.keys = quant ? at::zeros({batch, kvh, capacity, D}, cache) : at::randn({batch, kvh, capacity, D}).to(cache);
  r.values = quant ? at::zeros({batch, kvh, capacity, D}, cache) : at::randn({batch, kvh, capacity, D}).to(cache);
  if (quant) {
    r.k_scale = at::zeros({batch, kvh, capacity});
    r.v_scale = at::zeros({batch, kvh, capacity});
  }
  r.positions = at::full({batch, capacity}, -1, at::kInt);
  r.keys_new = at::randn({batch, kvh, chunk, D}).to(src);
  r.values_new = at::randn({batch, kvh, chunk, D}).to(src);
  r.sinks = sinks;
  return r;
}

at::Tensor run(Ring& r, const at::Tensor& start) {
  at::Tensor length = at::empty(start.sizes(), at::kInt);
  const kvcache::detail::RingUpdateParams p = kvcache::detail::ring_update_params(
      r.keys, r.values, r.positions, r.keys_new, r.values_new, start, r.sinks, {}, length);
  EmulatedRuntime rt;
  if (!r.k_scale.has_value()) {
    kvcache::ring_kernels::run_ring_update(p, rt);
  } else {
    kvcache::detail::RingQuantUpdateParams q;
    q.ring = p;
    q.ring.elem = static_cast<int64_t>(r.keys_new.element_size());
    kvcache::detail::fill_quant_fields(q, r.keys, r.keys_new, *r.k_scale, *r.v_scale);
    kvcache::ring_kernels::run_ring_update_quantized(q, rt);
  }
  return length;
}

// Where row b's chunk goes: (token, slot) of every kept position.
std::vector<std::pair<int64_t, int64_t>> kept(int64_t start, int64_t chunk, int64_t sinks,
                                              int64_t capacity) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const int64_t end = start + chunk;
  for (int64_t t = 0; t < chunk; ++t) {
    const int64_t p = start + t;
    if (p >= sinks && p < end - (capacity - sinks)) continue;
    out.emplace_back(t, p < sinks ? p : sinks + (p - sinks) % (capacity - sinks));
  }
  return out;
}

}  // namespace

TEST_CASE("emulated CUDA ring_update_: chunks wrap, keep their sinks and last positions", "[cuda-emulated]") {
  // Row starts: at 0 (fills the sinks), mid-ring, and a chunk longer than
  // the ring past its sinks (only the last capacity - sinks are kept).
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    for (int64_t chunk : {int64_t{5}, int64_t{23}}) {
      INFO("dtype " << dt << " chunk " << chunk);
      for (const Schedule& s : kSchedules) {
        use(s);
        Ring r = make_ring(3, 2, 12, 8, chunk, 2, dt, dt);
        const at::Tensor k0 = r.keys.clone(), v0 = r.values.clone();
        const std::vector<int64_t> starts{0, 9, 31};
        const at::Tensor len = run(r, at::tensor(starts).to(at::kInt));
        at::Tensor wk = k0.clone(), wv = v0.clone(), wp = at::full({3, 12}, -1, at::kInt);
        for (int64_t b = 0; b < 3; ++b) {
          CHECK(len[b].item<int64_t>() == starts[b] + chunk);
          for (const auto& [t, slot] : kept(starts[b], chunk, 2, 12)) {
            wk[b].select(1, slot).copy_(r.keys_new[b].select(1, t));
            wv[b].select(1, slot).copy_(r.values_new[b].select(1, t));
            wp[b][slot] = starts[b] + t;
          }
        }
        CHECK(at::equal(r.keys, wk));
        CHECK(at::equal(r.values, wv));
        CHECK(at::equal(r.positions, wp));
      }
      use(kSchedules[0]);
    }
  }
}

TEST_CASE("emulated CUDA ring_update_: a bad start writes nothing, lengths -1", "[cuda-emulated]") {
  for (bool quant : {false, true}) {
    INFO("quantized " << quant);
    Ring r = make_ring(2, 2, 8, 8, 3, 1, quant ? at::kFloat8_e4m3fn : at::kFloat, at::kFloat);
    const at::Tensor k0 = r.keys.clone();
    const at::Tensor len = run(r, at::tensor(std::vector<int64_t>{4, -2}));
    CHECK(at::equal(len, at::full({2}, -1, at::kInt)));
    CHECK(at::equal(r.keys.view(at::kByte), k0.view(at::kByte)));
    CHECK(at::equal(r.positions, at::full({2, 8}, -1, at::kInt)));
  }
}

TEST_CASE("emulated CUDA ring_update_ with scales: int8 slots quantized where they land", "[cuda-emulated]") {
  Ring r = make_ring(2, 2, 10, 40, 14, 2, at::kChar, at::kHalf);
  const std::vector<int64_t> starts{0, 5};
  run(r, at::tensor(starts));
  for (int64_t b = 0; b < 2; ++b) {
    for (const auto& [t, slot] : kept(starts[b], 14, 2, 10)) {
      const at::Tensor x = r.keys_new[b].select(1, t).to(at::kFloat);  // (kvh, D)
      const at::Tensor scale = x.abs().amax(-1) / 127.f;
      CHECK(at::equal(r.k_scale.value()[b].select(1, slot), scale));
      const at::Tensor y = (x / scale.unsqueeze(-1)).clamp(-127, 127).to(at::kDouble);
      CHECK(at::equal(r.keys[b].select(1, slot), (y.sign() * at::floor(y.abs() + 0.5)).to(at::kChar)));
      CHECK(r.positions[b][slot].item<int64_t>() == starts[b] + t);
    }
  }
}
