#!/usr/bin/env bash
# On 2 ranks over a rate-limited link (network namespaces of this test's own, veth + tc tbf),
# HP_TRACE's files parse, the fused MC2 ops' transfers are covered by matmuls (overlap >= 0.5)
# and a serial control's are not (overlap < 0.1); the column Linear's fused backward has its
# reduce-scatter covered by its weight gradient (spans "wgrad" >= 0.5) and a serial backward
# does not (< 0.1). A row Linear's backward gather has the next row's deferred weight gradient
# in its window (spans "wgrad" over all_gather_matmul's transfers >= 0.4), and none with the
# deferral off (< 0.1). Needs root (namespaces); skipped otherwise. Under a sanitizer
# (HP_TIMING_CHECKS=0, set by scripts/sanitize.sh) the instrumented code's timing means nothing:
# the coverages are printed, not asserted; the traces must still parse and hold every op.
#   trace_overlap.sh HP_RUN HP_TRACE_TOOL PROGRAM NETNS_SH
set -uo pipefail
hp_run=$1 hp_trace=$2 program=$3 netns=$4
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "SKIP: needs root and iproute2 for the rate-limited link"
  exit 77
fi
export HP_NETNS_PREFIX=hptr HP_NETNS_SUBNET=10.232.0
dir=$(mktemp -d)
cleanup() { bash "$netns" down 2 >/dev/null 2>&1; rm -rf "$dir"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }

bash "$netns" up 2 1gbit || fail "could not create the namespaces"
HP_TRACE=$dir OMP_NUM_THREADS=1 "$hp_run" --nproc-per-node 2 --timeout 300 \
  --master-addr "$(bash "$netns" addr)" --master-port 29731 -- bash "$netns" exec -- "$program" \
  || fail "the traced program failed"
[[ -f $dir/rank0.json && -f $dir/rank1.json ]] || fail "expected rank0.json and rank1.json in $dir"
for f in "$dir"/rank*.json; do
  /usr/bin/python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$f" || fail "$f does not parse"
done
"$hp_trace" overlap "$dir"
"$hp_trace" overlap "$dir" --json >"$dir/overlap.json" || fail "hp-trace overlap failed"
"$hp_trace" overlap "$dir" --by wgrad
"$hp_trace" overlap "$dir" --by wgrad --json >"$dir/wgrad.json" || fail "hp-trace overlap --by wgrad failed"
/usr/bin/python3 - "$dir/overlap.json" "$dir/wgrad.json" <<'PY' || exit 1
import json, os, sys
timed = os.environ.get("HP_TIMING_CHECKS", "1") != "0"
by_matmul, by_wgrad = (json.load(open(f)) for f in sys.argv[1:3])
def check(ops, name, ok, text, by="matmul"):
    if name not in ops:
        print(f"FAIL: no {name} in the trace"); sys.exit(1)
    v = ops[name]["overlap"]
    print(f"{name}: covered by {by} {v:.2f} (expected {text}{'' if timed else '; not asserted'})")
    if timed and not ok(v): print("FAIL"); sys.exit(1)
check(by_matmul, "all_gather_matmul", lambda v: v >= 0.5, ">= 0.5")
check(by_matmul, "matmul_reduce_scatter", lambda v: v >= 0.5, ">= 0.5")
check(by_matmul, "serial_all_gather_then_matmul", lambda v: v < 0.1, "< 0.1")
check(by_wgrad, "column_backward", lambda v: v >= 0.4, ">= 0.4", "wgrad")
check(by_wgrad, "serial_column_backward", lambda v: v < 0.1, "< 0.1", "wgrad")
PY
# The started all-reduces: every send each rank posts carries the op (2 phases to 1 peer; a count,
# indices and rows to 1 peer), none is left to op -1.
/usr/bin/python3 - "$dir/rank0.json" <<'PY' || exit 1
import json, sys
events = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e.get("ph") == "X"]
started = {e["args"]["op"]: e["args"]["detail"] for e in events
           if e["cat"] == "op" and e["name"] == "all_reduce" and "(started)" in e["args"]["detail"]}
for op, detail in started.items():
    sends = [e for e in events if e["cat"] == "transfer" and e["args"]["op"] == op and e["name"].startswith("send")]
    expected = 3 if "row-sparse" in detail else 2
    print(f"{detail}: {len(sends)} sends traced as its own (expected {expected})")
    if len(sends) != expected: print("FAIL"); sys.exit(1)
if len(started) != 2: print(f"FAIL: expected 2 started all-reduces, got {len(started)}"); sys.exit(1)
PY
# The row chain, deferred and serial, each traced into a folder of its own.
for mode in deferred serial; do
  mkdir -p "$dir/$mode"
  HP_TRACE=$dir/$mode OMP_NUM_THREADS=1 "$hp_run" --nproc-per-node 2 --timeout 300 \
    --master-addr "$(bash "$netns" addr)" --master-port 29733 -- bash "$netns" exec -- "$program" "$mode" \
    || fail "the traced row chain ($mode) failed"
  "$hp_trace" overlap "$dir/$mode" --by wgrad
  "$hp_trace" overlap "$dir/$mode" --by wgrad --json >"$dir/$mode.json" || fail "hp-trace overlap ($mode) failed"
done
/usr/bin/python3 - "$dir/deferred.json" "$dir/serial.json" <<'PY' || exit 1
import json, os, sys
timed = os.environ.get("HP_TIMING_CHECKS", "1") != "0"
for path, ok, text in ((sys.argv[1], lambda v: v >= 0.4, ">= 0.4"), (sys.argv[2], lambda v: v < 0.1, "< 0.1")):
    ops = json.load(open(path))
    if "all_gather_matmul" not in ops:
        print(f"FAIL: no all_gather_matmul in {path}"); sys.exit(1)
    v = ops["all_gather_matmul"]["overlap"]
    print(f"{path}: row backward gathers covered by wgrad {v:.2f} (expected {text}{'' if timed else '; not asserted'})")
    if timed and not ok(v): print("FAIL"); sys.exit(1)
PY
echo "PASS"
