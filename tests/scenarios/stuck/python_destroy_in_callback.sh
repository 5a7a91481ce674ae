#!/usr/bin/env bash
# destroy_process_group from a callback of torch's work on an adopted group (its last holder):
# both ranks finish, three launches in a row.
#   python_destroy_in_callback.sh HP_RUN PYTHON_PATH
set -uo pipefail
hp_run=$1
export PYTHONPATH=$2
script=$(dirname "$0")/python_destroy_in_callback.py
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for launch in 1 2 3; do
  HP_TIMEOUT_S=30 "$hp_run" --nproc-per-node 2 --timeout 90 -- /usr/bin/python3 "$script" >"$out" 2>&1
  rc=$?
  if [[ $rc -ne 0 || $(grep -c "python_destroy_in_callback rank [01]: PASS" "$out") -ne 2 ]]; then
    echo "FAIL: launch $launch (hp-run exit $rc)"
    echo "--- output ---"
    cat "$out"
    exit 1
  fi
done
echo "PASS"
