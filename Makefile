# Everything a fresh machine needs: `make demo` and `make test` create .venv by themselves.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test test-slow test-all lint demo bench clean test-pythons test-compat
.PHONY: test-sanitize soak venvs-pythons test-torchrun
.PHONY: browser postgres slurm system-deps

# Every system package the suites' real servers need, each target a no-op when its package
# is there: .ci/run starts this in the background while the main venv builds.
system-deps: browser postgres slurm

# eventbus/_speedups.c is built by the editable install: a change to it reinstalls.
$(STAMP): pyproject.toml setup.py eventbus/_speedups.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build. Then
	# everything else with torch held where it is (a constraint file of the installed
	# version): Lightning and transformers (the trainer extras) never pull another torch.
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -e ".[test,plot,bench,sinks,trainers,postgres,wandb]"
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check eventbus publishers subscribers eventbus_app tests benchmarks examples
	$(VENV)/bin/mypy

# Headless Chromium for the job view's browser tests (tests/test_ui.py): the Debian
# package, installed when missing and apt-get is at hand (CI runs as root). Never fails
# the build: without a browser those tests skip and say why.
CHROMIUM ?= /usr/bin/chromium
browser:
	@if [ -x $(CHROMIUM) ]; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo -n ); \
	  ( $$SUDO apt-get install -y -q chromium >/dev/null 2>&1 || \
	    { $$SUDO apt-get update -q >/dev/null 2>&1 && \
	      $$SUDO apt-get install -y -q chromium >/dev/null 2>&1; } ) \
	  && echo "browser: installed $(CHROMIUM)" \
	  || echo "browser: could not install chromium; the browser tests will skip"; \
	else echo "browser: no $(CHROMIUM) and no apt-get; the browser tests will skip"; fi

# A PostgreSQL server for the host ledger's tests (tests/test_hosts_ledger.py, run as the
# postgres user in a cluster of their own): Debian's package, installed when its initdb is
# missing and apt-get is at hand. Never fails the build: without it those tests skip and
# say why.
PG_INITDB := $(wildcard /usr/lib/postgresql/*/bin/initdb)
postgres:
	@if [ -n "$(PG_INITDB)" ]; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo -n ); \
	  ( $$SUDO apt-get install -y -q postgresql >/dev/null 2>&1 || \
	    { $$SUDO apt-get update -q >/dev/null 2>&1 && \
	      $$SUDO apt-get install -y -q postgresql >/dev/null 2>&1; } ) \
	  && echo "postgres: installed Debian's postgresql" \
	  || echo "postgres: could not install postgresql; the PostgreSQL ledger tests will skip"; \
	else echo "postgres: no /usr/lib/postgresql/*/bin/initdb and no apt-get; the PostgreSQL ledger tests will skip"; fi

# A real Slurm cluster for tests/test_slurm_cluster.py (tests/slurm_cluster.py starts one
# controller and three nodes in network namespaces, everything under a temporary folder):
# Debian's slurmctld, slurmd, slurm-client and munge, plus iproute2 and util-linux
# (ip netns, nsenter), installed when missing and apt-get is at hand. A policy-rc.d that
# denies every start is in place during the install, so the packages' init scripts start
# no munged, slurmd nor slurmctld; one that was there before is put back. Never fails the
# build: without them those tests skip and say why.
SLURM_BINS := slurmctld slurmd munged sbatch ip nsenter
SLURM_PKGS := slurmctld slurmd slurm-client munge iproute2 util-linux
slurm:
	@missing=""; for b in $(SLURM_BINS); do \
	  PATH="$$PATH:/usr/sbin:/sbin" command -v $$b >/dev/null 2>&1 || missing="$$missing $$b"; \
	done; \
	if [ -z "$$missing" ]; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo -n ); \
	  rc=/usr/sbin/policy-rc.d; saved=""; \
	  if [ -e $$rc ]; then saved=$$($$SUDO mktemp 2>/dev/null) && $$SUDO cp -p $$rc $$saved; fi; \
	  printf '#!/bin/sh\nexit 101\n' | $$SUDO tee $$rc >/dev/null 2>&1 && $$SUDO chmod 755 $$rc; \
	  install="$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(SLURM_PKGS)"; \
	  ( $$install >/dev/null 2>&1 || \
	    { $$SUDO apt-get update -q >/dev/null 2>&1 && $$install >/dev/null 2>&1; } ) \
	  && echo "slurm: installed$$missing (Debian's $(SLURM_PKGS))" \
	  || echo "slurm: could not install$$missing; the Slurm cluster tests will skip"; \
	  { if [ -n "$$saved" ]; then $$SUDO mv $$saved $$rc; else $$SUDO rm -f $$rc; fi; } \
	    2>/dev/null || :; \
	else echo "slurm: no$$missing and no apt-get; the Slurm cluster tests will skip"; fi

# About 3 minutes on 2 cores (74 s of it the fast suite, on two workers), lint and the
# pure-Python re-run included: everything but
# the tests marked slow (real torchrun / `eventbus run` / elastic_launch jobs, long
# subprocesses, load and stress runs, the wheel build, the demo). `make test-slow` runs
# those; CI runs both (.ci/run).
test: $(STAMP) lint browser postgres
	$(PY) -m pytest -q -m "not slow and not serial" -n 2 --durations=15
	# The tests that read the machine (CPU shares, benchmark ratios, 50 reader threads) run
	# alone, after the parallel pass.
	$(PY) -m pytest -q -m "not slow and serial" --durations=5 $(SERIAL_TESTS)
	# The core again on the pure-Python path: the compiled one (eventbus/_speedups.c)
	# stands in for it where it is built, and both must behave alike.
	EVENTBUS_PURE_PYTHON=1 $(PY) -m pytest -q -p no:cacheprovider -m "not slow" $(PURE_TESTS)

# The modules that hold tests marked serial (tests/test_suites.py keeps the list true):
# naming them spares the serial pass the whole suite's collection.
SERIAL_TESTS := tests/test_benchmarks_smoke.py tests/test_evidence.py tests/test_health.py \
	tests/test_ui.py

PURE_TESTS := tests/test_bus.py tests/test_events.py tests/test_queued.py tests/test_wire.py \
	tests/test_wire_fast_path.py tests/test_properties.py tests/test_compiled.py \
	tests/test_jsonl.py tests/reliability/test_data_snapshots.py \
	tests/reliability/test_reentrant_record.py \
	tests/reliability/test_subscribe_cancel_mid_dispatch.py \
	tests/reliability/test_raising_subscriber.py tests/reliability/test_strict_mode.py \
	tests/reliability/test_many_threads.py

# eventbus/_speedups.c under AddressSanitizer and UBSan, built into a temporary copy of the
# tree (the in-place .so stays): the core tests on the compiled path, then 100,000 calls of
# each fast-path shape checked for leaks (tests/sanitize/run.sh says how).
test-sanitize: $(STAMP)
	tests/sanitize/run.sh $(PY) $(PURE_TESTS)

# Every test's time goes into the output (--durations=0, the slowest first), so that CI's
# log says where the slow suite's minutes go; a slow test over 60 s says in its docstring
# why it must take that long.
test-slow: $(STAMP) browser postgres slurm
	$(PY) -m pytest -q -m slow --durations=0

test-all: test test-slow

# Every test of tests/reliability (the fault matrix), N rounds (default 10), under one busy
# process per core that the script starts and stops; prints one table (runs, passed,
# failed, slowest, each distinct failure, each process a test left behind: killed and
# counted as a failure), writes it into docs/guarantees.md ("Soak") and fails on any
# failure. SOAK_K=EXPR selects (pytest -k), e.g. N=30 SOAK_K='sigterm_flush and chained'.
# 10-12 min a round on 2 cores under the soak's load.
N ?= 10
SOAK_K ?=
soak: $(STAMP)
	$(PY) tests/soak.py -n $(N) $(if $(SOAK_K),-k "$(SOAK_K)") --doc docs/guarantees.md

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) -m benchmarks

# -- every Python and torch the package admits (docs/run.md, "Tested with") ------------
# requires-python admits 3.10 and later: .venv's interpreter (3.11 here) runs everything,
# and test-pythons runs the torch-free fast suite on each of PYTHON_VERSIONS, with the
# first interpreter of PYTHONS (pyenv's by default) that reports that version. This
# machine has a torch wheel for 3.11 only (others would download GBs of CUDA builds), so
# there the package goes in with --no-deps plus its torch-free dependencies, and
# tests/conftest.py leaves out (and names) the test modules that need torch.
# A version with no interpreter is skipped and named on the last line; with CI=true in
# the environment (CI services set it) it fails the target instead: CI tests them all.
PYTHON_VERSIONS ?= 3.10 3.12 3.13
PYTHONS ?= $(wildcard $(HOME)/.pyenv/versions/3.10.*/bin/python) \
	$(wildcard $(HOME)/.pyenv/versions/3.12.*/bin/python) \
	$(wildcard $(HOME)/.pyenv/versions/3.13.*/bin/python)
TORCH_FREE_DEPS := "blinker>=1.8" "attrs>=23.1" "pytest>=8" "pytest-timeout>=2.2" \
	"hypothesis>=6.100" "numpy>=1.24" "psygnal>=0.11" "pyee>=11" "matplotlib>=3.7"

# The venvs of test-pythons only (no test run): .ci/run builds them in the background
# while the main suites run; a version with no interpreter is left to test-pythons to name.
venvs-pythons:
	@for want in $(PYTHON_VERSIONS); do \
	  py=""; for cand in $(PYTHONS); do \
	    v=$$($$cand -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
	      && [ "$$v" = "$$want" ] && { py=$$cand; break; }; \
	  done; \
	  [ -n "$$py" ] || continue; \
	  venv=.venv-py$$want; \
	  if [ ! -f $$venv/.installed ] || [ eventbus/_speedups.c -nt $$venv/.installed ]; then \
	    $$py -m venv $$venv && $$venv/bin/pip install -q --no-deps -e . && \
	    $$venv/bin/pip install -q $(TORCH_FREE_DEPS) && touch $$venv/.installed \
	    || echo "venvs-pythons: Python $$want's venv failed; test-pythons will say why"; fi; \
	done

test-pythons:
	@ran=""; failed=""; skipped=""; \
	for want in $(PYTHON_VERSIONS); do \
	  py=""; for cand in $(PYTHONS); do \
	    v=$$($$cand -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
	      && [ "$$v" = "$$want" ] && { py=$$cand; break; }; \
	  done; \
	  if [ -z "$$py" ]; then skipped="$$skipped $$want"; continue; fi; \
	  venv=.venv-py$$want; \
	  if [ ! -f $$venv/.installed ] || [ eventbus/_speedups.c -nt $$venv/.installed ]; then \
	    $$py -m venv $$venv && $$venv/bin/pip install -q --no-deps -e . && \
	    $$venv/bin/pip install -q $(TORCH_FREE_DEPS) && touch $$venv/.installed \
	    || { failed="$$failed $$want (install)"; continue; }; fi; \
	  echo "== Python $$want ($$py, no torch): fast tests"; \
	  ran="$$ran $$want"; \
	  $$venv/bin/python -m pytest -q -p no:cacheprovider -m "not slow" \
	    || failed="$$failed $$want"; \
	done; \
	line="test-pythons: ran$${ran:- none}"; \
	[ -z "$$failed" ] || line="$$line; failed$$failed"; \
	[ -z "$$skipped" ] || line="$$line; skipped$$skipped (no interpreter)"; \
	case "$${CI:-}" in true|True|TRUE|1) if [ -n "$$skipped" ]; then \
	  line="$$line; CI=$$CI: every one of PYTHON_VERSIONS must run"; failed=1; fi;; esac; \
	echo "$$line"; [ -z "$$failed" ]

# The launcher hooks private torchelastic internals: check them, and one end-to-end restart
# job, on another torch. PyPI's builds carry CUDA libraries: ~6 GB in the venv, ~5-7 min
# to install here (measured, see docs/run.md); pip's cache keeps reruns to a reinstall.
# Not in .ci/run for that reason; run by hand: make test-compat TORCH_COMPAT=2.8.0
# COMPAT_VENV=DIR reuses a venv that already holds that torch and pytest (a CI cache, or
# one built by hand) as it is: nothing is installed into it, the tests import this checkout.
TORCH_COMPAT ?= 2.8.0
COMPAT_VENV ?= .venv-compat-$(TORCH_COMPAT)
COMPAT_READY := import sys, torch, pytest, attrs, blinker; \
	sys.exit(torch.__version__.split("+")[0] != "$(TORCH_COMPAT)")

test-compat:
	@if [ ! -f $(COMPAT_VENV)/.installed ] && \
	  ! $(COMPAT_VENV)/bin/python -c '$(COMPAT_READY)' 2>/dev/null; then \
	  $(PYTHON) -m venv $(COMPAT_VENV) && \
	  PIP_CONSTRAINT= PIP_CONFIG_FILE=/dev/null $(COMPAT_VENV)/bin/pip install -q \
	    "torch==$(TORCH_COMPAT)" && \
	  $(COMPAT_VENV)/bin/pip install -q --no-deps -e . && \
	  $(COMPAT_VENV)/bin/pip install -q $(TORCH_FREE_DEPS) && \
	  touch $(COMPAT_VENV)/.installed; fi
	PYTHONPATH=$(CURDIR) $(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider \
	  tests/test_launcher_internals.py \
	  "tests/test_launcher.py::test_reactor_restart_recovers_the_job"

# PyTorch's own tests of torchrun (test/distributed/launcher/test_run.py, torch 2.13's),
# run with torch's launcher and again with `eventbus run` in its place
# (torch.distributed.run.main rebound): one table of both outcomes, exit 1 on a test that
# passes under torch only (tests/torch_launcher/run.py, docs/run.md "Tested with"). The
# files are PyTorch's and are not kept here: tests/torch_launcher/SOURCE.txt names them
# (commit, sha256) and says where they go; PYTORCH_SRC=DIR takes them from a PyTorch
# checkout. Nothing is fetched. About 5 min on 2 shared cores (torch 107 s, eventbus 195 s
# in one run), so not in CI.
PYTORCH_SRC ?=
test-torchrun: $(STAMP)
	$(PY) -c "import expecttest" 2>/dev/null || $(PY) -m pip install -q expecttest
	$(PY) tests/torch_launcher/run.py $(if $(PYTORCH_SRC),--source $(PYTORCH_SRC))

clean:
	rm -rf $(VENV) .venv-py* .venv-compat-* .pytest_cache .mypy_cache .ruff_cache build \
		eventbus/_speedups.*.so
