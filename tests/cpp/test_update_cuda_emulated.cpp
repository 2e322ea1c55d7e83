// The CUDA kernels of update_ (host start), update_.Tensor (device starts)
// and append_ (lengths advanced in place), plain and quantized, executed on
// the CPU: csrc/cuda/update_kernels.cuh under cuda_emulator.h, on the
// parameters the entries build (update_params, then each entry's start
// fields), with the starts left on the "device" so bad ones reach the
// validation kernel. Results against plain ATen slicing (plain writes, bit
// for bit) and the formats' rule (quantized), under several schedules.
#include "emulated_runtime.h"  // first: the emulator, then the kernels
#include "cuda/update_kernels.cuh"

#include <ATen/ATen.h>

#include <vector>

#include "catch.h"

namespace {

using kvcache::testing::EmulatedRuntime;
using kvcache::testing::kSchedules;
using kvcache::testing::Schedule;
using kvcache::testing::use;

struct Write {
  at::Tensor keys, values, keys_new, values_new;
  std::optional<at::Tensor> k_scale, v_scale;
};

// A cache (batch, kv_heads, max_len, D) of random old contents and a chunk;
// strided: the chunk is a (batch, chunk, kv_heads, D) buffer viewed
// head-major.
Write make_write(int64_t batch, int64_t kvh, int64_t max_len, int64_t D, int64_t chunk,
                 at::ScalarType cache, at::ScalarType src, bool strided, uint64_t seed = 0) {
  at::manual_seed(seed);
  Write w;
  const bool quant = cache == at::kChar || cache == at::kFloat8_e4m3fn;
  w.keys = quant ? at::zeros({batch, kvh, max_len, D}, cache) : at::randn({batch, kvh, max_len, D}).to(cache);
  w.values = quant ? at::zeros({batch, kvh, max_len, D}, cache) : at::randn({batch, kvh, max_len, D}).to(cache);
  if (quant) {
    w.k_scale = at::zeros({batch, kvh, max_len});
    w.v_scale = at::zeros({batch, kvh, max_len});
  }
  if (strided) {
    w.keys_new = at::randn({batch, chunk, kvh, D}).to(src).transpose(1, 2);
    w.values_new = at::randn({batch, chunk, kvh, D}).to(src).transpose(1, 2);
  } else {
    w.keys_new = at::randn({batch, kvh, chunk, D}).to(src);
    w.values_new = at::randn({batch, kvh, chunk, D}).to(src);
  }
  return w;
}

// Runs the write with the start fields set by `starts`: a host start
// (starts undefined), per-row device starts, or (append) the lengths
// themselves, advanced in place. Returns lengths_out.
at::Tensor run(Write& w, int64_t host_start, const at::Tensor& starts, bool append) {
  kvcache::detail::UpdateParams p =
      kvcache::detail::update_params(w.keys, w.values, w.keys_new, w.values_new);
  at::Tensor out;
  if (!starts.defined()) {
    out = at::empty({}, at::kInt);
    p.start = host_start;
    p.host_starts = &host_start;
  } else {
    p.starts = kvcache::detail::int_rows(starts);
    out = append ? starts : at::empty(starts.sizes(), at::kInt);
  }
  p.lengths_out = kvcache::detail::int_rows(out);
  EmulatedRuntime rt;
  if (!w.k_scale.has_value()) {
    kvcache::update_kernels::run_update(p, rt);
  } else {
    kvcache::detail::QuantUpdateParams q;
    q.base = p;
    q.base.elem = static_cast<int64_t>(w.keys_new.element_size());
    kvcache::detail::fill_quant_fields(q, w.keys, w.keys_new, *w.k_scale, *w.v_scale);
    kvcache::update_kernels::run_quant_update(q, rt);
  }
  return out;
}

// The cache after row b's chunk went to [start_b, start_b + chunk).
at::Tensor expected(const at::Tensor& old, const at::Tensor& chunk, const std::vector<int64_t>& start) {
  at::Tensor want = old.clone();
  for (int64_t b = 0; b < old.size(0); ++b) {
    want[b].slice(1, start[b], start[b] + chunk.size(2)).copy_(chunk[b]);
  }
  return want;
}

}  // namespace

TEST_CASE("emulated CUDA update_: a host start writes every row there and the new length", "[cuda-emulated]") {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (bool strided : {false, true}) {
      INFO("dtype " << dt << " strided " << strided);
      for (const Schedule& s : kSchedules) {
        use(s);
        Write w = make_write(3, 2, 20, 8, 5, dt, dt, strided);
        const at::Tensor k0 = w.keys.clone(), v0 = w.values.clone();
        const at::Tensor len = run(w, 7, at::Tensor(), false);
        CHECK(len.item<int32_t>() == 12);
        CHECK(at::equal(w.keys, expected(k0, w.keys_new, {7, 7, 7})));
        CHECK(at::equal(w.values, expected(v0, w.values_new, {7, 7, 7})));
      }
      use(kSchedules[0]);
    }
  }
}

TEST_CASE("emulated CUDA update_.Tensor and append_: per-row device starts", "[cuda-emulated]") {
  for (at::ScalarType it : {at::kInt, at::kLong}) {
    for (bool append : {false, true}) {
      INFO("starts " << it << " append " << append);
      Write w = make_write(4, 3, 16, 12, 3, at::kFloat, at::kFloat, append);
      const at::Tensor k0 = w.keys.clone(), v0 = w.values.clone();
      const at::Tensor starts = at::tensor(std::vector<int64_t>{0, 13, 6, 2}).to(it);
      const at::Tensor out = run(w, 0, starts, append);
      CHECK(at::equal(out.to(at::kLong), at::tensor(std::vector<int64_t>{3, 16, 9, 5})));
      if (append) CHECK(out.data_ptr() == starts.data_ptr());  // in place
      CHECK(at::equal(w.keys, expected(k0, w.keys_new, {0, 13, 6, 2})));
      CHECK(at::equal(w.values, expected(v0, w.values_new, {0, 13, 6, 2})));
    }
  }
}

TEST_CASE("emulated CUDA update_.Tensor: one bad device start writes nothing, lengths -1", "[cuda-emulated]") {
  for (int64_t bad : {int64_t{14}, int64_t{-1}, int64_t{1} << 40}) {
    for (bool quant : {false, true}) {
      INFO("bad start " << bad << " quantized " << quant);
      Write w = make_write(3, 2, 16, 8, 3, quant ? at::kChar : at::kFloat, at::kFloat, false);
      const at::Tensor k0 = w.keys.clone(), v0 = w.values.clone();
      const at::Tensor out = run(w, 0, at::tensor(std::vector<int64_t>{0, bad, 5}), false);
      CHECK(at::equal(out, at::full({3}, -1, at::kInt)));
      CHECK(at::equal(w.keys, k0));
      CHECK(at::equal(w.values, v0));
      if (quant) CHECK(w.k_scale->count_nonzero().item<int64_t>() == 0);
    }
  }
}

TEST_CASE("emulated CUDA quantized writes: int8 and fp8 slots with their scales", "[cuda-emulated]") {
  for (at::ScalarType cache : {at::kChar, at::kFloat8_e4m3fn}) {
    for (at::ScalarType src : {at::kFloat, at::kBFloat16}) {
      INFO("cache " << cache << " source " << src);
      Write w = make_write(2, 3, 12, 40, 4, cache, src, true);
      const at::Tensor starts = at::tensor(std::vector<int32_t>{8, 1}, at::kInt);
      const at::Tensor out = run(w, 0, starts, false);
      CHECK(at::equal(out, at::tensor(std::vector<int32_t>{12, 5}, at::kInt)));
      const double qmax = cache == at::kChar ? 127. : 448.;
      for (int which = 0; which < 2; ++which) {
        const at::Tensor pages = (which == 0 ? w.keys : w.values).view(at::kByte);
        const at::Tensor scales = which == 0 ? *w.k_scale : *w.v_scale;
        const at::Tensor src_data = (which == 0 ? w.keys_new : w.values_new).to(at::kFloat);
        for (int64_t b = 0; b < 2; ++b) {
          const int64_t s0 = starts[b].item<int64_t>();
          const at::Tensor x = src_data[b];  // (kvh, chunk, D)
          // csrc/core/quant.h's rule: scale = absmax / qmax in float32;
          // int8 rounds half away from zero, fp8 to nearest even.
          const at::Tensor want_scale = x.abs().amax(-1) / static_cast<float>(qmax);
          CHECK(at::equal(scales[b].slice(1, s0, s0 + 4), want_scale));
          const at::Tensor y = (x / want_scale.unsqueeze(-1)).clamp(-qmax, qmax);
          at::Tensor want;
          if (cache == at::kChar) {
            const at::Tensor yd = y.to(at::kDouble);
            want = (yd.sign() * at::floor(yd.abs() + 0.5)).to(at::kChar).view(at::kByte);
          } else {
            want = y.to(at::kFloat8_e4m3fn).view(at::kByte);
          }
          CHECK(at::equal(pages[b].slice(1, s0, s0 + 4), want));
        }
        // Nothing else written.
        CHECK(pages.count_nonzero().item<int64_t>() ==
              pages[0].slice(1, 8, 12).count_nonzero().item<int64_t>() +
                  pages[1].slice(1, 1, 5).count_nonzero().item<int64_t>());
      }
    }
  }
}
