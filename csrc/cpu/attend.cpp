// CPU work of attend (see csrc/ops/attend.h).
//
// Flash-decoding on the CPU: tasks of (batch row, KV head, tile of query
// positions, range of slots), each an online softmax over the slots its
// queries see (attend_kernel.h); rows long enough to leave threads idle are
// split along their slots, and the splits merged at the end. The inner
// loops exist three times, for the baseline ISA, for AVX2/FMA/F16C and for
// AVX-512 F/BW/VL, and the bf16 tasks a fourth time for AVX512-BF16
// (chosen at run time: the build passes no -march flag; KVCACHE_ATTEND_ISA
// caps the choice), see attend_vec.h.
//
// Threads: a call goes parallel only when its estimated work is above the
// cost of waking a thread (AttendCpuTuning::parallel_work, measured with
// benchmarks/bench_attend.py --cases crossover); a decode step over a
// short cache runs on the calling thread. The helpers come from ATen's inter-op
// pool and join when they get a core, so the caller never waits for a
// thread that is not running (an OpenMP region does, which costs
// milliseconds on a loaded machine; see helpers.h). All threads take
// tasks from one counter, longest first (rows are ragged, causal tiles
// uneven).
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <numeric>
#include <thread>
#include <type_traits>
#include <vector>

#include "kvcache/attend_cpu.h"

#include "../core/merge.h"
#include "../core/visibility.h"
#include "../ops/attend.h"
#include "../ops/paged.h"
#include "attend_plan.h"
#include "attend_vec.h"
#include "helpers.h"

namespace kvcache {
namespace attend_cpu {

// VecGeneric's 32-byte vectors pass by value between inline functions;
// GCC's note that their ABI differs without AVX concerns library
// boundaries, which they never cross. Templates are instantiated at the end
// of the file, so the note is silenced for all of it.
#pragma GCC diagnostic ignored "-Wpsabi"
namespace isa_generic {
using Vec = VecGeneric;
#include "attend_kernel.h"  // NOLINT(build/include): instantiated per ISA
}  // namespace isa_generic

#if KVCACHE_ATTEND_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
using Vec = VecAvx2;
#include "attend_kernel.h"  // NOLINT(build/include): instantiated per ISA
}  // namespace isa_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace isa_avx512 {
using Vec = VecAvx512;
#include "attend_kernel.h"  // NOLINT(build/include): instantiated per ISA
}  // namespace isa_avx512
#pragma GCC pop_options

// Only int8-cache tasks of 16-bit queries are instantiated here
// (attend_typed): their integer loops fuse each multiply-add pair.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace isa_avx512vnni {
using Vec = VecAvx512Vnni;
#include "attend_kernel.h"  // NOLINT(build/include): instantiated per ISA
}  // namespace isa_avx512vnni
#pragma GCC pop_options

// Only bf16 tasks are instantiated here (attend_typed); their chunk blocks
// take the pair loops, their other scores qk_tile_bf16 (head_dim a multiple
// of 32), the rest is VecAvx512's code.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,avx2,fma,f16c")
namespace isa_avx512bf16 {
using Vec = VecAvx512Bf16;
#include "attend_kernel.h"  // NOLINT(build/include): instantiated per ISA
}  // namespace isa_avx512bf16
#pragma GCC pop_options
#endif

namespace {

// Query rows (group x positions) a task aims for: enough to reuse each
// key/value block from L1 many times, few enough to keep the scores,
// outputs and queries of the task in L2.
constexpr int64_t kTileRows = 64;
// The chunk loops (Plan::gemm) keep a strip of the packed keys or of the
// values in L1 whatever the rows, so their tasks take twice the rows: each
// task re-reads the row's keys and values from memory, half as often.
// Re-tune with benchmarks/bench_attend.py --cases chunk --filled 4096 (its
// seq-128 rows) after changing it.
constexpr int64_t kGemmTileRows = 128;
// Default estimated work (see work_of) above which a call uses helper
// threads: 2e5 units, about the work a helper's wake-up must pay back on an
// idle core; a batch-1 decode with 32/8 heads, head_dim 128 goes parallel
// from about 128 (fp32) or 192 (bf16) filled slots. Too low costs the
// wake-up on short caches; too high leaves a core idle on long ones; on a
// machine whose cores are shared the break-even moves up. Re-measure with
// benchmarks/bench_attend.py --cases crossover and set
// KVCACHE_ATTEND_PARALLEL_WORK (or AttendCpuTuning::parallel_work).
constexpr double kDefaultParallelWork = 2e5;
// Default fewest slots in a split of a row: two blocks; the merge of a
// split costs about one block's output update.
constexpr int64_t kDefaultMinSplit = 2 * kBlock;
// Tasks per thread the splitting aims for (load balance).
constexpr int64_t kTasksPerThread = 4;

double env_double(const char* name, double fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  char* end = nullptr;
  const double v = std::strtod(env, &end);
  return (end != nullptr && *end == '\0' && v >= 0.0) ? v : fallback;
}

// The settings (kvcache/attend_cpu.h): read by every call, replaced only by
// set_attend_cpu_tuning (benchmarks, tests).
std::atomic<double>& parallel_work_setting() {
  static std::atomic<double> v{env_double("KVCACHE_ATTEND_PARALLEL_WORK", kDefaultParallelWork)};
  return v;
}
static_assert(AttendCpuTuning{}.gemm_rows == kDefaultGemmRows,
              "kvcache/attend_cpu.h and attend_plan.h agree on the default");
std::atomic<int64_t>& gemm_rows_setting() {
  static std::atomic<int64_t> v{std::max<int64_t>(
      1, static_cast<int64_t>(env_double("KVCACHE_ATTEND_GEMM_ROWS", double(kDefaultGemmRows))))};
  return v;
}
std::atomic<int64_t>& min_split_setting() {
  static std::atomic<int64_t> v{std::max<int64_t>(
      1, static_cast<int64_t>(env_double("KVCACHE_ATTEND_MIN_SPLIT", double(kDefaultMinSplit))))};
  return v;
}

enum class Isa { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kAvx512Bf16 = 4 };

// The best path this CPU runs, capped by KVCACHE_ATTEND_ISA (generic, avx2,
// avx512, avx512vnni or avx512bf16; read once): tests force each path the
// machine has. A cap above what the CPU has is the CPU's best. avx512bf16
// asks for AVX512-VNNI too (every CPU with AVX512-BF16 has it: Cooper Lake,
// Sapphire Rapids, Zen 4 on).
Isa isa() {
#if KVCACHE_ATTEND_X86
  static const Isa chosen = [] {
    __builtin_cpu_init();
    Isa best = Isa::kGeneric;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
      best = Isa::kAvx2;
      if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl")) {
        best = Isa::kAvx512;
        if (__builtin_cpu_supports("avx512vnni")) {
          best = Isa::kAvx512Vnni;
          if (__builtin_cpu_supports("avx512bf16")) best = Isa::kAvx512Bf16;
        }
      }
    }
    Isa cap = Isa::kAvx512Bf16;
    const char* env = std::getenv("KVCACHE_ATTEND_ISA");
    if (env != nullptr && std::strcmp(env, "generic") == 0) cap = Isa::kGeneric;
    if (env != nullptr && std::strcmp(env, "avx2") == 0) cap = Isa::kAvx2;
    if (env != nullptr && std::strcmp(env, "avx512") == 0) cap = Isa::kAvx512;
    if (env != nullptr && std::strcmp(env, "avx512vnni") == 0) cap = Isa::kAvx512Vnni;
    return std::min(best, cap);
  }();
  return chosen;
#else
  return Isa::kGeneric;
#endif
}

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::kAvx512Bf16: return "avx512bf16";
    case Isa::kAvx512Vnni: return "avx512vnni";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

int isa_lanes(Isa i) { return i >= Isa::kAvx512 ? 16 : 8; }

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

// Rings: whether each query of row b finds every position the rule asks
// for (visible_count) among the row's slots. One that does not (the ring
// lost a position it needs: a rollback or a chunk beyond the ring's bound)
// gets NaN rather than a silently different answer. O(seq x max_len) per
// row for a few queries, else O(max_len log max_len) from the row's sorted
// positions.
std::vector<char> ring_missing(const AttendParams& p) {
  std::vector<char> bad(static_cast<size_t>(p.batch * p.seq), 0);
  std::vector<int64_t> sorted;
  // A few queries (decode, speculative verification): count each query's
  // visible positions in one pass over the row's slots (O(seq x max_len),
  // no sort; positions are unique, so the count is the same).
  constexpr int64_t kDirectCount = 8;
  if (p.seq <= kDirectCount) {
    for (int64_t b = 0; b < p.batch; ++b) {
      const int32_t* pos = p.positions + b * p.pos_stride[0];
      const int64_t first = p.host_kv_start ? p.host_kv_start[b] : 0;
      const int64_t len = p.host_lengths[b];
      int64_t have[kDirectCount] = {};
      for (int64_t j = 0; j < p.max_len; ++j) {
        const int64_t q = pos[j * p.pos_stride[1]];
        if (q < 0) continue;
        for (int64_t i = 0; i < p.seq; ++i) {
          have[i] += detail::sees(q, len - p.seq + i, first, p.window, p.sinks) ? 1 : 0;
        }
      }
      for (int64_t i = 0; i < p.seq; ++i) {
        bad[b * p.seq + i] =
            have[i] != detail::visible_count(len - p.seq + i, first, p.window, p.sinks);
      }
    }
    return bad;
  }
  for (int64_t b = 0; b < p.batch; ++b) {
    sorted.clear();
    const int32_t* pos = p.positions + b * p.pos_stride[0];
    for (int64_t j = 0; j < p.max_len; ++j) {
      const int64_t q = pos[j * p.pos_stride[1]];
      if (q >= 0) sorted.push_back(q);
    }
    std::sort(sorted.begin(), sorted.end());
    // Positions present in [a, e).
    auto present = [&](int64_t a, int64_t e) -> int64_t {
      if (a >= e) return 0;
      return std::lower_bound(sorted.begin(), sorted.end(), e) -
             std::lower_bound(sorted.begin(), sorted.end(), a);
    };
    const int64_t first = p.host_kv_start ? p.host_kv_start[b] : 0;
    const int64_t len = p.host_lengths[b];
    for (int64_t i = 0; i < p.seq; ++i) {
      const int64_t qp = len - p.seq + i;
      int64_t have;
      if (p.window <= 0) {
        have = present(first, qp + 1);
      } else {
        const int64_t sink_end = std::min(qp + 1, p.sinks);
        const int64_t lo = std::max({first, p.sinks, qp - p.window + 1});
        have = present(first, sink_end) + present(lo, qp + 1);
      }
      bad[b * p.seq + i] = have != detail::visible_count(qp, first, p.window, p.sinks);
    }
  }
  return bad;
}

// Cost model of a task, in units of about 1/4 ns: two passes of
// rows x slots x head_dim multiply-adds (8 per vector op, about 2 vector ops
// a cycle), plus reading each slot's key and value (streamed from memory
// for long rows).
double work_of(const Plan& plan, int64_t rows, int64_t slots, int64_t elem_bytes) {
  const double flops = 2.0 * double(rows) * double(slots) * double(plan.dim_pad) / 16.0;
  const double bytes = 2.0 * double(slots) * double(plan.dim) * double(elem_bytes) / 8.0;
  return flops + bytes + 200.0;
}

using TaskFn = void (*)(const Plan&, const Task&, Scratch&);

// Combines the splits of a row by the rule of core/merge.h (shared with the
// CUDA combine): out = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s over
// the parts that saw a slot; zeros where none did (left padding), NaN where
// a merged part carries a NaN (as the unsplit task gives).
template <typename T>
void merge_parts(const Plan& plan, int64_t b, int64_t kvh, int64_t heads, int64_t first_part,
                 int64_t parts) {
  const AttendParams& p = *plan.p;
  const int64_t G = plan.group, D = plan.dim, Dp = plan.dim_pad;
  // A part holds the task's rows over its heads (Task: head-major).
  const int64_t per_head = G * p.seq_of(b);
  const int64_t rows = per_head * heads;
  std::vector<float> w(static_cast<size_t>(parts));
  std::vector<float> acc(static_cast<size_t>(D));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = (kvh + r / per_head) * G + r % G, i = (r % per_head) / G;
    auto part_ml = [&](int64_t s, float* m, float* l) {
      const float* part = plan.partial + (first_part + s) * plan.part_stride;
      *m = part[rows * Dp + r];
      *l = part[rows * Dp + rows + r];
    };
    // The sink logit in the kernel's base-2 units (with_sink).
    const bool has_sink = p.sink_logits != nullptr;
    const float sink = has_sink ? p.sink_logits[head * p.sink_stride] * kLog2e : 0.f;
    const float f = detail::merge_splits(
        parts, part_ml, [](float x) { return std::exp2(x); }, has_sink, sink, w.data());
    // merged_sum's sum, part by part (the same order of additions per
    // element, over contiguous rows).
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t s = 0; s < parts; ++s) {
      if (!detail::merged(w[s])) continue;  // saw nothing: not read
      const float* o = plan.partial + (first_part + s) * plan.part_stride + r * Dp;
      for (int64_t d = 0; d < D; ++d) acc[d] += w[s] * o[d];
    }
    T* dst = static_cast<T*>(p.out) + b * p.out_stride[0] + head * p.out_stride[1] +
             (p.first_token(b) + i) * p.out_stride[2];
    for (int64_t d = 0; d < D; ++d) dst[d * p.out_stride[3]] = static_cast<T>(acc[d] * f);
  }
}

template <typename T, typename TKV = T>
void attend_typed(const AttendParams& p) {
  Plan plan;
  plan.p = &p;
  plan.group = p.num_heads / p.num_kv_heads;
  plan.dim = p.head_dim;
  const Isa path = isa();
  const int64_t lanes = isa_lanes(path);
  plan.dim_pad = (p.head_dim + lanes - 1) / lanes * lanes;
  plan.tile = std::clamp<int64_t>(kTileRows / plan.group, 1, p.seq);
  plan.fast_k = p.k_stride[3] == 1 && p.head_dim % lanes == 0;
  plan.fast_v = p.v_stride[3] == 1 && p.head_dim % lanes == 0;
  plan.ring = p.positions != nullptr;
  // The integer loops (I8DotAvx2): 16 int16 lanes a step, exact int32 sums
  // up to 256 elements. Only for 16-bit queries: rounding a query row to
  // int16 (2^-16 of its largest element) adds less to a score than the
  // queries' own bf16/fp16 rounding did, while fp32 queries keep fp32
  // scores (the float loops, as every other int8 cache).
  plan.i8dot = std::is_same_v<TKV, int8_t> && !std::is_same_v<T, float> &&
               path != Isa::kGeneric && plan.fast_k && p.head_dim % 16 == 0 &&
               p.head_dim <= 256;
  plan.gemm_rows = gemm_rows_setting().load();
  plan.gemm = !plan.ring && !plan.i8dot && p.head_dim % 8 == 0 &&
              plan.max_rows() >= plan.gemm_rows;
  if (plan.gemm) plan.tile = std::clamp<int64_t>(kGemmTileRows / plan.group, 1, p.seq);
  // bf16 queries over a bf16 cache, keys in place, on AVX512-BF16: the pair loops.
  const bool bf16_pairs = path == Isa::kAvx512Bf16 && std::is_same_v<T, c10::BFloat16> &&
                          std::is_same_v<TKV, c10::BFloat16> && plan.fast_k;
  plan.bf16dot = bf16_pairs && plan.gemm && plan.fast_v && p.k_stride[2] % 2 == 0;
  plan.bf16qk = bf16_pairs && p.head_dim % 32 == 0;
  plan.bf16pv = plan.bf16qk && plan.fast_v;
  // Linear bf16 tasks score every block on the bf16 queries (sc.qh): the
  // pair chunks (bf16dot) or, below gemm_rows rows, qk_tile_bf16. Rings
  // gather blocks that are not consecutive into float32 rows (sc.q's loops).
  plan.f32_queries = !(plan.bf16qk && !plan.ring && (!plan.gemm || plan.bf16dot));
  if (p.softcap > 0.f) {
    plan.qscale = p.scale / p.softcap;
    plan.cap = p.softcap * kLog2e;
  } else {
    plan.qscale = p.scale * kLog2e;
  }
  TaskFn task_fn = plan.ring ? &isa_generic::run_task_ring<T, TKV> : &isa_generic::run_task<T, TKV>;
#if KVCACHE_ATTEND_X86
  if (path == Isa::kAvx2) {
    task_fn = plan.ring ? &isa_avx2::run_task_ring<T, TKV> : &isa_avx2::run_task<T, TKV>;
  } else if (path >= Isa::kAvx512) {
    task_fn = plan.ring ? &isa_avx512::run_task_ring<T, TKV> : &isa_avx512::run_task<T, TKV>;
    if constexpr (std::is_same_v<TKV, int8_t> && !std::is_same_v<T, float>) {
      if (plan.i8dot && path >= Isa::kAvx512Vnni) {
        task_fn = plan.ring ? &isa_avx512vnni::run_task_ring<T, TKV> : &isa_avx512vnni::run_task<T, TKV>;
      }
    }
    if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<TKV, c10::BFloat16>) {
      if (plan.bf16dot || plan.bf16qk) {
        task_fn = plan.ring ? &isa_avx512bf16::run_task_ring<T, TKV> : &isa_avx512bf16::run_task<T, TKV>;
      }
    }
  }
#endif

  // Paged slots hold every KV head side by side: tiles of few rows take
  // all heads in one task (Plan::heads).
  if (p.block_table != nullptr && !plan.ring && p.num_kv_heads > 1 &&
      p.num_heads <= Plan::kGroupedRows) {
    plan.heads = p.num_kv_heads;
  }

  // Tasks: (row, KV head or all KV heads, tile), each over the slots its
  // queries see. The most tiles a row has (rows of varlen queries have
  // fewer or as many).
  const int64_t tiles = (p.seq + plan.tile - 1) / plan.tile;
  std::vector<Task> tasks;
  std::vector<double> work;
  tasks.reserve(p.batch * p.num_kv_heads * tiles);
  double total = 0.0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t seq_b = p.seq_of(b);
    for (int64_t tile = 0; tile * plan.tile < seq_b; ++tile) {
      const int64_t i0 = tile * plan.tile, i1 = std::min(seq_b, i0 + plan.tile);
      int64_t lo0, hi0, lo1, hi1;
      visible(p, b, i0, lo0, hi0);
      visible(p, b, i1 - 1, lo1, hi1);
      const int64_t slots = std::max<int64_t>(0, hi1 - std::min(lo0, lo1));
      const double w = work_of(plan, plan.group * (i1 - i0), slots, sizeof(TKV));
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
        tasks.push_back(t);
        work.push_back(w * double(heads));
        total += w * double(heads);
      }
    }
  }

  const int64_t threads = at::get_num_threads();
  const bool parallel = threads > 1 && total > parallel_work_setting().load() &&
                        !at::in_parallel_region();

  // Split long rows when there are too few tasks to keep the threads busy
  // (decode of a small batch): one part per kBlock-aligned range.
  std::vector<float> partial;
  struct Split {
    int64_t b, kvh, heads, first_part, parts;
  };
  std::vector<Split> splits;
  if (parallel && tiles == 1) {
    const int64_t want = kTasksPerThread * threads;
    if (static_cast<int64_t>(tasks.size()) < want) {
      int64_t slots_total = 0;
      for (const Task& t : tasks) slots_total += t.j1 - t.j0;
      const int64_t min_split = (min_split_setting().load() + kBlock - 1) / kBlock * kBlock;
      const int64_t target = std::max<int64_t>(
          min_split, (slots_total / want + kBlock - 1) / kBlock * kBlock);
      std::vector<Task> split_tasks;
      std::vector<double> split_work;
      int64_t parts_total = 0;
      for (size_t x = 0; x < tasks.size(); ++x) {
        const Task& t = tasks[x];
        const int64_t parts = std::max<int64_t>(1, (t.j1 - t.j0 + target - 1) / target);
        if (parts == 1) {
          split_tasks.push_back(t);
          split_work.push_back(work[x]);
          continue;
        }
        splits.push_back({t.b, t.kvh, t.heads, parts_total, parts});
        for (int64_t s = 0; s < parts; ++s) {
          Task u = t;
          u.j0 = t.j0 + s * target;
          u.j1 = std::min(t.j1, u.j0 + target);
          u.part = parts_total + s;
          split_tasks.push_back(u);
          split_work.push_back(work[x] / double(parts));
        }
        parts_total += parts;
      }
      if (parts_total > 0) {
        const int64_t rows = plan.group * p.seq * plan.heads;
        plan.part_stride = rows * plan.dim_pad + 2 * rows;
        partial.resize(parts_total * plan.part_stride);
        plan.partial = partial.data();
        tasks.swap(split_tasks);
        work.swap(split_work);
      }
    }
  }

  if (!parallel || tasks.size() < 2) {
    Scratch scratch(plan);
    for (const Task& t : tasks) task_fn(plan, t, scratch);
  } else {
    std::vector<int64_t> order(tasks.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return work[a] > work[b]; });
    const int64_t helpers = std::min<int64_t>(threads, static_cast<int64_t>(tasks.size())) - 1;
    cpu::run_with_helpers(helpers, [&](const std::atomic<bool>& closed, std::atomic<int64_t>& next) {
      if (closed.load()) return;
      Scratch scratch(plan);
      const int64_t n = static_cast<int64_t>(tasks.size());
      for (int64_t x = next.fetch_add(1); x < n; x = next.fetch_add(1)) {
        task_fn(plan, tasks[order[x]], scratch);
      }
    });
  }
  for (const Split& s : splits) merge_parts<T>(plan, s.b, s.kvh, s.heads, s.first_part, s.parts);
  if (plan.ring) {
    const std::vector<char> bad = ring_missing(p);
    for (int64_t b = 0; b < p.batch; ++b) {
      for (int64_t i = 0; i < p.seq; ++i) {
        if (!bad[b * p.seq + i]) continue;
        T* row = static_cast<T*>(p.out) + b * p.out_stride[0] + i * p.out_stride[2];
        for (int64_t h = 0; h < p.num_heads; ++h) {
          for (int64_t d = 0; d < p.head_dim; ++d) {
            row[h * p.out_stride[1] + d * p.out_stride[3]] =
                static_cast<T>(std::numeric_limits<float>::quiet_NaN());
          }
        }
      }
    }
  }
}

// The cache's element type: q's dtype, or a quantized format.
template <typename T>
void attend_format(const AttendParams& p) {
  switch (p.kv_format) {
    case detail::KvFormat::kPlain: return attend_typed<T>(p);
    case detail::KvFormat::kInt8: return attend_typed<T, int8_t>(p);
    case detail::KvFormat::kFp8: return attend_typed<T, c10::Float8_e4m3fn>(p);
  }
}

void attend_cpu_kernel(const AttendParams& p) {
  switch (p.dtype) {
    case detail::AttnDtype::kFloat32: return attend_format<float>(p);
    case detail::AttnDtype::kBFloat16: return attend_format<c10::BFloat16>(p);
    case detail::AttnDtype::kFloat16: return attend_format<c10::Half>(p);
  }
}

}  // namespace
}  // namespace attend_cpu

AttendCpuTuning attend_cpu_tuning() {
  return {attend_cpu::parallel_work_setting().load(), attend_cpu::min_split_setting().load(),
          attend_cpu::gemm_rows_setting().load()};
}

void set_attend_cpu_tuning(const AttendCpuTuning& tuning) {
  if (!(tuning.parallel_work >= 0.0)) {
    throw std::invalid_argument("set_attend_cpu_tuning: parallel_work must be >= 0");
  }
  if (tuning.min_split < 1) {
    throw std::invalid_argument("set_attend_cpu_tuning: min_split must be >= 1");
  }
  if (tuning.gemm_rows < 1) {
    throw std::invalid_argument("set_attend_cpu_tuning: gemm_rows must be >= 1");
  }
  attend_cpu::parallel_work_setting().store(tuning.parallel_work);
  attend_cpu::min_split_setting().store(tuning.min_split);
  attend_cpu::gemm_rows_setting().store(tuning.gemm_rows);
}

std::string attend_cpu_isa() { return attend_cpu::isa_name(attend_cpu::isa()); }

}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(attend_stub, cpu, &kvcache::attend_cpu::attend_cpu_kernel);
KVCACHE_REGISTER_KERNEL(paged_attend_stub, cpu, &kvcache::attend_cpu::attend_cpu_kernel);
