// The CUDA kernels of paged_write_ and paged_attend, executed on the CPU.
//
// No GPU has run these kernels yet, so this file runs the real ones: it
// compiles csrc/cuda/paged_kernels.cuh (the kernels and the host code that
// plans and launches them, as paged.cu runs them) as plain C++ under
// cuda_emulator.h, which executes every block's threads as fibers with real
// __syncthreads barriers and warp shuffles. The parameters come from the
// library's own paged_write_params / paged_attend_params with the metadata
// left on the "device" (check_paged_*(values_known = false)), as the CUDA
// entry builds them, so bad metadata reaches the kernels. Each result is
// checked against an independent float64 reference in plain ATen over each
// sequence's gathered slots (attend) or plain indexing (write), under
// several schedules (thread and block orders), which must agree bit for bit.
//
// What this cannot show: speed, memory coalescing, register or shared-memory
// limits of a real GPU, or races between blocks (blocks run one at a time).
// scripts/gpu_check.sh runs the same kernels on a GPU when one is lent.
#include "emulated_runtime.h"  // first: the emulator, then the kernels
#include "cuda/paged_kernels.cuh"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "catch.h"

namespace {

using kvcache::attn_cuda::DeviceLimits;
using kvcache::detail::KvFormat;
using kvcache::testing::EmulatedRuntime;
using kvcache::testing::kBigGpu;
using kvcache::testing::kSchedules;
using kvcache::testing::Schedule;
using kvcache::testing::kSmallGpu;
using kvcache::testing::use;

// ---------------------------------------------------------------- attend

struct Batch {
  at::Tensor q;            // (total_q, num_heads, head_dim)
  at::Tensor key_pages;    // (num_blocks, block_size, num_kv_heads, head_dim)
  at::Tensor value_pages;
  at::Tensor block_table;  // (num_seqs, max_blocks) int32, -1 padded
  at::Tensor context_lens; // (num_seqs,) int32
  at::Tensor cu_seqlens_q; // (num_seqs + 1,) int32
  std::optional<at::Tensor> key_scales, value_scales, sink_logits;
  double scale = 0.;
  int64_t window = 0;
  double softcap = 0.;
};

// Sequences with these context lengths and query counts, their pages
// shuffled over a pool of spare ones, tables padded with -1.
Batch make_batch(const std::vector<int64_t>& lens, const std::vector<int64_t>& q_lens,
                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 at::ScalarType dtype, KvFormat format, int64_t pad_rows = 0, uint64_t seed = 0) {
  at::manual_seed(seed);
  const int64_t n = static_cast<int64_t>(lens.size());
  int64_t max_blocks = 1, used = 0, total_q = pad_rows;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t b = (lens[s] + block_size - 1) / block_size;
    max_blocks = std::max(max_blocks, b + 1);  // one -1 entry past the context at least
    used += b;
    total_q += q_lens[s];
  }
  const int64_t num_blocks = used + 3;
  const at::Tensor perm = at::randperm(num_blocks, at::kInt);
  Batch b;
  b.block_table = at::full({n, max_blocks}, -1, at::kInt);
  int64_t next = 0;
  std::vector<int32_t> cu(1, 0);
  for (int64_t s = 0; s < n; ++s) {
    const int64_t blocks = (lens[s] + block_size - 1) / block_size;
    for (int64_t j = 0; j < blocks; ++j) b.block_table.index_put_({s, j}, perm[next++]);
    cu.push_back(cu.back() + static_cast<int32_t>(q_lens[s]));
  }
  b.context_lens = at::tensor(std::vector<int32_t>(lens.begin(), lens.end()), at::kInt);
  b.cu_seqlens_q = at::tensor(cu, at::kInt);
  b.q = at::randn({total_q, num_heads, head_dim}).to(dtype);
  const std::vector<int64_t> shape{num_blocks, block_size, num_kv_heads, head_dim};
  if (format == KvFormat::kPlain) {
    b.key_pages = at::randn(shape).to(dtype);
    b.value_pages = at::randn(shape).to(dtype);
  } else {
    const at::ScalarType st = format == KvFormat::kInt8 ? at::kChar : at::kFloat8_e4m3fn;
    if (format == KvFormat::kInt8) {
      b.key_pages = at::randint(-127, 128, shape, at::kChar);
      b.value_pages = at::randint(-127, 128, shape, at::kChar);
    } else {
      b.key_pages = (at::randn(shape) * 40).to(st);
      b.value_pages = (at::randn(shape) * 40).to(st);
    }
    b.key_scales = at::rand({num_blocks, block_size, num_kv_heads}) * 0.02 + 0.001;
    b.value_scales = at::rand({num_blocks, block_size, num_kv_heads}) * 0.02 + 0.001;
  }
  b.scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  return b;
}

// float64 attention of each sequence's queries over its gathered slots; rows
// past cu_seqlens_q[num_seqs] are 0.
at::Tensor reference(const Batch& b) {
  const int64_t n = b.block_table.size(0);
  const int64_t bs = b.key_pages.size(1), kvh = b.key_pages.size(2), D = b.key_pages.size(3);
  const int64_t H = b.q.size(1), group = H / kvh;
  auto flat = [&](const at::Tensor& pages, const std::optional<at::Tensor>& scales) {
    at::Tensor x = pages.to(at::kDouble);
    if (scales.has_value()) x = x * scales->to(at::kDouble).unsqueeze(-1);
    return x.reshape({-1, kvh, D});
  };
  const at::Tensor K = flat(b.key_pages, b.key_scales), V = flat(b.value_pages, b.value_scales);
  at::Tensor out = at::zeros({b.q.size(0), H, D}, at::kDouble);
  for (int64_t s = 0; s < n; ++s) {
    const int64_t len = b.context_lens[s].item<int64_t>();
    const int64_t q0 = b.cu_seqlens_q[s].item<int64_t>(), q1 = b.cu_seqlens_q[s + 1].item<int64_t>();
    if (q1 == q0) continue;
    std::vector<int64_t> idx;
    for (int64_t j = 0; j < len; ++j) {
      idx.push_back(b.block_table[s][j / bs].item<int64_t>() * bs + j % bs);
    }
    const at::Tensor where = at::tensor(idx, at::kLong);
    const at::Tensor k = K.index_select(0, where).repeat_interleave(group, 1);  // (len, H, D)
    const at::Tensor v = V.index_select(0, where).repeat_interleave(group, 1);
    const at::Tensor q = b.q.slice(0, q0, q1).to(at::kDouble);                   // (q_len, H, D)
    at::Tensor sc = at::einsum("qhd,khd->hqk", {q, k}) * b.scale;
    if (b.softcap > 0) sc = at::tanh(sc / b.softcap) * b.softcap;
    const at::Tensor pos = at::arange(len - (q1 - q0), len, at::kLong).unsqueeze(1);
    const at::Tensor key_pos = at::arange(len, at::kLong).unsqueeze(0);
    at::Tensor seen = key_pos <= pos;
    if (b.window > 0) seen = seen & (pos - key_pos < b.window);
    sc = sc.masked_fill(~seen.unsqueeze(0), -std::numeric_limits<double>::infinity());
    if (b.sink_logits.has_value()) {
      const at::Tensor sink = b.sink_logits->to(at::kDouble).view({H, 1, 1}).expand({H, q1 - q0, 1});
      sc = at::cat({sc, sink}, 2);
    }
    at::Tensor p = at::softmax(sc, 2);
    if (b.sink_logits.has_value()) p = p.slice(2, 0, len);
    out.slice(0, q0, q1).copy_(at::einsum("hqk,khd->qhd", {p, v}));
  }
  return out;
}

// paged_attend's CUDA code on the emulator: the entry's checks without
// reading values, its zeros, its parameters.
at::Tensor emulated_attend(const Batch& b, EmulatedRuntime& rt) {
  const auto rows = kvcache::detail::check_paged_attend(
      b.q, b.key_pages, b.value_pages, b.block_table, b.context_lens, b.cu_seqlens_q, b.scale,
      b.window, b.softcap, b.key_scales, b.value_scales, b.sink_logits, false);
  at::Tensor out = at::zeros(b.q.sizes(), b.q.options());
  const kvcache::detail::AttendParams p = kvcache::detail::paged_attend_params(
      b.q, out, b.key_pages, b.value_pages, b.block_table, b.context_lens, b.cu_seqlens_q,
      b.scale, b.window, b.softcap, b.key_scales, b.value_scales, b.sink_logits, rows);
  if (out.numel() > 0) kvcache::paged_kernels::run_paged_attend(p, rt);
  return out;
}

// Runs the batch under every schedule (check_schedules).
void check_attend(const Batch& b, DeviceLimits device, int min_launches = 1) {
  kvcache::testing::check_schedules([&](EmulatedRuntime& rt) { return emulated_attend(b, rt); },
                                    reference(b), device, min_launches);
}

}  // namespace

TEST_CASE("emulated CUDA paged_attend: decode batches, split over slots and merged", "[cuda-emulated]") {
  // Few (sequence, KV head) blocks for 132 SMs: the slots are split (64 at
  // least per split) and paged_combine_kernel merges them (2 launches).
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    INFO("dtype " << dt);
    const Batch b = make_batch({300, 17, 1, 160}, {1, 1, 1, 1}, 4, 2, 64, 16, dt, KvFormat::kPlain);
    check_attend(b, kBigGpu, 2);
  }
}

TEST_CASE("emulated CUDA paged_attend: one split per block, odd head_dim (scalar loads)", "[cuda-emulated]") {
  // 2 SMs: no split. head_dim 6 is not a multiple of 16 bytes: element loads.
  const Batch b = make_batch({40, 9, 33}, {1, 1, 1}, 6, 3, 6, 4, at::kFloat, KvFormat::kPlain);
  check_attend(b, kSmallGpu, 1);
}

TEST_CASE("emulated CUDA paged_attend: prefill and mixed batches (4 and 16 rows a block, slices)", "[cuda-emulated]") {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    INFO("dtype " << dt);
    // Mixed: a prefill chunk among decodes.
    check_attend(make_batch({70, 130, 5, 96}, {1, 37, 1, 3}, 4, 2, 32, 16, dt, KvFormat::kPlain),
                 kBigGpu);
    // Prefill only, GQA 8/2: 16-row blocks over several row tiles.
    check_attend(make_batch({48, 19}, {48, 19}, 8, 2, 16, 8, dt, KvFormat::kPlain), kSmallGpu);
  }
}

TEST_CASE("emulated CUDA paged_attend: head_dim 128 and 256 under a small shared-memory limit", "[cuda-emulated]") {
  // 48 KiB and 4 SMs: narrower tiles (N = 8 for head_dim 256 with 16-row
  // blocks), still split for the decodes.
  const DeviceLimits small{48 * 1024, 4};
  for (int64_t D : {int64_t{128}, int64_t{256}}) {
    INFO("head_dim " << D);
    check_attend(make_batch({70, 9}, {1, 6}, 8, 2, D, 16, at::kBFloat16, KvFormat::kPlain), small);
  }
}

TEST_CASE("emulated CUDA paged_attend: pages of 1 and 3 slots, shared pages, empty sequences", "[cuda-emulated]") {
  for (int64_t bs : {int64_t{1}, int64_t{3}}) {
    INFO("block_size " << bs);
    // Sequences 1 and 3 are empty (no query; sequence 3 no context either).
    Batch b = make_batch({40, 17, 23, 0}, {1, 0, 5, 0}, 4, 2, 16, bs, at::kFloat, KvFormat::kPlain);
    // Sequence 2 starts with sequence 0's first pages (a shared prefix).
    b.block_table = b.block_table.clone();
    b.block_table[2].slice(0, 0, 4).copy_(b.block_table[0].slice(0, 0, 4));
    check_attend(b, kBigGpu);
    check_attend(b, kSmallGpu);
  }
}

TEST_CASE("emulated CUDA paged_attend: window, softcap and sink logits", "[cuda-emulated]") {
  Batch b = make_batch({200, 45, 3}, {1, 5, 3}, 4, 1, 32, 16, at::kFloat, KvFormat::kPlain);
  b.window = 24;
  b.softcap = 5.0;
  b.sink_logits = at::randn({4});
  check_attend(b, kBigGpu);
  check_attend(b, kSmallGpu);
}

TEST_CASE("emulated CUDA paged_attend: int8 and fp8 pages read with their scales", "[cuda-emulated]") {
  for (KvFormat f : {KvFormat::kInt8, KvFormat::kFp8}) {
    for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
      INFO("format " << static_cast<int>(f) << " dtype " << dt);
      check_attend(make_batch({150, 20}, {1, 4}, 4, 2, 32, 16, dt, f), kBigGpu);
    }
  }
}

TEST_CASE("emulated CUDA paged_attend: padded batches and a batch of no sequence", "[cuda-emulated]") {
  // Three rows after cu_seqlens_q[-1]: no sequence's, returned as 0 (with and
  // without splits).
  const Batch b = make_batch({100, 7}, {1, 2}, 4, 2, 32, 16, at::kFloat, KvFormat::kPlain, 3);
  check_attend(b, kBigGpu);
  check_attend(b, kSmallGpu);

  Batch none = make_batch({5}, {1}, 2, 1, 8, 4, at::kFloat, KvFormat::kPlain);
  none.block_table = none.block_table.slice(0, 0, 0);
  none.context_lens = none.context_lens.slice(0, 0, 0);
  none.cu_seqlens_q = at::zeros({1}, at::kInt);
  EmulatedRuntime rt;
  CHECK(at::equal(emulated_attend(none, rt), at::zeros_like(none.q)));  // cu_seqlens_q = [0]
  none.cu_seqlens_q.fill_(1);                                           // bad: NaN
  CHECK(emulated_attend(none, rt).isnan().all().item<bool>());
}

TEST_CASE("emulated CUDA paged_attend: bad metadata gives NaN, never a read out of bounds", "[cuda-emulated]") {
  for (const DeviceLimits& dev : {kBigGpu, kSmallGpu}) {
    const Batch good = make_batch({90, 30, 12}, {1, 2, 1}, 4, 2, 16, 16, at::kFloat, KvFormat::kPlain);
    const at::Tensor want = reference(good);
    {
      // cu_seqlens_q not starting at 0, or decreasing: every row NaN.
      for (const std::vector<int32_t>& cu : {std::vector<int32_t>{1, 1, 3, 4},
                                            std::vector<int32_t>{0, 3, 1, 4}}) {
        Batch b = good;
        b.cu_seqlens_q = at::tensor(cu, at::kInt);
        EmulatedRuntime rt;
        rt.device = dev;
        CHECK(emulated_attend(b, rt).isnan().all().item<bool>());
      }
    }
    {
      // A context length below the sequence's query count, or beyond its
      // table: that sequence's rows NaN, the others right.
      for (int32_t bad_len : {1, 1 << 20}) {
        Batch b = good;
        b.context_lens = good.context_lens.clone();
        b.context_lens[1] = bad_len;
        EmulatedRuntime rt;
        rt.device = dev;
        const at::Tensor got = emulated_attend(b, rt).to(at::kDouble);
        CHECK(got.slice(0, 1, 3).isnan().all().item<bool>());
        CHECK(at::allclose(got.slice(0, 0, 1), want.slice(0, 0, 1), 1e-4, 1e-5));
        CHECK(at::allclose(got.slice(0, 3, 4), want.slice(0, 3, 4), 1e-4, 1e-5));
      }
    }
    {
      // A table entry out of range (and a -1) under sequence 0's visible
      // slots: its query NaN; with a window that hides that page, right.
      Batch b = good;
      b.block_table = good.block_table.clone();
      b.block_table[0][1] = 1 << 30;
      b.block_table[0][2] = -1;
      EmulatedRuntime rt;
      rt.device = dev;
      const at::Tensor got = emulated_attend(b, rt).to(at::kDouble);
      CHECK(got.slice(0, 0, 1).isnan().all().item<bool>());
      CHECK(at::allclose(got.slice(0, 1, 4), want.slice(0, 1, 4), 1e-4, 1e-5));
      b.window = 16;  // position 89 sees 74..89: pages 4 and 5 only
      Batch w = good;
      w.window = 16;
      EmulatedRuntime rt2;
      rt2.device = dev;
      CHECK(at::allclose(emulated_attend(b, rt2).to(at::kDouble), reference(w), 1e-4, 1e-5));
    }
  }
}

// ---------------------------------------------------------------- write

namespace {

struct WriteCase {
  at::Tensor key_pages, value_pages, key, value, slots;
  std::optional<at::Tensor> key_scales, value_scales;
};

void emulated_write(WriteCase& c) {
  kvcache::detail::check_paged_write(c.key_pages, c.value_pages, c.key, c.value, c.slots,
                                     c.key_scales, c.value_scales, false);
  const kvcache::detail::PagedWriteParams p = kvcache::detail::paged_write_params(
      c.key_pages, c.value_pages, c.key, c.value, c.slots, c.key_scales, c.value_scales);
  EmulatedRuntime rt;
  kvcache::paged_kernels::run_paged_write(p, rt);
}

// Tokens to distinct random slots of a pool, some skipped (-1).
WriteCase make_write(int64_t tokens, int64_t num_blocks, int64_t block_size, int64_t kvh,
                     int64_t D, at::ScalarType page_dtype, at::ScalarType src_dtype,
                     bool strided_src) {
  WriteCase c;
  c.key_pages = at::zeros({num_blocks, block_size, kvh, D}, page_dtype);
  c.value_pages = at::zeros({num_blocks, block_size, kvh, D}, page_dtype);
  if (page_dtype == at::kChar || page_dtype == at::kFloat8_e4m3fn) {
    c.key_scales = at::zeros({num_blocks, block_size, kvh});
    c.value_scales = at::zeros({num_blocks, block_size, kvh});
  }
  if (strided_src) {
    // (tokens, kvh, D) views of a (tokens, D, kvh) buffer: element stride kvh.
    c.key = at::randn({tokens, D, kvh}).to(src_dtype).transpose(1, 2);
    c.value = at::randn({tokens, D, kvh}).to(src_dtype).transpose(1, 2);
  } else {
    c.key = at::randn({tokens, kvh, D}).to(src_dtype);
    c.value = at::randn({tokens, kvh, D}).to(src_dtype);
  }
  at::Tensor s = at::randperm(num_blocks * block_size, at::kLong).slice(0, 0, tokens).clone();
  s.index_put_({at::arange(0, tokens, 5)}, -1);
  c.slots = s.to(at::kInt);
  return c;
}

// Plain indexing: the rows of the tokens not skipped, at their slots.
void check_plain_write(const WriteCase& c) {
  const at::Tensor keep = c.slots >= 0;
  const at::Tensor at_slots = c.slots.masked_select(keep).to(at::kLong);
  const int64_t kvh = c.key.size(1), D = c.key.size(2);
  for (int w = 0; w < 2; ++w) {
    const at::Tensor& pages = w == 0 ? c.key_pages : c.value_pages;
    const at::Tensor& src = w == 0 ? c.key : c.value;
    at::Tensor want = at::zeros_like(pages).reshape({-1, kvh, D});
    want.index_put_({at_slots}, src.index({keep}));
    CHECK(at::equal(pages.reshape({-1, kvh, D}), want));
  }
}

}  // namespace

TEST_CASE("emulated CUDA paged_write_: plain pages bit-exact, inline and global slot checks", "[cuda-emulated]") {
  // Up to 512 tokens every block checks the mapping itself; past it the
  // check kernel over a hash table in scratch sets a flag the write kernel
  // reads.
  for (int64_t tokens : {37, 512, 513}) {
    for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
      for (bool strided : {false, true}) {
        INFO("tokens " << tokens << " dtype " << dt << " strided " << strided);
        for (const Schedule& s : kSchedules) {
          use(s);
          WriteCase c = make_write(tokens, 90, 8, 3, 8, dt, dt, strided);
          emulated_write(c);
          check_plain_write(c);
        }
        use(kSchedules[0]);
      }
    }
  }
}

TEST_CASE("emulated CUDA paged_write_: a bad slot mapping writes nothing", "[cuda-emulated]") {
  for (int64_t tokens : {37, 512, 513}) {
    for (int bad : {0, 1, 2}) {
      INFO("tokens " << tokens << " case " << bad);
      WriteCase c = make_write(tokens, 90, 8, 3, 8, at::kFloat, at::kFloat, false);
      if (bad == 0) c.slots[tokens - 1] = 90 * 8;                 // one past the pages
      if (bad == 1) c.slots[tokens - 1] = c.slots[1].item<int32_t>();  // a slot twice
      if (bad == 2) c.slots[tokens / 2] = -2;
      emulated_write(c);
      CHECK(c.key_pages.count_nonzero().item<int64_t>() == 0);
      CHECK(c.value_pages.count_nonzero().item<int64_t>() == 0);
    }
  }
}

TEST_CASE("emulated CUDA paged_write_: int8 and fp8 pages quantized per slot with their scales", "[cuda-emulated]") {
  for (at::ScalarType page : {at::kChar, at::kFloat8_e4m3fn}) {
    for (at::ScalarType src : {at::kFloat, at::kBFloat16, at::kHalf}) {
      INFO("pages " << page << " source " << src);
      WriteCase c = make_write(41, 30, 4, 3, 40, page, src, false);
      emulated_write(c);
      const at::Tensor keep = c.slots >= 0;
      const at::Tensor at_slots = c.slots.masked_select(keep).to(at::kLong);
      const double qmax = page == at::kChar ? 127. : 448.;
      for (int w = 0; w < 2; ++w) {
        const at::Tensor pages = (w == 0 ? c.key_pages : c.value_pages).view(at::kByte).reshape({-1, 3, 40});
        const at::Tensor scales = (w == 0 ? *c.key_scales : *c.value_scales).reshape({-1, 3});
        const at::Tensor x = (w == 0 ? c.key : c.value).index({keep}).to(at::kFloat);  // (n, kvh, D)
        // The format's rule (csrc/core/quant.h's header): scale = absmax /
        // qmax in float32; int8 rounds half away from zero, fp8 to nearest even.
        const at::Tensor want_scale = x.abs().amax(-1) / static_cast<float>(qmax);
        CHECK(at::equal(scales.index_select(0, at_slots), want_scale));
        const at::Tensor y = (x / want_scale.unsqueeze(-1)).clamp(-qmax, qmax);
        at::Tensor want;
        if (page == at::kChar) {
          const at::Tensor yd = y.to(at::kDouble);
          want = (yd.sign() * at::floor(yd.abs() + 0.5)).to(at::kChar);
        } else {
          want = y.to(at::kFloat8_e4m3fn);
        }
        CHECK(at::equal(pages.index_select(0, at_slots), want.view(at::kByte)));
        // Slots no token was given keep their zeros.
        CHECK(pages.count_nonzero().item<int64_t>() == pages.index_select(0, at_slots).count_nonzero().item<int64_t>());
      }
    }
  }
}
