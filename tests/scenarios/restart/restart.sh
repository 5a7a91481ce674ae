#!/usr/bin/env bash
# Faults lose no work: a job under `hp-run --max-restarts` that loses a rank restarts by itself from
# its latest checkpoint, and a stop request ends in a checkpoint and exit status 75. Every case
# trains the same 12 fp32 steps (tiny preset, --checkpoint-every 2) and must end with the last loss
# and the final checkpoint of an uninterrupted run, bit for bit:
#   kill_at_step   HP_FAULT_KILL_AT_STEP at a seeded rank and step, TP 2 (KILL_SEEDS seeds)
#   kill_outside   kill -9 from outside of a seeded rank, parked at a seeded step, TP 4
#   sigstop        a rank stops (SIGSTOP) at step 2; the others time out (HP_TIMEOUT_S=15)
#   save_fault     HP_CHECKPOINT_FAULT at each point, on the first attempt
#   async_write    --async-checkpoint; a rank dies halfway through a background write
#   preempt        SIGTERM to hp-run while rank 0 is parked at step 3: checkpoint, exit 75; a
#                  relaunch without flags continues
# A rank is parked at a known step by HP_FAULT_STOP_AT_STEP (it stops itself there), so what
# the script does from outside happens at that step whatever the machine's load.
#   two_nodes      two `hp-run --nnodes 2` on this host; a rank of node 1 dies
#   python         train.py --async-checkpoint killed at a step and restarted
#   restart.sh HP_RUN LLAMA3_TRAIN PYTHONPATH [KILL_SEEDS=3] [CASES...]
set -uo pipefail
hp_run=$1 train=$2
export PYTHONPATH=$3 OMP_NUM_THREADS=1
kill_seeds=${4:-3}
shift $(($# < 4 ? $# : 4))
cases=("$@")
((${#cases[@]})) || cases=(kill_at_step kill_outside sigstop save_fault async_write preempt two_nodes python)
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
compare=$repo/tests/scenarios/checkpoint/compare.py
work=$(mktemp -d)
out=$work/out
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; echo "--- output ---"; tail -n 40 "$out"; exit 1; }

common_args=(--preset tiny --dtype fp32 --batch-size 2 --checkpoint-every 2)
train_args=("${common_args[@]}" --steps 12)
restart_args=(--max-restarts 2 --restart-backoff-s 0 --timeout 300)
py_train=$repo/examples/torch/llama3/train.py

last_loss() { grep -o '(last [^)]*)' "$1" | tail -n 1; }
restarts() { grep -c '^hp-run: restart ' "$1"; }

# expect_like_reference NAME DIR REFERENCE: the run in $out ended as the reference did.
expect_like_reference() {
  local name=$1 dir=$2 ref=$3
  [[ "$(last_loss "$out")" == "$(last_loss "$ref/out")" ]] ||
    fail "$name: last loss $(last_loss "$out"), uninterrupted $(last_loss "$ref/out")"
  [[ $(cat "$dir/latest") == step-12 ]] || fail "$name: expected latest = step-12"
  /usr/bin/python3 "$compare" "$ref" "$dir" >"$work/compare" || { cat "$work/compare"; fail "$name: final checkpoint"; }
}

# reference NAME NPROC PROGRAM...: an uninterrupted run into $work/NAME (its output in $work/NAME/out).
reference() {
  local name=$1 nproc=$2
  shift 2
  mkdir -p "$work/$name"
  "$hp_run" --nproc-per-node "$nproc" --timeout 300 -- "$@" "${train_args[@]}" --checkpoint-dir "$work/$name" \
    >"$work/$name/out" 2>&1 || { cat "$work/$name/out"; fail "the uninterrupted $name run failed"; }
}

# wait_for_line PATTERN PID: until the output shows PATTERN (or the job is gone).
wait_for_line() {
  until grep -q "$1" "$out"; do
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.05
  done
}

# parked_rank PID: prints the pid of the rank process of job PID that stopped itself
# (HP_FAULT_STOP_AT_STEP), once it has; fails if the job ends first.
parked_rank() {
  while kill -0 "$1" 2>/dev/null; do
    for pid in $(pgrep -P "$1"); do
      [[ $(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null) == T ]] && { echo "$pid"; return 0; }
    done
    sleep 0.05
  done
  return 1
}

case_kill_at_step() {
  for ((seed = 1; seed <= kill_seeds; ++seed)); do
    RANDOM=$seed
    local rank=$((RANDOM % 2)) step=$((RANDOM % 12 + 1)) dir=$work/kill-$seed
    HP_FAULT_KILL_AT_STEP=$rank:$step "$hp_run" --nproc-per-node 2 "${restart_args[@]}" -- "$train" \
      "${train_args[@]}" --checkpoint-dir "$dir" >"$out" 2>&1 || fail "seed $seed: the job failed"
    [[ $(restarts "$out") == 1 ]] || fail "seed $seed (rank $rank, step $step): expected one restart"
    grep -q "^hp-run: restart 1/2 after rank $rank was killed by signal SIGKILL" "$out" || fail "seed $seed: cause"
    expect_like_reference "seed $seed (rank $rank killed at step $step)" "$dir" "$work/ref2"
    echo "kill_at_step: seed $seed: rank $rank killed at step $step; one restart; bitwise equal"
  done
}

case_kill_outside() {
  RANDOM=${KILL_OUTSIDE_SEED:-7}
  local rank=$((RANDOM % 4)) step=$((RANDOM % 10 + 1)) dir=$work/outside
  HP_FAULT_STOP_AT_STEP=$rank:$step "$hp_run" --nproc-per-node 4 "${restart_args[@]}" -- "$train" "${train_args[@]}" \
    --checkpoint-dir "$dir" >"$out" 2>&1 &
  local job=$!
  local victim
  victim=$(parked_rank $job) || fail "kill_outside: the job ended before rank $rank stopped at step $step"
  kill -9 "$victim"
  wait $job || fail "kill_outside: the job failed"
  [[ $(restarts "$out") == 1 ]] || fail "kill_outside: expected one restart"
  expect_like_reference "kill_outside" "$dir" "$work/ref4"
  echo "kill_outside: seed ${KILL_OUTSIDE_SEED:-7}: kill -9 of rank $rank, parked at step $step, at TP 4;" \
    "one restart; bitwise equal"
}

case_sigstop() {
  local dir=$work/sigstop
  HP_FAULT_STOP_AT_STEP=1:2 HP_TIMEOUT_S=15 "$hp_run" --nproc-per-node 2 "${restart_args[@]}" --grace 1 -- "$train" \
    "${train_args[@]}" --checkpoint-dir "$dir" >"$out" 2>&1 || fail "sigstop: the job failed"
  grep -q "HP_FAULT_STOP_AT_STEP=1:2: rank 1 stops itself at step 2" "$out" || fail "sigstop: rank 1 did not stop"
  [[ $(restarts "$out") == 1 ]] || fail "sigstop: expected one restart"
  expect_like_reference "sigstop" "$dir" "$work/ref2"
  echo "sigstop: rank 1 stopped at step 2; the other timed out; one restart; bitwise equal"
}

case_save_fault() {
  for fault in after_shard before_rename before_latest; do
    local dir=$work/fault-$fault
    "$hp_run" --nproc-per-node 2 --timeout 300 -- "$train" "${common_args[@]}" --steps 4 --checkpoint-dir "$dir" \
      >"$out" 2>&1 || fail "$fault: the first 4 steps failed"
    HP_CHECKPOINT_FAULT=$fault "$hp_run" --nproc-per-node 2 "${restart_args[@]}" -- "$train" "${train_args[@]}" \
      --checkpoint-dir "$dir" >"$out" 2>&1 || fail "$fault: the job failed"
    grep -q "HP_CHECKPOINT_FAULT=$fault: rank [01] exits with status 3" "$out" || fail "$fault: the fault did not fire"
    [[ $(restarts "$out") == 1 ]] || fail "$fault: expected one restart"
    [[ $(grep -c "resumed from step 4 " "$out") == 2 ]] || fail "$fault: expected both attempts to resume from step 4"
    expect_like_reference "$fault" "$dir" "$work/ref2"
    echo "save_fault: $fault at the save of step 6; the restart resumed from step 4; bitwise equal"
  done
}

case_async_write() {
  local dir=$work/async-write
  "$hp_run" --nproc-per-node 2 --timeout 300 -- "$train" "${common_args[@]}" --steps 4 --checkpoint-dir "$dir" \
    >"$out" 2>&1 || fail "async_write: the first 4 steps failed"
  HP_CHECKPOINT_FAULT=async_write "$hp_run" --nproc-per-node 2 "${restart_args[@]}" -- "$train" "${train_args[@]}" \
    --async-checkpoint --checkpoint-dir "$dir" >"$out" 2>&1 || fail "async_write: the job failed"
  grep -q "HP_CHECKPOINT_FAULT=async_write: rank 1 exits with status 3" "$out" || fail "async_write: no fault"
  [[ $(restarts "$out") == 1 ]] || fail "async_write: expected one restart"
  [[ $(grep -c "resumed from step 4 " "$out") == 2 ]] || fail "async_write: expected both attempts to resume from step 4"
  expect_like_reference "async_write" "$dir" "$work/ref2"
  echo "async_write: rank 1 died halfway through the background write of step 6; resumed from step 4; bitwise equal"
}

case_preempt() {
  local dir=$work/preempt
  HP_FAULT_STOP_AT_STEP=0:3 "$hp_run" --nproc-per-node 2 "${restart_args[@]}" -- "$train" "${train_args[@]}" \
    --checkpoint-dir "$dir" >"$out" 2>&1 &
  local job=$!
  local parked
  parked=$(parked_rank $job) || fail "preempt: the job ended before rank 0 stopped at step 3"
  kill -TERM $job
  # Rank 0 resumes once hp-run has sent every rank its stop request (rank 0's waits, pending).
  wait_for_line "asking every rank to checkpoint and stop" $job || fail "preempt: hp-run did not ask the ranks to stop"
  kill -CONT "$parked"
  wait $job
  local code=$?
  [[ $code == 75 ]] || fail "preempt: expected exit status 75, got $code"
  local step
  step=$(sed -n 's/^hp-run: preempted; checkpoint at step \([0-9]*\)$/\1/p' "$out")
  [[ -n $step && $(cat "$dir/latest") == step-$step ]] || fail "preempt: expected latest = the preemption's step"
  "$hp_run" --nproc-per-node 2 --timeout 300 -- "$train" "${train_args[@]}" --checkpoint-dir "$dir" >"$out" 2>&1 ||
    fail "preempt: the relaunch failed"
  grep -q "resumed from step $step " "$out" || fail "preempt: expected the relaunch to resume from step $step"
  expect_like_reference "preempt" "$dir" "$work/ref2"
  echo "preempt: SIGTERM with rank 0 parked at step 3; checkpoint at step $step, exit 75; the relaunch continued;" \
    "bitwise equal"
}

free_port_pair() {
  /usr/bin/python3 -c '
import socket
for port in range(23000 + __import__("os").getpid() % 20000, 65000, 7):
    try:
        for p in range(port, port + 3):
            socket.create_server(("127.0.0.1", p)).close()
        print(port); break
    except OSError:
        pass'
}

case_two_nodes() {
  local dir=$work/two-nodes port
  port=$(free_port_pair)
  local node_args=(--nnodes 2 --nproc-per-node 1 --master-addr 127.0.0.1 --master-port "$port" "${restart_args[@]}")
  for node in 0 1; do
    HP_FAULT_KILL_AT_STEP=1:5 "$hp_run" "${node_args[@]}" --node-rank $node -- "$train" "${train_args[@]}" \
      --checkpoint-dir "$dir" >"$work/node$node" 2>&1 &
    eval "node${node}_job=$!"
  done
  wait "$node0_job" || { out=$work/node0; fail "two_nodes: node 0 failed"; }
  wait "$node1_job" || { out=$work/node1; fail "two_nodes: node 1 failed"; }
  for node in 0 1; do
    out=$work/node$node
    [[ $(restarts "$out") == 1 ]] || fail "two_nodes: expected node $node to restart once"
  done
  out=$work/node0
  expect_like_reference "two_nodes" "$dir" "$work/ref2"
  echo "two_nodes: rank 1 (node 1) killed at step 5; both nodes restarted on port $((port + 1)); bitwise equal"
}

case_python() {
  local dir=$work/python
  reference pyref 2 /usr/bin/python3 "$py_train"
  HP_FAULT_KILL_AT_STEP=0:7 "$hp_run" --nproc-per-node 2 "${restart_args[@]}" -- /usr/bin/python3 "$py_train" \
    "${train_args[@]}" --async-checkpoint --checkpoint-dir "$dir" >"$out" 2>&1 ||
    fail "python: the job failed"
  [[ $(restarts "$out") == 1 ]] || fail "python: expected one restart"
  # The save of step 6 may still be in flight when step 7 begins: then step 4 is the latest.
  grep -Eq "resumed from step (4|6) " "$out" || fail "python: expected the restart to resume from step 4 or 6"
  expect_like_reference "python" "$dir" "$work/pyref"
  echo "python: train.py --async-checkpoint, rank 0 killed at step 7; one restart, $(grep -o 'resumed from step [0-9]*' "$out"); bitwise equal"
}

reference ref2 2 "$train"
[[ " ${cases[*]} " == *" kill_outside "* ]] && reference ref4 4 "$train"
for c in "${cases[@]}"; do
  "case_$c"
done
echo "PASS"
