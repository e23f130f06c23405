// The core's own thread pool: passive (sleeping) workers, the calling thread takes part, and work is
// claimed dynamically in chunks from an atomic counter.
//
// Why not OpenMP: with libgomp's default spin-waits a descheduled thread stalls every barrier, and
// on a machine whose cores are busy with other processes a 25 ms Hessian took 580 ms. Its wait
// policy (OMP_WAIT_POLICY) is read once per process and shared with PyTorch, so blockhess cannot
// change it without changing how PyTorch behaves. This pool never spins for more than 50
// microseconds, and the caller waits only for chunks that another thread has actually claimed:
// a worker that has not woken up yet (or was descheduled before it joined) simply gets no work,
// and the caller does it. Which thread runs a chunk never changes a result: every chunk writes
// its own outputs and the split of the work into items is fixed by the caller.
//
// Calls from inside a running loop (nesting), and calls made while another thread is using the
// pool, run serially on their caller: there is one job at a time and nothing ever waits for the
// pool to become free. Exceptions thrown by a chunk are rethrown on the caller after the loop
// (chunks claimed after the first exception are skipped).
//
// Global state: the configured thread count (an atomic) and the pool itself, created lazily on
// first use and never destroyed (workers sleep until the process exits). Neither affects results.
// Thread count: set_num_threads(n), else BLOCKHESS_NUM_THREADS, else OMP_NUM_THREADS (its first
// entry), else the CPUs this process may run on (its affinity mask), else hardware_concurrency.
// After fork() the child starts a fresh pool (the parent's workers do not exist there).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "blockhess/config.hpp"
#include "blockhess/process_singleton.hpp"

namespace blockhess::parallel {

// Largest thread count accepted (a bound against typos such as BLOCKHESS_NUM_THREADS=10000).
constexpr int kMaxThreads = 1024;

namespace detail {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How long an idle worker polls for the next loop before it sleeps. Long enough to catch the next
// loop of the same call and of a caller's tight loop of small calls (a sleep/wake round trip costs
// tens of microseconds), short enough that an idle worker on a busy machine soon yields its core.
constexpr int kWorkerSpinMicroseconds = 50;

// Spins for at most `us` microseconds until pred() holds; returns pred().
template <class Pred>
bool spin_briefly(Pred&& pred, int us) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (;;) {
    for (int k = 0; k < 32; ++k) {
      if (pred()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= until) return pred();
  }
}

// A positive integer at the start of `s` ("4" or the "4" of OMP_NUM_THREADS="4,2"), else 0.
inline int parse_count(const char* s) {
  if (s == nullptr) return 0;
  while (*s == ' ' || *s == '\t') ++s;
  long v = 0;
  bool any = false;
  for (; *s >= '0' && *s <= '9'; ++s) {
    any = true;
    v = v * 10 + (*s - '0');
    if (v > kMaxThreads) v = kMaxThreads;
  }
  while (*s == ' ' || *s == '\t') ++s;
  if (!any || (*s != '\0' && *s != ',')) return 0;
  return static_cast<int>(v);
}

inline int default_num_threads() {
  if (int n = parse_count(std::getenv("BLOCKHESS_NUM_THREADS"))) return n;
  if (int n = parse_count(std::getenv("OMP_NUM_THREADS"))) return n;
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return std::min(n, kMaxThreads);
  }
#endif
  const unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : static_cast<int>(std::min<unsigned>(hc, kMaxThreads));
}

// The configured count (0 = not yet decided). Kept apart from the pool so that it survives fork.
inline std::atomic<int>& configured_threads() {
  static std::atomic<int> n{0};
  return n;
}

// One parallel loop: items [0, n) in chunks of `chunk`, run by fn(ctx, begin, end, slot).
// Shared (shared_ptr) by the caller and every worker that looked at it, so a worker that wakes up
// late only ever touches this object, never the caller's (possibly finished) stack frame: ctx is
// used for claimed chunks only, and the caller waits for every claimed chunk.
struct Job {
  using Fn = void (*)(void* ctx, index_t begin, index_t end, int slot);
  Fn fn = nullptr;
  void* ctx = nullptr;
  index_t n = 0, chunk = 1;
  int max_slots = 1;  // threads that may take part, the caller included
  std::atomic<int> joined{1};  // slots handed out: the caller has slot 0, helpers the next ones
  std::atomic<index_t> next{0};  // first unclaimed item
  std::atomic<index_t> done{0};  // items finished (or skipped after an error)
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // the first exception, written once by whoever set `failed`
  std::mutex error_mutex, done_mutex;
  std::condition_variable done_cv;

  // Claims and runs chunks until none is left.
  void work(int slot) {
    for (;;) {
      const index_t b = next.fetch_add(chunk, std::memory_order_relaxed);
      if (b >= n) return;
      const index_t e = std::min(n, b + chunk);
      if (!failed.load(std::memory_order_relaxed)) {
        try {
          fn(ctx, b, e, slot);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (!error) error = std::current_exception();
          failed.store(true, std::memory_order_relaxed);
        }
      }
      if (done.fetch_add(e - b, std::memory_order_acq_rel) + (e - b) == n) {
        // The last chunk: wake the caller if it is asleep (the lock orders this after its check).
        { std::lock_guard<std::mutex> lock(done_mutex); }
        done_cv.notify_all();
      }
    }
  }

  bool finished() const { return done.load(std::memory_order_acquire) == n; }

  void wait() {
    if (spin_briefly([this] { return finished(); }, 5)) return;
    std::unique_lock<std::mutex> lock(done_mutex);
    done_cv.wait(lock, [this] { return finished(); });
  }
};

class Pool {
 public:
  Pool() = default;
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  // Never called for the process-wide pool (see instance()); kept correct for other owners.
  ~Pool() { stop_workers(); }

  // Runs the job on the caller and on the workers whose slot is below job->max_slots; `workers`
  // is how many the pool should have (num_threads() - 1). Returns false, having run nothing, if the
  // pool is busy with another caller's job or this is a nested call from inside a job.
  bool try_run(const std::shared_ptr<Job>& job, int workers) {
    bool expected = false;
    if (!busy_.compare_exchange_strong(expected, true, std::memory_order_acquire)) return false;
    struct Release {
      std::atomic<bool>& b;
      ~Release() { b.store(false, std::memory_order_release); }
    } release{busy_};
    resize(workers);
    int to_wake = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = job;
      ++generation_;
      published_.store(generation_, std::memory_order_release);
      // Helpers that can get a chunk at all: at most max_slots - 1 and one per chunk beyond the first.
      const index_t chunks = (job->n + job->chunk - 1) / job->chunk;
      to_wake = static_cast<int>(std::min<index_t>({sleeping_, job->max_slots - 1, chunks - 1}));
      if (to_wake > 0 && to_wake == sleeping_) to_wake = -1;  // all of them
    }
    if (to_wake < 0) cv_.notify_all();
    for (int k = 0; k < to_wake; ++k) cv_.notify_one();
    job->work(0);
    job->wait();
    // set_num_threads() lowered the count during the job: let the extra workers go now.
    const int now = configured_threads().load(std::memory_order_relaxed) - 1;
    if (now < static_cast<int>(threads_.size())) resize(std::max(0, now));
    return true;
  }

  // Stops surplus workers unless the pool is in use (then the running job's caller does it).
  void try_shrink(int workers) {
    bool expected = false;
    if (!busy_.compare_exchange_strong(expected, true, std::memory_order_acquire)) return;
    if (workers < static_cast<int>(threads_.size())) resize(workers);
    busy_.store(false, std::memory_order_release);
  }

 private:
  // Starts or stops workers so that there are `workers` of them; called only while busy_ is held
  // (so generation_, which changes only there, can be read without the mutex).
  void resize(int workers) {
    if (workers < static_cast<int>(threads_.size())) stop_workers();
    while (static_cast<int>(threads_.size()) < workers) {
      const std::uint64_t seen = generation_;  // the next job is the first this worker takes part in
      try {
        threads_.emplace_back([this, seen] { worker(seen); });
      } catch (const std::system_error&) {
        break;  // cannot start more threads: run with those we have
      }
    }
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = false;
    job_.reset();
  }

  void worker(std::uint64_t seen) {
    for (;;) {
      // Polling for a while catches back-to-back loops without a sleep/wake round trip.
      spin_briefly([&] { return published_.load(std::memory_order_acquire) != seen; }, kWorkerSpinMicroseconds);
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (generation_ == seen && !stop_) {
          ++sleeping_;
          cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
          --sleeping_;
        }
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      if (job) {
        const int slot = job->joined.fetch_add(1, std::memory_order_relaxed);
        if (slot < job->max_slots) job->work(slot);
      }
    }
  }

  std::atomic<bool> busy_{false};
  std::atomic<std::uint64_t> published_{0};
  std::mutex mutex_;  // guards everything below
  std::condition_variable cv_;
  std::shared_ptr<Job> job_;
  std::uint64_t generation_ = 0;
  int sleeping_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;  // touched only while busy_ is held
};

// The process-wide pool (process_singleton.hpp): leaked, since destroying it at exit would race
// with threads still inside blockhess, and sleeping workers cost nothing.
inline Pool& instance() { return blockhess::detail::process_singleton<Pool>(); }

template <class F>
void invoke_chunk(void* ctx, index_t begin, index_t end, int slot) {
  (*static_cast<F*>(ctx))(begin, end, slot);
}

}  // namespace detail

// Threads used by the core's parallel loops (including the calling thread).
inline int num_threads() {
  auto& n = detail::configured_threads();
  int v = n.load(std::memory_order_relaxed);
  if (v == 0) {
    int expected = 0;
    v = detail::default_num_threads();
    if (!n.compare_exchange_strong(expected, v, std::memory_order_relaxed)) v = expected;
  }
  return v;
}

// Sets the thread count (clamped to [1, kMaxThreads]) for the next parallel loops. Surplus
// workers are stopped (now, or when a loop running elsewhere ends); missing ones start on demand.
inline void set_num_threads(int n) {
  n = std::clamp(n, 1, kMaxThreads);
  detail::configured_threads().store(n, std::memory_order_relaxed);
  if (detail::Pool* p = blockhess::detail::existing_singleton<detail::Pool>()) p->try_shrink(n - 1);
}

// Runs f(begin, end, slot) over [0, n) in chunks of `chunk` items on up to `max_threads` threads
// (the caller included); slot in [0, max_threads) names the thread running a chunk during this call
// (for per-thread scratch; it must not influence results). Serial (one call f(0, n, 0)) when
// max_threads <= 1, when there is a single chunk, or when the pool is in use (nesting, or
// another thread's loop). Exceptions from f are rethrown here.
template <class F>
void for_chunks(index_t n, index_t chunk, int max_threads, F&& f) {
  if (n <= 0) return;
  chunk = std::max<index_t>(1, chunk);
  const int threads = std::min(max_threads, num_threads());
  if (threads > 1 && n > chunk) {
    using Fn = std::remove_reference_t<F>;
    auto job = std::make_shared<detail::Job>();
    job->fn = &detail::invoke_chunk<Fn>;
    job->ctx = const_cast<void*>(static_cast<const void*>(std::addressof(f)));
    job->n = n;
    job->chunk = chunk;
    job->max_slots = threads;
    if (detail::instance().try_run(job, num_threads() - 1)) {
      if (job->error) std::rethrow_exception(job->error);
      return;
    }
  }
  f(index_t(0), n, 0);
}

}  // namespace blockhess::parallel
