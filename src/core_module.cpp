// PYBIND11_MODULE(_core): the CPU extension. Each area registers itself from its own bind_*.cpp.
#include "binding.hpp"
#include "blockhess/activation.hpp"
#include "blockhess/heads.hpp"
#include "blockhess/params.hpp"

#include "blockhess/version.hpp"

// Set by CMakeLists.txt, which builds this module once per instruction-set level (_core_portable,
// _core_x86_64_v3, _core_x86_64_v4, or _core_native); defaults for a build that compiles this file
// some other way.
#ifndef BLOCKHESS_MODULE_NAME
#define BLOCKHESS_MODULE_NAME _core_portable
#endif
#ifndef BLOCKHESS_ISA
#define BLOCKHESS_ISA "portable"
#endif
#ifndef BLOCKHESS_BUILD_TYPE
#define BLOCKHESS_BUILD_TYPE ""
#endif

namespace {
// Whether this CPU (and its operating system, which must save the wider registers) runs the
// x86-64-v3 build (AVX2, FMA, BMI1/2, F16C, LZCNT, MOVBE) and the x86-64-v4 build (v3 plus
// AVX-512 F, BW, CD, DQ, VL). GCC's and clang's checks read XCR0 for the registers' state.
bool cpu_runs_x86_64_v3() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
  __builtin_cpu_init();
  return __builtin_cpu_supports("x86-64-v3");
#elif (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_runs_x86_64_v4() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
  __builtin_cpu_init();
  return __builtin_cpu_supports("x86-64-v4");
#elif (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  return cpu_runs_x86_64_v3() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}
}  // namespace

PYBIND11_MODULE(BLOCKHESS_MODULE_NAME, m, py::mod_gil_not_used()) {
  m.doc() = "blockhess CPU core (private; use the blockhess package)";
  m.attr("__cpp_version__") = BLOCKHESS_VERSION_STRING;
  {
    // How this extension was compiled (read-only): "isa" is its instruction-set level; "native" is
    // true only for a -march=native build (BLOCKHESS_NATIVE=ON), which runs on the build machine's
    // CPU family only.
    py::dict info;
    info["isa"] = py::str(BLOCKHESS_ISA);
    info["native"] = py::bool_(std::string(BLOCKHESS_ISA) == "native");
    info["build_type"] = py::str(BLOCKHESS_BUILD_TYPE);
#if defined(__clang__)
    info["compiler"] = py::str("clang " __clang_version__);
#elif defined(__GNUC__)
    info["compiler"] = py::str("GCC " __VERSION__);
#elif defined(_MSC_VER)
    info["compiler"] = py::str("MSVC " + std::to_string(_MSC_FULL_VER));
#endif
    info["cplusplus"] = py::int_(static_cast<long>(__cplusplus));
    m.attr("build_info") = py::module_::import("types").attr("MappingProxyType")(info);
  }
  // The registries by name (codes by position): BlockSpec's norm positions, norms (params.hpp) and
  // activations (activation.hpp), and the functions' losses (heads.hpp).
  auto names = [](const auto& registry) {
    py::tuple t(registry.size());
    for (size_t k = 0; k < registry.size(); ++k) t[k] = py::str(registry[k]);
    return t;
  };
  m.attr("norm_positions") = names(blockhess::block::kNormPositions);
  m.attr("norms") = names(blockhess::block::kNorms);
  m.attr("activations") = names(blockhess::activation::kNames);
  m.attr("losses") = names(blockhess::heads::kNames);
  m.def("cpu_runs_x86_64_v3", &cpu_runs_x86_64_v3, "Whether this CPU runs the x86-64-v3 build.");
  m.def("cpu_runs_x86_64_v4", &cpu_runs_x86_64_v4, "Whether this CPU runs the x86-64-v4 build.");
  using namespace blockhess::bind;
  bind_layernorm(m);
  bind_softmax(m);
  bind_commutation(m);
  bind_attention(m);
  bind_ffn(m);
  bind_block(m);
  bind_checks(m);
  bind_threads(m);
  bind_memory(m);
}
