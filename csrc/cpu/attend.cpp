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
// VecGeneric's 32-byte vectors pass by value between inline functions;
// GCC's note that their ABI differs without AVX concerns library
// boundaries, which they never cross. It is silenced for the rest of the
// file from here: VecGeneric's own functions (attend_vec.h) draw it when
// they are not inlined (-O1, the sanitizer build), and the templates that
// use them are instantiated at the end.
#pragma GCC diagnostic ignored "-Wpsabi"
#include "attend_vec.h"
#include "helpers.h"

namespace kvcache {
namespace attend_cpu {

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

// One call: plan (make_plan), the ISA's instance of the main loop, schedule
// (make_schedule), the tasks on the calling thread and its helpers, the
// merge of split rows, and a ring's lost positions made NaN.
template <typename T, typename TKV = T>
void attend_typed(const AttendParams& p) {
  const Isa path = isa();
  Plan plan = make_plan(p, path, gemm_rows_setting().load());
  TaskFn task_fn = &isa_generic::run_task<T, TKV>;
#if KVCACHE_ATTEND_X86
  if (path == Isa::kAvx2) {
    task_fn = &isa_avx2::run_task<T, TKV>;
  } else if (path >= Isa::kAvx512) {
    task_fn = &isa_avx512::run_task<T, TKV>;
    if constexpr (std::is_same_v<TKV, int8_t> && !std::is_same_v<T, float>) {
      if (plan.scores == Loops::kInt16 && path >= Isa::kAvx512Vnni) {
        task_fn = &isa_avx512vnni::run_task<T, TKV>;
      }
    }
    if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<TKV, c10::BFloat16>) {
      if (plan.bf16_queries()) {
        task_fn = &isa_avx512bf16::run_task<T, TKV>;
      }
    }
  }
#endif

  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  Schedule schedule =
      make_schedule(plan, threads, parallel_work_setting().load(), min_split_setting().load());
  std::vector<Task>& tasks = schedule.tasks;
  std::vector<double>& work = schedule.work;
  const bool parallel = schedule.parallel;
  std::vector<float> partial(static_cast<size_t>(schedule.parts * plan.part_stride));
  plan.partial = partial.data();

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
  for (const Split& s : schedule.splits) merge_parts<T>(plan, s.b, s.kvh, s.heads, s.first_part, s.parts);
  if (plan.layout == Layout::kRing) {
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
