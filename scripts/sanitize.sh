#!/usr/bin/env bash
# Builds the library and its C++ tests with sanitizers, each into a build folder of its own, and
# runs them:
#   asan   AddressSanitizer + UndefinedBehaviorSanitizer, on every C++ test (build-asan/)
#   tsan   ThreadSanitizer, on the tests of the comm engine's threads: collectives, agreement,
#          MC2, the trace, the flight recorder, one thread per group, the preemption signal and
#          the asynchronous checkpoint writer, started all-reduces, data parallelism, deferred
#          weight gradients and sequence-parallel gradient sums (build-tsan/)
#   bash scripts/sanitize.sh [asan|tsan|all]      (default: all)
# libtorch and Gloo are not instrumented; the suppressions in tests/sanitizers/ cover only frames
# inside them, each with its reason. Any finding in this project's code fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
bash scripts/install_deps.sh
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
# Instrumented code runs several times slower: no test asserts a time beyond a hang deadline (the
# race, leak and undefined-behaviour checks are what these runs are for).
export OMP_NUM_THREADS=1 HP_TIMEOUT_S=120
supp=$PWD/tests/sanitizers

configure() {  # build dir, sanitizer flags [targets...]
  # -O1 -g1: fast enough to run the multi-rank tests, line tables for the reports, and a build a
  # third the time of -O2 -g.
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -g1 -DNDEBUG" \
    -DHP_BUILD_PYTHON=OFF -DHP_BUILD_BENCH=OFF -DHP_WERROR=ON -DCMAKE_CXX_FLAGS="$2 -fno-omit-frame-pointer" \
    -DCMAKE_EXE_LINKER_FLAGS="$2" -DCMAKE_SHARED_LINKER_FLAGS="$2" >/dev/null
  local dir=$1
  shift 2
  cmake --build "$dir" ${1:+--target "$@"}
}

if [[ $what == asan || $what == all ]]; then
  configure build-asan "-fsanitize=address,undefined -fno-sanitize-recover=undefined"
  export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:halt_on_error=1:suppressions=$supp/asan.supp"
  export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp"
  # Every C++ test and scenario (the lint checks and the installed-package test need no rerun).
  (cd build-asan && ctest --output-on-failure --parallel 2 --timeout 1800 -LE "lint|package")
  unset ASAN_OPTIONS LSAN_OPTIONS UBSAN_OPTIONS
fi
if [[ $what == tsan || $what == all ]]; then
  configure build-tsan "-fsanitize=thread" hp-run hp-trace test_collectives test_agreement test_mc2_style \
    test_mc2_distributed trace_overlap_main stuck_rank_main test_op_scope_threads test_lifecycle test_async_save \
    test_pending_all_reduce test_data_parallel test_mc2_deferred_weight_grad test_tp_styles
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$supp/tsan.supp"
  (cd build-tsan && ctest --output-on-failure --parallel 2 --timeout 1800 \
    -R "test_collectives|test_agreement|test_mc2|trace_overlap|stuck_rank|test_op_scope_threads|test_lifecycle|test_async_save|test_pending_all_reduce|test_data_parallel|test_tp_styles")
fi
echo "sanitize.sh: $what passed"
