// The runtime that csrc/cuda/*_kernels.cuh's host code takes (device limits,
// scratch, memset, launch), on the CPU: launches run on cuda_emulator.h's
// fibers, "device" memory is host memory. Shared by the emulated CUDA tests
// (test_*_cuda_emulated.cpp); include it before a kernel header.
#pragma once

#include "cuda_emulator.h"  // first: __global__, threadIdx, __syncthreads, ...
#include "cuda/attend_common.cuh"

#include <ATen/ATen.h>

#include "catch.h"

#include <cstring>
#include <vector>

namespace kvcache {
namespace testing {

using attn_cuda::DeviceLimits;

// Scratch starts as garbage (0xab bytes), as device memory would.
struct EmulatedRuntime {
  DeviceLimits device{227 * 1024, 132};  // an H100's opt-in shared memory and SMs
  std::vector<at::Tensor> held;
  int launches = 0;

  DeviceLimits limits() const { return device; }
  void* scratch(size_t bytes) {
    held.push_back(at::full({static_cast<int64_t>(bytes) + 16}, 0xab, at::kByte));
    return held.back().data_ptr();
  }
  void memset(void* p, int byte, size_t bytes) { std::memset(p, byte, bytes); }
  template <typename Kernel, typename... Args>
  void launch(Kernel kernel, dim3 grid, dim3 block, size_t smem, const Args&... args) {
    ++launches;
    kvemu::launch(kernel, grid, block, smem, args...);
  }
};

// The schedules every case runs under: a correct kernel's output does not
// depend on the order of blocks or of threads between barriers.
struct Schedule {
  const char* name;
  bool reverse_threads, reverse_blocks;
  unsigned seed;
};
inline constexpr Schedule kSchedules[] = {
    {"forward", false, false, 0}, {"reverse threads", true, false, 0},
    {"reverse blocks", false, true, 0}, {"shuffled", false, false, 7}};

inline void use(const Schedule& s) {
  kvemu::options.reverse_threads = s.reverse_threads;
  kvemu::options.reverse_blocks = s.reverse_blocks;
  kvemu::options.shuffle_seed = s.seed;
}

inline double tolerance(at::ScalarType dtype) { return dtype == at::kFloat ? 2e-5 : 2e-2; }

// Runs a launch under every schedule: each result matches `want` (float64)
// within the output dtype's tolerance, scaled by the largest |want|, and all
// give the same bits. `run` launches on the runtime it is given.
template <typename Run>
void check_schedules(const Run& run, const at::Tensor& want, DeviceLimits device,
                     int min_launches = 1) {
  at::Tensor first;
  for (const Schedule& s : kSchedules) {
    use(s);
    EmulatedRuntime rt;
    rt.device = device;
    const at::Tensor got = run(rt);
    INFO("schedule " << s.name << ", launches " << rt.launches);
    CHECK(rt.launches >= min_launches);
    const double err = (got.to(at::kDouble) - want).abs().max().item<double>();
    CHECK(err <= tolerance(got.scalar_type()) * (1 + want.abs().max().item<double>()));
    if (!first.defined()) {
      first = got;
    } else {
      CHECK(at::equal(got, first));
    }
  }
  use(kSchedules[0]);
}

// An H100's opt-in shared memory and multiprocessors (decode batches split
// their slots), and a small GPU (no split).
inline constexpr DeviceLimits kBigGpu{227 * 1024, 132};
inline constexpr DeviceLimits kSmallGpu{48 * 1024, 2};

}  // namespace testing
}  // namespace kvcache
