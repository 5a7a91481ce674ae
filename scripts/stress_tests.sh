#!/usr/bin/env bash
# The whole test suite under load: every test repeated (ctest --repeat until-fail:N, default 3)
# at a higher --parallel (default 4) on this machine's cores, with two busy-loop processes
# running beside it the whole time. Reports each test that failed at least once and exits
# non-zero if any did. Uses the test command's build (run scripts/test.sh, or scripts/build.sh,
# first); extra arguments go to ctest (e.g. -R test_mc2 or -LE python).
#   bash scripts/stress_tests.sh [ctest args...]
# HP_STRESS_REPEATS, HP_STRESS_PARALLEL and HP_STRESS_BUSY (busy loops) change the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build}
repeats=${HP_STRESS_REPEATS:-3} parallel=${HP_STRESS_PARALLEL:-4} busy=${HP_STRESS_BUSY:-2}
[[ -f $build_dir/CTestTestfile.cmake ]] || { echo "stress_tests: no build in $build_dir; run scripts/test.sh first" >&2; exit 2; }

busy_pids=()
stop_busy() { ((${#busy_pids[@]})) && kill "${busy_pids[@]}" 2>/dev/null; wait 2>/dev/null || true; }
trap stop_busy EXIT
for ((i = 0; i < busy; ++i)); do
  bash -c 'while :; do :; done' &
  busy_pids+=($!)
done

log=$(mktemp)
start=$(date +%s)
status=0
(cd "$build_dir" && ctest --output-on-failure --parallel "$parallel" \
  --repeat "until-fail:$repeats" "$@") >"$log" 2>&1 || status=$?
elapsed=$(($(date +%s) - start))
stop_busy
trap - EXIT

# CTest writes the tests that failed (any repeat) to LastTestsFailed.log: "index:name".
failed_file=$build_dir/Testing/Temporary/LastTestsFailed.log
failed=()
if ((status != 0)) && [[ -f $failed_file ]]; then
  mapfile -t failed < <(cut -d: -f2- "$failed_file")
fi
tail -n 5 "$log"
echo "stress_tests: ${elapsed} s, --repeat until-fail:$repeats --parallel $parallel, $busy busy loops"
if ((status == 0)); then
  echo "stress_tests: 0 tests failed"
  rm -f "$log"
  exit 0
fi
echo "stress_tests: ${#failed[@]} test(s) failed at least once (full log: $log):"
printf '  %s\n' "${failed[@]}"
exit 1
