#!/usr/bin/env bash
# A checkpoint moves between the C++ and the Python trainer, across TP degrees, bit for bit:
#   A  the C++ llama3_train at TP 2, 3 AdamW steps (model and AdamW state)
#   B  A loaded by the Python model at TP 4, saved again          (C++ -> Python, TP 2 -> 4)
#   C  B loaded by the C++ model at TP 2, saved again              (Python -> C++, TP 4 -> 2)
# and every tensor of A, B and C is equal. And with the trainers' default flags (one table,
# train_defaults.json): llama3_train's checkpoint resumes in train.py at another TP degree.
#   cross_language.sh HP_RUN LLAMA3_TRAIN RESHARD_MAIN PYTHONPATH
set -euo pipefail
hp_run=$1 train=$2 reshard=$3
export PYTHONPATH=$4 OMP_NUM_THREADS=1
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for dtype in fp32 bf16; do
  "$hp_run" --nproc-per-node 2 --timeout 300 -- "$train" --preset tiny --dtype "$dtype" --steps 3 --batch-size 2 \
    --checkpoint-dir "$work/$dtype-a" --checkpoint-every 3 >/dev/null
  "$hp_run" --nproc-per-node 4 --timeout 300 -- /usr/bin/python3 "$here/reshard.py" tiny "$dtype" "$work/$dtype-a" "$work/$dtype-b" | grep -v "^\[rank [1-3]\]"
  "$hp_run" --nproc-per-node 2 --timeout 300 -- "$reshard" tiny "$dtype" "$work/$dtype-b" "$work/$dtype-c" | grep -v "^\[rank 1\]"
  /usr/bin/python3 "$here/compare.py" "$work/$dtype-a" "$work/$dtype-b"
  /usr/bin/python3 "$here/compare.py" "$work/$dtype-a" "$work/$dtype-c"
done
echo "cross_language.sh: C++ TP 2 -> Python TP 4 -> C++ TP 2: every tensor bitwise equal (fp32 and bf16)"
"$hp_run" --nproc-per-node 2 --timeout 300 -- "$train" --steps 2 --checkpoint-dir "$work/defaults" \
  --checkpoint-every 2 >/dev/null
out=$("$hp_run" --nproc-per-node 4 --timeout 300 -- /usr/bin/python3 "$here/../../../examples/torch/llama3/train.py" \
  --steps 3 --checkpoint-dir "$work/defaults" --resume 2>&1) || { echo "$out"; exit 1; }
grep -q "resumed from step 2 " <<<"$out" || { echo "$out"; echo "FAIL: expected train.py to resume from step 2"; exit 1; }
grep -q "step *3 |" <<<"$out" || { echo "$out"; echo "FAIL: expected train.py to run step 3"; exit 1; }
echo "cross_language.sh: default flags: llama3_train at TP 2 resumed in train.py at TP 4"
# Another dtype: the floating tensors are cast on load, with one line saying so.
out=$("$hp_run" --nproc-per-node 1 --timeout 300 -- /usr/bin/python3 "$here/../../../examples/torch/llama3/train.py" \
  --dtype fp32 --steps 3 --checkpoint-dir "$work/defaults" --resume 2>&1) || { echo "$out"; exit 1; }
grep -q "cast floating tensors of the checkpoint .* from BF16 to F32" <<<"$out" || { echo "$out"; echo "FAIL: no cast line"; exit 1; }
grep -q "step *3 |" <<<"$out" || { echo "$out"; echo "FAIL: expected the fp32 run to resume and run step 3"; exit 1; }
echo "cross_language.sh: the bf16 checkpoint resumed an fp32 train.py at TP 1, cast on load"
