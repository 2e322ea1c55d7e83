// cuda_emulator.h -- a host (CPU) emulator of the CUDA execution model, for unit tests.
//
// Purpose: compile real CUDA kernel source as plain C++20 (g++ 12+/clang, __CUDACC__ undefined)
// and run it on a CPU, deterministically, under several thread/block schedules, so that kernel
// logic, indexing, shared-memory use and barrier placement can be unit-tested without a GPU.
// Include this header FIRST, then the kernel header; launch with kvemu::launch(kernel, grid,
// block, dynamic_smem_bytes, args...).
//
// What it emulates:
//  * Blocks run one at a time (order: kvemu::options). Inside a block every CUDA thread is a
//    fiber (ucontext) on ONE OS thread; fibers switch only inside barriers / warp ops, so
//    `__shared__` (= function-local `static`) is shared by the block, like real shared memory.
//  * __syncthreads[_or|_and|_count]: released when every non-returned thread has arrived
//    (returned threads count as arrived). __syncwarp, __shfl*_sync, __ballot/__any/__all_sync:
//    a barrier among the lanes named in `mask`, with PTX shfl.sync width/clamp semantics.
//  * Shared memory, dynamic (KVCACHE_EXTERN_SMEM) and static (`__shared__` variables, kept in
//    one linker section, kvemu_shared), refilled with 0xff bytes (float NaN, integer -1) before
//    every block, so reads of shared memory the block never wrote are visible.
//  * Loud errors (message on stderr + abort): deadlock, warp op naming a returned lane,
//    mismatched warp-op masks/kinds, xor-shuffle from an inactive lane, exceptions in kernels.
// What it does NOT emulate:
//  * No memory model: no data races are possible or detected (a thread runs uninterrupted
//    between barriers), atomics are trivially atomic, __threadfence is a no-op, blocks never
//    run concurrently (inter-block spin-waits hang forever).
//  * No timing/occupancy, no limits on shared memory or registers, no lock-step warps: lanes of
//    a warp only meet inside warp ops (warp-synchronous code without __syncwarp is not modeled).
//  * Not thread-safe: one launch at a time per process; no nested launches.
// Works with -fsanitize=address,undefined (fiber switches are annotated for ASan).
#pragma once
#ifdef __CUDACC__
#error "cuda_emulator.h is for host-only builds; do not compile it with nvcc"
#endif
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <numeric>
#include <source_location>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#define KVEMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVEMU_ASAN 1
#endif
#endif
#ifdef KVEMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// Device code guarded for nvcc (csrc/cuda/copy.cuh) compiles here too.
#define KVCACHE_CUDA_EMULATOR 1

// ---------------------------------------------------------------- CUDA keywords & types
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
// Every static `__shared__` variable of the program lands in section kvemu_shared, which the
// linker brackets with __start_kvemu_shared / __stop_kvemu_shared (GNU ld, lld and gold do so
// for a section named like a C identifier); run_block poisons it. GCC leaves variables in a
// named section out of ASan's global redzones, so the memset touches nothing ASan guards.
#define __shared__ static __attribute__((section("kvemu_shared")))
extern "C" {
extern char __start_kvemu_shared[] __attribute__((weak, visibility("hidden")));
extern char __stop_kvemu_shared[] __attribute__((weak, visibility("hidden")));
}
// `KVCACHE_EXTERN_SMEM(float4, s);` replaces `extern __shared__ float4 s[];` (16-byte aligned).
#define KVCACHE_EXTERN_SMEM(T, name) T* const name = reinterpret_cast<T*>(::kvemu::detail::dynamic_smem())
#define __expf(x) expf(x)
#define __logf(x) logf(x)
#define __fdividef(a, b) ((a) / (b))

struct uint3 { unsigned x, y, z; };
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline constexpr float2 make_float2(float x, float y) { return {x, y}; }
inline constexpr float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline constexpr int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline constexpr uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
using cudaStream_t = void*;

// Built-in variables; the scheduler sets them before switching into each fiber.
inline uint3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0};
inline dim3 blockDim, gridDim;

namespace kvemu {
struct Options {
  bool reverse_threads = false;  // resume fibers in descending tid order in each phase
  bool reverse_blocks = false;   // run blocks in descending linear order
  unsigned shuffle_seed = 0;     // != 0: seeded random block order and per-phase fiber order
  size_t stack_bytes = 64 * 1024;  // per-thread fiber stack (guard page below each stack)
};
inline Options options;
struct NamedSchedule { const char* name; Options opt; };
// The standard schedule set a test should run a kernel under (results must all be identical).
inline std::vector<NamedSchedule> all_schedules() {
  std::vector<NamedSchedule> v{{"forward", {}}, {"reverse_threads", {}}, {"reverse_blocks", {}},
                               {"shuffle1", {}}, {"shuffle2", {}}, {"shuffle3", {}}};
  v[1].opt.reverse_threads = true;
  v[2].opt.reverse_blocks = true;
  for (unsigned i = 0; i < 3; ++i) v[3 + i].opt.shuffle_seed = i + 1;
  return v;
}
struct Stats { uint64_t launches = 0, blocks = 0, barriers = 0, shuffles = 0, syncwarps = 0, switches = 0; };
inline Stats stats;  // cumulative counters; barriers/shuffles/syncwarps count released instances

namespace detail {
enum class St : unsigned char { Ready, Running, AtBlock, AtWarp, Done };
enum class WOp : unsigned char { Sync, Idx, Up, Down, Xor, Ballot };
struct Fiber {
  ucontext_t ctx{};
  St st = St::Ready;
  const char* what = "";         // intrinsic it waits in (for reports)
  std::source_location loc{};    // call site of that intrinsic
  int kind = 0, pred = 0, bar_result = 0;  // block barrier: 0 plain, 1 or, 2 and, 3 count
  WOp op = WOp::Sync;
  unsigned mask = 0;
  int arg = 0, width = 32;
  uint64_t val = 0, result = 0;
  void* fake_stack = nullptr;    // ASan bookkeeping
};
struct Launch {
  dim3 grid, block;
  unsigned nthreads = 0, cur = 0;
  void (*invoke)(void*) = nullptr;
  void* args = nullptr;
  std::vector<Fiber> fibers;
  unsigned char* map = nullptr;
  size_t map_bytes = 0, stack_bytes = 0, stride = 0;
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
  ucontext_t sched{};
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
  void* sched_fake = nullptr;
  uint64_t rng = 0;
  unsigned char* stack(unsigned tid) const { return map + tid * stride + (stride - stack_bytes); }
};
inline Launch* g_launch = nullptr;

inline std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
inline std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}
[[noreturn]] inline void fail(const std::string& msg) {
  std::fprintf(stderr, "\n[kvemu] FATAL: %s\n", msg.c_str());
  std::fflush(stderr);
  std::abort();
}
inline std::string loc_str(const std::source_location& l) {
  const char* f = l.file_name();
  const char* s = std::strrchr(f, '/');
  return fmt("%s:%u", s ? s + 1 : f, static_cast<unsigned>(l.line()));
}
inline std::string where(const Launch& L, unsigned tid) {
  const dim3 b = L.block;
  return fmt("block (%u,%u,%u) thread %u (%u,%u,%u)", blockIdx.x, blockIdx.y, blockIdx.z, tid,
             tid % b.x, tid / b.x % b.y, tid / (b.x * b.y));
}
inline Launch& need_launch(const char* what, const std::source_location& loc) {
  if (!g_launch) fail(fmt("%s called outside kvemu::launch (%s)", what, loc_str(loc).c_str()));
  return *g_launch;
}
inline void* dynamic_smem() {
  if (!g_launch) fail("KVCACHE_EXTERN_SMEM used outside kvemu::launch");
  return g_launch->smem;
}
inline uint64_t next_rand(uint64_t& s) {  // splitmix64: same sequence on every platform
  uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
inline void arrange(std::vector<unsigned>& v, bool reverse, Launch& L) {
  if (options.shuffle_seed) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[next_rand(L.rng) % i]);
  } else if (reverse) {
    std::reverse(v.begin(), v.end());
  }
}

// ---------------------------------------------------------------- fiber switching
inline void yield_to_scheduler() {  // called on the fiber's stack
  Launch& L = *g_launch;
  Fiber& f = L.fibers[L.cur];
#ifdef KVEMU_ASAN
  __sanitizer_start_switch_fiber(&f.fake_stack, L.sched_bottom, L.sched_size);
#endif
  swapcontext(&f.ctx, &L.sched);
#ifdef KVEMU_ASAN
  __sanitizer_finish_switch_fiber(f.fake_stack, &L.sched_bottom, &L.sched_size);
#endif
}
inline void fiber_entry(int tid_int) {
  Launch& L = *g_launch;
  const unsigned tid = static_cast<unsigned>(tid_int);
#ifdef KVEMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &L.sched_bottom, &L.sched_size);
#endif
  try {
    L.invoke(L.args);
  } catch (const std::exception& e) {
    fail(fmt("exception escaped the kernel in %s: %s", where(L, tid).c_str(), e.what()));
  } catch (...) {
    fail(fmt("unknown exception escaped the kernel in %s", where(L, tid).c_str()));
  }
  L.fibers[tid].st = St::Done;
#ifdef KVEMU_ASAN
  __sanitizer_start_switch_fiber(nullptr, L.sched_bottom, L.sched_size);  // fiber is finished
#endif
  setcontext(&L.sched);
  fail("setcontext failed");
}
inline void resume(Launch& L, unsigned tid) {  // called on the scheduler's stack
  const dim3 b = L.block;
  threadIdx = {tid % b.x, tid / b.x % b.y, tid / (b.x * b.y)};
  L.cur = tid;
  L.fibers[tid].st = St::Running;
  ++stats.switches;
#ifdef KVEMU_ASAN
  __sanitizer_start_switch_fiber(&L.sched_fake, L.stack(tid), L.stack_bytes);
#endif
  swapcontext(&L.sched, &L.fibers[tid].ctx);
#ifdef KVEMU_ASAN
  __sanitizer_finish_switch_fiber(L.sched_fake, nullptr, nullptr);
#endif
  if (L.fibers[tid].st == St::Running) fail("internal: fiber yielded without a wait state");
}

// ---------------------------------------------------------------- barriers (fiber side)
inline int block_barrier(int kind, int pred, const char* what, const std::source_location& loc) {
  Launch& L = need_launch(what, loc);
  Fiber& f = L.fibers[L.cur];
  f.st = St::AtBlock, f.kind = kind, f.pred = pred != 0, f.what = what, f.loc = loc;
  yield_to_scheduler();
  return f.bar_result;  // per-thread slot: the next barrier instance cannot clobber it
}
inline uint64_t warp_op(WOp op, const char* what, unsigned mask, uint64_t val, int arg, int width,
                        const std::source_location& loc) {
  Launch& L = need_launch(what, loc);
  const unsigned tid = L.cur, lane = tid % 32, base = tid - lane;
  if (!(mask >> lane & 1u))
    fail(fmt("%s at %s in %s: mask 0x%08x does not contain the calling lane %u", what,
             loc_str(loc).c_str(), where(L, tid).c_str(), mask, lane));
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail(fmt("%s at %s: width %d is not a power of two in [1,32]", what, loc_str(loc).c_str(), width));
  for (unsigned l = 0; l < 32; ++l)
    if ((mask >> l & 1u) && base + l < L.nthreads && L.fibers[base + l].st == St::Done)
      fail(fmt("%s at %s in %s: mask 0x%08x names lane %u (thread %u), which has already returned",
               what, loc_str(loc).c_str(), where(L, tid).c_str(), mask, l, base + l));
  Fiber& f = L.fibers[tid];
  f.st = St::AtWarp, f.op = op, f.what = what, f.loc = loc, f.mask = mask, f.val = val;
  f.arg = arg, f.width = width;
  yield_to_scheduler();
  return f.result;
}
template <class T>
T shfl(WOp op, const char* what, unsigned mask, T var, int arg, int width, const std::source_location& loc) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffled type must be <= 8 bytes, trivially copyable");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = warp_op(op, what, mask, bits, arg, width, loc);
  T out = var;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// ---------------------------------------------------------------- scheduler side
inline void release_warp_ops(Launch& L) {
  for (unsigned base = 0; base < L.nthreads; base += 32) {
    const unsigned n = std::min(32u, L.nthreads - base);
    const unsigned exist = n == 32 ? ~0u : (1u << n) - 1;  // lanes missing in a partial warp are ignored
    unsigned done = 0, waiting = 0, released = 0;
    for (unsigned l = 0; l < n; ++l) {
      if (L.fibers[base + l].st == St::Done) done |= 1u << l;
      if (L.fibers[base + l].st == St::AtWarp) waiting |= 1u << l;
    }
    for (unsigned l = 0; l < n; ++l) {
      if (!(waiting >> l & 1u) || (released >> l & 1u)) continue;
      const Fiber& f = L.fibers[base + l];
      const unsigned grp = f.mask & exist;
      if (grp & done)
        fail(fmt("%s at %s in block (%u,%u,%u) thread %u: mask 0x%08x names lane %d (thread %u), which has returned",
                 f.what, loc_str(f.loc).c_str(), blockIdx.x, blockIdx.y, blockIdx.z, base + l, f.mask,
                 std::countr_zero(grp & done), base + std::countr_zero(grp & done)));
      if ((grp & waiting) != grp) continue;  // some named lane has not arrived (yet)
      for (unsigned m = 0; m < n; ++m) {
        const Fiber& g = L.fibers[base + m];
        if ((grp >> m & 1u) && (g.mask != f.mask || g.op != f.op || g.width != f.width))
          fail(fmt("mismatched warp ops in block (%u,%u,%u) warp %u: lane %u %s mask 0x%08x width %d (%s) vs "
                   "lane %u %s mask 0x%08x width %d (%s)", blockIdx.x, blockIdx.y, blockIdx.z, base / 32, l,
                   f.what, f.mask, f.width, loc_str(f.loc).c_str(), m, g.what, g.mask, g.width,
                   loc_str(g.loc).c_str()));
      }
      uint64_t ballot = 0;
      for (unsigned m = 0; m < n; ++m)
        if ((grp >> m & 1u) && L.fibers[base + m].val) ballot |= 1u << m;
      for (unsigned m = 0; m < n; ++m) {
        if (!(grp >> m & 1u)) continue;
        Fiber& g = L.fibers[base + m];
        // PTX shfl.sync: segmask = c[12:8] = 32 - width, clamp = 31 (0 for up).
        const int lane = static_cast<int>(m), b = g.arg & 31, seg = (32 - g.width) & 31;
        const int minl = lane & seg, maxl = minl | (31 & ~seg);
        int j = lane;
        bool ok = true;
        switch (g.op) {
          case WOp::Sync: case WOp::Ballot: break;
          case WOp::Idx: j = minl | (b & ~seg); ok = j <= maxl; break;
          case WOp::Up: j = lane - b; ok = j >= minl; break;
          case WOp::Down: j = lane + b; ok = j <= maxl; break;
          case WOp::Xor: j = lane ^ b; ok = j <= maxl; break;
        }
        if (!ok) j = lane;
        if (!(grp >> j & 1u)) {  // source lane not participating (outside mask / warp)
          if (g.op == WOp::Xor)
            fail(fmt("%s at %s in block (%u,%u,%u) thread %u: source lane %d is not in mask 0x%08x (or does not "
                     "exist); result undefined in CUDA", g.what, loc_str(g.loc).c_str(), blockIdx.x, blockIdx.y,
                     blockIdx.z, base + m, j, g.mask));
          j = lane;  // down/up/idx: caller keeps its own value
        }
        g.result = g.op == WOp::Ballot ? ballot : L.fibers[base + static_cast<unsigned>(j)].val;
      }
      released |= grp;
      ++(f.op == WOp::Sync ? stats.syncwarps : stats.shuffles);
    }
    for (unsigned l = 0; l < n; ++l)
      if (released >> l & 1u) L.fibers[base + l].st = St::Ready;
  }
}
inline void release_block_barrier(Launch& L) {
  unsigned live = 0, at = 0, count = 0;
  int any = 0, all = 1;
  for (const Fiber& f : L.fibers) {
    if (f.st == St::Done) continue;
    ++live;
    if (f.st != St::AtBlock) continue;
    ++at, count += f.pred, any |= f.pred, all &= f.pred;
  }
  if (live == 0 || at != live) return;
  for (Fiber& f : L.fibers) {
    if (f.st != St::AtBlock) continue;
    f.bar_result = f.kind == 1 ? any : f.kind == 2 ? all : static_cast<int>(count);
    f.st = St::Ready;
  }
  ++stats.barriers;
}
[[noreturn]] inline void report_deadlock(Launch& L) {
  std::string s = fmt("deadlock in block (%u,%u,%u) of grid (%u,%u,%u), blockDim (%u,%u,%u): no thread can "
                      "proceed (tid = x + y*bx + z*bx*by, warp = tid/32)\n", blockIdx.x, blockIdx.y, blockIdx.z,
                      L.grid.x, L.grid.y, L.grid.z, L.block.x, L.block.y, L.block.z);
  auto desc = [&](unsigned t) -> std::string {
    const Fiber& f = L.fibers[t];
    if (f.st == St::Done) return "returned";
    if (f.st == St::AtBlock) return fmt("waiting at BLOCK barrier %s (%s)", f.what, loc_str(f.loc).c_str());
    return fmt("waiting at WARP op %s mask 0x%08x in warp %u (%s)", f.what, f.mask, t / 32, loc_str(f.loc).c_str());
  };
  for (unsigned t = 0; t < L.nthreads;) {  // run-length compress identical descriptions
    const std::string d = desc(t);
    unsigned e = t + 1;
    while (e < L.nthreads && desc(e) == d && (L.fibers[t].st != St::AtWarp || e / 32 == t / 32)) ++e;
    s += fmt("  threads %u-%u: %s\n", t, e - 1, d.c_str());
    t = e;
  }
  fail(s);
}
// Separate non-inlined function: getcontext "returns twice", which would clobber loop variables.
__attribute__((noinline)) inline void init_fiber(Launch& L, unsigned t) {
  Fiber& f = L.fibers[t];
  f = Fiber{};
#ifdef KVEMU_ASAN
  ASAN_UNPOISON_MEMORY_REGION(L.stack(t), L.stack_bytes);  // stale frames of the previous block
#endif
  if (getcontext(&f.ctx) != 0) fail("getcontext failed");
  f.ctx.uc_stack.ss_sp = L.stack(t);
  f.ctx.uc_stack.ss_size = L.stack_bytes;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, reinterpret_cast<void (*)()>(&fiber_entry), 1, static_cast<int>(t));
}
inline void run_block(Launch& L, unsigned lin) {
  const dim3 g = L.grid;
  blockIdx = {lin % g.x, lin / g.x % g.y, lin / (g.x * g.y)};
  if (L.smem_bytes) std::memset(L.smem, 0xff, L.smem_bytes);  // poison: NaN floats
  if (__start_kvemu_shared != nullptr && __stop_kvemu_shared > __start_kvemu_shared) {
    std::memset(__start_kvemu_shared, 0xff,
                static_cast<size_t>(__stop_kvemu_shared - __start_kvemu_shared));
  }
  for (unsigned t = 0; t < L.nthreads; ++t) init_fiber(L, t);
  std::vector<unsigned> order;
  for (;;) {  // phase: run every ready fiber until it blocks or returns, then release barriers
    order.clear();
    bool all_done = true;
    for (unsigned t = 0; t < L.nthreads; ++t) {
      if (L.fibers[t].st == St::Ready) order.push_back(t);
      all_done &= L.fibers[t].st == St::Done;
    }
    if (all_done) break;
    if (order.empty()) report_deadlock(L);
    arrange(order, options.reverse_threads, L);
    for (unsigned t : order) resume(L, t);
    release_warp_ops(L);
    release_block_barrier(L);
  }
  ++stats.blocks;
}
inline void run_grid(dim3 grid, dim3 block, size_t smem_bytes, void (*invoke)(void*), void* args) {
  if (g_launch) fail("nested kvemu::launch (kernel launching a kernel / launch from a kernel) is not supported");
  const uint64_t nb = uint64_t(grid.x) * grid.y * grid.z, nt = uint64_t(block.x) * block.y * block.z;
  if (nb == 0 || nt == 0 || nt > 1024 || nb > 0xffffffffu)
    fail(fmt("invalid launch configuration grid (%u,%u,%u) block (%u,%u,%u)", grid.x, grid.y, grid.z, block.x,
             block.y, block.z));
  Launch L;
  L.grid = grid, L.block = block, L.nthreads = static_cast<unsigned>(nt), L.invoke = invoke, L.args = args;
  L.fibers.resize(L.nthreads);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  L.stack_bytes = (std::max<size_t>(options.stack_bytes, 16384) + page - 1) / page * page;
  L.stride = L.stack_bytes + page;  // [guard page][stack] per thread
  L.map_bytes = L.stride * L.nthreads;
  void* m = mmap(nullptr, L.map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) fail("mmap of fiber stacks failed");
  L.map = static_cast<unsigned char*>(m);
  for (unsigned t = 0; t < L.nthreads; ++t) mprotect(L.map + size_t(t) * L.stride, page, PROT_NONE);
  L.smem_bytes = smem_bytes;
  L.smem = static_cast<unsigned char*>(::operator new(smem_bytes, std::align_val_t{16}));
  L.rng = options.shuffle_seed;
  std::vector<unsigned> blocks(static_cast<size_t>(nb));
  std::iota(blocks.begin(), blocks.end(), 0u);
  arrange(blocks, options.reverse_blocks, L);
  gridDim = grid, blockDim = block;
  g_launch = &L;
  ++stats.launches;
  for (unsigned b : blocks) run_block(L, b);
  g_launch = nullptr;
  ::operator delete(L.smem, std::align_val_t{16});
  munmap(L.map, L.map_bytes);
}
}  // namespace detail

// Runs the whole grid synchronously. Arguments are converted to the kernel's parameter types once
// (like kernel parameters); every thread receives its own copy.
template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t dynamic_smem_bytes, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "kvemu::launch: wrong number of kernel arguments");
  struct Pack { void (*k)(P...); std::tuple<std::decay_t<P>...> a; };
  Pack pack{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)};
  detail::run_grid(grid, block, dynamic_smem_bytes,
                   [](void* p) { auto* pk = static_cast<Pack*>(p); std::apply(pk->k, pk->a); }, &pack);
}
}  // namespace kvemu

// ---------------------------------------------------------------- intrinsics (global namespace)
using kvemu_loc = std::source_location;
inline void __syncthreads(kvemu_loc l = kvemu_loc::current()) { kvemu::detail::block_barrier(0, 0, "__syncthreads", l); }
inline int __syncthreads_or(int p, kvemu_loc l = kvemu_loc::current()) { return kvemu::detail::block_barrier(1, p, "__syncthreads_or", l); }
inline int __syncthreads_and(int p, kvemu_loc l = kvemu_loc::current()) { return kvemu::detail::block_barrier(2, p, "__syncthreads_and", l); }
inline int __syncthreads_count(int p, kvemu_loc l = kvemu_loc::current()) { return kvemu::detail::block_barrier(3, p, "__syncthreads_count", l); }
inline void __syncwarp(unsigned mask = 0xffffffffu, kvemu_loc l = kvemu_loc::current()) {
  kvemu::detail::warp_op(kvemu::detail::WOp::Sync, "__syncwarp", mask, 0, 0, 32, l);
}
template <class T> T __shfl_sync(unsigned mask, T var, int srcLane, int width = 32, kvemu_loc l = kvemu_loc::current()) {
  return kvemu::detail::shfl(kvemu::detail::WOp::Idx, "__shfl_sync", mask, var, srcLane, width, l);
}
template <class T> T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32, kvemu_loc l = kvemu_loc::current()) {
  return kvemu::detail::shfl(kvemu::detail::WOp::Up, "__shfl_up_sync", mask, var, static_cast<int>(delta), width, l);
}
template <class T> T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32, kvemu_loc l = kvemu_loc::current()) {
  return kvemu::detail::shfl(kvemu::detail::WOp::Down, "__shfl_down_sync", mask, var, static_cast<int>(delta), width, l);
}
template <class T> T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = 32, kvemu_loc l = kvemu_loc::current()) {
  return kvemu::detail::shfl(kvemu::detail::WOp::Xor, "__shfl_xor_sync", mask, var, laneMask, width, l);
}
inline unsigned __ballot_sync(unsigned mask, int p, kvemu_loc l = kvemu_loc::current()) {
  return static_cast<unsigned>(kvemu::detail::warp_op(kvemu::detail::WOp::Ballot, "__ballot_sync", mask, p != 0, 0, 32, l));
}
inline int __any_sync(unsigned mask, int p, kvemu_loc l = kvemu_loc::current()) { return __ballot_sync(mask, p, l) != 0; }
inline int __all_sync(unsigned mask, int p, kvemu_loc l = kvemu_loc::current()) { return __ballot_sync(mask, !p, l) == 0; }

// Atomics: fibers never switch inside them, so plain read-modify-write is atomic here.
inline int atomicCAS(int* a, int c, int v) { int o = *a; if (o == c) *a = v; return o; }
inline unsigned atomicCAS(unsigned* a, unsigned c, unsigned v) { unsigned o = *a; if (o == c) *a = v; return o; }
inline unsigned long long atomicCAS(unsigned long long* a, unsigned long long c, unsigned long long v) { auto o = *a; if (o == c) *a = v; return o; }
inline int atomicAdd(int* a, int v) { int o = *a; *a = o + v; return o; }
inline unsigned atomicAdd(unsigned* a, unsigned v) { unsigned o = *a; *a = o + v; return o; }
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) { auto o = *a; *a = o + v; return o; }
inline float atomicAdd(float* a, float v) { float o = *a; *a = o + v; return o; }
inline double atomicAdd(double* a, double v) { double o = *a; *a = o + v; return o; }
inline int atomicSub(int* a, int v) { int o = *a; *a = o - v; return o; }
inline unsigned atomicSub(unsigned* a, unsigned v) { unsigned o = *a; *a = o - v; return o; }
inline int atomicMax(int* a, int v) { int o = *a; if (v > o) *a = v; return o; }
inline unsigned atomicMax(unsigned* a, unsigned v) { unsigned o = *a; if (v > o) *a = v; return o; }
inline int atomicMin(int* a, int v) { int o = *a; if (v < o) *a = v; return o; }
inline unsigned atomicMin(unsigned* a, unsigned v) { unsigned o = *a; if (v < o) *a = v; return o; }
inline int atomicExch(int* a, int v) { int o = *a; *a = v; return o; }
inline unsigned atomicExch(unsigned* a, unsigned v) { unsigned o = *a; *a = v; return o; }
inline float atomicExch(float* a, float v) { float o = *a; *a = v; return o; }
inline unsigned atomicOr(unsigned* a, unsigned v) { unsigned o = *a; *a = o | v; return o; }
inline unsigned atomicAnd(unsigned* a, unsigned v) { unsigned o = *a; *a = o & v; return o; }

inline int __clz(int x) { return std::countl_zero(static_cast<unsigned>(x)); }  // 32 for 0
inline int __clzll(long long x) { return std::countl_zero(static_cast<unsigned long long>(x)); }
inline int __popc(unsigned x) { return std::popcount(x); }
inline int __popcll(unsigned long long x) { return std::popcount(x); }
inline int __ffs(int x) { return x ? std::countr_zero(static_cast<unsigned>(x)) + 1 : 0; }
inline void __threadfence() {}
inline void __threadfence_block() {}
template <class T> inline T __ldg(const T* p) { return *p; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : x > 1.f ? 1.f : x; }
