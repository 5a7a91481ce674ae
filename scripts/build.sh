#!/usr/bin/env bash
# Configures and builds everything into ${BUILD_DIR:-build} (Release, Ninja, ccache). Extra CMake
# arguments come from HP_CMAKE_ARGS (e.g. "-DHP_WERROR=ON", which the test command sets).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
# Precompiled headers are only reused through ccache with these sloppiness settings.
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
# shellcheck disable=SC2086  # HP_CMAKE_ARGS is a list of arguments
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release ${HP_CMAKE_ARGS:-} >/dev/null
cmake --build "$build_dir"
