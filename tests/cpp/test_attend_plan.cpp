// csrc/cpu/attend_plan.cpp: the CPU attend's plan and schedule, on their own
// (no kernel runs). The plan's choices follow from shapes, strides, dtypes,
// layout and ISA as attend_plan.h states them; the schedule's tasks cover
// each (row, KV head)'s visible slots exactly once, splits included.
#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "catch.h"
#include "cpu/attend_plan.h"

namespace {

using kvcache::attend_cpu::Chunks;
using kvcache::attend_cpu::Isa;
using kvcache::attend_cpu::kBlock;
using kvcache::attend_cpu::Layout;
using kvcache::attend_cpu::Loops;
using kvcache::attend_cpu::make_plan;
using kvcache::attend_cpu::make_schedule;
using kvcache::attend_cpu::Plan;
using kvcache::attend_cpu::Schedule;
using kvcache::attend_cpu::Task;
using kvcache::detail::AttendParams;
using kvcache::detail::AttnDtype;
using kvcache::detail::KvFormat;

// A contiguous (batch, heads, seq, dim) query over a contiguous (batch,
// kv_heads, max_len, dim) cache with the given host lengths.
struct Call {
  AttendParams p;
  std::vector<int64_t> lengths;
  std::vector<int32_t> positions, table;

  Call(int64_t batch, int64_t heads, int64_t kv_heads, int64_t seq, int64_t dim, int64_t max_len,
       std::vector<int64_t> lens, AttnDtype dtype = AttnDtype::kFloat32)
      : lengths(std::move(lens)) {
    p.dtype = dtype;
    p.batch = batch;
    p.num_heads = heads;
    p.num_kv_heads = kv_heads;
    p.seq = seq;
    p.head_dim = dim;
    p.max_len = max_len;
    p.scale = 0.125f;
    const int64_t q[4] = {heads * seq * dim, seq * dim, dim, 1};
    const int64_t k[4] = {kv_heads * max_len * dim, max_len * dim, dim, 1};
    std::copy(q, q + 4, p.q_stride);
    std::copy(q, q + 4, p.out_stride);
    std::copy(k, k + 4, p.k_stride);
    std::copy(k, k + 4, p.v_stride);
    p.host_lengths = lengths.data();
  }
};

// Each (row, KV head, tile) of the schedule: the union of its tasks' slot
// ranges, checked to be one range covered exactly once.
void check_cover(const Plan& plan, const Schedule& s) {
  const AttendParams& p = *plan.p;
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::vector<std::pair<int64_t, int64_t>>> ranges;
  std::vector<int> part_used(static_cast<size_t>(s.parts), 0);
  for (const Task& t : s.tasks) {
    REQUIRE(t.j0 <= t.j1);
    REQUIRE(t.i0 < t.i1);
    REQUIRE(t.i1 <= p.seq_of(t.b));
    for (int64_t h = 0; h < t.heads; ++h) ranges[{t.b, t.kvh + h, t.i0}].push_back({t.j0, t.j1});
    if (t.part >= 0) {
      REQUIRE(t.part < s.parts);
      ++part_used[t.part];
    }
  }
  for (int used : part_used) REQUIRE(used == 1);
  for (auto& [key, r] : ranges) {
    std::sort(r.begin(), r.end());
    for (size_t x = 1; x < r.size(); ++x) {
      REQUIRE(r[x].first == r[x - 1].second);          // no gap, no overlap
      REQUIRE((r[x].first - r[0].first) % kBlock == 0);  // splits on block bounds
    }
    const auto [b, kvh, i0] = key;
    // The tile's last query sees up to its position; its first from the
    // window's start (or 0).
    const int64_t len = p.host_lengths[b];
    const int64_t last = len - p.seq_of(b) + std::min<int64_t>(i0 + plan.tile, p.seq_of(b)) - 1;
    const int64_t first = len - p.seq_of(b) + i0;
    const int64_t lo = p.window > 0 ? std::max<int64_t>(0, first - p.window + 1) : 0;
    REQUIRE(r.front().first == lo);
    REQUIRE(r.back().second == last + 1);
  }
  // Every (row, KV head) has its tiles.
  int64_t expected = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    expected += p.num_kv_heads * ((p.seq_of(b) + plan.tile - 1) / plan.tile);
  }
  REQUIRE(static_cast<int64_t>(ranges.size()) == expected);
}

}  // namespace

TEST_CASE("make_plan: decode over rows takes the float loops in place", "[attend_plan]") {
  Call c(2, 8, 2, 1, 64, 512, {100, 300});
  const Plan plan = make_plan(c.p, Isa::kAvx2, 32);
  REQUIRE(plan.layout == Layout::kRows);
  REQUIRE(plan.scores == Loops::kFloat);
  REQUIRE(plan.weights == Loops::kFloat);
  REQUIRE(plan.chunks == Chunks::kNone);
  REQUIRE(plan.group == 4);
  REQUIRE(plan.dim_pad == 64);
  REQUIRE(plan.tile == 1);
  REQUIRE(plan.heads == 1);
  REQUIRE(plan.f32_queries());
}

TEST_CASE("make_plan: strides and head_dim choose widened rows", "[attend_plan]") {
  Call c(1, 4, 4, 1, 12, 64, {10});
  Plan plan = make_plan(c.p, Isa::kAvx2, 32);  // 12 is not a whole number of 8 lanes
  REQUIRE(plan.scores == Loops::kWidened);
  REQUIRE(plan.weights == Loops::kWidened);
  REQUIRE(plan.dim_pad == 16);
  REQUIRE(make_plan(c.p, Isa::kAvx512, 32).dim_pad == 16);
  Call d(1, 4, 4, 1, 64, 64, {10});
  d.p.v_stride[3] = 2;  // values of element stride 2: widened; keys stay in place
  plan = make_plan(d.p, Isa::kAvx2, 32);
  REQUIRE(plan.scores == Loops::kFloat);
  REQUIRE(plan.weights == Loops::kWidened);
}

TEST_CASE("make_plan: chunks of at least gemm_rows rows take the GEMM loops", "[attend_plan]") {
  Call c(1, 8, 2, 128, 64, 4096, {4096});
  Plan plan = make_plan(c.p, Isa::kAvx2, 32);
  REQUIRE(plan.chunks == Chunks::kFloat);
  REQUIRE(plan.tile == 128 / 4);  // kGemmTileRows / group
  REQUIRE(make_plan(c.p, Isa::kAvx2, 4096).chunks == Chunks::kNone);  // the setting
  Call odd(1, 8, 2, 128, 12, 4096, {4096});  // head_dim not a multiple of 8
  REQUIRE(make_plan(odd.p, Isa::kAvx2, 32).chunks == Chunks::kNone);
}

TEST_CASE("make_plan: int8 caches read by 16-bit queries take the integer loops", "[attend_plan]") {
  Call c(1, 8, 2, 128, 64, 4096, {4096}, AttnDtype::kBFloat16);
  c.p.kv_format = KvFormat::kInt8;
  Plan plan = make_plan(c.p, Isa::kAvx2, 32);
  REQUIRE(plan.scores == Loops::kInt16);
  REQUIRE(plan.weights == Loops::kInt16);
  REQUIRE(plan.chunks == Chunks::kNone);  // not with the integer loops
  REQUIRE(make_plan(c.p, Isa::kGeneric, 32).scores == Loops::kFloat);
  c.p.dtype = AttnDtype::kFloat32;  // fp32 queries keep fp32 scores
  REQUIRE(make_plan(c.p, Isa::kAvx2, 32).scores == Loops::kFloat);
  Call wide(1, 8, 2, 1, 320, 64, {10}, AttnDtype::kFloat16);  // head_dim above 256
  wide.p.kv_format = KvFormat::kInt8;
  REQUIRE(make_plan(wide.p, Isa::kAvx2, 32).scores == Loops::kFloat);
}

TEST_CASE("make_plan: bf16 pairs only on AVX512-BF16", "[attend_plan]") {
  Call c(1, 8, 2, 1, 64, 512, {300}, AttnDtype::kBFloat16);
  Plan plan = make_plan(c.p, Isa::kAvx512Bf16, 32);
  REQUIRE(plan.scores == Loops::kBf16Pairs);
  REQUIRE(plan.weights == Loops::kBf16Pairs);
  REQUIRE_FALSE(plan.f32_queries());
  REQUIRE(plan.bf16_queries());
  REQUIRE(make_plan(c.p, Isa::kAvx512, 32).scores == Loops::kFloat);
  Call chunk(1, 8, 2, 128, 64, 4096, {4096}, AttnDtype::kBFloat16);
  plan = make_plan(chunk.p, Isa::kAvx512Bf16, 32);
  REQUIRE(plan.chunks == Chunks::kBf16Pairs);
  REQUIRE_FALSE(plan.f32_queries());
  // Paged chunks: the pair GEMMs over pages of a block or more; over smaller
  // pages the float GEMMs, which gather a block's runs (float queries too).
  std::vector<int32_t> table(64, 0);
  chunk.p.block_table = table.data();
  chunk.p.bt_stride[0] = 64;
  chunk.p.bt_stride[1] = 1;
  chunk.p.block_size = kBlock;
  REQUIRE(make_plan(chunk.p, Isa::kAvx512Bf16, 32).chunks == Chunks::kBf16Pairs);
  for (int64_t bs : {1, 16, 48}) {
    chunk.p.block_size = bs;
    plan = make_plan(chunk.p, Isa::kAvx512Bf16, 32);
    REQUIRE(plan.layout == Layout::kPages);
    REQUIRE(plan.chunks == Chunks::kFloat);
    REQUIRE(plan.scores == Loops::kBf16Pairs);  // decode blocks keep the pair loops
    REQUIRE(plan.f32_queries());
  }
  Call d48(1, 8, 2, 1, 48, 512, {300}, AttnDtype::kBFloat16);  // not a multiple of 32
  REQUIRE(make_plan(d48.p, Isa::kAvx512Bf16, 32).scores == Loops::kFloat);
}

TEST_CASE("make_plan: layouts", "[attend_plan]") {
  Call ring(1, 8, 2, 1, 64, 64, {100});
  ring.positions.assign(64, -1);
  ring.p.positions = ring.positions.data();
  ring.p.pos_stride[0] = 64;
  ring.p.pos_stride[1] = 1;
  REQUIRE(make_plan(ring.p, Isa::kAvx2, 32).layout == Layout::kRing);

  Call paged(2, 8, 2, 1, 64, 64, {20, 40});
  paged.table.assign(2 * 4, -1);
  paged.p.block_table = paged.table.data();
  paged.p.bt_stride[0] = 4;
  paged.p.bt_stride[1] = 1;
  paged.p.block_size = 16;
  Plan plan = make_plan(paged.p, Isa::kAvx2, 32);
  REQUIRE(plan.layout == Layout::kPages);
  REQUIRE(plan.heads == 2);  // few query rows: a task takes every KV head of its sequence
  Schedule s = make_schedule(plan, 1, 2e5, 128);
  REQUIRE(s.tasks.size() == 2);
  REQUIRE(s.tasks[0].heads == 2);
}

TEST_CASE("make_plan: token-major rows group their KV heads as pages do", "[attend_plan]") {
  // (batch, max_len, kv_heads, dim) memory viewed head-major: each slot's heads side by side.
  Call tm(2, 9, 3, 1, 64, 256, {256, 30});
  const int64_t k[4] = {256 * 3 * 64, 64, 3 * 64, 1};
  std::copy(k, k + 4, tm.p.k_stride);
  std::copy(k, k + 4, tm.p.v_stride);
  Plan plan = make_plan(tm.p, Isa::kAvx2, 32);
  REQUIRE(plan.layout == Layout::kRows);
  REQUIRE(plan.heads == 3);
  Schedule s = make_schedule(plan, 2, 0.0, 64);  // splits of the long row keep every head
  for (const Task& t : s.tasks) REQUIRE(t.heads == 3);
  check_cover(plan, s);
  // Values head-major: the heads are not side by side in both, one head a task.
  const int64_t v[4] = {3 * 256 * 64, 256 * 64, 64, 1};
  std::copy(v, v + 4, tm.p.v_stride);
  REQUIRE(make_plan(tm.p, Isa::kAvx2, 32).heads == 1);
  // Long chunks (more than kGroupedRows rows over all heads): one head a task.
  Call chunk(1, 9, 3, 64, 64, 256, {256});
  std::copy(k, k + 4, chunk.p.k_stride);
  std::copy(k, k + 4, chunk.p.v_stride);
  Plan cplan = make_plan(chunk.p, Isa::kAvx2, 32);
  Schedule cs = make_schedule(cplan, 1, 0.0, 128);
  for (const Task& t : cs.tasks) REQUIRE(t.heads == 1);
  check_cover(cplan, cs);
}

TEST_CASE("make_schedule: one thread runs every tile whole", "[attend_plan]") {
  Call c(3, 8, 2, 5, 64, 4096, {5, 1000, 4000});
  Plan plan = make_plan(c.p, Isa::kAvx2, 32);
  Schedule s = make_schedule(plan, 1, 0.0, 128);
  REQUIRE_FALSE(s.parallel);
  REQUIRE(s.splits.empty());
  REQUIRE(s.parts == 0);
  REQUIRE(s.tasks.size() == s.work.size());
  check_cover(plan, s);
}

TEST_CASE("make_schedule: few long rows are split on block bounds", "[attend_plan]") {
  Call c(2, 8, 2, 1, 64, 20000, {300, 20000});
  Plan plan = make_plan(c.p, Isa::kAvx2, 32);
  Schedule s = make_schedule(plan, 2, 0.0, 128);
  REQUIRE(s.parallel);
  REQUIRE_FALSE(s.splits.empty());
  REQUIRE(s.parts > 0);
  REQUIRE(plan.part_stride == (plan.group * c.p.seq) * plan.dim_pad + 2 * plan.group * c.p.seq);
  int64_t parts = 0;
  for (const auto& sp : s.splits) parts += sp.parts;
  REQUIRE(parts == s.parts);
  check_cover(plan, s);
  // Below the parallel threshold nothing is split.
  Plan plan2 = make_plan(c.p, Isa::kAvx2, 32);
  Schedule serial = make_schedule(plan2, 2, 1e30, 128);
  REQUIRE_FALSE(serial.parallel);
  REQUIRE(serial.parts == 0);
}

TEST_CASE("make_schedule: windows and ragged query counts", "[attend_plan]") {
  Call c(2, 4, 2, 40, 64, 8192, {3000, 8000});
  c.p.window = 700;
  Plan plan = make_plan(c.p, Isa::kAvx2, 32);
  check_cover(plan, make_schedule(plan, 2, 0.0, 128));

  // Varlen queries: rows of 3 and 40 queries.
  Call v(2, 4, 2, 40, 64, 8192, {50, 5000});
  std::vector<int64_t> starts = {0, 3, 43};
  v.p.host_q_start = starts.data();
  Plan pv = make_plan(v.p, Isa::kAvx2, 32);
  Schedule s = make_schedule(pv, 1, 0.0, 128);
  check_cover(pv, s);
  for (const Task& t : s.tasks) REQUIRE(t.i1 <= (t.b == 0 ? 3 : 40));
}
