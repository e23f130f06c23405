// Bindings for the core's cache of large buffers (memory_cache.hpp): its limit, what it holds, and
// handing that back.
#include "binding.hpp"

#include "blockhess/memory_cache.hpp"

namespace blockhess::bind {

void bind_memory(py::module_& m) {
  m.def("get_memory_cache_limit", [] { return memory::cache_limit(); },
        "The most bytes of freed large buffers the core keeps for its next calls.");
  m.def(
      "set_memory_cache_limit", [](std::size_t bytes) { memory::set_cache_limit(bytes); }, py::arg("nbytes"),
      "Sets that limit (0: keep none); what the cache holds beyond it is freed now.");
  m.def("cached_memory", [] { return memory::cached_bytes(); }, "Bytes the cache holds now.");
  m.def(
      "release_memory", [] { return memory::release_cached(); }, py::call_guard<py::gil_scoped_release>(),
      "Frees every buffer the cache holds; returns how many bytes that was.");
}

}  // namespace blockhess::bind
