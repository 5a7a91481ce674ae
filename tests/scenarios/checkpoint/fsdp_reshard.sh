#!/usr/bin/env bash
# fully_shard's checkpoints reshard across data-parallel and tensor-parallel degrees, bit for bit:
#   A  llama3_train --fsdp 2 at world 4 (dp 2 x tp 2), 3 AdamW steps (model and AdamW state)
#   B  A loaded at dp 4 x tp 1, saved again
#   C  B loaded at dp 1 x tp 2, saved again
# and every tensor of A, B and C is equal; then C resumes training at dp 2 x tp 2 (MC2 all, under
# the relaxed contract: the tiny preset's dims are below the strict one's k >= 256).
#   fsdp_reshard.sh HP_RUN LLAMA3_TRAIN RESHARD_MAIN PYTHONPATH
set -euo pipefail
hp_run=$1 train=$2 reshard=$3
export PYTHONPATH=$4 OMP_NUM_THREADS=1
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$hp_run" --nproc-per-node 4 --timeout 300 -- "$train" --preset tiny --dtype fp32 --fsdp 2 --steps 3 \
  --batch-size 4 --checkpoint-dir "$work/a" --checkpoint-every 3 >/dev/null
"$hp_run" --nproc-per-node 4 --timeout 300 -- "$reshard" tiny fp32 "$work/a" "$work/b" 4 | grep -v "^\[rank [1-3]\]"
"$hp_run" --nproc-per-node 2 --timeout 300 -- "$reshard" tiny fp32 "$work/b" "$work/c" 1 | grep -v "^\[rank 1\]"
/usr/bin/python3 "$here/compare.py" "$work/a" "$work/b"
/usr/bin/python3 "$here/compare.py" "$work/a" "$work/c"
out=$("$hp_run" --nproc-per-node 4 --timeout 300 -- "$train" --preset tiny --dtype bf16 --fsdp 2 --steps 4 \
  --batch-size 4 --enable-mc2 --mc2-scope all --relaxed-mc2-contract --checkpoint-dir "$work/c" --resume 2>&1) \
  || { echo "$out"; echo "FAIL: resuming C at dp 2 x tp 2"; exit 1; }
grep -q "cast floating tensors" <<<"$out" || { echo "$out"; echo "FAIL: expected the fp32 state cast to bf16"; exit 1; }
grep -q "step *4 |" <<<"$out" || { echo "$out"; echo "FAIL: expected step 4"; exit 1; }
echo "fsdp_reshard.sh: dp 2 x tp 2 -> dp 4 x tp 1 -> dp 1 x tp 2: every tensor bitwise equal; resumed with MC2 all"
