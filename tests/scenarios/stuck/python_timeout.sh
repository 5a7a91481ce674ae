#!/usr/bin/env bash
# A transfer on a group the Python package adopts from torch.distributed waits HP_TIMEOUT_S, else
# the group's own timeout (given to init_process_group or new_group): rank 1 skips a collective,
# rank 0 fails in time, naming rank 1.
#   python_timeout.sh HP_RUN PYTHON_PATH
set -uo pipefail
hp_run=$1
export PYTHONPATH=$2
script=$(dirname "$0")/python_timeout.py
out=$(mktemp)
trace_dir=$(mktemp -d)
trap 'rm -rf "$out" "$trace_dir"' EXIT
# case: group, torch's world timeout (s), new_group's ("-": torch's default), "store" to give
# init_process_group a store with a timeout of its own, HP_TIMEOUT_S ("-" for unset), HP_TRACE
# (a traced transfer is waited for by a thread of its own), TORCH_DISTRIBUTED_DEBUG (DETAIL wraps
# torch's groups)
for case in "world 1800 - - 8 - -" "subgroup 1800 - - 8 - -" "world 8 - store - - -" \
  "subgroup 1800 8 - - - -" "subgroup 1800 8 - - - DETAIL" "world 1800 - - 8 $trace_dir -"; do
  read -r group world_timeout subgroup_timeout store hp_timeout trace debug <<<"$case"
  [[ $hp_timeout == - ]] && hp_timeout=
  [[ $trace == - ]] && trace=
  [[ $debug == - ]] && debug=OFF
  HP_TIMEOUT_S=$hp_timeout HP_TRACE=$trace TORCH_DISTRIBUTED_DEBUG=$debug "$hp_run" --nproc-per-node 2 --timeout 90 -- \
    /usr/bin/python3 "$script" "$group" "$world_timeout" "$subgroup_timeout" "$store" >"$out" 2>&1
  if ! grep -q "python_timeout $group: PASS" "$out"; then
    echo "FAIL: $case"
    echo "--- output ---"
    cat "$out"
    exit 1
  fi
  grep "rank 0 failed after" "$out"
done
echo "PASS"
