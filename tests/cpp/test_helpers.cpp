// csrc/cpu/helpers.h: the caller-never-waits helpers, hot helpers included.
// Each call's tasks run exactly once, none runs after its call returned,
// back-to-back calls (which hot helpers join) and calls from several threads
// at once included, and an exception in the caller's share reaches it.
#include <ATen/Parallel.h>

#include <atomic>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "catch.h"
#include "cpu/helpers.h"

namespace {

// Runs `calls` calls of for_each_task over `tasks` tasks at `threads`
// threads; returns false at the first task run twice, missed, or run after
// its call returned.
bool calls_run_each_task_once(int calls, int64_t tasks, int64_t threads) {
  // Flags outlive every call: a task of a returned call would find its flag set.
  std::vector<std::unique_ptr<std::atomic<bool>>> returned;
  std::atomic<bool> late{false};
  for (int c = 0; c < calls; ++c) {
    returned.push_back(std::make_unique<std::atomic<bool>>(false));
    std::atomic<bool>* done = returned.back().get();
    std::vector<std::atomic<int>> runs(tasks);
    kvcache::cpu::for_each_task(
        tasks,
        [&](int64_t t) {
          if (done->load()) late.store(true);
          runs[t].fetch_add(1);
          // A little work, so that helpers overlap with the caller.
          volatile double x = 0;
          for (int i = 0; i < 200; ++i) x = x + i;
        },
        threads);
    done->store(true);
    for (int64_t t = 0; t < tasks; ++t) {
      if (runs[t].load() != 1) return false;
    }
  }
  return !late.load();
}

}  // namespace

TEST_CASE("helpers: every task of every call runs exactly once", "[helpers]") {
  for (int64_t threads : {2, 3, 4}) {
    for (int64_t tasks : {1, 2, 3, 17, 64}) {
      INFO("threads " << threads << ", tasks " << tasks);
      CHECK(calls_run_each_task_once(300, tasks, threads));
    }
  }
}

TEST_CASE("helpers: calls from several threads at once", "[helpers]") {
  std::atomic<int> bad{0};
  std::vector<std::thread> callers;
  for (int i = 0; i < 3; ++i) {
    callers.emplace_back([&bad] {
      if (!calls_run_each_task_once(200, 9, 2)) bad.fetch_add(1);
    });
  }
  for (auto& t : callers) t.join();
  CHECK(bad.load() == 0);
}

TEST_CASE("helpers: an exception in the caller's share reaches the caller", "[helpers]") {
  const std::thread::id caller = std::this_thread::get_id();
  for (int c = 0; c < 50; ++c) {
    std::atomic<bool> thrown{false};
    bool caught = false;
    try {
      kvcache::cpu::run_with_helpers(2, [&](const std::atomic<bool>& closed, std::atomic<int64_t>& next) {
        if (closed.load()) return;
        if (std::this_thread::get_id() == caller) {
          thrown.store(true);
          throw std::runtime_error("task failed");
        }
        for (int64_t i = next.fetch_add(1); i < 8; i = next.fetch_add(1)) {
        }
      });
    } catch (const std::runtime_error& e) {
      caught = std::string(e.what()) == "task failed";
    }
    CHECK(thrown.load());
    CHECK(caught);
  }
  // The helpers still serve later calls.
  CHECK(calls_run_each_task_once(50, 17, 3));
}
