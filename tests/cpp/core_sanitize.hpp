// Shared by the translation units of core_sanitize: the check counters and the two entry points.
#pragma once

#include <random>

namespace sanitize {
inline int g_checks = 0, g_failures = 0;  // the checks run on the main thread only

void run_double(std::mt19937_64& rng);  // core_sanitize_double.cpp
void run_float(std::mt19937_64& rng);   // core_sanitize_float.cpp
}  // namespace sanitize
