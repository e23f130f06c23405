// core_sanitize's checks in float.
#include "core_sanitize_checks.hpp"

void sanitize::run_float(std::mt19937_64& rng) { run_all<float>(rng); }
