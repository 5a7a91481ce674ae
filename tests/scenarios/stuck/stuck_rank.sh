#!/usr/bin/env bash
# A stuck rank is named, not its neighbour that noticed: on 4 ranks rank 2 freezes; the others
# time out and print hp-waiting-on lines; hp-run names rank 2 and says how it was stuck.
#   stuck_rank.sh HP_RUN PROGRAM
set -uo pipefail
hp_run=$1 program=$2
out=$(mktemp)
trap 'rm -f "$out"' EXIT
fail() { echo "FAIL: $*"; echo "--- output ---"; cat "$out"; exit 1; }
run() { HP_TIMEOUT_S=15 "$hp_run" --nproc-per-node 4 --grace 3 --timeout 120 -- "$program" "$@" >"$out" 2>&1; }

# (a) SIGSTOP: rank 2 cannot report or exit; the others name it.
run stop
grep -q "hp-waiting-on: rank [013] peer 2 op" "$out" || fail "(a) expected a rank waiting on rank 2"
grep -q "hp-run: rank(s) .* were waiting on rank 2; unresponsive" "$out" || fail "(a) expected hp-run to name rank 2 as unresponsive"
grep -q "stuck_rank_main: hyper_parallel::comm: .*all_gather.*failed" "$out" || fail "(a) expected a timeout error naming the op"

# (a') the same without the agreement step: the ranks wait on their ring neighbours in a chain
# (1 -> 0 -> 3 -> 2), and hp-run follows it to rank 2.
HP_COMM_CHECK=0 run stop
grep -q "hp-run: rank(s) .* were waiting on rank 2; unresponsive" "$out" || fail "(a') expected hp-run to follow the chain to rank 2"

if grep -q -e "SIGABRT" -e "terminate called" "$out"; then fail "(a') expected no abort"; fi

# (b) a rank sleeping in its own code reports it was in no collective and dies: of SIGTERM, or,
# if the others' closed connections reach it first, when Gloo's own thread terminates it.
run sleep
grep -q "hp-waiting-on: rank 2 none" "$out" || fail "(b) expected rank 2 to report it was in no collective"
grep -q "hp-run: rank(s) .* were waiting on rank 2; it was not inside a collective" "$out" \
  || fail "(b) expected hp-run to name rank 2"
echo "PASS"
