#!/usr/bin/env bash
# `make test-slurm`: run jobs/*.sbatch on a real, throwaway, single-node Slurm.
#
# Installs Slurm 22.05 + munge from the Debian packages if they are missing (root only), starts
# munged, slurmctld and slurmd in the background with their configuration, state and logs in a
# temporary directory under /tmp (nothing in /etc, nothing in the repository), waits until the
# node is idle, then submits:
#   1. jobs/train_digits.sbatch (srun --mpi=pmi2, 4 tasks): "mpidist: 4 ranks" (not 4 singletons),
#      final test accuracy >= 0.95 in metrics.json;
#   2. jobs/train_digits.sbatch again (srun, then MPIDIST_LAUNCHER=mpiexec: hydra inside the
#      allocation), interrupted by the time-limit warning (`--signal=B:USR1@..`, sent here with
#      `scancel --batch --signal=USR1` while the ranks are paused, as soon as every rank has its
#      stop handler installed, so that it reaches them before training ends however fast the job
#      runs): the ranks checkpoint, the job requeues itself, resumes with --resume and must end
#      bitwise equal to job 1;
#   3. jobs/train_torch.sbatch (srun, 4 tasks): the torch job, "mpidist: 4 ranks", final test
#      accuracy >= 0.97;
#   4. jobs/lightning.sbatch (srun, 4 tasks) with tests/frameworks/lightning_train.py: PyTorch
#      Lightning's DDPStrategy over "mpidist" with MPIEnvironment, its two fits (logging without
#      and with sync_dist) each ending "FRAMEWORK OK ... np=4" (identical parameters, falling loss,
#      disjoint samples; tests/frameworks/_fwcheck.py); skipped when Lightning is not installed;
#   5. jobs/test_suite.sbatch (pytest --with-mpi on 4 ranks under srun) on the communication
#      tests (SUITE_K below; the whole suite runs at 4 ranks under mpiexec in `make test-mpi`).
# The daemons (and any job left) are always stopped by their PIDs on exit; the temporary
# directory is removed after a pass and kept (with every log) after a failure.
#
# Exit status: 0 when every check passes, or when Slurm cannot be installed here (not root,
# no apt-get, no package registry): then it prints "SKIPPED: ..." instead. 1 when a check fails.
#
# Environment: PY (python with mpidist, default .venv/bin/python), SLURM_TEST_KEEP=1 keeps the
# temporary directory, SLURM_TEST_JOB_TIMEOUT (s, default 150) bounds each job.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"
PY="${PY:-$repo/.venv/bin/python}"
job_timeout="${SLURM_TEST_JOB_TIMEOUT:-150}"
packages=(slurmctld slurmd slurm-client munge)
commands=(slurmctld slurmd sbatch srun sinfo squeue scontrol scancel munged)

say() { printf '[test-slurm %3ds] %s\n' "$SECONDS" "$*"; }
skip() { echo "SKIPPED: test-slurm: $*"; exit 0; }
failures=0
fail() { say "FAIL: $*" >&2; failures=$((failures + 1)); }

missing_commands() {
    local c
    for c in "${commands[@]}"; do
        command -v "$c" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$c" >/dev/null 2>&1 || return 0
    done
    return 1
}

# --- 1. Slurm and munge, from the distribution's packages ------------------------------------
export PATH="$PATH:/usr/sbin:/sbin"
if missing_commands; then
    (( EUID == 0 )) || skip "Slurm is not installed and installing it needs root (apt-get install ${packages[*]})"
    command -v apt-get >/dev/null || skip "Slurm is not installed and there is no apt-get to install it"
    say "installing ${packages[*]} with apt-get"
    apt_log="$(mktemp /tmp/mpidist-slurm-apt.XXXXXX)"
    export DEBIAN_FRONTEND=noninteractive
    install=(apt-get install -y -q --no-install-recommends "${packages[@]}")
    if ! timeout 300 "${install[@]}" >"$apt_log" 2>&1; then
        # Maybe only the package lists are missing or stale.
        if ! { timeout 120 apt-get update -q && timeout 300 "${install[@]}"; } >>"$apt_log" 2>&1; then
            tail -n 5 "$apt_log" | sed 's/^/    /'
            rm -f "$apt_log"
            skip "apt-get could not install ${packages[*]} (no network or package registry?)"
        fi
    fi
    rm -f "$apt_log"
    missing_commands && skip "apt-get installed ${packages[*]}, but some of: ${commands[*]} are still missing"
fi
(( EUID == 0 )) || skip "starting slurmd and munged as the daemons' users needs root"
[[ -x "$PY" ]] || { echo "test-slurm: no python at $PY (run 'make install')" >&2; exit 2; }

# --- 2. a private cluster under a temporary directory ----------------------------------------
tmp="$(mktemp -d /tmp/mpidist-slurm.XXXXXX)"
chmod 755 "$tmp"
mkdir -p "$tmp"/{etc,state,spool,log,jobs,out}
install -d -o munge -g munge -m 755 "$tmp/munge"
# Everything this harness starts carries this variable, so that a leftover (a slurmstepd, a rank)
# can be found, by PID, at the end.
export MPIDIST_SLURM_TEST="$tmp"
marker="MPIDIST_SLURM_TEST=$tmp"
export SLURM_CONF="$tmp/etc/slurm.conf"
daemons=()  # "name:pid"

cleanup() {
    local rc=$? entry pid i
    trap - EXIT INT TERM
    set +e
    if (( ${#daemons[@]} > 0 )) && [[ -n "$(squeue -h -o %i 2>/dev/null)" ]]; then
        say "cancelling jobs still in the queue: $(squeue -h -o %i | tr '\n' ' ')"
        scancel --quiet --full --signal=KILL --user="$(id -un)" 2>/dev/null
        scancel --quiet --user="$(id -un)" 2>/dev/null
        for (( i = 0; i < 30; i++ )); do
            [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break
            sleep 0.5
        done
    fi
    for entry in "${daemons[@]}"; do  # slurmd, slurmctld, munged: the reverse of starting order
        kill -TERM "${entry#*:}" 2>/dev/null
    done
    for entry in "${daemons[@]}"; do
        pid="${entry#*:}"
        for (( i = 0; i < 50; i++ )); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -0 "$pid" 2>/dev/null && { say "killing ${entry%%:*} (pid $pid)"; kill -KILL "$pid"; }
        wait "$pid" 2>/dev/null
    done
    # Anything else started here (a slurmstepd, a rank) that is still around.
    # (grep finds itself too: it has exited, or is a zombie with no command line, by then.)
    local leftovers cmd
    mapfile -t leftovers < <(grep -lsxzF -- "$marker" /proc/[0-9]*/environ | cut -d/ -f3)
    for pid in "${leftovers[@]}"; do
        cmd="$(tr '\0' ' ' 2>/dev/null < "/proc/$pid/cmdline")"
        [[ "$pid" != "$$" && -n "$cmd" ]] || continue
        say "killing leftover process $pid ($cmd)"
        kill -KILL "$pid" 2>/dev/null
    done
    if (( rc == 0 )) && [[ -z "${SLURM_TEST_KEEP:-}" ]]; then
        rm -rf "$tmp"
    else
        say "logs kept in $tmp (log/, jobs/)"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
ctld_port="$(free_port)"
slurmd_port="$(free_port)"
while [[ "$slurmd_port" == "$ctld_port" ]]; do slurmd_port="$(free_port)"; done

cat > "$SLURM_CONF" <<EOF
# Throwaway single-node cluster of tests/slurm/run.sh (see ../shared/REFERENCE.md).
ClusterName=mpidist-test
SlurmctldHost=localhost
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$tmp/munge/munge.socket
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=pmi2
SwitchType=switch/none
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
EnforcePartLimits=ALL
KillWait=10
# sbatch --wait polls every 2 s while 2 < MinJobAge/2, else every 8 s, then 32 s (Slurm 22.05's
# _job_wait): with the default 300 a 15 s job returns after 42 s. Finished jobs stay >= 4 s.
MinJobAge=4
# Job IDs from a random start, not 1, in each run: MPICH names its shared-memory segment
# (/dev/shm/mpich_shm_*) after the PMI KVS name, which under srun is JOBID.STEPID; a job killed
# in an earlier run leaves its segment behind, and the same JOBID.STEP in a later run attached
# to it and hung in MPI_Init.
FirstJobId=$(( RANDOM * 1000 + 1000 ))
InactiveLimit=0
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs=4 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=30 State=UP
EOF

say "starting munged, slurmctld and slurmd (config and logs in $tmp)"
dd if=/dev/urandom of="$tmp/munge/munge.key" bs=1024 count=1 status=none
chown munge:munge "$tmp/munge/munge.key"
chmod 400 "$tmp/munge/munge.key"
# setpriv execs munged itself (no forking wrapper), so $! is munged's PID.
setpriv --reuid=munge --regid=munge --init-groups \
    munged -F --key-file="$tmp/munge/munge.key" --socket="$tmp/munge/munge.socket" \
    --pid-file="$tmp/munge/munged.pid" --seed-file="$tmp/munge/munged.seed" \
    --log-file="$tmp/log/munged.log" </dev/null >>"$tmp/log/munged.out" 2>&1 &
daemons=("munged:$!")
for (( i = 0; i < 50; i++ )); do [[ -S "$tmp/munge/munge.socket" ]] && break; sleep 0.1; done
[[ -S "$tmp/munge/munge.socket" ]] || { cat "$tmp/log/munged.out" "$tmp/log/munged.log" >&2; fail "munged did not start"; exit 1; }
slurmctld -D -i -f "$SLURM_CONF" </dev/null >>"$tmp/log/slurmctld.out" 2>&1 &
daemons=("slurmctld:$!" "${daemons[@]}")
slurmd -D -N localhost -f "$SLURM_CONF" </dev/null >>"$tmp/log/slurmd.out" 2>&1 &
daemons=("slurmd:$!" "${daemons[@]}")

state=""
for (( i = 0; i < 120; i++ )); do
    state="$(sinfo -h -o %t 2>/dev/null || true)"
    [[ "$state" == idle ]] && break
    for entry in "${daemons[@]}"; do
        kill -0 "${entry#*:}" 2>/dev/null || { fail "${entry%%:*} exited at start"; tail -n 20 "$tmp"/log/*.out "$tmp"/log/*.log >&2; exit 1; }
    done
    sleep 0.5
done
if [[ "$state" != idle ]]; then
    fail "the node is not idle after 60 s (sinfo says '${state:-nothing}')"
    tail -n 20 "$tmp"/log/*.log >&2
    exit 1
fi
say "Slurm $(sinfo -V | awk '{print $2}') is up: node localhost idle, $(sinfo -h -o %c) CPUs"

# --- 3. the jobs --------------------------------------------------------------------------------
# Runs `sbatch --wait` with the job's log at $tmp/jobs/NAME.out; returns the job's exit code.
submit_wait() {
    local name="$1"; shift
    local rc=0
    timeout -k 10 "$job_timeout" sbatch --wait --quiet --output="$tmp/jobs/$name.out" "$@" || rc=$?
    (( rc == 124 || rc == 137 )) && say "job $name: sbatch --wait did not return in ${job_timeout}s"
    return "$rc"
}

show_log() { sed 's/^/    | /' "$tmp/jobs/$1.out" >&2 || true; }

# Checks the main job's log and outputs: N ranks in one world, accuracy reached.
check_training() {
    local name="$1" out="$2" min_acc="$3"
    grep -q "^mpidist: 4 ranks, " "$tmp/jobs/$name.out" \
        || { fail "job $name: no 'mpidist: 4 ranks' line (singletons? srun --mpi=none?)"; show_log "$name"; return 1; }
    "$PY" - "$out/metrics.json" "$min_acc" <<'EOF' || { fail "job $name: metrics check failed"; show_log "$name"; return 1; }
import json, sys
history = json.load(open(sys.argv[1]))
last = history[-1]
assert all(h["world_size"] == 4 for h in history), history
assert last["test_accuracy"] >= float(sys.argv[2]), last
print(f"    {len(history)} epochs, final test accuracy {last['test_accuracy']:.4f}")
EOF
}

run_training() {  # NAME MIN_ACCURACY [JOB ARGS...]; the script is $SBATCH_SCRIPT (default: the main job's)
    local name="$1" min_acc="$2"; shift 2
    local out="$tmp/out/$name" rc=0 script="${SBATCH_SCRIPT:-jobs/train_digits.sbatch}"
    say "job $name: sbatch --wait $script $*"
    OUT="$out" submit_wait "$name" "$script" "$@" || rc=$?
    if (( rc != 0 )); then fail "job $name exited with $rc"; show_log "$name"; return 0; fi
    check_training "$name" "$out" "$min_acc" && say "job $name: passed"
    return 0
}

run_training train-srun 0.95

# The time-limit warning (#SBATCH --signal=B:USR1@90) sent by hand while the ranks train: they
# checkpoint, the job requeues itself and resumes; it must end bitwise equal to job train-srun.
wait_for_state() {  # JOB: poll until it has finished; prints "STATE RESTARTS"
    local job="$1" i info state held=-1 moved=""
    for (( i = 0; i < 2 * job_timeout; i++ )); do
        info="$(scontrol show job "$job" 2>/dev/null || true)"
        state="$(grep -o 'JobState=[A-Z_]*' <<< "$info" | cut -d= -f2)"
        case "$state" in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY) break ;; esac
        # Slurm holds a requeued job back for about 2 minutes (Reason=BeginTime): start it 3 s
        # after it was requeued (in the second the last run ended, the start would fail with "Job
        # credential revoked"), and with StartTime=now, which also makes Slurm schedule at once.
        if [[ -z "$moved" && "$state" == PENDING && "$info" == *Reason=BeginTime* ]]; then
            (( held >= 0 )) || held=$i
            if (( i - held >= 6 )); then scontrol update jobid="$job" StartTime=now && moved=1; fi
        fi
        sleep 0.5
    done
    echo "${state:-UNKNOWN} $(grep -o 'Restarts=[0-9]*' <<< "$info" | cut -d= -f2)"
}

# PIDs of the main job's ranks writing to OUT: the Python processes started under this harness
# (marker) whose command line runs mpidist.examples.train_digits --out OUT (not srun or mpiexec).
rank_pids() {  # OUT
    local pid argv
    for pid in $(grep -lsxzF -- "$marker" /proc/[0-9]*/environ | cut -d/ -f3); do
        mapfile -d '' -t argv < "/proc/$pid/cmdline" 2>/dev/null || continue
        (( ${#argv[@]} > 0 )) && [[ "${argv[0]##*/}" == python* ]] || continue
        [[ " ${argv[*]} " == *" mpidist.examples.train_digits "* && " ${argv[*]} " == *" --out $1 "* ]] && echo "$pid"
    done
}

# True when every thread of every PID is stopped (State: T in /proc/PID/task/*/status).
all_stopped() {  # PID...
    local pid states
    for pid in "$@"; do
        states="$(awk '$1 == "State:" {print $2}' /proc/"$pid"/task/*/status 2>/dev/null | sort -u)"
        [[ "$states" == T ]] || return 1
    done
}

# True when every PID has signal SIG (a number) set in one of the masks named of its
# /proc/PID/status: SigCgt (a handler is installed), SigIgn (ignored), ShdPnd/SigPnd (pending).
signal_in() {  # SIG "MASK..." PID...
    local bit=$(( $1 - 1 )) masks="$2" pid mask m any
    shift 2
    for pid in "$@"; do
        mask="$(awk -v want=" $masks " '{k = $1; sub(/:$/, "", k)} index(want, " " k " ") {print $2}' "/proc/$pid/status" 2>/dev/null)" || return 1
        [[ -n "$mask" ]] || return 1
        any=0
        for m in $mask; do (( (16#$m >> bit) & 1 )) && any=1; done
        (( any )) || return 1
    done
}

# The time-limit warning must reach the ranks while they train, however fast this machine runs
# the job (30 epochs can take 1 s) and however late Slurm writes the log (a trigger on the log's
# "epoch 3" line once came after training had ended) or passes the signal on. So the trigger is
# in the ranks themselves: their stop handlers. MPICH catches SIGUSR1 from MPI_Init on, so the
# sign is a caught SIGTERM (the job installs its SIGUSR1 handler and then its SIGTERM handler
# first thing in main, and sets both to ignored once training is over). Then the ranks are
# paused (SIGSTOP), the batch shell gets USR1 and passes it on, and the ranks go on (SIGCONT)
# once every one of them has it pending: they stop after their first training step.
pause_and_signal() {  # JOB OUT: prints nothing; returns 1 with a reason on stderr
    local job="$1" out="$2" pids=() i rc=0
    for (( i = 0; i < 20 * job_timeout; i++ )); do
        mapfile -t pids < <(rank_pids "$out")
        (( ${#pids[@]} == 4 )) && signal_in 15 SigCgt "${pids[@]}" && break
        (( i % 40 == 39 )) && [[ -z "$(squeue -h -j "$job" -o %i 2>/dev/null)" ]] && break  # it ended
        sleep 0.05
    done
    (( ${#pids[@]} == 4 )) || { echo "found ${#pids[@]} rank processes, not 4 (pids: ${pids[*]})" >&2; return 1; }
    signal_in 15 SigCgt "${pids[@]}" || { echo "ranks ${pids[*]} never all had their stop handlers installed" >&2; return 1; }
    kill -STOP "${pids[@]}" || { echo "could not pause ranks ${pids[*]}" >&2; kill -CONT "${pids[@]}" 2>/dev/null; return 1; }
    # SIGSTOP takes effect asynchronously: wait until every rank is stopped (state T), or a
    # signal landing first could be taken by a thread still running, and never show as pending.
    for (( i = 0; i < 600; i++ )); do all_stopped "${pids[@]}" && break; sleep 0.05; done
    all_stopped "${pids[@]}" || { echo "ranks ${pids[*]} did not stop in 30 s" >&2; kill -CONT "${pids[@]}" 2>/dev/null; return 1; }
    if ! signal_in 15 SigCgt "${pids[@]}"; then  # a rank got past training (it ignores them now)
        echo "the ranks had ended training before they were paused" >&2; rc=1
    elif scancel --batch --signal=USR1 "$job"; then
        for (( i = 0; i < 120; i++ )); do signal_in 10 "ShdPnd SigPnd" "${pids[@]}" && break; sleep 0.5; done
        signal_in 10 "ShdPnd SigPnd" "${pids[@]}" || { echo "SIGUSR1 did not reach every rank in 60 s" >&2; rc=1; }
    else
        echo "scancel --batch --signal=USR1 $job failed" >&2; rc=1
    fi
    kill -CONT "${pids[@]}" 2>/dev/null
    return "$rc"
}

run_requeue() {  # NAME: with the launcher from MPIDIST_LAUNCHER
    local name="$1" out="$tmp/out/$1" log="$tmp/jobs/$1.out" job signalled="" why="" result stopped
    say "job $name (${MPIDIST_LAUNCHER:-srun}): USR1 to the batch shell while the ranks train, requeue, resume"
    job="$(OUT="$out" sbatch --parsable --output="$log" jobs/train_digits.sbatch)"
    job="${job%%;*}"
    why="$(pause_and_signal "$job" "$out" 2>&1)" && signalled=1
    [[ -n "$signalled" ]] || { fail "job $name: no stop signal sent while the ranks trained: $why"; show_log "$name"; return 0; }
    result="$(wait_for_state "$job")"
    if [[ "$result" != "COMPLETED 1" ]]; then
        fail "job $name: state/restarts '$result' (want 'COMPLETED 1')"; show_log "$name"; return 0
    fi
    if ! stopped="$(grep -Eo "^stopped by SIGUSR1 after [0-9]+ epochs and [0-9]+/" "$log")" \
            || ! grep -q "requeueing job $job to resume it" "$log" \
            || ! grep -q "^resumed from $out/checkpoint.npz: ${stopped#stopped by SIGUSR1 after }" "$log"; then
        fail "job $name: no stop / requeue / resume from the same step in its log"; show_log "$name"; return 0
    fi
    check_training "$name" "$out" 0.95 || return 0
    if "$PY" - "$tmp/out/train-srun/checkpoint.npz" "$out/checkpoint.npz" "$stopped" <<'EOF'; then
import sys
import numpy as np
from mpidist.checkpoint import load_checkpoint
a, b = (load_checkpoint(p) for p in sys.argv[1:3])
differ = sorted(k for k in set(a) | set(b) if k != "history" and not (k in a and k in b and np.array_equal(a[k], b[k])))
assert not differ, f"arrays that differ from the uninterrupted run: {differ}"
print(f"    {sys.argv[3]}..., requeued, resumed: final checkpoint bitwise equal to train-srun's")
EOF
        say "job $name: passed"
    else
        fail "job $name: the resumed run differs from the uninterrupted one"
    fi
}

run_requeue requeue-srun
MPIDIST_LAUNCHER=mpiexec run_requeue requeue-mpiexec

# The torch job (torch DDP over the mpidist backend) through its own script: 4 ranks in one world.
SBATCH_SCRIPT=jobs/train_torch.sbatch run_training train-torch 0.97

# PyTorch Lightning under srun (issue 23): the frameworks suite's Lightning script through the
# user-facing jobs/lightning.sbatch, 4 tasks; both fits must print FRAMEWORK OK at np=4.
if "$PY" -c "import pytorch_lightning" 2>/dev/null; then
    say "job lightning: sbatch --wait jobs/lightning.sbatch tests/frameworks/lightning_train.py"
    mkdir -p "$tmp/out/lightning"
    rc=0
    FW_OUT="$tmp/out/lightning" submit_wait lightning jobs/lightning.sbatch tests/frameworks/lightning_train.py || rc=$?
    if (( rc != 0 )); then
        fail "job lightning exited with $rc"; show_log lightning
    elif ! grep -q "^FRAMEWORK OK lightning np=4 backend=mpidist" "$tmp/jobs/lightning.out" \
        || ! grep -q "^FRAMEWORK OK lightning-sync-dist np=4 backend=mpidist" "$tmp/jobs/lightning.out"; then
        fail "job lightning: no 'FRAMEWORK OK lightning np=4' and 'lightning-sync-dist np=4' lines"; show_log lightning
    else
        say "job lightning: passed ($(grep -c '^FRAMEWORK OK' "$tmp/jobs/lightning.out") fits at np=4 under srun)"
    fi
else
    say "job lightning: SKIPPED: pytorch_lightning is not installed in this venv (the frameworks extra: make test-frameworks)"
fi

# The suite's communication tests (collectives, point-to-point, groups, the mismatch check, the
# launcher's files): what srun's PMI changes (the object collectives and DDP, built on the same
# calls, ran here too until the CI run neared its 30 min: 157 of 403 tests, ~15 s). All of it
# took about 2 min here.
SUITE_K="${SLURM_TEST_SUITE_K:-test_collectives or test_p2p or test_groups or test_mismatch or test_launcher_files}"
say "job test-suite: sbatch --wait jobs/test_suite.sbatch -k '$SUITE_K'"
rc=0
submit_wait test-suite jobs/test_suite.sbatch -k "$SUITE_K" || rc=$?
if (( rc != 0 )); then
    fail "job test-suite exited with $rc"; show_log test-suite
elif ! grep -Eq "^[0-9]+ passed" "$tmp/jobs/test-suite.out" || grep -Eq "[0-9]+ (failed|error)" "$tmp/jobs/test-suite.out"; then
    fail "job test-suite: no clean pytest summary"; show_log test-suite
else
    say "job test-suite: $(grep -E '^[0-9]+ passed' "$tmp/jobs/test-suite.out" | tail -n 1)"
fi

if (( failures > 0 )); then
    say "$failures check(s) FAILED"
    exit 1
fi
say "all Slurm checks passed"
