// core_sanitize's checks in double, with the finite-difference checks and the error cases.
#include "core_sanitize_checks.hpp"

void sanitize::run_double(std::mt19937_64& rng) {
  run_all<double>(rng);
  check_block_output_derivatives(rng);
  check_block_errors(rng);
  check_stack(rng);
  check_language_model(rng);
  check_vit(rng, /*class_token=*/false);
  check_vit(rng, /*class_token=*/true);
}
