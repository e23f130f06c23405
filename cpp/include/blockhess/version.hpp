// The single source of the blockhess version: CMake and pyproject.toml both read these lines.
#pragma once

#define BLOCKHESS_VERSION_MAJOR 0
#define BLOCKHESS_VERSION_MINOR 1
#define BLOCKHESS_VERSION_PATCH 0

#define BLOCKHESS_STRINGIFY_(x) #x
#define BLOCKHESS_STRINGIFY(x) BLOCKHESS_STRINGIFY_(x)
#define BLOCKHESS_VERSION_STRING                                                    \
  BLOCKHESS_STRINGIFY(BLOCKHESS_VERSION_MAJOR)                                      \
  "." BLOCKHESS_STRINGIFY(BLOCKHESS_VERSION_MINOR) "." BLOCKHESS_STRINGIFY(BLOCKHESS_VERSION_PATCH)
