#!/usr/bin/env bash
# Command 2 of the README: install what is missing, build, run every test: CTest (C++ unit and
# multi-rank tests, launcher, scenarios), then the Python package's pytest suites (unit tests in
# one process, system tests on 2 and 4 ranks under hp-run), all with Debian's /usr/bin/python3.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
build_dir=${BUILD_DIR:-build}
(cd "$build_dir" && ctest --output-on-failure --parallel 2 --timeout 900)

export PYTHONPATH="$PWD/$build_dir/python${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 HP_TIMEOUT_S=120
hp_run="$build_dir/tools/hp-run/hp-run"
/usr/bin/python3 -m pytest -q -p no:cacheprovider tests/python/ut
for world in 2 4; do
  "$hp_run" --nproc-per-node "$world" --timeout 900 -- /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/python/st
done
