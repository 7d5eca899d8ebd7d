#!/usr/bin/env bash
# The package as `pip install mpidist` gives it: the wheel in dist/ installed (not the checkout)
# into a fresh venv with the mpich, examples and torch extras, then used from outside the
# checkout (make test-wheel; docs/hpc.md, "From a wheel"):
#   - the installed files are the wheel's (no checkout on sys.path), with py.typed, and the
#     version is the one setup.cfg reads from mpidist/__init__.py;
#   - `mpiexec -n 2 python -m mpidist -c ...` runs an all_reduce;
#   - `import mpidist.torch` registers the "mpidist" backend with the torch extra;
#   - the numpy main job runs from the installed package;
#   - `python -m mpidist.info` runs.
# Usage: tests/wheel/run.sh WHEEL VENV PYTHON TORCH_PIN
set -euo pipefail
wheel=$1 venv=$2 python=$3 torch_pin=$4
root=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$venv"
"$python" -m venv "$venv"
py=$(cd "$venv" && pwd)/bin/python
mpiexec=$(dirname "$py")/mpiexec
# (--no-compile: these few checks import torch's sources uncompiled faster than pip compiles them all)
"$py" -m pip install -q --no-compile "$wheel[mpich,examples,torch]" "$torch_pin"

work=$(mktemp -d "${TMPDIR:-/tmp}/mpidist-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"  # not the checkout: `import mpidist` must find the installed package

say() { echo "[test-wheel] $*"; }
"$py" - "$root" <<'EOF'
import os, sys, sysconfig
import mpidist
root = sys.argv[1]
where = os.path.dirname(mpidist.__file__)
site = sysconfig.get_paths()["purelib"]
assert where == os.path.join(site, "mpidist"), f"mpidist imported from {where}, not from the wheel in {site}"
assert os.path.isfile(os.path.join(where, "py.typed")), "py.typed missing from the wheel"
version = open(os.path.join(root, "mpidist", "__init__.py")).read().split('__version__ = "')[1].split('"')[0]
assert mpidist.__version__ == version, (mpidist.__version__, version)
from importlib.metadata import version as dist_version
assert dist_version("mpidist") == version, (dist_version("mpidist"), version)
print(f"[test-wheel] mpidist {mpidist.__version__} installed from the wheel at {where}")
EOF
timeout -k 10 120 "$mpiexec" -n 2 "$py" -m mpidist -c "
import numpy as np, mpidist
mpidist.init_process_group()
x = np.full(4, mpidist.get_rank() + 1.0)
mpidist.all_reduce(x)
assert (x == 3).all(), x
if mpidist.get_rank() == 0:
    print('[test-wheel] mpiexec -n 2 python -m mpidist -c: all_reduce gave', x.tolist())
mpidist.destroy_process_group()
"
timeout -k 10 120 "$py" -c "
import torch.distributed as tdist
import mpidist.torch
assert tdist.is_backend_available('mpidist'), 'backend mpidist not registered'
print('[test-wheel] import mpidist.torch: backend mpidist registered with torch', __import__('torch').__version__)
"
timeout -k 10 300 "$mpiexec" -n 2 "$py" -m mpidist -m mpidist.examples.train_digits --epochs 2 --no-progress \
  --out "$work/digits" | tail -2
test -s "$work/digits/metrics.json" && test -s "$work/digits/checkpoint.npz"
say "the main job ran from the installed package"
timeout -k 10 120 "$mpiexec" -n 2 "$py" -m mpidist.info > "$work/info.txt"
grep -q "all_reduce" "$work/info.txt" || { cat "$work/info.txt"; exit 1; }
say "python -m mpidist.info ran; passed"
