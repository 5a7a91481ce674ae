#!/usr/bin/env bash
# Both trainers (C++ llama3_train and Python train.py), tiny preset, fp32, 4 steps: --fsdp N
# trains like replicated --dp N (step-4 loss within 1e-3, relative), at
#   dp 2 x tp 1                         (world 2; also --no-reshard-after-forward)
#   dp 2 x tp 2, MC2 on every layer and loss parallel (world 4, bitwise equal run to run)
#   HSDP 2 replicas x 2 shards x tp 1   (world 4, bitwise equal run to run)
# (test_llama3 and the Python system tests check dp 2 x tp 1 run to run, without the launches.)
#   fsdp_trainers.sh HP_RUN LLAMA3_TRAIN TRAIN_PY PYTHONPATH
set -euo pipefail
hp_run=$1 train_cpp=$2 train_py=$3
export PYTHONPATH=$4 OMP_NUM_THREADS=1

# The step-4 loss, to all printed digits, of one run: last_loss WORLD TRAINER FLAGS...
last_loss() {
  local world=$1 trainer=$2 out
  shift 2
  local common=(--preset tiny --dtype fp32 --steps 4)
  if [[ $trainer == cpp ]]; then
    out=$("$hp_run" --nproc-per-node "$world" --timeout 300 -- "$train_cpp" "${common[@]}" "$@" 2>&1)
  else
    out=$("$hp_run" --nproc-per-node "$world" --timeout 300 -- /usr/bin/python3 "$train_py" "${common[@]}" "$@" 2>&1)
  fi || { echo "$out" >&2; echo "FAIL: $trainer $* at world $world" >&2; return 1; }
  grep -q "step *4 |" <<<"$out" || { echo "$out" >&2; echo "FAIL: no step 4 ($trainer $*)" >&2; return 1; }
  sed -n 's/^\[rank 0\] loss fell: .*(last \([-0-9.e]*\))$/\1/p' <<<"$out"
}

# The replicated run of a (world, trainer, flags) is trained once and its loss reused.
replicated_losses=$(mktemp -d)
trap 'rm -rf "$replicated_losses"' EXIT
replicated_loss() {
  local file
  file="$replicated_losses/$(tr ' ' '_' <<<"$*")"
  [[ -s $file ]] || last_loss "$@" >"$file"
  cat "$file"
}

# compare WORLD TRAINER "REPLICATED FLAGS" "SHARDED FLAGS" [twice]: "twice" also trains the
# sharded run a second time and expects the same loss, bit for bit.
compare() {
  local world=$1 trainer=$2 dp fsdp again note=""
  dp=$(replicated_loss "$world" "$trainer" $3)
  fsdp=$(last_loss "$world" "$trainer" $4)
  [[ -n $dp && -n $fsdp ]] || { echo "FAIL: no final loss ($trainer $3 / $4)"; exit 1; }
  if [[ ${5:-} == twice ]]; then
    again=$(last_loss "$world" "$trainer" $4)
    [[ $fsdp == "$again" ]] || { echo "FAIL: $trainer $4 not bitwise run to run: $fsdp vs $again"; exit 1; }
    note=", bitwise run to run"
  fi
  /usr/bin/python3 - "$dp" "$fsdp" "$trainer" "$3" "$4" "$note" <<'EOF'
import sys
dp, fsdp = float(sys.argv[1]), float(sys.argv[2])
rel = abs(dp - fsdp) / abs(dp)
verdict = "ok" if rel <= 1e-3 else "FAIL"
print(f"{verdict}: {sys.argv[3]:3s} step-4 loss {sys.argv[4]}: {dp:.10f}  {sys.argv[5]}: {fsdp:.10f} "
      f"(relative difference {rel:.1e}{sys.argv[6]})")
sys.exit(0 if rel <= 1e-3 else 1)
EOF
}

mc2="--enable-mc2 --mc2-scope all --relaxed-mc2-contract --loss-parallel"
for trainer in cpp py; do
  compare 2 "$trainer" "--dp 2" "--fsdp 2"
  compare 2 "$trainer" "--dp 2" "--fsdp 2 --no-reshard-after-forward"
  compare 4 "$trainer" "--dp 2 $mc2" "--fsdp 2 $mc2" twice
  compare 4 "$trainer" "--dp 4" "--fsdp 2 --hsdp 2" twice
done
echo "fsdp_trainers.sh: fully_shard matches replicated data parallelism in both trainers"
