#!/usr/bin/env bash
# Command 1 of the README: install what is missing, build, train the tiny Llama 3 with TP + SP + MC2
# in bf16 on 2 local ranks (prints one line per step and whether the loss fell).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh hp-run llama3_train
build_dir=${BUILD_DIR:-build}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$build_dir/tools/hp-run/hp-run" --nproc-per-node 2 --timeout 600 -- \
  "$build_dir/examples/torch/llama3/llama3_train" --steps 20 --dtype bf16 --enable-mc2
