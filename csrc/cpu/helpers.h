// Parallel work that never waits for a thread that is not running.
//
// at::parallel_for opens an OpenMP region: the caller waits until every
// worker has started and finished. On a machine whose cores are busy a woken
// worker can wait a whole scheduler slice (milliseconds) for a core, and the
// caller waits with it, so a sub-millisecond copy can take a slice.
// run_with_helpers instead lets the caller start at once and take tasks
// from a shared counter; helpers from ATen's inter-op pool (at::launch) join
// when they get a core. If none shows up, the caller does all the work, at
// the cost of one enqueue per helper. Used by attend and by the cache writes.
//
// Hot helpers. Waking a sleeping pool thread takes tens of microseconds
// (more on a VM, whose idle vCPU sleeps in the hypervisor), as long as a
// whole decode-step attend over a few hundred slots, so a call split over
// two cold threads runs at its serial speed. So a helper that has finished
// stays a while (spin_us(), default 200 us; KVCACHE_HELPER_SPIN_US, 0:
// never) polling the Lobby for the next call's crew, yielding the core
// between polls so that any other runnable thread (the caller's own, an
// OpenMP worker) goes first; a call takes the hot helpers before it
// enqueues new ones. The spin trades a little idle CPU after each call for
// decode steps that find their helpers awake; re-tune it with
// KVCACHE_HELPER_SPIN_US and `python benchmarks/bench_attend.py --cases
// decode --threads 2` (short rows are the ones it helps).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

namespace kvcache {
namespace cpu {

// Shared by the caller and its helpers; outlives the call (a helper that
// starts late, or a hot one, still reads it).
struct Crew {
  std::atomic<int64_t> next{0};      // next task to take
  std::atomic<int64_t> active{0};    // helpers inside the work
  std::atomic<bool> closed{false};   // the caller is done: late helpers leave
  std::atomic<int64_t> seats{0};     // helpers still wanted
  uint64_t epoch = 0;                // its number in the Lobby
  // The caller's work, type-erased; only called while !closed (the caller
  // then waits for the helpers inside it, so `work` is alive).
  void (*call)(const void* work, const std::atomic<bool>& closed, std::atomic<int64_t>& next) = nullptr;
  const void* work = nullptr;
};

// How long a helper stays hot after its work, in microseconds.
inline int64_t spin_us() {
  static const int64_t us = [] {
    const char* env = std::getenv("KVCACHE_HELPER_SPIN_US");
    if (env == nullptr || *env == '\0') return int64_t{200};
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    return (end != nullptr && *end == '\0' && v >= 0) ? static_cast<int64_t>(std::min(v, 100000LL))
                                                      : int64_t{200};
  }();
  return us;
}

// The latest call's crew, where hot helpers look for work; process-wide.
class Lobby {
 public:
  static Lobby& get() {
    static Lobby* lobby = new Lobby();  // never destroyed: helpers may poll it at exit
    return *lobby;
  }
  void post(const std::shared_ptr<Crew>& crew) {
    std::lock_guard<std::mutex> lock(mutex_);
    crew->epoch = epoch_.load() + 1;
    current_ = crew;
    epoch_.store(crew->epoch);
  }
  // The crew posted after `seen`, if any (and `seen` moves to it).
  std::shared_ptr<Crew> take(uint64_t& seen) {
    if (epoch_.load(std::memory_order_acquire) == seen) return nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    seen = epoch_.load();
    return current_;
  }
  std::atomic<int64_t>& hot() { return hot_; }

 private:
  std::mutex mutex_;
  std::shared_ptr<Crew> current_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int64_t> hot_{0};  // helpers polling now
};

// One helper's turn in a crew: a seat if one is left, then the work unless
// the caller is done. Seq-cst order: either the caller sees this helper in
// `active`, or the helper sees `closed` and touches nothing of the caller's.
inline void join_crew(Crew& crew) {
  if (crew.seats.fetch_sub(1) <= 0) return;
  crew.active.fetch_add(1);
  if (!crew.closed.load()) {
    try {
      crew.call(crew.work, crew.closed, crew.next);
    } catch (...) {
      // `work` may throw only before it takes a task (attend allocates its
      // scratch first): the other threads then take them all.
    }
  }
  crew.active.fetch_sub(1);
}

// A pool thread's helper: the crew it was enqueued for, then every crew
// posted while it stays hot.
inline void serve(std::shared_ptr<Crew> crew) {
  uint64_t seen = crew->epoch;
  join_crew(*crew);
  crew.reset();
  const auto spin = std::chrono::microseconds(spin_us());
  if (spin.count() == 0) return;
  Lobby& lobby = Lobby::get();
  lobby.hot().fetch_add(1);
  auto until = std::chrono::steady_clock::now() + spin;
  while (std::chrono::steady_clock::now() < until) {
    if (std::shared_ptr<Crew> next = lobby.take(seen)) {
      lobby.hot().fetch_sub(1);
      join_crew(*next);
      lobby.hot().fetch_add(1);
      until = std::chrono::steady_clock::now() + spin;
    } else {
      std::this_thread::yield();
    }
  }
  lobby.hot().fetch_sub(1);
}

// Runs `work` on the calling thread and on up to `helpers` threads of ATen's
// inter-op pool (at::launch), all taking tasks from one counter. Unlike an
// OpenMP region (at::parallel_for), the caller never waits for a helper that
// has not started: on a loaded machine a woken thread can wait a whole time
// slice (milliseconds) for a core, and the caller would wait with it. The
// caller does all the work if no helper shows up; it waits only for helpers
// that are inside a task. Hot helpers (see the top of this file) join first;
// as many more as are still wanted are enqueued. `work(closed, next)` must
// return at once when `closed` is set (it then touches nothing the caller
// owns).
template <typename Work>
inline void run_with_helpers(int64_t helpers, const Work& work) {
  auto crew = std::make_shared<Crew>();
  crew->seats.store(helpers);
  crew->work = &work;
  crew->call = [](const void* w, const std::atomic<bool>& closed, std::atomic<int64_t>& next) {
    (*static_cast<const Work*>(w))(closed, next);
  };
  Lobby& lobby = Lobby::get();
  lobby.post(crew);
  const int64_t hot = std::min(helpers, lobby.hot().load());
  for (int64_t h = hot; h < helpers; ++h) at::launch([crew] { serve(crew); });
  std::exception_ptr error;
  try {
    static const std::atomic<bool> open{false};
    work(open, crew->next);
  } catch (...) {
    error = std::current_exception();
  }
  crew->closed.store(true);
  while (crew->active.load() != 0) std::this_thread::yield();
  if (error) {
    // Tasks the caller took and did not finish are lost: fail the call.
    std::rethrow_exception(error);
  }
}

// Runs task(i) for i in [0, tasks) on the caller and up to threads - 1
// helpers (threads: at::get_num_threads() by default).
template <typename Task>
void for_each_task(int64_t tasks, const Task& task, int64_t threads = -1) {
  if (threads < 0) threads = at::get_num_threads();
  const int64_t helpers = std::min<int64_t>(threads, tasks) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < tasks; ++i) task(i);
    return;
  }
  run_with_helpers(helpers, [&](const std::atomic<bool>& closed, std::atomic<int64_t>& next) {
    if (closed.load()) return;
    for (int64_t i = next.fetch_add(1); i < tasks; i = next.fetch_add(1)) task(i);
  });
}

}  // namespace cpu
}  // namespace kvcache
