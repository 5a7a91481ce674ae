#!/usr/bin/env bash
# Runs a benchmark twice on N local ranks: over loopback, then over rate-limited veth links between
# network namespaces (needs root and iproute2). Each table says which link it ran on.
#   bash bench/run_bench.sh bench_mc2|bench_comm|bench_ffn|PATH/TO/PROGRAM [RATE=2gbit] [NPROC=2] [-- args]
# e.g. Llama 3 steps over the link:
#   bash bench/run_bench.sh build/examples/torch/llama3/llama3_train 2gbit 2 -- \
#     --preset bench --dtype bf16 --steps 8 --enable-mc2
# HP_BENCH_LOOPBACK=0 skips the loopback run. Inside the namespaces, HP_BENCH_RATE_CMD lets the
# program change its own link's rate (bench_mc2 --sweep).
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: run_bench.sh bench_mc2|bench_comm|bench_ffn|PROGRAM [RATE] [NPROC] [-- args]}
shift
rate=2gbit nproc=2
if [[ $# -gt 0 && $1 != "--" ]]; then rate=$1; shift; fi
if [[ $# -gt 0 && $1 != "--" ]]; then nproc=$1; shift; fi
[[ ${1:-} == "--" ]] && shift
build_dir=${BUILD_DIR:-build}
hp_run="$build_dir/tools/hp-run/hp-run"
bench="$build_dir/bench/$name"
[[ $name == */* ]] && bench=$name
export OMP_NUM_THREADS=1

if [[ ${HP_BENCH_LOOPBACK:-1} != 0 ]]; then
  "$hp_run" --nproc-per-node "$nproc" --timeout 3000 -- "$bench" "$@"
fi

if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null; then
  echo "run_bench: skipping the veth link (needs root and iproute2)" >&2
  exit 0
fi
trap 'bash bench/netns.sh down "$nproc"' EXIT
bash bench/netns.sh up "$nproc" "$rate"
HP_BENCH_LINK="veth between network namespaces, tc tbf $rate per rank" \
HP_BENCH_RATE_CMD="bash $PWD/bench/netns.sh rate" \
  "$hp_run" --nproc-per-node "$nproc" --timeout 3000 --master-addr "$(bash bench/netns.sh addr)" \
  --master-port 29611 -- bash bench/netns.sh exec -- "$bench" "$@"
