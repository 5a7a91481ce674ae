#!/usr/bin/env bash
# On 2 ranks over a rate-limited link (network namespaces of this test's own, veth + tc tbf),
# HP_TRACE's files parse and hold every op, and the order of events shows the overlap (what
# share of the transfer time was covered moves with the machine's load; it is printed, not
# asserted):
# - every instance of the fused MC2 ops has its matmuls inside the op, and in some instance a
#   matmul starts while the op's transfers are in flight (a schedule that waited for every
#   transfer first would have none); in the serial control (all_gather, then the matmul) every
#   matmul starts after the transfers completed;
# - every instance of the column Linear's fused backward runs its weight gradient (span "wgrad")
#   inside the op, in some instance while the reduce-scatter's transfers are in flight; the
#   serial backward starts it after they completed, in every instance;
# - in the row chain with deferred weight gradients, the next row's dW runs inside each of the
#   first row's backward gathers (one per step and rank), in some of them while its transfers
#   are in flight; with the deferral off no gather holds a wgrad span;
# - an all-gather started with its per-op agreement, and an embedding's row gather, while a large
#   gather is on the link return before that one completes, in 2 of 3 instances on each rank
#   (neither queues behind the payload).
# (Whether one instance's compute starts before its last transfer completes depends on the
# link's burst and the cores' load; that some instance's does, and that the control's never
# does, does not.)
# Needs root (namespaces); skipped otherwise.
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
# ops.json: {name: {instances, started_in_flight, started_after, overlap, ...}} (hp-trace overlap
# --json). 3 instances of each op per rank (the warm-up is an op of its own).
/usr/bin/python3 - "$dir/overlap.json" "$dir/wgrad.json" <<'PY' || exit 1
import json, sys
by_matmul, by_wgrad = (json.load(open(f)) for f in sys.argv[1:3])
def check(ops, name, by, fused):
    if name not in ops:
        print(f"FAIL: no {name} in the trace"); sys.exit(1)
    o = ops[name]
    n, in_flight, after = o["instances"], o["started_in_flight"], o["started_after"]
    print(f"{name}: {n} instances, {by} started in flight in {in_flight}, after the transfers in {after} "
          f"(share covered {o['overlap']:.2f}, not asserted)")
    ok = in_flight + after == n and (in_flight >= 1 if fused else in_flight == 0)
    if n != 6 or not ok:
        expected = "in flight in at least one" if fused else "after the transfers in every one"
        print(f"FAIL: expected 6 instances, each with {by} spans, {expected}"); sys.exit(1)
check(by_matmul, "all_gather_matmul", "matmul", True)
check(by_matmul, "matmul_reduce_scatter", "matmul", True)
check(by_matmul, "serial_all_gather_then_matmul", "matmul", False)
check(by_wgrad, "column_backward", "wgrad", True)
check(by_wgrad, "serial_column_backward", "wgrad", False)
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
# 4 steps on 2 ranks: 16 row backward gathers, 8 of them the first row's (hosting the second
# row's dW when deferred).
/usr/bin/python3 - "$dir/deferred.json" "$dir/serial.json" <<'PY' || exit 1
import json, sys
for path, deferred in ((sys.argv[1], True), (sys.argv[2], False)):
    ops = json.load(open(path))
    if "all_gather_matmul" not in ops:
        print(f"FAIL: no all_gather_matmul in {path}"); sys.exit(1)
    o = ops["all_gather_matmul"]
    in_flight, after = o["started_in_flight"], o["started_after"]
    print(f"{path}: {o['instances']} row backward gathers, wgrad started in flight in {in_flight}, after the "
          f"transfers in {after} (share covered {o['overlap']:.2f}, not asserted)")
    ok = (in_flight + after == 8 and in_flight >= 1) if deferred else (in_flight + after == 0)
    if o["instances"] != 16 or not ok:
        print("FAIL: expected 16 gathers, " + ("8 hosting a wgrad span, some in flight" if deferred else "none "
                                               "hosting a wgrad span")); sys.exit(1)
PY
# A per-op agreement, and an embedding's row gather, while a large gather is on the link do not
# wait for it: the control channel has connections of its own (in 2 of 3 instances at least, on
# each rank; on one connection per peer, a rank saw the agreement so in at most 1 of 3, when the
# gather's completion was marked late). The agreement is on whatever the environment says.
out=$(HP_COMM_CHECK=1 OMP_NUM_THREADS=1 "$hp_run" --nproc-per-node 2 --timeout 300 \
  --master-addr "$(bash "$netns" addr)" --master-port 29735 -- bash "$netns" exec -- "$program" agreement) ||
  fail "the agreement run failed"
echo "$out"
for r in 0 1; do
  grep -Eq "rank $r: agreements beside payload in flight: [23] of 3; row gathers: [23] of 3" <<<"$out" ||
    fail "expected rank $r's agreements and row gathers to complete while a gather was in flight, in 2 of 3"
done
echo "PASS"
