// Parallel work that never waits for a thread that is not running.
//
// at::parallel_for opens an OpenMP region: the caller waits until every
// worker has started and finished. On a machine whose cores are busy a woken
// worker can wait a whole scheduler slice (milliseconds) for a core, and the
// caller waits with it: measured on the shared 2-core CI machine, a 2 MiB
// copy took 20 ms instead of 0.26 ms. run_with_helpers instead lets the
// caller start at once and take tasks from a shared counter; helpers from
// ATen's inter-op pool (at::launch) join when they get a core. If none
// shows up, the caller does all the work, at the cost of one enqueue per
// helper. Used by attend and by the cache writes.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <thread>

namespace kvcache {
namespace cpu {

// Shared by the caller and its helpers; outlives the call (a helper that
// starts late still reads it).
struct Crew {
  std::atomic<int64_t> next{0};      // next task to take
  std::atomic<int64_t> active{0};    // helpers inside the work
  std::atomic<bool> closed{false};   // the caller is done: late helpers leave
};

// Runs `work` on the calling thread and on up to `helpers` threads of ATen's
// inter-op pool (at::launch), all taking tasks from one counter. Unlike an
// OpenMP region (at::parallel_for), the caller never waits for a helper that
// has not started: on a loaded machine a woken thread can wait a whole time
// slice (milliseconds) for a core, and the caller would wait with it. The
// caller does all the work if no helper shows up; it waits only for helpers
// that are inside a task. `work(closed, next)` must return at once when
// `closed` is set (it then touches nothing the caller owns).
template <typename Work>
inline void run_with_helpers(int64_t helpers, const Work& work) {
  auto crew = std::make_shared<Crew>();
  for (int64_t h = 0; h < helpers; ++h) {
    at::launch([crew, &work] {
      // Seq-cst order: either the caller sees this helper in `active`, or
      // the helper sees `closed` and touches nothing of the caller's.
      crew->active.fetch_add(1);
      if (!crew->closed.load()) {
        try {
          work(crew->closed, crew->next);
        } catch (...) {
          // `work` may throw only before it takes a task (attend allocates
          // its scratch first): the other threads then take them all.
        }
      }
      crew->active.fetch_sub(1);
    });
  }
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
