#!/usr/bin/env bash
# A user error in an example is one line "program: message" and exit status 1 on the rank that
# hit it (no abort, no backtrace), and hp-run names the rank.
#   one_line_errors.sh HP_RUN LLAMA3_TRAIN [BENCH_LLAMA_STEP]
set -uo pipefail
hp_run=$1 train=$2 bench=${3:-}
fail() { echo "FAIL: $*"; echo "--- output ---"; cat "$out"; exit 1; }
out=$(mktemp)
trap 'rm -f "$out"' EXIT

# seq_len 7 is not divisible by TP 2: the plan rejects it on every rank.
"$hp_run" --nproc-per-node 2 --timeout 120 -- "$train" --preset tiny --seq-len 7 --steps 1 >"$out" 2>&1
code=$?
[[ $code -eq 1 ]] || fail "expected exit status 1, got $code"
grep -q '^\[rank [01]\] llama3_train: parallelize_llama3: expected seq_len (7) divisible by the TP size (2)' "$out" \
  || fail "expected the one-line error"
grep -q 'hp-run: rank [01] exited with code 1' "$out" || fail "expected hp-run to name the rank"
if grep -q -e 'Exception raised from' -e 'terminate called' -e 'SIGABRT' -e 'frame #' "$out"; then
  fail "expected no backtrace or abort"
fi
lines=$(grep -c 'llama3_train: ' "$out")
[[ $lines -le 2 ]] || fail "expected one error line per rank, got $lines"

# An error inside the model on a single rank: the sequence is longer than the preset allows.
"$hp_run" --nproc-per-node 1 --timeout 60 -- "$train" --preset tiny --seq-len 9 --steps 1 >"$out" 2>&1
code=$?
[[ $code -eq 1 ]] || fail "expected exit status 1 for a too-long sequence, got $code"
grep -q "llama3_train: Attention: expected seq_len <= max_seq_len 8, got 9" "$out" \
  || fail "expected the model's error on one line"

# A bad flag value is a usage error (exit 2) that names the flag and the value.
"$train" --preset nope >"$out" 2>&1
code=$?
[[ $code -eq 2 ]] || fail "expected exit status 2 for a bad flag, got $code"
grep -q -- "--preset: nope" "$out" || fail "expected the message to name --preset and 'nope'"
# --mc2-chunks takes auto or a whole count: 0.5 is not silently auto, nor 2.7 silently 2.
for bad in 0.5 2.7 0 1e30; do
  "$train" --enable-mc2 --mc2-chunks "$bad" >"$out" 2>&1
  code=$?
  [[ $code -eq 2 ]] || fail "expected exit status 2 for --mc2-chunks $bad, got $code"
  grep -q -- "--mc2-chunks: expected auto or a count from 1 to 9999, got '$bad'" "$out" \
    || fail "expected the message to name --mc2-chunks and '$bad'"
done
# --async-checkpoint without --checkpoint-dir: a usage error naming both flags.
"$train" --async-checkpoint >"$out" 2>&1
code=$?
[[ $code -eq 2 ]] || fail "expected exit status 2 for --async-checkpoint alone, got $code"
grep -q -- "--async-checkpoint requires --checkpoint-dir" "$out" || fail "expected the flag dependency named"

# An unknown HP_CHECKPOINT_FAULT is one line naming every fault point and the value.
dir=$(mktemp -d)
HP_CHECKPOINT_FAULT=bogus "$hp_run" --nproc-per-node 1 --timeout 60 -- "$train" --preset tiny --steps 1 \
  --checkpoint-dir "$dir" --checkpoint-every 1 >"$out" 2>&1
code=$?
rm -rf "$dir"
[[ $code -eq 1 ]] || fail "expected exit status 1 for a bad HP_CHECKPOINT_FAULT, got $code"
grep -q "llama3_train: checkpoint::save: expected HP_CHECKPOINT_FAULT to be after_shard, async_write, before_rename or before_latest, got 'bogus'" "$out" \
  || fail "expected the fault points named"

# bench_llama_step --configs with a name it does not measure: one line naming the known ones.
if [[ -n $bench ]]; then
  "$hp_run" --nproc-per-node 1 --timeout 60 -- "$bench" --dp 1 --configs "MC2 al" >"$out" 2>&1
  code=$?
  [[ $code -eq 1 ]] || fail "expected exit status 1 for an unknown --configs name, got $code"
  grep -q "bench_llama_step: expected --configs among 'plain TP', 'MC2 ffn', 'MC2 all serial dW', 'MC2 all', got 'MC2 al'" \
    "$out" || fail "expected the known configurations named"
fi
echo "PASS"
