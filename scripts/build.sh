#!/usr/bin/env bash
# Configures ${BUILD_DIR:-build} (Release, Ninja, ccache; warnings are errors) and builds the
# targets named as arguments, or everything. Both README commands use this one configuration, so
# the test command compiles only what the main command did not. Extra CMake arguments come from
# HP_CMAKE_ARGS.
#   bash scripts/build.sh                       # everything
#   bash scripts/build.sh hp-run llama3_train   # the launcher and the trainer (and the library)
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
# Precompiled headers are only reused through ccache with these sloppiness settings.
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
# shellcheck disable=SC2086  # HP_CMAKE_ARGS is a list of arguments
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release ${HP_CMAKE_ARGS:-} >/dev/null
if (($# > 0)); then
  cmake --build "$build_dir" --target "$@"
else
  cmake --build "$build_dir"
fi
