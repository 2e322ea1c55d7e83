// Work plan of the CPU attend kernel: what a task is, what it needs, and
// the scratch it runs in. Shared by the portable, AVX2 and AVX-512 instances of
// attend_kernel.h and by the scheduler in attend.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <c10/util/BFloat16.h>

#include "../ops/attend.h"

namespace kvcache {
namespace attend_cpu {

using detail::AttendParams;

// Cached slots per block: one block's scores (rows x kBlock floats) and its
// keys/values stay in L1/L2 while a block is processed.
constexpr int64_t kBlock = 64;
// A chunk's block takes the GEMM loops (Plan::chunks) when at least this many
// query rows of its task see it: below, packing the keys costs more than the
// micro-kernels save (measured: benchmarks/bench_attend.py --cases gemmrows).
constexpr int64_t kDefaultGemmRows = 32;
// log2(e): the kernel works in base 2 (exp2 is cheaper than exp).
constexpr float kLog2e = 1.4426950408889634f;

// The softmax denominator of query head h whose slots gave running max m
// and sum l (log2 units, m finite): l, plus exp2(sink * log2(e) - m) for a
// learned sink logit (a virtual slot with no value). A sink far above every
// score makes it inf and the output 0, its limit.
inline float with_sink(const AttendParams& p, int64_t h, float m, float l) {
  if (p.sink_logits == nullptr) return l;
  return l + std::exp2(p.sink_logits[h * p.sink_stride] * kLog2e - m);
}

// The instruction-set paths of the kernel (attend.cpp picks the best this
// CPU runs, capped by KVCACHE_ATTEND_ISA).
enum class Isa { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kAvx512Bf16 = 4 };
// Floats per vector on a path: 8, or 16 on the AVX-512 paths.
int isa_lanes(Isa i);

// The plan's run-time choices, each named by what it chooses (see Plan).
enum class Layout : uint8_t { kRows, kPages, kRing };
enum class Loops : uint8_t { kWidened, kFloat, kInt16, kBf16Pairs };
enum class Chunks : uint8_t { kNone, kFloat, kBf16Pairs };

struct Plan {
  const AttendParams* p = nullptr;
  int64_t group = 1;   // query heads per KV head
  int64_t dim = 0;     // head_dim
  int64_t dim_pad = 0; // head_dim rounded up to the ISA's lanes, 8 or 16 (zero-padded in scratch)
  int64_t tile = 1;    // query positions per task
  // Where a task's slots come from (SlotRows): the row's slots in order
  // (kRows), pages through a block table (kPages: AttendParams::block_table),
  // or a ring's slots by recorded position (kRing: AttendParams::positions;
  // the task's visible slots in slot order, a mask per block).
  Layout layout = Layout::kRows;
  // The loops of a block's scores (S = Q K^T) and of its weighted values
  // (O = alpha O + P V), below gemm_rows query rows (Loops):
  //   kWidened:   rows widened to float32 scratch first (element stride not
  //               1, or head_dim not a whole number of vectors);
  //   kFloat:     float loops over the rows read in place;
  //   kInt16:     an int8 cache read with bf16 or fp16 queries, head_dim a
  //               multiple of 16 and at most 256, where the ISA has integer
  //               dot products (Vec::kI8Dot): queries and weights rounded to
  //               int16 (Int16Scores, Int16Weights);
  //   kBf16Pairs: bf16 queries over a bf16 cache on AVX512-BF16, head_dim a
  //               multiple of 32: bf16 pair dot products (qk_tile_bf16,
  //               Bf16Weights; the weights rounded to bf16 once a block).
  Loops scores = Loops::kWidened;
  Loops weights = Loops::kWidened;
  // Chunks (attend_kernel.h, "Chunks"): blocks seen by at least gemm_rows
  // query rows run GEMM micro-kernels over keys packed and transposed once
  // per block (kFloat; head_dim a multiple of 8, the packing's 8 x 8 tiles;
  // not with the integer loops), on AVX512-BF16 for bf16 queries and cache
  // with keys and values read in place and key rows an even number of
  // elements apart on bf16 pairs (kBf16Pairs, "Chunks on bf16 pairs").
  // kNone: no block takes them.
  Chunks chunks = Chunks::kNone;
  int64_t gemm_rows = kDefaultGemmRows;  // the setting (kvcache/attend_cpu.h)
  // Scores in log2 units: q is scaled by scale * log2(e); with a softcap,
  // by scale / softcap, and the score becomes cap * tanh(q.k) with
  // cap = softcap * log2(e).
  float qscale = 1.f;
  float cap = 0.f;
  // Partial results of tasks that cover a split of a row's slots: per
  // part, rows x dim_pad unnormalized outputs, then rows maxima, then rows
  // sums (rows = group * seq: split tasks hold every query position).
  float* partial = nullptr;
  int64_t part_stride = 0;
  // Paged layouts (and token-major caches) keep a slot's KV heads side by
  // side (slot stride num_kv_heads x head_dim): a task over one head would
  // read a strip of every slot and skip the rest, which measured up to 1.9x
  // slower than the same work over a head-major cache
  // (benchmarks/bench_paged.py). Tasks of few query rows (decode, short
  // chunks: at most kGroupedRows rows over all heads) therefore take every
  // KV head of their sequence (Task::heads) and walk the heads inside each
  // piece of a block, so its slots are read whole while they are in L1.
  // 1: one head a task (head-major caches, rings).
  int64_t heads = 1;

  int64_t max_rows() const { return group * tile; }
  bool keys_in_place() const { return scores != Loops::kWidened; }
  bool values_in_place() const { return weights != Loops::kWidened; }
  // Whether a block may read the task's float32 scaled queries (sc.q): all
  // but bf16 tasks whose every block takes the bf16 pair loops (those score
  // on the bf16 queries as given, sc.qh).
  bool f32_queries() const {
    return !(scores == Loops::kBf16Pairs && (chunks == Chunks::kNone || chunks == Chunks::kBf16Pairs));
  }
  // Whether the task's queries are copied as given (bf16) / rounded to int16.
  bool bf16_queries() const { return scores == Loops::kBf16Pairs || chunks == Chunks::kBf16Pairs; }
  // Query rows a task's scratch holds: a tile of one head or a grouped
  // task's rows over all its heads.
  int64_t scratch_rows() const { return heads > 1 ? std::max(max_rows(), kGroupedRows) : max_rows(); }
  static constexpr int64_t kGroupedRows = 64;
};

// The rows of one call of a micro-kernel given by their addresses: row j
// is ptr[j] + off, so the call's rows may cross pages (the bf16 pair loops'
// grouped decode pieces; grouped_block_bf16 fills ptr once a block).
// The other form of rows is a pointer and a stride (row j at k + j * ldk),
// what every loop reads otherwise.
template <typename E>
struct PointerRows {
  const E* const* ptr;
  int64_t off;
};

// Where the slots of one (row, KV head) of a cache buffer (keys, values or
// their scales) live: the kernel asks for the address of slot j and for how
// many slots from j on are consecutive rows `ld` elements apart, the most a
// block may read in place. A linear cache is one run; a paged cache
// (AttendParams::block_table) is runs of block_size slots, one per page; a
// ring (AttendParams::positions) is the task's selected slots (Task slots
// j are its j-th visible slot in slot order, `sel`), runs where they are
// consecutive. A new layout is a new way to answer these two questions.
template <typename E>
struct SlotRows {
  const E* base = nullptr;           // linear, ring: the row's slot 0; paged: page 0's
  int64_t ld = 0;                    // elements between consecutive slots
  const int32_t* table = nullptr;    // paged: the row's block table; nullptr: linear
  int64_t table_stride = 0;
  int64_t page_stride = 0;           // elements between pages
  int64_t block_size = 1;
  // Ring: slot j of the task is slot sel[j] of the row, and sel[j + i] ==
  // sel[j] + i for i < sel_run[j]. nullptr: slot j is slot j.
  const int64_t* sel = nullptr;
  const int64_t* sel_run = nullptr;
  // log2(block_size) when it is a power of two (every page size in use), else -1: the page and
  // offset of a slot by shift and mask instead of two integer divisions, which the kernel's
  // per-run bookkeeping otherwise paid tens of times per block.
  int shift = -1;

  int64_t page_of(int64_t j) const { return shift >= 0 ? j >> shift : j / block_size; }
  int64_t offset_of(int64_t j) const { return shift >= 0 ? j & (block_size - 1) : j % block_size; }
  const E* at(int64_t j) const {
    if (sel != nullptr) return base + sel[j] * ld;
    if (table == nullptr) return base + j * ld;
    return base + int64_t(table[page_of(j) * table_stride]) * page_stride + offset_of(j) * ld;
  }
  int64_t run(int64_t j) const {
    if (sel != nullptr) return sel_run[j];
    return table == nullptr ? std::numeric_limits<int64_t>::max() : block_size - offset_of(j);
  }
  // Reads slots through a ring task's selection (see sel).
  SlotRows& select(const int64_t* s, const int64_t* runs) {
    sel = s;
    sel_run = runs;
    return *this;
  }
};

// The slots of row b, KV head kvh of a buffer with element strides
// {row or page, head, slot, ...}.
template <typename E>
inline SlotRows<E> slot_rows(const AttendParams& p, const E* data, const int64_t* stride,
                             int64_t b, int64_t kvh) {
  SlotRows<E> r;
  r.ld = stride[2];
  if (p.block_table == nullptr) {
    r.base = data + b * stride[0] + kvh * stride[1];
    return r;
  }
  r.base = data + kvh * stride[1];
  r.table = p.block_table + b * p.bt_stride[0];
  r.table_stride = p.bt_stride[1];
  r.page_stride = stride[0];
  r.block_size = p.block_size;
  if (p.block_size > 0 && (p.block_size & (p.block_size - 1)) == 0) {
    r.shift = 0;
    while ((int64_t(1) << r.shift) < p.block_size) ++r.shift;
  }
  return r;
}

// Query positions [i0, i1) of row b and KV heads [kvh, kvh + heads), over
// the slots [j0, j1) (the whole row unless the row is split); part < 0: the
// task writes the output, otherwise partial slot `part`. A task's scratch
// rows are head-major: head kvh + h owns rows [h * R, (h + 1) * R),
// R = group x (i1 - i0), position-major within.
struct Task {
  int64_t b = 0, kvh = 0, heads = 1, i0 = 0, i1 = 0, j0 = 0, j1 = 0, part = -1;
};

// Per-thread buffers, sized once per kernel call (zero-initialized: the
// padding columns of q and the packed keys/values stay 0).
struct Scratch {
  std::vector<float> q, o, s, kb, vb, m, l, alpha;
  // Plan::chunks: a block's keys packed and transposed (dim_pad x kBlock).
  std::vector<float> kt;
  std::vector<int64_t> lo, hi;
  // Rings: the task's selected slots, their positions and consecutive
  // runs (SlotRows::sel, sel_run), and the per-(position, slot)
  // visibility of a block.
  std::vector<int64_t> sel, sel_pos, sel_run;
  std::vector<unsigned char> vis;
  // Visible slots each query position saw so far (rings), and in the
  // current block.
  std::vector<int64_t> seen, seen_block;
  // Loops::kInt16: the query rows rounded to int16 (rows x dim) and their
  // scales; a block's weights rounded to int16 (rows x (kBlock + 2)) and theirs.
  std::vector<int16_t> q16, wq;
  std::vector<float> qs, ws;
  // Whether the current task's q16 holds every query row exactly
  // (round_queries_i16): else its scores take the float loops on q.
  bool q16_ok = false;
  // Plan::bf16_queries(): the bf16 query rows (rows x dim); bf16 pair
  // chunks or weights: a block's weights rounded to bf16 (rows x kBlock).
  std::vector<c10::BFloat16> qh, pb;

  explicit Scratch(const Plan& plan) {
    const int64_t rows = plan.scratch_rows();
    q.assign(rows * plan.dim_pad, 0.f);
    o.assign(rows * plan.dim_pad, 0.f);
    s.assign(rows * kBlock, 0.f);
    const bool chunks = plan.chunks != Chunks::kNone;
    // Widened keys and values: kBlock x dim_pad floats per head of a task.
    if (!plan.keys_in_place() || chunks) kb.assign(plan.heads * kBlock * plan.dim_pad, 0.f);
    if (!plan.values_in_place() || chunks) vb.assign(plan.heads * kBlock * plan.dim_pad, 0.f);
    if (chunks) kt.assign(plan.dim_pad * kBlock, 0.f);
    if (plan.layout == Layout::kRing) {
      sel.assign(plan.p->max_len, 0);
      sel_pos.assign(plan.p->max_len, 0);
      sel_run.assign(plan.p->max_len, 0);
      vis.assign(plan.tile * kBlock, 0);
      seen.assign(plan.tile, 0);
      seen_block.assign(plan.tile, 0);
    }
    if (plan.scores == Loops::kInt16 || plan.weights == Loops::kInt16) {
      q16.assign(rows * plan.dim, 0);
      qs.assign(rows, 0.f);
      wq.assign(rows * (kBlock + 2), 0);
      ws.assign(rows, 0.f);
    }
    if (plan.bf16_queries()) qh.assign(rows * plan.dim, c10::BFloat16(0.f));
    if (plan.chunks == Chunks::kBf16Pairs || plan.weights == Loops::kBf16Pairs) pb.assign(rows * kBlock, c10::BFloat16(0.f));
    m.assign(rows, 0.f);
    l.assign(rows, 0.f);
    alpha.assign(rows, 0.f);
    lo.assign(plan.tile, 0);
    hi.assign(plan.tile, 0);
  }
};

// The plan of one attend call: a pure function of its shapes, strides,
// dtypes and layout (p), the ISA path and the gemm_rows setting
// (AttendCpuTuning). Plan::p points at p.
Plan make_plan(const AttendParams& p, Isa path, int64_t gemm_rows);

// Rows [first_part, first_part + parts) of Plan::partial hold the splits of
// (row b, KV heads [kvh, kvh + heads)), merged after the tasks ran.
struct Split {
  int64_t b, kvh, heads, first_part, parts;
};

// The tasks of a call and their estimated work (work_of); splits of long
// rows when there are too few tasks for the threads, and the number of
// partial results they need (Plan::part_stride floats each); whether the
// call is worth helper threads.
struct Schedule {
  std::vector<Task> tasks;
  std::vector<double> work;
  std::vector<Split> splits;
  int64_t parts = 0;
  bool parallel = false;
};

// The estimated cost of a task, in units of about 1/4 ns: two passes of
// rows x slots x head_dim multiply-adds (8 per vector op, about 2 vector ops
// a cycle), plus reading each slot's key and value (streamed from memory
// for long rows).
double work_of(const Plan& plan, int64_t rows, int64_t slots, int64_t elem_bytes);

// The schedule of a planned call (sets plan.part_stride when it splits):
// a pure function of the plan, the host lengths in *plan.p, the threads the
// call may use (1 inside a parallel region) and the settings parallel_work
// and min_split (AttendCpuTuning).
Schedule make_schedule(Plan& plan, int64_t threads, double parallel_work, int64_t min_split);

}  // namespace attend_cpu
}  // namespace kvcache
