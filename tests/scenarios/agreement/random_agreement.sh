#!/usr/bin/env bash
# The randomized agreement test at scale: RUNS runs split over world sizes 2, 3 and 4, each
# launch running its share of random ops, one in five with a rank that disagrees (another shape,
# or a skipped call). Every run must end equal to a single-process reference or with an
# agreement error on all ranks. Prints each launch's summary line.
#   bash tests/scenarios/agreement/random_agreement.sh [RUNS] [HP_RUN TEST_AGREEMENT]
set -euo pipefail
runs=${1:-500}
build_dir=${BUILD_DIR:-build}
hp_run=${2:-$build_dir/tools/hp-run/hp-run}
test_agreement=${3:-$build_dir/tests/test_agreement}
for world in 2 3 4; do
  share=$(((runs + 2) / 3))
  HP_AGREEMENT_RUNS=$share OMP_NUM_THREADS=1 "$hp_run" --nproc-per-node "$world" \
    --timeout 3600 -- "$test_agreement" --gtest_filter='*Randomized*' | grep -E "randomized agreement|PASSED|FAILED"
done
