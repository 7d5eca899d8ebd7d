#!/usr/bin/env bash
# Every GPU check in one bounded run (docs/device.md, "On a real GPU"), for a GPU machine whose
# Python has CuPy and a CUDA torch but that cannot reach a package index:
#   1. a venv over that Python's packages (a .pth file: the Python may itself be a venv, whose
#      packages --system-site-packages would not see), with mpich, mpi4py and pytest-mpi
#      installed offline from the wheels in $WHEELS, and mpidist from this checkout;
#   2. `make test-gpu`'s two commands: tests/gpu serially, then under mpiexec -n 2 (both ranks
#      on one GPU; NCCL_MULTI_RANK_GPU_ENABLE=1 unless set);
#   3. the CPU suite's device tests (fakes), with the real CuPy importable;
#   4. where the host time of a small device collective goes (tools/profile_device_call.py, 1 rank);
#   5. `make bench-gpu` (benchmarks/bench_gpu.py at -n 1 and 2) and benchmarks/bench_torch_gpu.py
#      (torch DDP on CUDA over "mpidist" against torch's NCCL over mpi://) at -n 1 and 2.
# tests/gpu holds the torch main job on CUDA (over "mpidist" and --backend nccl, 1 and 2 ranks) and
# torch.compile of DDP on CUDA (over "mpidist" and torch's NCCL; aot_eager and inductor).
# Steps run in the order of their value (the CPU fakes last), so a short lease loses the least.
# Each step has its own time limit and a step is skipped once less than its limit is left of
# $DEADLINE seconds (default 540); ONLY="probe venv ..." runs just the steps named. Logs and
# benchmark results go to $LOGS; the last lines printed are one line per step with its exit
# status and time.
#
#   WHEELS=.whl LOGS=out/gpu-check bash tools/gpu_check.sh
# Fetch the wheels where pip works (the target's Python version; here 3.12):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux1_x86_64 -d .whl mpich==5.0.2 mpi4py==4.1.2 pytest-mpi==0.6
set -u
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
LOGS=${LOGS:-out/gpu-check}
VENV=${VENV:-/tmp/mpidist-gpu-venv}
DEADLINE=${DEADLINE:-540}
BASE_PY=${BASE_PY:-python3}
export NCCL_MULTI_RANK_GPU_ENABLE=${NCCL_MULTI_RANK_GPU_ENABLE:-1}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
mkdir -p "$LOGS/results"
T0=$(date +%s)
SUMMARY=()

step() {  # step NAME LIMIT_S COMMAND...: run it with its log in $LOGS/NAME.log
  local name=$1 limit=$2 left rc t
  shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
    return
  fi
  left=$((DEADLINE - ($(date +%s) - T0)))
  if [ "$left" -lt "$limit" ]; then
    SUMMARY+=("$name: skipped (${left}s left of the deadline, needs ${limit}s)")
    return
  fi
  echo "== $name (limit ${limit}s)"
  t=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  tail -n 4 "$LOGS/$name.log"
  SUMMARY+=("$name: rc=$rc in $(($(date +%s) - t))s")
}

probe() {
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$BASE_PY" - <<'EOF'
import importlib
for name in ("torch", "cupy", "mpi4py", "numpy", "pytest", "pytest_timeout"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"), m.__file__)
    except Exception as exc:  # noqa: BLE001
        print(name, "missing:", exc)
try:
    import torch
    print("torch cuda", torch.version.cuda, "devices", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version())
except Exception as exc:  # noqa: BLE001
    print("torch cuda:", exc)
try:
    from cupy.cuda import nccl
    print("cupy nccl", nccl.get_version())
except Exception as exc:  # noqa: BLE001
    print("cupy nccl:", exc)
EOF
}

make_venv() {
  set -e
  rm -rf "$VENV"
  "$BASE_PY" -m venv "$VENV"
  local site
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$BASE_PY" -c 'import site, sys; print("\n".join(site.getsitepackages() + sys.path[1:]))' \
    | grep -E 'site-packages|dist-packages' | awk '!seen[$0]++' >"$site/_base_python.pth"
  "$VENV/bin/python" -m pip install -q --no-index --no-deps --ignore-installed "$WHEELS"/*.whl
  "$VENV/bin/python" -m pip install -q --no-index --no-deps --ignore-installed --no-build-isolation -e . \
    || echo "editable install failed: PYTHONPATH=$PWD is used instead"
  "$VENV/bin/mpiexec" -n 2 "$VENV/bin/python" -c \
    'from mpi4py import MPI; import mpidist, torch, cupy; c = MPI.COMM_WORLD; print(c.rank, c.size, MPI.Get_library_version().split(chr(10))[0], MPI.Query_thread(), mpidist.__file__, torch.__version__, cupy.__version__)'
}

PY=$VENV/bin/python
MPIEXEC=$VENV/bin/mpiexec
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} VENV WHEELS BASE_PY
export -f probe make_venv
step probe 60 bash -c probe
step venv 120 bash -c make_venv
step test-gpu-serial 240 "$PY" -m pytest --with-mpi -rs -q --durations=10 tests/gpu
step test-gpu-np2 150 "$MPIEXEC" -n 2 "$PY" -m mpidist -m pytest --with-mpi -rs -q tests/gpu
step profile 60 "$MPIEXEC" -n 1 "$PY" tools/profile_device_call.py
step bench-gpu-np2 150 "$MPIEXEC" -n 2 "$PY" benchmarks/bench_gpu.py --out "$LOGS/results" --staging-chunks 1M,2M,8M,16M
step bench-torch-gpu-np2 80 "$MPIEXEC" -n 2 "$PY" benchmarks/bench_torch_gpu.py --out "$LOGS/results"
step bench-gpu-np1 60 "$MPIEXEC" -n 1 "$PY" benchmarks/bench_gpu.py --out "$LOGS/results"
step bench-torch-gpu-np1 50 "$MPIEXEC" -n 1 "$PY" benchmarks/bench_torch_gpu.py --out "$LOGS/results"
# the CPU suite's device and torch-CUDA tests (fakes), where the real CuPy and CUDA are importable
step device-tests 120 "$PY" -m pytest --with-mpi -rs -q tests/test_device_nccl.py tests/test_device_staging.py \
  tests/test_device_paths.py tests/test_device_integration.py tests/test_device_mpi_cuda.py tests/test_torch_cuda.py \
  tests/test_torch_backend.py tests/test_torch_compile.py
echo "== summary ($(($(date +%s) - T0))s)"
printf '%s\n' "${SUMMARY[@]}" | tee "$LOGS/summary.txt"
