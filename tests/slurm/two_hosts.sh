#!/usr/bin/env bash
# The multi-host path without a second machine: two network namespaces ("hosts" 10.77.0.1 and
# 10.77.0.2) joined by a veth pair, and the main job on 4 ranks, 2 per host, through
# jobs/mpirun.sh --hostfile: hydra's mpiexec runs in the first namespace and starts the second
# host's proxy through tests/slurm/netns_launcher.sh (in place of ssh); MPICH's UCX netmod is
# limited to TCP (UCX_TLS=tcp,self), as between real hosts without a fast interconnect, while
# ranks on the same host still use shared memory. Checks: 4 ranks in one world, the accuracy,
# and that the gradients crossed the veth link (its byte counter). Needs root (ip netns);
# prints "SKIPPED: ..." and exits 0 where namespaces cannot be made. About 10 s.
#
# Usage: two_hosts.sh [--slots "A B"] [--qdisc "QDISC ARGS"] [--timeout S] [-- COMMAND ...]
#   --slots    ranks on the first and the second host (default "2 2");
#   --qdisc    shape the link both ways with this tc queueing discipline, e.g. "tbf rate 10gbit
#              burst 1mb latency 10ms" (a cluster's 10 Gbit/s link; tc-tbf(8); "netem delay 20us"
#              where the kernel has netem); default: the veth pair as it is;
#   -- COMMAND run COMMAND on every rank (jobs/mpirun.sh ... -- COMMAND) and exit with its status,
#              instead of the main job and its checks (make bench-hosts, make test-slurm's
#              algorithm tests across the hosts).
set -euo pipefail
slots=(2 2)
qdisc=""
timeout=120
command=()
while (( $# )); do
    case "$1" in
        --slots) read -r -a slots <<<"$2"; shift 2 ;;
        --qdisc) qdisc="$2"; shift 2 ;;
        --timeout) timeout="$2"; shift 2 ;;
        --) shift; command=("$@"); break ;;
        *) echo "usage: ${0##*/} [--slots 'A B'] [--qdisc 'ARGS'] [--timeout S] [-- COMMAND ...]" >&2; exit 2 ;;
    esac
done

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"
PY="${PY:-$repo/.venv/bin/python}"
export PATH="$PATH:/usr/sbin:/sbin"

say() { printf '[two-hosts %3ds] %s\n' "$SECONDS" "$*"; }
skip() { echo "SKIPPED: two-hosts: $*"; exit 0; }
(( EUID == 0 )) || skip "network namespaces need root"
command -v ip >/dev/null || skip "no 'ip' command (iproute2)"

ns1="mpidist-h1-$$"
ns2="mpidist-h2-$$"
veth1="mpdv1-$$"
veth2="mpdv2-$$"
tmp="$(mktemp -d /tmp/mpidist-two-hosts.XXXXXX)"
cleanup() {
    local rc=$? ns pid
    trap - EXIT INT TERM
    set +e
    for ns in "$ns1" "$ns2"; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
        ip netns del "$ns" 2>/dev/null  # takes its end of the veth pair with it
    done
    ip link del "$veth1" 2>/dev/null
    if (( rc == 0 )); then rm -rf "$tmp"; else say "logs kept in $tmp"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if ! { ip netns add "$ns1" && ip netns add "$ns2"; } 2>"$tmp/ip.err"; then
    skip "cannot create network namespaces here ($(head -n 1 "$tmp/ip.err"))"
fi
ip link add "$veth1" type veth peer name "$veth2"
ip link set "$veth1" netns "$ns1"
ip link set "$veth2" netns "$ns2"
ip -n "$ns1" addr add 10.77.0.1/24 dev "$veth1"
ip -n "$ns2" addr add 10.77.0.2/24 dev "$veth2"
for ns in "$ns1" "$ns2"; do ip -n "$ns" link set lo up; done
ip -n "$ns1" link set "$veth1" up
ip -n "$ns2" link set "$veth2" up
printf '10.77.0.1:%d\n10.77.0.2:%d\n' "${slots[0]}" "${slots[1]}" > "$tmp/hosts"
nranks=$(( slots[0] + slots[1] ))
say "hosts 10.77.0.1 ($ns1, ${slots[0]} ranks) and 10.77.0.2 ($ns2, ${slots[1]}), joined by $veth1/$veth2"
if [[ -n "$qdisc" ]]; then
    command -v tc >/dev/null || skip "no 'tc' command (iproute2) to shape the link"
    # shellcheck disable=SC2086  # the qdisc's arguments are words
    ip netns exec "$ns1" tc qdisc add dev "$veth1" root $qdisc
    # shellcheck disable=SC2086
    ip netns exec "$ns2" tc qdisc add dev "$veth2" root $qdisc
    say "link shaped both ways: tc qdisc $qdisc"
fi

export MPIDIST_NETNS_MAP="10.77.0.1=$ns1 10.77.0.2=$ns2"
export MPIEXEC_ARGS="-launcher ssh -launcher-exec $here/netns_launcher.sh -genv UCX_TLS tcp,self"
if (( ${#command[@]} )); then
    say "ip netns exec $ns1 jobs/mpirun.sh -n $nranks --hostfile hosts -- ${command[*]}"
    rc=0
    ip netns exec "$ns1" jobs/mpirun.sh -n "$nranks" --hostfile "$tmp/hosts" --timeout "$timeout" -- "${command[@]}" || rc=$?
    (( rc == 0 )) || say "FAIL: the command exited with $rc"
    exit "$rc"
fi

tx() { ip netns exec "$ns1" cat "/sys/class/net/$veth1/statistics/tx_bytes"; }
before="$(tx)"
say "ip netns exec $ns1 jobs/mpirun.sh -n $nranks --hostfile hosts -- python -m mpidist.examples.train_digits"
rc=0
ip netns exec "$ns1" jobs/mpirun.sh -n "$nranks" --hostfile "$tmp/hosts" --timeout "$timeout" -- \
    "$PY" -m mpidist.examples.train_digits --no-progress --out "$tmp/out" >"$tmp/job.log" 2>&1 || rc=$?
sent=$(( $(tx) - before ))
fail() { say "FAIL: $*" >&2; sed 's/^/    | /' "$tmp/job.log" >&2; exit 1; }
(( rc == 0 )) || fail "the job exited with $rc"
grep -q "^mpidist: $nranks ranks, " "$tmp/job.log" || fail "no 'mpidist: $nranks ranks' line"
# A message sent and never received (UCX warns of each at exit): the teardown must leave none.
! grep -q "UCX  WARN  unexpected tag-receive" "$tmp/job.log" || fail "messages left unreceived at exit (UCX's warnings)"
"$PY" - "$tmp/out/metrics.json" "$nranks" <<'PYEOF' || fail "accuracy below 0.95"
import json, sys
last, n = json.load(open(sys.argv[1]))[-1], int(sys.argv[2])
assert last["test_accuracy"] >= 0.95 and last["world_size"] == n, last
print(f"    final test accuracy {last['test_accuracy']:.4f} on {n} ranks")
PYEOF
# 30 epochs x 23 all-reduces of the 26,122 float32 gradients: tens of MB, not the few kB of PMI.
(( sent > 10000000 )) || fail "only $sent bytes crossed the veth link: the ranks did not talk over TCP"
say "passed: $((sent / 1000000)) MB crossed the link between the two hosts"
