#!/usr/bin/env bash
# Simulated hosts for multi-host tests: network namespaces on one private switch.
#
#   scripts/netns.sh up   PREFIX N   # PREFIX-sw (a bridge) + hosts PREFIX-h1..hN at 10.77.0.1..N
#   scripts/netns.sh cut  PREFIX I   # take host I off the switch (its link loses carrier)
#   scripts/netns.sh heal PREFIX I   # put it back
#   scripts/netns.sh throttle PREFIX I RATE   # host I's link at RATE (tc's units: 2mbit), both ways
#   scripts/netns.sh down PREFIX     # kill what runs in the namespaces, delete them
#   scripts/netns.sh addr I          # the address of host I
#
# Every host has only `lo` and `eth0` (10.77.0.I/24), wired by a veth pair to port `pI`
# of a bridge inside PREFIX-sw. Nothing touches the caller's own namespace: no route,
# address or link outside the PREFIX-* namespaces, so traffic can only reach the test's
# own hosts. A cut takes the switch port down, so packets are dropped silently (no RST,
# no "network unreachable"), as when a cable is pulled or a machine vanishes.
# Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; as root it installs iproute2
# with apt-get when `ip` is missing.
set -euo pipefail

SUBNET="${REINFORGE_NETNS_SUBNET:-10.77.0}"

die() { echo "netns.sh: $*" >&2; exit 2; }

need_ip() {
    command -v ip >/dev/null 2>&1 && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 >/dev/null \
            || die "apt-get install iproute2 failed"
        return 0
    fi
    die "the 'ip' command (iproute2) is missing and cannot be installed (not root)"
}

check_prefix() {
    [[ "$1" =~ ^[a-z0-9-]{1,20}$ ]] || die "bad PREFIX '$1' (a-z, 0-9, '-', at most 20 chars)"
}

check_index() {
    [[ "$1" =~ ^[0-9]+$ ]] && [ "$1" -ge 1 ] && [ "$1" -le 250 ] || die "bad host index '$1'"
}

up() {
    local prefix=$1 n=$2 sw="$1-sw" i host
    check_prefix "$prefix"; check_index "$n"
    ip netns add "$sw"
    ip -n "$sw" link set lo up
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    for i in $(seq 1 "$n"); do
        host="$prefix-h$i"
        ip netns add "$host"
        ip -n "$host" link set lo up
        ip -n "$sw" link add "p$i" type veth peer name eth0 netns "$host"
        ip -n "$sw" link set "p$i" master br0 up
        ip -n "$host" addr add "$SUBNET.$i/24" dev eth0
        ip -n "$host" link set eth0 up
    done
}

down() {
    local prefix=$1 ns pid
    check_prefix "$prefix"
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^$prefix-(sw|h[0-9]+)$" || true); do
        # Only processes inside the test's own namespaces, by pid.
        for pid in $(ip netns pids "$ns" 2>/dev/null || true); do
            kill -KILL "$pid" 2>/dev/null || true
        done
        ip netns del "$ns" 2>/dev/null || true
    done
}

set_port() {
    local prefix=$1 i=$2 state=$3
    check_prefix "$prefix"; check_index "$i"
    ip -n "$prefix-sw" link set "p$i" "$state"
}

throttle() {
    local prefix=$1 i=$2 rate=$3
    check_prefix "$prefix"; check_index "$i"
    [[ "$rate" =~ ^[0-9]+[kmg]?bit$ ]] || die "bad RATE '$rate' (e.g. 512kbit, 2mbit)"
    command -v tc >/dev/null 2>&1 || die "the 'tc' command (iproute2) is missing"
    # A token bucket on each end of the host's cable: what the host sends (its eth0) and
    # what it receives (the switch's port). Packets past 400 ms of queue are dropped.
    ip netns exec "$prefix-h$i" tc qdisc replace dev eth0 root tbf rate "$rate" burst 32kbit latency 400ms
    ip netns exec "$prefix-sw" tc qdisc replace dev "p$i" root tbf rate "$rate" burst 32kbit latency 400ms
}

need_ip
cmd="${1:-}"; shift || true
case "$cmd" in
    up)   [ $# = 2 ] || die "usage: up PREFIX N"; up "$1" "$2" ;;
    down) [ $# = 1 ] || die "usage: down PREFIX"; down "$1" ;;
    cut)  [ $# = 2 ] || die "usage: cut PREFIX I"; set_port "$1" "$2" down ;;
    heal) [ $# = 2 ] || die "usage: heal PREFIX I"; set_port "$1" "$2" up ;;
    throttle) [ $# = 3 ] || die "usage: throttle PREFIX I RATE"; throttle "$1" "$2" "$3" ;;
    addr) [ $# = 1 ] || die "usage: addr I"; check_index "$1"; echo "$SUBNET.$1" ;;
    *)    die "usage: netns.sh up|down|cut|heal|throttle|addr ..." ;;
esac
