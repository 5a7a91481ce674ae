#!/usr/bin/env bash
# Network namespaces joined by veth through a bridge, each rank's link rate-limited with tc tbf,
# so the transfers travel over a "wire" instead of costing CPU on the cores that run the matmuls
# (on loopback, 2 ranks on 2 cores pay for every TCP byte with CPU time). Needs root and iproute2.
# These namespaces are this project's own test hosts; nothing else runs against their addresses.
#
#   bench/netns.sh up N RATE      create ${P}ns0..${P}ns(N-1) at $SUBNET.1.. (RATE as tc: 2gbit)
#   bench/netns.sh down N         remove them
#   bench/netns.sh exec -- CMD    run CMD in namespace ${P}ns$LOCAL_RANK (set by hp-run)
#   bench/netns.sh rate RATE      from inside a rank's namespace: change its link's rate
#   bench/netns.sh addr           print the master address ($SUBNET.1)
# P = HP_NETNS_PREFIX (default hp), SUBNET = HP_NETNS_SUBNET (default 10.231.0), so that tests
# and benchmarks can run side by side in namespaces of their own.
set -euo pipefail

prefix=${HP_NETNS_PREFIX:-hp}
subnet=${HP_NETNS_SUBNET:-10.231.0}

# Bits per second of a tc rate such as 2gbit, 500mbit or 123456bit.
rate_bits() {
  local r=${1%bit} mult=1
  case $r in
    *g) mult=1000000000 r=${r%g} ;;
    *m) mult=1000000 r=${r%m} ;;
    *k) mult=1000 r=${r%k} ;;
  esac
  awk -v r="$r" -v m="$mult" 'BEGIN { printf "%d", r * m }'
}

# A token bucket of about 2 ms at the rate (at least 64 KiB), so the shaper is smooth at any rate.
qdisc_args() {
  local burst=$(($(rate_bits "$1") / 8 / 500))
  ((burst < 65536)) && burst=65536
  echo "rate $1 burst $burst latency 100ms"
}

cmd=${1:-}
case "$cmd" in
  up)
    n=${2:?usage: netns.sh up N RATE}
    rate=${3:?usage: netns.sh up N RATE}
    "$0" down "$n" 2>/dev/null || true
    ip link add "${prefix}br0" type bridge
    ip link set "${prefix}br0" up
    for ((i = 0; i < n; i++)); do
      ip netns add "${prefix}ns$i"
      ip link add "${prefix}v$i" type veth peer name "${prefix}v${i}p"
      ip link set "${prefix}v${i}p" netns "${prefix}ns$i"
      ip link set "${prefix}v$i" master "${prefix}br0" up
      ip netns exec "${prefix}ns$i" ip link set lo up
      ip netns exec "${prefix}ns$i" ip addr add "$subnet.$((i + 1))/24" dev "${prefix}v${i}p"
      ip netns exec "${prefix}ns$i" ip link set "${prefix}v${i}p" up
      # Shape what this rank sends.
      # shellcheck disable=SC2046
      ip netns exec "${prefix}ns$i" tc qdisc add dev "${prefix}v${i}p" root tbf $(qdisc_args "$rate")
    done
    ;;
  down)
    n=${2:?usage: netns.sh down N}
    for ((i = 0; i < n; i++)); do
      ip netns del "${prefix}ns$i" 2>/dev/null || true
      ip link del "${prefix}v$i" 2>/dev/null || true
    done
    ip link del "${prefix}br0" 2>/dev/null || true
    ;;
  exec)
    shift
    [[ ${1:-} == "--" ]] && shift
    exec ip netns exec "${prefix}ns${LOCAL_RANK:?LOCAL_RANK is set by hp-run}" "$@"
    ;;
  rate)
    rate=${2:?usage: netns.sh rate RATE}
    # shellcheck disable=SC2046
    tc qdisc change dev "${prefix}v${LOCAL_RANK:?LOCAL_RANK is set by hp-run}p" root tbf $(qdisc_args "$rate")
    ;;
  addr)
    echo "$subnet.1"
    ;;
  *)
    echo "usage: netns.sh up N RATE | down N | exec -- CMD | rate RATE | addr" >&2
    exit 2
    ;;
esac
