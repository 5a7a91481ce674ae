#!/usr/bin/env bash
# An interrupted save never damages the last complete checkpoint. For each fault point of
# HP_CHECKPOINT_FAULT, a TP-2 run (tiny preset) that dies while saving step 3 leaves `latest` at
# step 2, with step-2 intact; --resume then continues from step 2 to the end. Last, a checkpoint
# saved at TP 2 resumes at TP 1.
#   faults.sh HP_RUN LLAMA3_TRAIN
set -uo pipefail
hp_run=$1 train=$2
out=$(mktemp)
root=$(mktemp -d)
trap 'rm -rf "$out" "$root"' EXIT
fail() { echo "FAIL: $*"; echo "--- output ---"; cat "$out"; exit 1; }
# run NPROC ARGS...: llama3_train under hp-run, output in $out.
run() {
  local n=$1
  shift
  "$hp_run" --nproc-per-node "$n" --timeout 240 -- "$train" --preset tiny --batch-size 2 "$@" >"$out" 2>&1
}
latest() { cat "$1/latest" 2>/dev/null; }

for fault in after_shard before_rename before_latest; do
  dir="$root/$fault"
  run 2 --steps 2 --checkpoint-dir "$dir" --checkpoint-every 1 || fail "$fault: the first run failed"
  [[ $(latest "$dir") == step-2 ]] || fail "$fault: expected latest = step-2 after the first run"
  [[ -f "$dir/step-1/COMPLETE" && -f "$dir/step-2/COMPLETE" ]] || fail "$fault: expected step-1 and step-2"

  HP_CHECKPOINT_FAULT=$fault run 2 --steps 4 --checkpoint-dir "$dir" --checkpoint-every 1 --resume
  code=$?
  [[ $code -ne 0 ]] || fail "$fault: expected the run to die while saving step 3"
  grep -q "HP_CHECKPOINT_FAULT=$fault: rank [01] exits with status 3" "$out" \
    || fail "$fault: expected the fault to fire"
  grep -q "step   4 |" "$out" && fail "$fault: expected no step after the failed save"
  [[ $(latest "$dir") == step-2 ]] || fail "$fault: expected latest to still name step-2"
  [[ -f "$dir/step-2/COMPLETE" && -f "$dir/step-2/index.json" ]] || fail "$fault: expected step-2 intact"
  tmp=$(ls -d "$dir"/.step-3.tmp-* 2>/dev/null | head -n 1)
  case $fault in
    after_shard)
      [[ ! -e "$dir/step-3" ]] || fail "$fault: expected no step-3"
      [[ -n $tmp && ! -e $tmp/COMPLETE ]] || fail "$fault: expected an incomplete temporary directory" ;;
    before_rename)
      [[ ! -e "$dir/step-3" ]] || fail "$fault: expected no step-3"
      [[ -n $tmp && -f $tmp/COMPLETE ]] || fail "$fault: expected the complete temporary directory" ;;
    before_latest)
      [[ -f "$dir/step-3/COMPLETE" ]] || fail "$fault: expected step-3 published but not named by latest" ;;
  esac

  run 2 --steps 5 --checkpoint-dir "$dir" --checkpoint-every 1 --resume \
    || fail "$fault: expected the resumed run to succeed"
  grep -q "resumed from step 2" "$out" || fail "$fault: expected 'resumed from step 2'"
  grep -q "step   2 |" "$out" && fail "$fault: expected step 2 not to run again"
  grep -q "step   3 |" "$out" && grep -q "step   5 |" "$out" || fail "$fault: expected steps 3 to 5"
  [[ $(latest "$dir") == step-5 ]] || fail "$fault: expected latest = step-5 at the end"
  if ls -A "$dir" | grep -q '^\.step-'; then fail "$fault: expected no leftovers of the interrupted save"; fi
done

# Saved at TP 2, resumed at TP 1.
dir="$root/before_latest"
run 1 --steps 6 --checkpoint-dir "$dir" --resume || fail "expected the TP-1 resume to succeed"
grep -q "resumed from step 5" "$out" && grep -q "step   6 |" "$out" || fail "expected step 6 after step 5 at TP 1"

# --resume needs --checkpoint-dir (a usage error).
"$train" --resume >"$out" 2>&1
code=$?
[[ $code -eq 2 ]] || fail "expected exit status 2 for --resume without --checkpoint-dir, got $code"
grep -q -- "--checkpoint-dir" "$out" || fail "expected the message to name --checkpoint-dir"
echo "PASS"
