// One object of a type per process, created on first use and deliberately leaked: threads may still
// be inside it, or static destructors may still use it, when the process exits. A child made by
// fork() starts without one and makes its own on first use: the parent's may be locked by a thread
// that the child does not have. (The thread pool and the memory cache are such objects.)
#pragma once

#include <atomic>
#include <memory>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif

namespace blockhess::detail {

template <class T>
std::atomic<T*>& singleton_pointer() {
  static std::atomic<T*> p{nullptr};
  return p;
}

template <class T>
void forget_singleton_after_fork() {
  singleton_pointer<T>().store(nullptr, std::memory_order_relaxed);
}

// The object, if it exists yet; creates nothing.
template <class T>
T* existing_singleton() {
  return singleton_pointer<T>().load(std::memory_order_acquire);
}

// The object, created by the first caller (of several racing, one wins and the rest use it).
template <class T>
T& process_singleton() {
#if defined(__unix__) || defined(__APPLE__)
  static const bool registered = (pthread_atfork(nullptr, nullptr, &forget_singleton_after_fork<T>), true);
  (void)registered;
#endif
  T* p = existing_singleton<T>();
  if (p != nullptr) return *p;
  auto fresh = std::make_unique<T>();
  if (singleton_pointer<T>().compare_exchange_strong(p, fresh.get(), std::memory_order_acq_rel)) return *fresh.release();
  return *p;  // another thread made it first
}

}  // namespace blockhess::detail
