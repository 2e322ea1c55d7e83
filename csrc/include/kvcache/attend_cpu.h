// Run-time settings of the CPU attend kernel, for benchmarks and tests:
// which instruction-set path it takes, the two thresholds that decide when
// a call uses helper threads and how finely a row's slots are split between
// them, and the query rows from which a block runs the chunk (GEMM) loops.
// Plain C++ (no torch headers).
#pragma once

#include "kvcache/export.h"

#include <cstdint>
#include <string>

namespace kvcache {

struct AttendCpuTuning {
  // Estimated work (the kernel's cost units, about 1/4 ns of AVX2 work each)
  // above which a call uses helper threads. 0: always, when there is more
  // than one thread and more than one task.
  double parallel_work;
  // Fewest slots in a split of a row (a multiple of 64 is used: the kernel's
  // block); rows are split only when there are fewer tasks than threads.
  int64_t min_split;
  // Fewest query rows of a task (query heads per KV head x positions) that
  // see a block for it to run the chunk loops: keys packed once per block,
  // GEMM micro-kernels. 1: every block of every call.
  int64_t gemm_rows = 32;
};

/// The settings in effect (initially the defaults, or the environment's
/// KVCACHE_ATTEND_PARALLEL_WORK / KVCACHE_ATTEND_MIN_SPLIT /
/// KVCACHE_ATTEND_GEMM_ROWS).
KVCACHE_API AttendCpuTuning attend_cpu_tuning();

/// Replaces the settings for later calls (not thread-safe against a call
/// in flight; meant for benchmarks and tests). Throws std::invalid_argument
/// for a negative parallel_work, or a min_split or gemm_rows below 1.
KVCACHE_API void set_attend_cpu_tuning(const AttendCpuTuning& tuning);

/// The instruction-set path the kernel takes on this machine: "avx512bf16"
/// (the avx512vnni path, with bf16 dot products for bf16 caches),
/// "avx512vnni" (the avx512 path, with fused integer dot products for int8
/// caches), "avx512", "avx2" or "generic".
/// KVCACHE_ATTEND_ISA=generic|avx2|avx512|avx512vnni|avx512bf16 (read once)
/// caps the choice at that path (tests force each path the CPU has).
KVCACHE_API std::string attend_cpu_isa();

}  // namespace kvcache
