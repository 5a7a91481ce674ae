#!/usr/bin/env bash
# Command 2 of the README: install what is missing, build, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
build_dir=${BUILD_DIR:-build}
cd "$build_dir"
ctest --output-on-failure --parallel 2 --timeout 900
