#!/usr/bin/env bash
# Network namespaces joined by veth through a bridge, each rank's link rate-limited with tc tbf,
# so the transfers travel over a "wire" instead of costing CPU on the cores that run the matmuls
# (on loopback, 2 ranks on 2 cores pay for every TCP byte with CPU time). Needs root and iproute2.
#
#   bench/netns.sh up N RATE      create hpns0..hpns(N-1) at 10.231.0.1.. (RATE as tc: 2gbit)
#   bench/netns.sh down N         remove them
#   bench/netns.sh exec -- CMD    run CMD in namespace hpns$LOCAL_RANK (set by hp-run)
set -euo pipefail

cmd=${1:-}
case "$cmd" in
  up)
    n=${2:?usage: netns.sh up N RATE}
    rate=${3:?usage: netns.sh up N RATE}
    "$0" down "$n" 2>/dev/null || true
    ip link add hpbr0 type bridge
    ip link set hpbr0 up
    for ((i = 0; i < n; i++)); do
      ip netns add "hpns$i"
      ip link add "hpv$i" type veth peer name "hpv${i}p"
      ip link set "hpv${i}p" netns "hpns$i"
      ip link set "hpv$i" master hpbr0 up
      ip netns exec "hpns$i" ip link set lo up
      ip netns exec "hpns$i" ip addr add "10.231.0.$((i + 1))/24" dev "hpv${i}p"
      ip netns exec "hpns$i" ip link set "hpv${i}p" up
      # Shape what this rank sends; burst of ~1 ms at the rate keeps it smooth.
      ip netns exec "hpns$i" tc qdisc add dev "hpv${i}p" root tbf rate "$rate" burst 256kb latency 50ms
    done
    ;;
  down)
    n=${2:?usage: netns.sh down N}
    for ((i = 0; i < n; i++)); do
      ip netns del "hpns$i" 2>/dev/null || true
      ip link del "hpv$i" 2>/dev/null || true
    done
    ip link del hpbr0 2>/dev/null || true
    ;;
  exec)
    shift
    [[ ${1:-} == "--" ]] && shift
    exec ip netns exec "hpns${LOCAL_RANK:?LOCAL_RANK is set by hp-run}" "$@"
    ;;
  *)
    echo "usage: netns.sh up N RATE | down N | exec -- CMD" >&2
    exit 2
    ;;
esac
