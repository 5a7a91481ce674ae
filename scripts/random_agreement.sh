#!/usr/bin/env bash
# The randomized agreement test at scale: RUNS runs (default 500) split over world sizes 2, 3
# and 4, each launch running its share of random ops, one in five with a rank that disagrees
# (another shape, or a skipped call). Every run must end equal to a single-process reference or
# with an agreement error on all ranks. Prints each launch's summary line.
#   bash scripts/random_agreement.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-500}
build_dir=${BUILD_DIR:-build}
for world in 2 3 4; do
  share=$(((runs + 2) / 3))
  HP_AGREEMENT_RUNS=$share OMP_NUM_THREADS=1 "$build_dir/tools/hp-run/hp-run" --nproc-per-node "$world" \
    --timeout 3600 -- "$build_dir/tests/test_agreement" --gtest_filter='*Randomized*' | grep -E "randomized agreement|PASSED|FAILED"
done
