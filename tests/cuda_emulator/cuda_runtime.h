// A CUDA runtime that runs blockhess's kernels on the CPU, for the tests only (never shipped).
//
// tests/kernel_emulation.py rewrites cuda/src/*.cu into C++ (`k<<<grid, block, smem, s>>>(args)`
// becomes `::blockhess_emu::launch(k, grid, block, smem, s)(args)`, `__shared__` becomes
// `static thread_local`) and compiles them with this header standing in for <cuda_runtime.h>, so
// the real kernel bodies and launchers run on NumPy memory.
//
// Every CUDA thread of a block is a fiber (started with ucontext, switched with _setjmp/_longjmp,
// which unlike swapcontext make no system call). A fiber runs until it reaches __syncthreads() or
// a warp shuffle, then yields; a barrier is released only when every thread that must arrive has
// arrived, so the emulation catches what a GPU would do silently wrong:
//   - a full-warp shuffle that a lane of the warp misses (exited or divergent lanes, a partial warp),
//   - launch configurations a GPU rejects (block size, grid limits, shared memory),
//   - reads of dynamic shared memory never written (it starts as NaN bytes).
// BLOCKHESS_EMULATOR_SCHEDULE picks the order in which threads run between barriers, so that a
// missing barrier or a race shows up as a different result:
//   lockstep (default)  every thread runs to its next barrier, in thread order, blocks in order;
//   reverse             the same in reverse thread and block order;
//   warp-ahead          each warp runs as far as it can (through its shuffles) before the next
//                       warp starts, lanes in reverse order, blocks in reverse order.
#pragma once

#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};

struct CUstream_st;
using cudaStream_t = CUstream_st*;
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719
};
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2, cudaMemcpyDeviceToDevice = 3 };

// Device code calls sqrt/exp unqualified; give float its own overloads as on the GPU.
using std::exp;
using std::sqrt;

namespace blockhess_emu {

constexpr unsigned kWarpSize = 32;
constexpr std::size_t kStackBytes = 128 * 1024;
constexpr std::size_t kSharedLimit = 48 * 1024;  // without the opt-in attribute, as the launchers assume

enum class LaneState { runnable, at_block_barrier, at_warp_barrier, done };

struct Lane {
  ucontext_t start;  // entry point, used once
  jmp_buf resume;    // where the fiber continues after a yield
  bool started;
  uint3 index;
  LaneState state;
};

struct BlockRun {
  dim3 grid, block;
  uint3 block_index;
  std::vector<Lane> lanes;
  Lane* current = nullptr;
  jmp_buf scheduler;
  const std::function<void()>* body = nullptr;
  std::vector<std::array<unsigned char, 8>> exchange;  // one shuffle slot per lane
  std::vector<unsigned char> dynamic_shared;
};

struct ThreadState {  // per OS thread: no state is shared between Python threads
  cudaError_t last_error = cudaSuccess;
  std::string message;
  std::vector<std::unique_ptr<char[]>> stacks;
};

inline thread_local BlockRun* g_run = nullptr;
inline ThreadState& thread_state() {
  static thread_local ThreadState state;
  return state;
}

inline void record_error(cudaError_t err, const std::string& what) {
  ThreadState& st = thread_state();
  if (st.last_error != cudaSuccess) return;  // keep the first error, as CUDA does
  st.last_error = err;
  st.message = "[CPU kernel emulator] " + what;
}

inline unsigned linear(const BlockRun& run, const Lane& lane) {
  return lane.index.x + run.block.x * (lane.index.y + run.block.y * lane.index.z);
}

// Suspends the calling fiber until the scheduler releases the barrier it waits at.
inline void wait_at(LaneState barrier) {
  BlockRun* run = g_run;
  Lane* me = run->current;
  me->state = barrier;
  if (!_setjmp(me->resume)) _longjmp(run->scheduler, 1);
}

inline void lane_entry() {
  BlockRun* run = g_run;
  (*run->body)();
  run->current->state = LaneState::done;
  _longjmp(run->scheduler, 1);  // never resumed
}

// Runs `lane` until it yields or finishes.
inline void resume(BlockRun& run, Lane& lane) {
  run.current = &lane;
  if (_setjmp(run.scheduler)) return;
  if (!lane.started) {
    lane.started = true;
    setcontext(&lane.start);
  }
  _longjmp(lane.resume, 1);
}

enum class Schedule { lockstep, reverse, warp_ahead };

inline bool schedule_from_environment(Schedule& schedule) {
  const char* name = std::getenv("BLOCKHESS_EMULATOR_SCHEDULE");
  const std::string s = name ? name : "lockstep";
  if (s == "lockstep") schedule = Schedule::lockstep;
  else if (s == "reverse") schedule = Schedule::reverse;
  else if (s == "warp-ahead") schedule = Schedule::warp_ahead;
  else {
    record_error(cudaErrorInvalidConfiguration, "BLOCKHESS_EMULATOR_SCHEDULE=" + s + " is not lockstep, reverse or warp-ahead");
    return false;
  }
  return true;
}

// Runs the runnable lanes of [begin, end), in order or in reverse; true if any ran.
inline bool run_lanes(BlockRun& run, std::size_t begin, std::size_t end, bool reverse) {
  bool ran = false;
  for (std::size_t k = begin; k < end; ++k) {
    Lane& lane = run.lanes[reverse ? end - 1 - (k - begin) : k];
    if (lane.state != LaneState::runnable) continue;
    resume(run, lane);
    ran = true;
  }
  return ran;
}

// Lets the warp of lanes [w0, w1) go on if all its 32 lanes wait at a shuffle; an error (false) if
// only some do while none can run: the others exited, wait at __syncthreads() or do not exist.
inline bool release_warp(BlockRun& run, std::size_t w0, std::size_t w1, bool& released) {
  std::size_t waiting = 0;
  for (std::size_t k = w0; k < w1; ++k) {
    if (run.lanes[k].state == LaneState::runnable) return true;
    waiting += run.lanes[k].state == LaneState::at_warp_barrier;
  }
  if (waiting == 0) return true;
  if (waiting != kWarpSize) {
    record_error(cudaErrorLaunchFailure,
                 "a full-warp shuffle in warp " + std::to_string(w0 / kWarpSize) + " reached by " +
                     std::to_string(waiting) + " of 32 lanes (exited or divergent lanes, or a partial warp)");
    return false;
  }
  for (std::size_t k = w0; k < w1; ++k) run.lanes[k].state = LaneState::runnable;
  released = true;
  return true;
}

inline bool run_block(BlockRun& run, Schedule schedule) {
  ThreadState& st = thread_state();
  const std::size_t n = run.lanes.size();
  while (st.stacks.size() < n) st.stacks.emplace_back(new char[kStackBytes]);
  ucontext_t blank;
  getcontext(&blank);
  for (std::size_t k = 0; k < n; ++k) {
    Lane& lane = run.lanes[k];
    lane.start = blank;
    lane.start.uc_stack.ss_sp = st.stacks[k].get();
    lane.start.uc_stack.ss_size = kStackBytes;
    lane.start.uc_link = nullptr;
    makecontext(&lane.start, lane_entry, 0);
    lane.started = false;
    lane.state = LaneState::runnable;
  }
  for (;;) {
    bool progress = false;
    if (schedule == Schedule::warp_ahead) {
      for (std::size_t w0 = 0; w0 < n; w0 += kWarpSize) {  // warp by warp, each as far as it goes
        const std::size_t w1 = std::min(n, w0 + kWarpSize);
        for (bool going = true; going;) {
          going = run_lanes(run, w0, w1, true);
          bool released = false;
          if (!release_warp(run, w0, w1, released)) return false;
          going = going || released;
          progress = progress || going;
        }
      }
    } else {
      progress = run_lanes(run, 0, n, schedule == Schedule::reverse);
      if (!progress)  // every warp whose lanes all wait at a shuffle goes on, together
        for (std::size_t w0 = 0; w0 < n; w0 += kWarpSize)
          if (!release_warp(run, w0, std::min(n, w0 + kWarpSize), progress)) return false;
    }
    if (progress) continue;
    // No lane can run and no warp can leave a shuffle: every live lane waits at __syncthreads().
    bool live = false;
    for (Lane& lane : run.lanes)
      if (lane.state == LaneState::at_block_barrier) {
        lane.state = LaneState::runnable;
        live = true;
      }
    if (!live) return true;
  }
}

inline bool valid_configuration(dim3 grid, dim3 block, std::size_t smem) {
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  std::string why;
  if (threads == 0 || threads > 1024 || block.z > 64)
    why = "block of " + std::to_string(block.x) + "x" + std::to_string(block.y) + "x" + std::to_string(block.z);
  else if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535u || grid.z > 65535u)
    why = "grid of " + std::to_string(grid.x) + "x" + std::to_string(grid.y) + "x" + std::to_string(grid.z);
  else if (smem > kSharedLimit)
    why = std::to_string(smem) + " bytes of dynamic shared memory";
  if (why.empty()) return true;
  record_error(cudaErrorInvalidConfiguration, "invalid launch configuration: " + why);
  return false;
}

// Device memory (cudaMallocAsync) is pages the host cannot touch: they open only while emulated
// device work runs (a launch, a copy, a memset, the cuBLAS stand-in's products), so host code that
// reads or writes device memory faults here, as it would crash or read garbage on a GPU, instead of
// passing silently. Memory the tests hand in as device memory (NumPy's) stays open. The pages are
// carved in order from one reserved range, so that opening and closing them is one mprotect each.
struct DeviceMemory {
  static constexpr std::size_t kReserved = std::size_t(1) << 40;  // address space only
  std::mutex mutex;
  char* base = nullptr;
  std::size_t used = 0;  // bytes carved so far (whole pages)
  int open = 0;          // device work in progress (nested)
  std::map<void*, std::size_t> live;  // start -> bytes
  DeviceMemory() {
    void* p = mmap(nullptr, kReserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    base = p == MAP_FAILED ? nullptr : static_cast<char*>(p);
  }
  void protect(int access) {
    if (used) mprotect(base, used, access);
  }
};
inline DeviceMemory& device_memory() {
  static DeviceMemory memory;
  return memory;
}
// Device memory open for the device work done while it lives.
struct DeviceWork {
  DeviceWork() {
    DeviceMemory& m = device_memory();
    const std::lock_guard<std::mutex> lock(m.mutex);
    if (m.open++ == 0) m.protect(PROT_READ | PROT_WRITE);
  }
  ~DeviceWork() {
    DeviceMemory& m = device_memory();
    const std::lock_guard<std::mutex> lock(m.mutex);
    if (--m.open == 0) m.protect(PROT_NONE);
  }
  DeviceWork(const DeviceWork&) = delete;
  DeviceWork& operator=(const DeviceWork&) = delete;
};
inline void* allocate_device(std::size_t bytes) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t size = (std::max<std::size_t>(bytes, 1) + page - 1) / page * page;
  DeviceMemory& m = device_memory();
  const std::lock_guard<std::mutex> lock(m.mutex);
  if (!m.base || size > DeviceMemory::kReserved - m.used) return nullptr;
  char* p = m.base + m.used;
  m.used += size;
  if (m.open) mprotect(p, size, PROT_READ | PROT_WRITE);
  m.live[p] = size;
  return p;
}
// Its pages go back to the system (never carved again: the range is large).
inline void free_device(void* p) {
  DeviceMemory& m = device_memory();
  const std::lock_guard<std::mutex> lock(m.mutex);
  const auto at = m.live.find(p);
  if (at == m.live.end()) return;
  madvise(at->first, at->second, MADV_DONTNEED);
  m.live.erase(at);
}

inline void execute(dim3 grid, dim3 block, std::size_t smem, const std::function<void()>& body) {
  const DeviceWork work;
  Schedule schedule;
  if (!valid_configuration(grid, block, smem) || !schedule_from_environment(schedule)) return;
  const bool reverse = schedule != Schedule::lockstep;
  BlockRun run;
  run.grid = grid;
  run.block = block;
  run.body = &body;
  run.lanes.resize(static_cast<std::size_t>(block.x) * block.y * block.z);
  run.exchange.resize(run.lanes.size());
  for (unsigned z = 0; z < block.z; ++z)
    for (unsigned y = 0; y < block.y; ++y)
      for (unsigned x = 0; x < block.x; ++x) run.lanes[x + block.x * (y + block.y * z)].index = {x, y, z};
  BlockRun* outer = g_run;
  g_run = &run;
  const unsigned long long blocks = 1ull * grid.x * grid.y * grid.z;
  for (unsigned long long b = 0; b < blocks; ++b) {
    const unsigned long long k = reverse ? blocks - 1 - b : b;
    run.block_index = {static_cast<unsigned>(k % grid.x), static_cast<unsigned>(k / grid.x % grid.y),
                       static_cast<unsigned>(k / grid.x / grid.y)};
    run.dynamic_shared.assign(std::max<std::size_t>(smem, 1), 0xFF);  // NaN until written
    if (!run_block(run, schedule)) break;
  }
  g_run = outer;
}

template <class... P>
struct Launch {
  void (*kernel)(P...);
  dim3 grid, block;
  std::size_t smem;

  template <class... A>
  void operator()(A&&... args) const {
    const std::tuple<P...> params(std::forward<A>(args)...);  // by value, as a launch copies them
    const auto fn = kernel;
    const std::function<void()> body = [&params, fn] { std::apply(fn, params); };
    execute(grid, block, smem, body);
  }
};

template <class... P>
Launch<P...> launch(void (*kernel)(P...), dim3 grid, dim3 block, std::size_t smem = 0, cudaStream_t = nullptr) {
  return {kernel, grid, block, smem};
}

inline unsigned char* dynamic_shared() { return g_run->dynamic_shared.data(); }

}  // namespace blockhess_emu

#define threadIdx (::blockhess_emu::g_run->current->index)
#define blockIdx (::blockhess_emu::g_run->block_index)
#define blockDim (::blockhess_emu::g_run->block)
#define gridDim (::blockhess_emu::g_run->grid)

inline void __syncthreads() { ::blockhess_emu::wait_at(::blockhess_emu::LaneState::at_block_barrier); }

template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta) {
  static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
  using namespace ::blockhess_emu;
  BlockRun& run = *g_run;
  if (mask != 0xffffffffu) record_error(cudaErrorLaunchFailure, "only full-warp shuffle masks are emulated");
  const unsigned me = linear(run, *run.current), lane = me % kWarpSize;
  std::memcpy(run.exchange[me].data(), &v, sizeof(T));
  wait_at(LaneState::at_warp_barrier);  // every lane has published its value
  T out = v;
  if (lane + delta < kWarpSize) std::memcpy(&out, run.exchange[me + delta].data(), sizeof(T));
  wait_at(LaneState::at_warp_barrier);  // every lane has read before any lane publishes again
  return out;
}

inline cudaError_t cudaGetLastError() {
  ::blockhess_emu::ThreadState& st = ::blockhess_emu::thread_state();
  const cudaError_t err = st.last_error;
  st.last_error = cudaSuccess;
  return err;
}
inline const char* cudaGetErrorString(cudaError_t err) {
  const std::string& message = ::blockhess_emu::thread_state().message;
  return err == cudaSuccess ? "no error" : message.empty() ? "emulated CUDA error" : message.c_str();
}
inline cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t) {
  const ::blockhess_emu::DeviceWork work;
  std::memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemset2DAsync(void* p, std::size_t pitch, int value, std::size_t width, std::size_t height,
                                     cudaStream_t) {
  const ::blockhess_emu::DeviceWork work;
  for (std::size_t r = 0; r < height; ++r) std::memset(static_cast<char*>(p) + r * pitch, value, width);
  return cudaSuccess;
}
// Host pages stand in for device memory (DeviceMemory), and the emulated stream runs each launch to
// the end before it returns, so copies are plain memcpy in call order.
inline cudaError_t cudaMallocAsync(void** p, std::size_t bytes, cudaStream_t) {
  *p = ::blockhess_emu::allocate_device(bytes);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t cudaFreeAsync(void* p, cudaStream_t) {
  ::blockhess_emu::free_device(p);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind, cudaStream_t) {
  const ::blockhess_emu::DeviceWork work;
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy2DAsync(void* dst, std::size_t dpitch, const void* src, std::size_t spitch,
                                     std::size_t width, std::size_t height, cudaMemcpyKind, cudaStream_t) {
  const ::blockhess_emu::DeviceWork work;
  for (std::size_t r = 0; r < height; ++r)
    std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
  return cudaSuccess;
}
// One fiber runs at a time: a read-modify-write is atomic.
inline unsigned atomicOr(unsigned* address, unsigned value) {
  const unsigned old = *address;
  *address = old | value;
  return old;
}
