# Two commands set everything up on a fresh clone: `make test` and `make demo`.
# The venv's interpreter: the distribution's Python 3.11 where it has one with venv (Debian's static,
# optimized build: the suite's imports and Python-level work run 20-45 % faster on it than on pyenv's
# default shared-libpython build, measured), else python3. `make PYTHON=... install` chooses.
DISTRO_PYTHON := $(shell /usr/bin/python3.11 -c 'import ensurepip, venv' >/dev/null 2>&1 && echo /usr/bin/python3.11)
PYTHON ?= $(or $(DISTRO_PYTHON),python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU wheel of torch lies on disk; pinning it keeps pip from pulling a multi-GB CUDA build.
# torch and Lightning are pinned to releases of the tested window (README "Supported versions"): the
# whole suite runs on these; tests/unit/test_private_apis.py compares them (`make tested-pins`) with
# the releases the adapters were verified on and with pyproject.toml's ranges.
TORCH_PIN ?= torch==2.13.0
LIGHTNING_PIN ?= lightning==2.6.6 pytorch-lightning==2.6.6
# Each requirement quoted for the shell (a range's < or > is no redirection).
quoted = $(foreach requirement,$(1),'$(requirement)')

.PHONY: install test test-compat tested-pins lint generate test-fast demo bench bench-cluster bench-overhead bench-llm bench-checkpoint bench-pipeline bench-ft bench-hf gpu-check clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(call quoted,$(TORCH_PIN) $(LIGHTNING_PIN))
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(STAMP)

install: $(STAMP)

# Lint and types first (seconds), then the whole suite on TEST_WORKERS pytest-xdist workers (0: one
# process), a test file per work unit, the longest files first (tests/time_budget.py orders them);
# CI runs exactly this (.ci/run).
# compileall first: with PYTHONDONTWRITEBYTECODE set (as on CI), every fresh interpreter a test
# starts (torchrun ranks, CLIs) would otherwise compile hp_lightning, tests/ and examples/ again
# (~0.35 s each); compileall writes the .pyc files regardless, once.
TEST_WORKERS ?= 2
test: $(STAMP) lint
	$(PY) -m compileall -q hp_lightning tests examples benchmarks > /dev/null
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The rest of the tested window (README "Supported versions"): each torch in COMPAT_TORCH gets a venv
# of its own, .venv-torch<major.minor>, and runs the compat slice, tests/compat_slice.txt (the tests that
# touch every private name and every composition once; each line says why it is there), on TEST_WORKERS.
# torch 2.14 is paired with the oldest Lightning supported (LIGHTNING_OLDEST), torch 2.15 with the newest
# (LIGHTNING_PIN), so both ends of the Lightning range are tested too. Each venv's pins are also its pip
# constraints (PIP_CONSTRAINT): nothing installed later moves them, and they replace this machine's pip cap
# (/etc/xdg/pip caps torch at the 2.14.1 on its disk; 2.15.0, a CUDA build, comes from the package index:
# ~2.8 GB; each venv takes about 2 minutes to build here and ~6 GB of disk).
COMPAT_TORCH ?= 2.14 2.15
LIGHTNING_OLDEST ?= 2.6.0
COMPAT_PINS_2.14 := torch==2.14.1 lightning==$(LIGHTNING_OLDEST) pytorch-lightning==$(LIGHTNING_OLDEST)
COMPAT_PINS_2.15 := torch==2.15.0 $(LIGHTNING_PIN)
COMPAT_STAMPS := $(foreach v,$(COMPAT_TORCH),.venv-torch$(v)/.installed)

.venv-torch%/.installed: pyproject.toml Makefile
	@test -n "$(COMPAT_PINS_$*)" || { echo "Makefile: no COMPAT_PINS_$* for torch $*" >&2; exit 1; }
	$(PYTHON) -m venv .venv-torch$*
	printf '%s\n' $(call quoted,$(COMPAT_PINS_$*)) > .venv-torch$*/constraints.txt
	PIP_CONSTRAINT=$(CURDIR)/.venv-torch$*/constraints.txt .venv-torch$*/bin/python -m pip install --quiet --upgrade pip
	PIP_CONSTRAINT=$(CURDIR)/.venv-torch$*/constraints.txt .venv-torch$*/bin/python -m pip install --quiet $(call quoted,$(COMPAT_PINS_$*))
	PIP_CONSTRAINT=$(CURDIR)/.venv-torch$*/constraints.txt .venv-torch$*/bin/python -m pip install --quiet -e ".[test]"
	touch $@

# The compat slice on every other torch of the window, one venv after the other (comments stripped from
# tests/compat_slice.txt into pytest's @file). Each version's slice must stay under 300 s on 2 cores.
test-compat: $(COMPAT_STAMPS)
	@set -e; for v in $(COMPAT_TORCH); do \
	  echo "== compat slice on .venv-torch$$v: $$(.venv-torch$$v/bin/python -c 'import torch, lightning, transformers; print("torch", torch.__version__, "lightning", lightning.__version__, "transformers", transformers.__version__)')"; \
	  sed -e 's/[[:space:]]*#.*//' -e '/^$$/d' tests/compat_slice.txt > .venv-torch$$v/compat_slice.args; \
	  .venv-torch$$v/bin/python -m compileall -q hp_lightning tests examples benchmarks > /dev/null; \
	  .venv-torch$$v/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder @.venv-torch$$v/compat_slice.args; \
	done

# What each venv of the window pins, one line each (read by tests/unit/test_private_apis.py).
tested-pins:
	@echo "$(VENV): $(TORCH_PIN) $(LIGHTNING_PIN)"
	@$(foreach v,$(COMPAT_TORCH),echo ".venv-torch$(v): $(COMPAT_PINS_$(v))";)

lint: $(STAMP)
	$(PY) -m ruff check hp_lightning
	$(PY) -m mypy --config-file mypy.ini hp_lightning

# Everything derived from the option fields in hp_lightning/core/options.py (the type checkers' view of the
# constructors, docs/configuration.md, full_options.yaml's keys, the golden file); a test names this when one is stale.
generate: $(STAMP)
	$(PY) scripts/generate.py

# The edit loop: unit tests and the in-process checks (no multi-rank launch), under a minute.
test-fast: $(STAMP) lint
	$(PY) -m pytest -q -m "not slow" tests/unit tests/faults/test_faults_unit.py tests/integration/test_cli.py

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) -m benchmarks.run
	$(PY) -m benchmarks.checkpoint_io
	$(PY) -m benchmarks.pipeline_bubble

# A simulated 2-node cluster (network namespaces + a tc-shaped veth link); needs root and iproute2.
bench-cluster: $(STAMP)
	$(PY) -m benchmarks.cluster

# The step's own overhead at one core per rank: raw FSDP2 loop vs hp_lightning vs ModelParallelStrategy
# (and the manual-optimization floor) at k = 1 and 4, with a per-category profile (2 gloo ranks, ~8 min idle).
bench-overhead: $(STAMP)
	$(PY) -m benchmarks.overhead

# compile per block and activation checkpointing (none / full / selective_op / every 2nd) on an 8-block Llama,
# 2 gloo ranks, interleaved rounds: step-time ratios to eager, compile time, peak heap (~10 min idle).
bench-llm: $(STAMP)
	$(PY) -m benchmarks.llm

# Checkpoint save / resume time against plain DCP, and the async_save stall (2 gloo ranks; also in make bench).
bench-checkpoint: $(STAMP)
	$(PY) -m benchmarks.checkpoint_io

# The pipeline bubble (idle fraction per stage) for GPipe and 1F1B at 4 and 8 micro-batches (2 gloo ranks; also in make bench).
bench-pipeline: $(STAMP)
	$(PY) -m benchmarks.pipeline_bubble

# Loading a ~500 MB Hugging Face directory into FSDP 4 on CPU: per-rank peak memory and time against
# rank 0 reading and broadcasting, and from_pretrained in one process (4 gloo ranks).
bench-hf: $(STAMP)
	$(PY) -m benchmarks.hf_load

# Fault-tolerant HSDP on torchft vs plain HSDP 2x2 at 1 Gbit/s, and the kill/restart recovery times.
bench-ft: $(STAMP)
	$(PY) -m benchmarks.fault_tolerance

gpu-check: $(STAMP)
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) $(foreach v,$(COMPAT_TORCH),.venv-torch$(v)) runs lightning_logs .pytest_cache
