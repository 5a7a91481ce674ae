#!/usr/bin/env bash
# Determinism with the backward's overlap on: two runs of the bench preset, MC2 on every Linear it
# can fuse, loss parallel, bf16, 3 steps, end with bitwise-equal parameters and AdamW state (their
# checkpoint files compared byte for byte), at TP 2 and TP 4.
#   mc2_overlap.sh HP_RUN LLAMA3_TRAIN
set -uo pipefail
hp_run=$1 train=$2
export OMP_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
args=(--preset bench --dtype bf16 --batch-size 2 --steps 3 --enable-mc2 --mc2-scope all --loss-parallel
  --checkpoint-every 3)
for tp in 2 4; do
  for run in a b; do
    "$hp_run" --nproc-per-node "$tp" --timeout 600 -- "$train" "${args[@]}" --checkpoint-dir "$work/tp$tp-$run" \
      >"$work/out" 2>&1 || { tail -n 30 "$work/out"; echo "FAIL: TP $tp run $run failed"; exit 1; }
  done
  files=0
  for f in "$work/tp$tp-a/step-3"/*; do
    cmp -s "$f" "$work/tp$tp-b/step-3/$(basename "$f")" || { echo "FAIL: TP $tp: $(basename "$f") differs"; exit 1; }
    files=$((files + 1))
  done
  ((files >= tp + 2)) || { echo "FAIL: TP $tp: expected $((tp + 2)) files, found $files"; exit 1; }
  echo "TP $tp: two runs, $files checkpoint files bitwise equal"
  rm -rf "$work/tp$tp-a" "$work/tp$tp-b"
done
echo PASS
