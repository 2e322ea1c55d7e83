// The CPU attend's plan and schedule (attend_plan.h): pure functions of a
// call's shapes, strides, dtypes, layout and host lengths, the ISA path and
// the settings, so that they can be unit-tested on their own
// (tests/cpp/test_attend_plan.cpp) and the kernel (attend.cpp) only runs them.
#include "attend_plan.h"

#include <algorithm>
#include <vector>

#include "../core/visibility.h"

namespace kvcache {
namespace attend_cpu {
namespace {

// Query rows (group x positions) a task aims for: enough to reuse each
// key/value block from L1 many times, few enough to keep the scores,
// outputs and queries of the task in L2.
constexpr int64_t kTileRows = 64;
// The chunk loops (Plan::chunks) keep a strip of the packed keys or of the
// values in L1 whatever the rows, so their tasks take twice the rows: each
// task re-reads the row's keys and values from memory, half as often.
// Re-tune with benchmarks/bench_attend.py --cases chunk --filled 4096 (its
// seq-128 rows) after changing it.
constexpr int64_t kGemmTileRows = 128;
// Tasks per thread the splitting aims for (load balance).
constexpr int64_t kTasksPerThread = 4;

// Visible slots [lo, hi) of the query at position i of row b (lo == hi:
// none). A ring's queries may see any slot: [0, max_len), read by position.
void visible(const AttendParams& p, int64_t b, int64_t i, int64_t& lo, int64_t& hi) {
  if (p.positions != nullptr) {
    lo = 0;
    hi = p.max_len;
    return;
  }
  const int64_t len = p.host_lengths[b];
  const int64_t pos = len - p.seq_of(b) + i;
  detail::visible_range(pos, p.host_kv_start ? p.host_kv_start[b] : 0, p.window, &lo, &hi);
}

// Bytes of one cached element.
int64_t kv_elem_bytes(const AttendParams& p) {
  if (p.kv_format != detail::KvFormat::kPlain) return 1;
  return p.dtype == detail::AttnDtype::kFloat32 ? 4 : 2;
}

}  // namespace

int isa_lanes(Isa i) { return i >= Isa::kAvx512 ? 16 : 8; }

Plan make_plan(const AttendParams& p, Isa path, int64_t gemm_rows) {
  using detail::AttnDtype;
  using detail::KvFormat;
  Plan plan;
  plan.p = &p;
  plan.group = p.num_heads / p.num_kv_heads;
  plan.dim = p.head_dim;
  const int64_t lanes = isa_lanes(path);
  plan.dim_pad = (p.head_dim + lanes - 1) / lanes * lanes;
  plan.tile = std::clamp<int64_t>(kTileRows / plan.group, 1, p.seq);
  const bool keys_in_place = p.k_stride[3] == 1 && p.head_dim % lanes == 0;
  const bool values_in_place = p.v_stride[3] == 1 && p.head_dim % lanes == 0;
  plan.layout = p.positions != nullptr     ? Layout::kRing
                : p.block_table != nullptr ? Layout::kPages
                                           : Layout::kRows;
  plan.scores = keys_in_place ? Loops::kFloat : Loops::kWidened;
  plan.weights = values_in_place ? Loops::kFloat : Loops::kWidened;
  // The integer loops (I8DotAvx2): 16 int16 lanes a step, exact int32 sums
  // up to 256 elements. Only for 16-bit queries: rounding a query row to
  // int16 (2^-16 of its largest element amax) moves the row by at most
  // sqrt(head_dim) 2^-16 amax, under its own bf16 / fp16 rounding's
  // 2^-9 / 2^-11 of its norm (>= amax) for head_dim <= 256. A key blind to a
  // row's one large channel sees the first and not the second: with fp16
  // queries whose one channel is 1000x the others, over keys with 0 there,
  // outputs off by 6e-2 of their largest against 1e-4 on the float loops
  // (100x: 3e-3). fp32 queries keep fp32 scores (the float loops, as every
  // other int8 cache).
  const bool int16 = p.kv_format == KvFormat::kInt8 && p.dtype != AttnDtype::kFloat32 &&
                     path != Isa::kGeneric && keys_in_place && p.head_dim % 16 == 0 &&
                     p.head_dim <= 256;
  if (int16) {
    plan.scores = Loops::kInt16;
    if (values_in_place) plan.weights = Loops::kInt16;
  }
  plan.gemm_rows = gemm_rows;
  if (!int16 && p.head_dim % 8 == 0 && plan.max_rows() >= plan.gemm_rows) {
    plan.chunks = Chunks::kFloat;
    plan.tile = std::clamp<int64_t>(kGemmTileRows / plan.group, 1, p.seq);
  }
  // bf16 queries over a bf16 cache, keys in place, on AVX512-BF16: the pair loops.
  const bool bf16_pairs = path == Isa::kAvx512Bf16 && p.dtype == AttnDtype::kBFloat16 &&
                          p.kv_format == KvFormat::kPlain && keys_in_place;
  // Not over pages smaller than a block: the pair GEMMs read a block in
  // place, so they would stop at every page end (GEMMs of one column over
  // transformers' gathered pages of one slot), where the float GEMMs gather
  // a block's runs first (attend_kernel.h, run_task).
  const bool small_pages = plan.layout == Layout::kPages && p.block_size < kBlock;
  if (bf16_pairs && plan.chunks == Chunks::kFloat && values_in_place && p.k_stride[2] % 2 == 0 && !small_pages) {
    plan.chunks = Chunks::kBf16Pairs;
  }
  if (bf16_pairs && p.head_dim % 32 == 0) {
    plan.scores = Loops::kBf16Pairs;
    if (values_in_place) plan.weights = Loops::kBf16Pairs;
  }
  if (p.softcap > 0.f) {
    plan.qscale = p.scale / p.softcap;
    plan.cap = p.softcap * kLog2e;
  } else {
    plan.qscale = p.scale * kLog2e;
  }
  // Paged slots hold every KV head side by side, and so do the slots of a
  // token-major cache ((batch, max_len, kv_heads, head_dim) memory viewed
  // head-major): tiles of few rows take all heads in one task (Plan::heads).
  const bool heads_side_by_side = p.k_stride[1] == p.head_dim && p.v_stride[1] == p.head_dim;
  if ((plan.layout == Layout::kPages || (plan.layout == Layout::kRows && heads_side_by_side)) &&
      p.num_kv_heads > 1 && p.num_heads <= Plan::kGroupedRows) {
    plan.heads = p.num_kv_heads;
  }
  return plan;
}

double work_of(const Plan& plan, int64_t rows, int64_t slots, int64_t elem_bytes) {
  const double flops = 2.0 * double(rows) * double(slots) * double(plan.dim_pad) / 16.0;
  const double bytes = 2.0 * double(slots) * double(plan.dim) * double(elem_bytes) / 8.0;
  return flops + bytes + 200.0;
}

Schedule make_schedule(Plan& plan, int64_t threads, double parallel_work, int64_t min_split) {
  const AttendParams& p = *plan.p;
  Schedule s;
  // Tasks: (row, KV head or all KV heads, tile), each over the slots its
  // queries see. The most tiles a row has (rows of varlen queries have
  // fewer or as many).
  const int64_t tiles = (p.seq + plan.tile - 1) / plan.tile;
  s.tasks.reserve(p.batch * p.num_kv_heads * tiles);
  double total = 0.0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t seq_b = p.seq_of(b);
    for (int64_t tile = 0; tile * plan.tile < seq_b; ++tile) {
      const int64_t i0 = tile * plan.tile, i1 = std::min(seq_b, i0 + plan.tile);
      int64_t lo0, hi0, lo1, hi1;
      visible(p, b, i0, lo0, hi0);
      visible(p, b, i1 - 1, lo1, hi1);
      const int64_t slots = std::max<int64_t>(0, hi1 - std::min(lo0, lo1));
      const double w = work_of(plan, plan.group * (i1 - i0), slots, kv_elem_bytes(p));
      const int64_t heads =
          plan.heads > 1 && p.num_heads * (i1 - i0) <= Plan::kGroupedRows ? plan.heads : 1;
      for (int64_t kvh = 0; kvh < p.num_kv_heads; kvh += heads) {
        Task t;
        t.b = b;
        t.kvh = kvh;
        t.heads = heads;
        t.i0 = i0;
        t.i1 = i1;
        t.j0 = std::min(lo0, lo1);
        t.j1 = std::max(t.j0, hi1);
        s.tasks.push_back(t);
        s.work.push_back(w * double(heads));
        total += w * double(heads);
      }
    }
  }

  s.parallel = threads > 1 && total > parallel_work;
  // Split long rows when there are too few tasks to keep the threads busy
  // (decode of a small batch): one part per kBlock-aligned range.
  if (s.parallel && tiles == 1) {
    const int64_t want = kTasksPerThread * threads;
    if (static_cast<int64_t>(s.tasks.size()) < want) {
      int64_t slots_total = 0;
      for (const Task& t : s.tasks) slots_total += t.j1 - t.j0;
      const int64_t split = (min_split + kBlock - 1) / kBlock * kBlock;
      const int64_t target =
          std::max<int64_t>(split, (slots_total / want + kBlock - 1) / kBlock * kBlock);
      std::vector<Task> split_tasks;
      std::vector<double> split_work;
      int64_t parts_total = 0;
      for (size_t x = 0; x < s.tasks.size(); ++x) {
        const Task& t = s.tasks[x];
        const int64_t parts = std::max<int64_t>(1, (t.j1 - t.j0 + target - 1) / target);
        if (parts == 1) {
          split_tasks.push_back(t);
          split_work.push_back(s.work[x]);
          continue;
        }
        s.splits.push_back({t.b, t.kvh, t.heads, parts_total, parts});
        for (int64_t q = 0; q < parts; ++q) {
          Task u = t;
          u.j0 = t.j0 + q * target;
          u.j1 = std::min(t.j1, u.j0 + target);
          u.part = parts_total + q;
          split_tasks.push_back(u);
          split_work.push_back(s.work[x] / double(parts));
        }
        parts_total += parts;
      }
      if (parts_total > 0) {
        const int64_t rows = plan.group * p.seq * plan.heads;
        plan.part_stride = rows * plan.dim_pad + 2 * rows;
        s.parts = parts_total;
        s.tasks.swap(split_tasks);
        s.work.swap(split_work);
      }
    }
  }
  return s;
}

}  // namespace attend_cpu
}  // namespace kvcache
