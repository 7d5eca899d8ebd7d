#!/usr/bin/env bash
# Hydra launcher for tests/slurm/two_hosts.sh: stands in for ssh (mpiexec -launcher ssh
# -launcher-exec THIS). Hydra calls it as `THIS [ssh options] HOST COMMAND`; it runs COMMAND in
# the network namespace that MPIDIST_NETNS_MAP ("IP=NAMESPACE IP=NAMESPACE ...") gives for HOST.
set -euo pipefail
while [[ "${1:-}" == -* ]]; do shift; done
host="${1:?usage: ${0##*/} [ssh options] HOST COMMAND}"
shift
ns=""
for pair in ${MPIDIST_NETNS_MAP:-}; do
    [[ "${pair%%=*}" == "$host" ]] && ns="${pair#*=}"
done
[[ -n "$ns" ]] || { echo "${0##*/}: no namespace for host '$host' in MPIDIST_NETNS_MAP='${MPIDIST_NETNS_MAP:-}'" >&2; exit 255; }
# Like ssh, the command arrives as words that a shell must put back together.
exec ip netns exec "$ns" sh -c "$*"
