// kiln-x86's decode work pool: helper threads that share the calling thread's small loops.
//
// Why not OpenMP (at::parallel_for): a decode step makes ~120 matmul calls of a few to a few
// hundred microseconds each. An OpenMP region ends in a barrier, so a helper thread that the OS
// has descheduled (the API server, the client or another process needs the core) stalls the
// model's thread until it runs again: on 2 cores that made two model threads slower than one.
// Here the calling thread never waits for a helper that has not started: every loop is cut into
// chunks that the caller and the helpers claim one at a time from one atomic counter, so a
// helper that is not running simply claims nothing and the caller does every chunk itself. The
// caller waits only for chunks a helper has claimed and not finished (a chunk is a few
// microseconds of work).
//
// Contract: ``WorkPool::instance().run(n, fn)`` calls ``fn(i)`` exactly once for every ``i`` in
// ``[0, n)`` (in no given order, on the calling thread or a helper) and returns when all calls
// have returned. ``fn`` must not call ``run`` again (helpers run one loop at a time) and must not
// throw. With 0 helpers (the default) ``run`` is a plain loop on the calling thread.
// ``set_helpers(cpus)`` replaces the helpers by one per core of ``cpus`` (not while a ``run`` is
// in progress). Between
// loops a helper spins for ``kSpinNs`` (the gap between two matmuls of a step), then sleeps
// until the next loop. One pool per extension that includes this header; ``attach(handle)``
// sends an extension's loops to another extension's pool (``handle()``: plain function
// pointers, the same across copies of this header), so a process keeps one set of helpers.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>
#include <torch/extension.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kiln_x86 {

// A pool's two entry points as plain function pointers, for another extension to call.
struct PoolHandle {
  int (*helpers)();
  void (*run)(int64_t n, void (*fn)(const void*, int64_t), const void* arg);
};

class WorkPool {
 public:
  static WorkPool& instance() {
    static WorkPool pool;
    return pool;
  }

  // This extension's pool (its own helpers, never an attached one's).
  static const PoolHandle* handle() {
    static const PoolHandle h{
        [] { return static_cast<int>(instance().threads_.size()); },
        [](int64_t n, void (*fn)(const void*, int64_t), const void* arg) {
          instance().run_here(n, [fn, arg](int64_t i) { fn(arg, i); });
        }};
    return &h;
  }

  // Later loops run on `other`'s pool (null, or this pool's own handle: on this one again).
  void attach(const PoolHandle* other) { attached_ = other == handle() ? nullptr : other; }

  int helpers() const {
    return attached_ ? attached_->helpers() : static_cast<int>(threads_.size());
  }

  // One helper per entry of `cpus`, pinned to that core (a negative id: not pinned); empty: none.
  void set_helpers(const std::vector<int>& cpus) {
    stop_helpers();
    stop_.store(false);
    for (int cpu : cpus) {
      threads_.emplace_back([this, cpu] {
        if (cpu >= 0) {
          cpu_set_t set;
          CPU_ZERO(&set);
          CPU_SET(cpu, &set);
          // Best effort: an unpinned helper still claims chunks wherever it runs.
          pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
        }
        helper_loop();
      });
    }
  }

  template <typename Fn>
  void run(int64_t n, const Fn& fn) {
    if (attached_ != nullptr) {
      attached_->run(n, [](const void* f, int64_t i) { (*static_cast<const Fn*>(f))(i); }, &fn);
      return;
    }
    run_here(n, fn);
  }

  ~WorkPool() { stop_helpers(); }

 private:
  static constexpr uint64_t kClosed = 0xffffffffu;
  static constexpr int64_t kSpinNs = 200000;

  WorkPool() = default;

  template <typename Fn>
  void run_here(int64_t n, const Fn& fn) {
    if (threads_.empty() || n <= 1) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    fn_ = [](const void* f, int64_t i) { (*static_cast<const Fn*>(f))(i); };
    arg_ = &fn;
    count_ = n;
    done_.store(0, std::memory_order_relaxed);
    // Publishing the new generation with index 0 opens the loop to helpers.
    const uint64_t gen = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    state_.store(gen << 32, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    claim(gen, n);
    // A helper mid-chunk finishes within microseconds, unless the OS took its core: then
    // yield, in case it waits for this one.
    for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 4096) _mm_pause();
      else std::this_thread::yield();
    }
    // Closed: a helper that read this loop's generation late can claim nothing more of it.
    state_.store((gen << 32) | kClosed, std::memory_order_release);
  }

  // Claims and runs chunks of loop `gen` (of `n` chunks) until none is left.
  void claim(uint64_t gen, int64_t n) {
    int64_t ran = 0;
    uint64_t s = state_.load(std::memory_order_acquire);
    while ((s >> 32) == gen && static_cast<int64_t>(s & kClosed) < n) {
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
      fn_(arg_, static_cast<int64_t>(s & kClosed));
      ++ran;
      s = state_.load(std::memory_order_acquire);
    }
    if (ran) done_.fetch_add(ran, std::memory_order_acq_rel);
  }

  void helper_loop() {
    uint64_t seen = state_.load(std::memory_order_acquire) >> 32;
    while (!stop_.load(std::memory_order_relaxed)) {
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(kSpinNs);
      uint64_t gen = state_.load(std::memory_order_acquire) >> 32;
      while (gen == seen && !stop_.load(std::memory_order_relaxed) &&
             std::chrono::steady_clock::now() < spin_until) {
        for (int i = 0; i < 64; ++i) _mm_pause();
        gen = state_.load(std::memory_order_acquire) >> 32;
      }
      if (gen == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] {
          return stop_.load() || (state_.load(std::memory_order_seq_cst) >> 32) != seen;
        });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        continue;
      }
      seen = gen;
      // count_ belongs to loop `gen` unless a later loop has been published since, in which case
      // the claim below fails on the generation and nothing runs.
      claim(gen, count_);
    }
  }

  void stop_helpers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
      wake_.notify_all();
    }
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  // High 32 bits: the loop's generation; low 32: the next chunk to claim (kClosed: none).
  std::atomic<uint64_t> state_{kClosed};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  void (*fn_)(const void*, int64_t) = nullptr;
  const void* arg_ = nullptr;
  int64_t count_ = 0;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> threads_;
  const PoolHandle* attached_ = nullptr;
};

// fn(b, e) over [begin, end) in pieces of `grain`: shared with the pool's helpers where it has
// any, else at::parallel_for (torch's threads). For loops whose results do not depend on how the
// range is cut (each element computed on its own).
template <typename Fn>
void parallel_range(int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
  WorkPool& pool = WorkPool::instance();
  grain = std::max<int64_t>(1, grain);
  if (pool.helpers() > 0 && end - begin > grain) {
    const int64_t pieces = (end - begin + grain - 1) / grain;
    pool.run(pieces, [&](int64_t i) {
      fn(begin + i * grain, std::min(end, begin + (i + 1) * grain));
    });
    return;
  }
  at::parallel_for(begin, end, grain, fn);
}

// The module's attach_pool(handle): its loops go to another extension's pool (pool_handle()).
inline void def_attach_pool(pybind11::module_& m) {
  m.def(
      "attach_pool",
      [](uintptr_t handle) {
        WorkPool::instance().attach(reinterpret_cast<const PoolHandle*>(handle));
      },
      "run this extension's parallel loops on another kiln-x86 extension's work pool");
}

}  // namespace kiln_x86
