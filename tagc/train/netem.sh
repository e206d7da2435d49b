#!/usr/bin/env bash
# Emulated slow network for TAGC benchmarks: N "hosts" as Linux network namespaces.
#
# N == 2: one veth pair, host0 <-> host1 (like the paper's two machines).
# N >  2: every host has a veth to a Linux bridge living in its own namespace
#         (<prefix>-br), so nothing is attached to the root namespace.
# Each host's interface is called <ifname> (default tagc0) and gets 10.77.0.(i+1)/24.
# The subnet exists only inside these namespaces and no namespace has a default
# route, so traffic can only flow between the namespaces this script creates.
#
# Link shaping: every egress that feeds a link gets a tc qdisc. `netem delay D rate R`
# when the kernel has sch_netem, otherwise `tbf rate R` (and a warning that the delay
# is not applied: many container kernels ship without sch_netem). With a bridge, the
# bridge-side port is shaped too, so a host also receives at most R (a switch port).
#
# Usage: tagc/train/netem.sh [options] COMMAND [args]
#   up                      create namespaces, links, addresses, qdiscs
#   down                    delete every namespace named <prefix>-h* / <prefix>-br
#   status                  namespaces, addresses, qdiscs, byte counters
#   rate RATE               change the rate of every link ("none" removes shaping)
#   exec I CMD...           run CMD inside host I's namespace
#   measure [MB]            send MB (default 20) host1 -> host0 over TCP, print
#                           measured Mbit/s next to the configured rate
#   torchrun [--port P] [--timeout S] [--nproc-per-node P] -- SCRIPT ARGS...
#                           one torchrun per host namespace: --nnodes N --node-rank i
#                           --master-addr <host0> --nproc-per-node P (default 1), with
#                           GLOO_SOCKET_IFNAME=<ifname>; waits for all, fails if any fails.
#                           Runs `$TAGC_PYTHON -m torch.distributed.run` (default python3).
#                           With P > 1 this is a two-level topology: the P ranks of a
#                           host talk over that namespace's own loopback route (unshaped,
#                           the fast links inside a node), hosts over the shaped link.
#   run CMD...              up, run CMD in the root namespace, then always down (trap)
# Options (before COMMAND):
#   -n, --hosts N     number of hosts (default 2)
#   --rate RATE       tc rate per link, e.g. 1gbit, 200mbit; "none" = unshaped (default 1gbit)
#   --delay D         one-way delay per link, e.g. 0.1ms; 0 = none (default 0.1ms)
#   --prefix P        namespace prefix (default tagc)
#   --ifname NAME     interface name inside each host namespace (default tagc0)
# Exported to children of `run` and `torchrun`: TAGC_NETEM_HOSTS, TAGC_NETEM_PREFIX,
# TAGC_NETEM_IFNAME, TAGC_NETEM_RATE, TAGC_NETEM_DELAY, TAGC_NETEM_ADDR0.
set -euo pipefail

# defaults come from the environment so commands run under `run` see the same network
HOSTS="${TAGC_NETEM_HOSTS:-2}"
RATE="${TAGC_NETEM_RATE:-1gbit}"
DELAY="${TAGC_NETEM_DELAY:-0.1ms}"
PREFIX="${TAGC_NETEM_PREFIX:-tagc}"
IFNAME="${TAGC_NETEM_IFNAME:-tagc0}"
SUBNET=10.77.0

die() { echo "netem.sh: error: $*" >&2; exit 2; }
warn() { echo "netem.sh: warning: $*" >&2; }

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        -n|--hosts) HOSTS="$2"; shift 2 ;;
        --rate) RATE="$2"; shift 2 ;;
        --delay) DELAY="$2"; shift 2 ;;
        --prefix) PREFIX="$2"; shift 2 ;;
        --ifname) IFNAME="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done
[[ $# -ge 1 ]] || { usage; exit 2; }
CMD="$1"; shift

[[ "$HOSTS" =~ ^[0-9]+$ ]] && (( HOSTS >= 2 && HOSTS <= 64 )) || die "--hosts must be 2..64, got '$HOSTS'"
[[ "$PREFIX" =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "--prefix must be 1-8 chars [a-z0-9], got '$PREFIX'"
[[ "$IFNAME" =~ ^[a-zA-Z][a-zA-Z0-9]{0,12}$ ]] || die "bad --ifname '$IFNAME'"
[[ "$RATE" == none || "$RATE" =~ ^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit)$ ]] \
    || die "--rate must look like 100mbit / 1gbit / none, got '$RATE'"
[[ "$DELAY" == 0 || "$DELAY" =~ ^[0-9]+(\.[0-9]+)?(us|ms)$ ]] || die "--delay must look like 0.1ms / 50us / 0, got '$DELAY'"

need_root_and_tools() {
    [[ "$(id -u)" == 0 ]] || die "needs root (network namespaces, veth and tc need CAP_NET_ADMIN); run with sudo"
    command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 \
        || die "needs iproute2 (ip, tc): apt-get update && apt-get install -y iproute2"
}

ns() { echo "${PREFIX}-h$1"; }
BRNS="${PREFIX}-br"
addr() { echo "${SUBNET}.$(( $1 + 1 ))"; }

# bits per second from a tc rate string
rate_bps() {
    local r="$1" num unit
    num="${r%%[a-z]*}"; unit="${r#"$num"}"
    case "$unit" in
        bit) awk -v n="$num" 'BEGIN{printf "%d", n}' ;;
        kbit) awk -v n="$num" 'BEGIN{printf "%d", n*1e3}' ;;
        mbit) awk -v n="$num" 'BEGIN{printf "%d", n*1e6}' ;;
        gbit) awk -v n="$num" 'BEGIN{printf "%d", n*1e9}' ;;
    esac
}

# shape NETNS DEV: put the configured qdisc on DEV's egress (replacing any)
shape() {
    local netns="$1" dev="$2"
    ip netns exec "$netns" tc qdisc del dev "$dev" root >/dev/null 2>&1 || true
    [[ "$RATE" == none ]] && return 0
    local bps burst
    bps="$(rate_bps "$RATE")"
    # burst: 2 ms worth of tokens (>= 64 KiB so a GSO super-packet always fits)
    burst=$(( bps / 8 / 500 )); (( burst < 65536 )) && burst=65536
    if [[ "$DELAY" != 0 ]]; then
        if ip netns exec "$netns" tc qdisc add dev "$dev" root netem delay "$DELAY" rate "$RATE" \
                limit 100000 2>/dev/null; then
            return 0
        fi
        if [[ -z "${_NETEM_WARNED:-}" ]]; then
            warn "sch_netem is not available in this kernel: links get tbf rate $RATE, delay $DELAY NOT applied"
            _NETEM_WARNED=1
        fi
    fi
    ip netns exec "$netns" tc qdisc add dev "$dev" root tbf rate "$RATE" burst "$burst" latency 100ms
}

do_down() {
    local n
    for n in $(ip netns list 2>/dev/null | awk '{print $1}'); do
        if [[ "$n" == "${PREFIX}-h"* || "$n" == "$BRNS" ]]; then
            ip netns del "$n" 2>/dev/null || warn "could not delete namespace $n"
        fi
    done
}

do_up() {
    local i
    for i in $(seq 0 $(( HOSTS - 1 ))); do
        if ip netns list | awk '{print $1}' | grep -qx "$(ns "$i")"; then
            die "namespace $(ns "$i") already exists: run '$0 --prefix $PREFIX down' first"
        fi
    done
    for i in $(seq 0 $(( HOSTS - 1 ))); do
        ip netns add "$(ns "$i")"
        ip -n "$(ns "$i")" link set lo up
    done
    if (( HOSTS == 2 )); then
        ip link add "$IFNAME" netns "$(ns 0)" type veth peer name "$IFNAME" netns "$(ns 1)"
    else
        ip netns add "$BRNS"
        ip -n "$BRNS" link set lo up
        ip -n "$BRNS" link add br0 type bridge
        ip -n "$BRNS" link set br0 up
        for i in $(seq 0 $(( HOSTS - 1 ))); do
            ip link add "$IFNAME" netns "$(ns "$i")" type veth peer name "p$i" netns "$BRNS"
            ip -n "$BRNS" link set "p$i" master br0
            ip -n "$BRNS" link set "p$i" up
        done
    fi
    for i in $(seq 0 $(( HOSTS - 1 ))); do
        ip -n "$(ns "$i")" addr add "$(addr "$i")/24" dev "$IFNAME"
        ip -n "$(ns "$i")" link set "$IFNAME" up
    done
    apply_rate
    echo "netem.sh: up: $HOSTS hosts $(ns 0)..$(ns $(( HOSTS - 1 ))) on ${SUBNET}.0/24 dev $IFNAME, rate $RATE, delay $DELAY"
}

apply_rate() {
    local i
    for i in $(seq 0 $(( HOSTS - 1 ))); do
        shape "$(ns "$i")" "$IFNAME"
        if (( HOSTS > 2 )); then shape "$BRNS" "p$i"; fi
    done
}

check_up() {
    ip netns list | awk '{print $1}' | grep -qx "$(ns 0)" || die "not up: run '$0 -n $HOSTS --rate $RATE up' first"
}

do_status() {
    local i
    ip netns list | awk '{print $1}' | grep -E "^(${PREFIX}-h[0-9]+|${BRNS})$" || { echo "netem.sh: no namespaces with prefix $PREFIX"; return 0; }
    for i in $(seq 0 $(( HOSTS - 1 ))); do
        echo "== $(ns "$i")"
        ip -n "$(ns "$i")" -br addr show dev "$IFNAME" || true
        ip netns exec "$(ns "$i")" tc qdisc show dev "$IFNAME" || true
        ip -n "$(ns "$i")" -s link show dev "$IFNAME" | sed -n '3,6p' || true
    done
}

# TCP bulk transfer host1 -> host0; bounded by a byte count and a timeout.
do_measure() {
    local mb="${1:-20}" port=29555
    [[ "$mb" =~ ^[0-9]+$ ]] && (( mb >= 1 && mb <= 2000 )) || die "measure: MB must be 1..2000"
    local tmo=$(( 20 + mb * 8 / 5 ))   # generous: enough for 5 Mbit/s
    local out; out="$(mktemp)"
    ip netns exec "$(ns 0)" timeout "$tmo" python3 - "$(addr 0)" "$port" "$mb" >"$out" <<'PY' &
import socket, sys, time
host, port, mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, port)); s.listen(1); s.settimeout(15)
c, _ = s.accept(); c.settimeout(15)
want, got, t0 = mb * 2**20, 0, time.perf_counter()
while got < want:
    b = c.recv(1 << 20)
    if not b:
        break
    got += len(b)
dt = time.perf_counter() - t0
c.sendall(b"k"); c.close()
print(f"{got * 8 / dt / 1e6:.1f} {got}")
PY
    local srv=$!
    local rc=0
    ip netns exec "$(ns 1)" timeout "$tmo" python3 - "$(addr 0)" "$port" "$mb" <<'PY' || rc=$?
import socket, sys, time
host, port, mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for _ in range(40):
    try:
        c = socket.create_connection((host, port), timeout=5); break
    except OSError:
        time.sleep(0.25)
else:
    sys.exit("could not connect")
buf = b"\0" * (1 << 20)
for _ in range(mb):
    c.sendall(buf)
c.recv(1); c.close()
PY
    wait "$srv" || rc=$?
    local res; res="$(cat "$out")"; rm -f "$out"
    (( rc == 0 )) && [[ -n "$res" ]] || die "measure: transfer failed (rc=$rc)"
    local mbit="${res%% *}"
    if [[ "$RATE" == none ]]; then
        echo "netem.sh: measured ${mbit} Mbit/s host1->host0 (${mb} MiB), configured: unshaped"
    else
        local cfg; cfg=$(awk -v b="$(rate_bps "$RATE")" 'BEGIN{printf "%.1f", b/1e6}')
        echo "netem.sh: measured ${mbit} Mbit/s host1->host0 (${mb} MiB), configured ${cfg} Mbit/s ($RATE)" \
            "ratio $(awk -v m="$mbit" -v c="$cfg" 'BEGIN{printf "%.3f", m/c}')"
    fi
}

export_env() {
    export TAGC_NETEM_HOSTS="$HOSTS" TAGC_NETEM_PREFIX="$PREFIX" TAGC_NETEM_IFNAME="$IFNAME" \
        TAGC_NETEM_RATE="$RATE" TAGC_NETEM_DELAY="$DELAY" TAGC_NETEM_ADDR0="$(addr 0)"
}

# One torchrun per host namespace, each a separate node of the job.
do_torchrun() {
    local port=29500 tmo=3600 nproc=1
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --port) port="$2"; shift 2 ;;
            --timeout) tmo="$2"; shift 2 ;;
            --nproc-per-node) nproc="$2"; shift 2 ;;
            --) shift; break ;;
            *) die "torchrun: unknown option $1 (usage: torchrun [--port P] [--timeout S] [--nproc-per-node P] -- SCRIPT ARGS)" ;;
        esac
    done
    [[ "$nproc" =~ ^[0-9]+$ ]] && (( nproc >= 1 && nproc <= 64 )) \
        || die "torchrun: --nproc-per-node must be 1..64, got '$nproc'"
    [[ $# -ge 1 ]] || die "torchrun: missing SCRIPT"
    # the interpreter of the caller (TAGC_PYTHON; a virtualenv's), not whatever
    # `torchrun` PATH finds first, which may belong to a Python without tagc_hook
    local py="${TAGC_PYTHON:-python3}"
    "$py" -c "import torch.distributed.run" >/dev/null 2>&1 \
        || die "torchrun: $py cannot import torch.distributed.run (install torch, or set TAGC_PYTHON)"
    export_env
    local i pids=() rc=0
    for i in $(seq 0 $(( HOSTS - 1 ))); do
        ip netns exec "$(ns "$i")" env GLOO_SOCKET_IFNAME="$IFNAME" TAGC_NETEM_NODE="$i" \
            timeout -k 10 "$tmo" "$py" -m torch.distributed.run --nnodes "$HOSTS" --node-rank "$i" --nproc-per-node "$nproc" \
            --master-addr "$(addr 0)" --master-port "$port" "$@" &
        pids+=("$!")
    done
    # wait -n: as soon as one node fails, end the others so nothing hangs on a dead peer
    local r done_pid
    while (( ${#pids[@]} > 0 )); do
        r=0; wait -n -p done_pid "${pids[@]}" || r=$?
        [[ -n "${done_pid:-}" ]] || break
        local keep=() p
        for p in "${pids[@]}"; do [[ "$p" == "$done_pid" ]] || keep+=("$p"); done
        pids=("${keep[@]+"${keep[@]}"}")
        if (( r != 0 && rc == 0 )); then
            rc=$r
            warn "a node exited with $r; stopping the others"
            for i in "${pids[@]}"; do kill -TERM "$i" 2>/dev/null || true; done
        fi
    done
    return "$rc"
}

case "$CMD" in
    up) need_root_and_tools; do_up ;;
    down) need_root_and_tools; do_down ;;
    status) need_root_and_tools; do_status ;;
    rate)
        need_root_and_tools; check_up
        [[ $# -eq 1 ]] || die "usage: rate RATE"
        RATE="$1"
        [[ "$RATE" == none || "$RATE" =~ ^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit)$ ]] || die "bad rate '$RATE'"
        apply_rate; echo "netem.sh: rate now $RATE" ;;
    exec)
        need_root_and_tools; check_up
        [[ $# -ge 2 ]] || die "usage: exec I CMD..."
        i="$1"; shift
        [[ "$i" =~ ^[0-9]+$ ]] && (( i < HOSTS )) || die "host index must be 0..$(( HOSTS - 1 ))"
        exec ip netns exec "$(ns "$i")" "$@" ;;
    measure) need_root_and_tools; check_up; do_measure "$@" ;;
    torchrun) need_root_and_tools; check_up; do_torchrun "$@" ;;
    run)
        need_root_and_tools
        [[ $# -ge 1 ]] || die "usage: run CMD..."
        trap do_down EXIT
        trap 'exit 130' INT TERM
        do_up
        export_env
        rc=0; "$@" || rc=$?
        exit "$rc" ;;
    *) die "unknown command '$CMD' (see --help)" ;;
esac
