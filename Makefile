# mpidist: the two commands that matter are `make run` and `make test`.
PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
MPIEXEC     := $(VENV)/bin/mpiexec
STAMP       := $(VENV)/.installed-stamp
EXTRAS      ?= mpich,examples,test
NP          ?= 4
OUT         ?= out/digits
RUN_ARGS    ?=
# Wall-clock bound (s) on every mpiexec, so a stuck rank fails the run instead of hanging it.
RUN_TIMEOUT ?= 600
TEST_TIMEOUT ?= 900
PYTEST      := $(PY) -m pytest --with-mpi

.PHONY: install run test test-serial test-mpi clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@touch $(STAMP)

run: install
	timeout -k 10 $(RUN_TIMEOUT) $(MPIEXEC) -n $(NP) $(PY) -m mpidist.examples.train_digits --out $(OUT) $(RUN_ARGS)

test: test-serial test-mpi

test-serial: install
	timeout -k 10 $(TEST_TIMEOUT) $(PYTEST)

test-mpi: install
	@set -e; for n in 2 3 4; do \
	  echo "== pytest under mpiexec -n $$n"; \
	  timeout -k 10 $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST) -q; \
	done

clean:
	rm -rf $(VENV) out build *.egg-info
