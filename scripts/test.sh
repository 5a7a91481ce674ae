#!/usr/bin/env bash
# Command 2 of the README: install what is missing, build (warnings are errors), run every test
# through CTest: the C++ unit and multi-rank tests, hp-run's tests, the scenarios of
# tests/scenarios/, the Python package's pytest suites (unit tests in one process, system tests
# on 2 and 4 ranks under hp-run, with Debian's /usr/bin/python3) and the lint checks (format,
# function length, the environment table, flake8 on the Python, the layers' includes). The build
# also links each layer alone (hp_layer_check_*). `ctest -L unit` runs the quick ones alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
build_dir=${BUILD_DIR:-build}
cd "$build_dir"
# Three tests at a time on 2 cores: several spend part of their time waiting (rank timeouts,
# restarts), and the suite holds under more load than this (scripts/stress_tests.sh: 4 at a time
# beside two busy loops). HP_TEST_JOBS sets another count.
ctest --output-on-failure --parallel "${HP_TEST_JOBS:-3}" --timeout 900
