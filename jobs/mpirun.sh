#!/usr/bin/env bash
# Launch an mpidist job with mpiexec on machines without Slurm (a workstation, or hosts
# listed in a hostfile), with a wall-clock limit so a stuck rank cannot hang forever.
# Run `jobs/mpirun.sh -h` for usage.
set -euo pipefail

prog="${0##*/}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"

usage() {
    cat <<EOF
usage: $prog [-n N] [--hostfile FILE] [--timeout SECONDS] [-- COMMAND [ARGS...]]

Runs COMMAND on N MPI ranks with mpiexec and exits with its exit code.
Default COMMAND (the main job):
  python -m mpidist -m mpidist.examples.train_digits --out out/digits

options:
  -n, --np N          number of ranks (default: \$MPIDIST_NP or 4)
  --hostfile FILE     hosts to run on; passed as -f (MPICH/hydra) or --hostfile (Open MPI)
  --timeout SECONDS   wall-clock limit (default: \$MPIDIST_WALLTIME or 600); when it expires
                      the job gets SIGTERM, then SIGKILL 10 s later, and $prog exits 124 (137)
  -h, --help          this text

environment:
  MPIDIST_VENV      virtualenv to use (default: \$VIRTUAL_ENV, else $repo/.venv);
                    its bin/ goes first on PATH, so its mpiexec and python are used
  MPIEXEC           mpiexec to use (default: the venv's, else the first on PATH)
  MPIEXEC_ARGS      extra mpiexec options, split on spaces (e.g. "--oversubscribe")
  OMP_NUM_THREADS   threads per rank (default: cores per node / ranks per node)

examples:
  $prog -n 4
  $prog -n 2 --timeout 120 -- python -m mpidist -m mpidist.examples.train_digits --out /tmp/d --epochs 2
  $prog -n 8 --hostfile hosts.txt -- python -m pytest --with-mpi -q tests/
EOF
}

die() { echo "$prog: $*" >&2; exit 2; }

np="${MPIDIST_NP:-4}"
hostfile=""
limit="${MPIDIST_WALLTIME:-600}"
cmd=()
while (( $# > 0 )); do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        -n|-np|--np)
            (( $# >= 2 )) || die "$1 needs a value"; np="$2"; shift 2 ;;
        -n*) np="${1#-n}"; shift ;;
        --np=*) np="${1#*=}"; shift ;;
        --hostfile)
            (( $# >= 2 )) || die "$1 needs a value"; hostfile="$2"; shift 2 ;;
        --hostfile=*) hostfile="${1#*=}"; shift ;;
        --timeout)
            (( $# >= 2 )) || die "$1 needs a value"; limit="$2"; shift 2 ;;
        --timeout=*) limit="${1#*=}"; shift ;;
        --) shift; cmd=("$@"); break ;;
        *) usage >&2; die "unknown option '$1' (put the command after --)" ;;
    esac
done
[[ "$np" =~ ^[1-9][0-9]*$ ]] || die "-n must be a positive integer, got '$np'"
[[ "$limit" =~ ^[1-9][0-9]*$ ]] || die "--timeout must be a positive number of seconds, got '$limit'"
if [[ -n "$hostfile" ]]; then
    [[ -r "$hostfile" ]] || die "hostfile '$hostfile' not found or not readable"
    hostfile="$(cd "$(dirname "$hostfile")" && pwd)/$(basename "$hostfile")"
fi
if (( ${#cmd[@]} == 0 )); then
    cmd=(python -m mpidist -m mpidist.examples.train_digits --out out/digits)
fi

# The venv's bin/ first on PATH: its mpiexec (the pip MPICH) and python, then the system's.
venv="${MPIDIST_VENV:-${VIRTUAL_ENV:-$repo/.venv}}"
if [[ -x "$venv/bin/python" ]]; then
    export VIRTUAL_ENV="$venv"
    export PATH="$venv/bin:$PATH"
elif [[ -n "${MPIDIST_VENV:-}" ]]; then
    die "MPIDIST_VENV=$MPIDIST_VENV is not a virtualenv (no bin/python)"
fi
mpiexec="${MPIEXEC:-$(command -v mpiexec || true)}"
[[ -n "$mpiexec" && -x "$mpiexec" ]] || die "no mpiexec found (install the venv with 'make install', or load an MPI module)"

# Which launcher: MPICH's hydra (and Intel MPI) take -f, Open MPI takes --hostfile.
version="$("$mpiexec" --version 2>&1 || true)"
case "$version" in
    *"Open MPI"*|*OpenRTE*|*"Open RTE"*|*PRRTE*) flavor=openmpi ;;
    *HYDRA*|*Hydra*|*hydra*|*MPICH*|*"Intel(R) MPI"*) flavor=hydra ;;
    *) flavor=unknown ;;
esac

# Threads per rank: cores on this node / ranks per node (hosts counted from the hostfile).
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    hosts=1
    if [[ -n "$hostfile" ]]; then
        hosts="$(sed -e 's/#.*//' "$hostfile" | awk 'NF { split($1, h, ":"); if (!(h[1] in seen)) { seen[h[1]] = 1; n++ } }
                                                    END { print n + 0 }')"
        (( hosts >= 1 )) || hosts=1
    fi
    per_node=$(( (np + hosts - 1) / hosts ))
    threads=$(( $(nproc) / per_node ))
    export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi

launch=("$mpiexec" -n "$np")
if [[ -n "$hostfile" ]]; then
    if [[ "$flavor" == hydra ]]; then launch+=(-f "$hostfile"); else launch+=(--hostfile "$hostfile"); fi
fi
if [[ "$flavor" == openmpi ]]; then
    # Open MPI binds each rank to one core (np <= 2) or socket: that would pile all of a rank's
    # BLAS threads on one core. And it only forwards the environment named with -x.
    launch+=(--bind-to none -x OMP_NUM_THREADS -x PATH)
    [[ -z "${VIRTUAL_ENV:-}" ]] || launch+=(-x VIRTUAL_ENV)
    [[ -z "${LD_LIBRARY_PATH:-}" ]] || launch+=(-x LD_LIBRARY_PATH)
fi
if [[ -n "${MPIEXEC_ARGS:-}" ]]; then
    read -r -a extra <<< "$MPIEXEC_ARGS"
    launch+=("${extra[@]}")
fi
launch+=("${cmd[@]}")

echo "$prog: $(printf '%q ' "${launch[@]}")(OMP_NUM_THREADS=$OMP_NUM_THREADS, timeout ${limit}s, $flavor)" >&2

# timeout runs in the background so that Ctrl-C / SIGTERM to this script reach it (timeout puts
# itself in its own process group, out of reach of the terminal's SIGINT) and are passed on.
# hydra passes SIGTERM on to every rank (the main job's clean stop); Open MPI's mpirun takes it as
# "kill the job" (the ranks are killed a moment after their SIGTERM) and passes SIGUSR1 on, so
# there the first signal becomes SIGUSR1 to mpirun (timeout's child), a second one SIGTERM.
child=""
caught=""
nsig=0
# shellcheck disable=SC2317  # called from the traps below
forward() {
    caught="$1"; nsig=$(( nsig + 1 ))
    [[ -n "$child" ]] || return 0
    if [[ "$flavor" == openmpi ]] && (( nsig == 1 )) && pkill -USR1 -P "$child" 2>/dev/null; then
        return 0
    fi
    kill -TERM "$child" 2>/dev/null || true
}
trap 'forward INT' INT
trap 'forward TERM' TERM
trap 'forward HUP' HUP
SECONDS=0
timeout -k 10 "$limit" "${launch[@]}" &
child=$!
[[ -z "$caught" ]] || kill -TERM "$child" 2>/dev/null || true  # a signal before the job started: no stop to ask for
while :; do
    before=$nsig
    rc=0
    wait "$child" || rc=$?
    # wait returns early (> 128) when a trapped signal arrives: then wait again for the job's status.
    (( rc > 128 && nsig != before )) || break
done
trap - INT TERM HUP
if [[ -n "$caught" ]]; then
    echo "$prog: got SIG$caught, stopped the job (its exit code: $rc)" >&2
    case "$caught" in INT) rc=130 ;; HUP) rc=129 ;; *) rc=143 ;; esac
elif (( rc == 0 )); then
    :
elif (( (rc == 124 || rc == 137) && SECONDS >= limit )); then
    sig=SIGTERM; (( rc == 124 )) || sig="SIGTERM, then SIGKILL"
    echo "$prog: timed out after ${limit}s ($sig sent to the job; rc=$rc)" >&2
else
    echo "$prog: job exited with code $rc" >&2
fi
exit "$rc"
