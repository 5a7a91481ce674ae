#!/usr/bin/env bash
# Runs state_digest at world sizes 1, 2, 3, 4 and 8 and compares its digest lines with the
# committed reference, tests/tools/state_digest.ref. A behaviour-preserving change (a refactor, a
# move between files) must leave every line unchanged.
#   bash tests/tools/state_digest.sh [--update] [HP_RUN STATE_DIGEST]
# --update rewrites the reference (do it on the commit whose behaviour is the baseline).
#
# The bits depend on the machine's kernels (oneDNN and OpenBLAS pick code paths by CPU), so the
# reference records the CPU model and its vector extensions; on another machine the check is
# skipped (exit 77) with that reason, and the baseline must be rebuilt there from the base commit.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
reference="$here/state_digest.ref"
update=0
if [[ ${1:-} == --update ]]; then
  update=1
  shift
fi
build_dir=${BUILD_DIR:-build}
hp_run=${1:-$build_dir/tools/hp-run/hp-run}
digest=${2:-$build_dir/tests/state_digest}
worlds=(1 2 3 4 8)

machine() {
  local model flags torch_version
  # The name alone does not tell CPU generations apart ("AMD EPYC"), and OpenBLAS picks its
  # float32 kernels by family and model, or by OPENBLAS_CORETYPE where that is set.
  model="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
  model+=" (family $(grep -m1 '^cpu family' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')"
  model+=", model $(grep -m1 '^model[[:space:]]*:' /proc/cpuinfo | cut -d: -f2 | tr -d ' ')"
  model+=", OPENBLAS_CORETYPE ${OPENBLAS_CORETYPE:-unset})"
  flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_bf16|amx_bf16|amx_tile)$' | sort | tr '\n' ' ')
  torch_version=$(dpkg-query -W -f='${Version}' libtorch-dev 2>/dev/null || echo unknown)
  echo "# machine: $model | $flags| libtorch-dev $torch_version"
}

run_all() {
  for world in "${worlds[@]}"; do
    # The item lines name every tensor; the reference keeps one digest per section and rank.
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "$hp_run" --nproc-per-node "$world" --timeout 900 -- "$digest" |
      sed -n "s/^\[rank \([0-9]*\)\] digest /world$world rank\1 /p" | sort -s -k1,2
  done
}

if ((update)); then
  { machine; run_all; } >"$reference"
  echo "state_digest: wrote $(($(wc -l <"$reference") - 1)) digests to $reference"
  exit 0
fi
if [[ ! -f $reference ]]; then
  echo "state_digest: no reference at $reference; make one with --update on the base commit" >&2
  exit 1
fi
if [[ "$(head -n1 "$reference")" != "$(machine)" ]]; then
  echo "state_digest: SKIP: the reference was made on another machine"
  echo "  reference: $(head -n1 "$reference")"
  echo "  this one:  $(machine)"
  echo "  (rebuild the base commit here and run this script with --update to compare)"
  exit 77
fi
actual=$(mktemp)
trap 'rm -f "$actual"' EXIT
run_all >"$actual"
if diff <(tail -n +2 "$reference") "$actual" >/dev/null; then
  echo "state_digest: $(wc -l <"$actual") digests at world sizes ${worlds[*]} equal the reference"
  exit 0
fi
echo "state_digest: these digests changed (< reference, > now):"
diff <(tail -n +2 "$reference") "$actual" || true
echo "state_digest: run $digest under hp-run and compare its 'item' lines with the base commit's to see which tensors changed"
exit 1
