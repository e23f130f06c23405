// Bindings for the core's thread pool: how many threads its parallel loops use.
#include "binding.hpp"

#include "blockhess/thread_pool.hpp"

namespace blockhess::bind {

void bind_threads(py::module_& m) {
  m.def("get_num_threads", [] { return parallel::num_threads(); },
        "Threads used by the core's parallel loops, the calling thread included.");
  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 1 || n > parallel::kMaxThreads)
          throw std::invalid_argument("set_num_threads: n must be in [1, " + std::to_string(parallel::kMaxThreads) +
                                      "], got " + std::to_string(n));
        parallel::set_num_threads(n);
      },
      py::arg("n"), "Sets the thread count of the core's parallel loops (from the next call on).");
  m.attr("_max_threads") = parallel::kMaxThreads;
}

}  // namespace blockhess::bind
