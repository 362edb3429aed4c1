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
TORCH_PIN ?= torch==2.13.0

.PHONY: install test lint test-fast demo bench bench-cluster bench-overhead bench-checkpoint bench-pipeline bench-ft bench-hf gpu-check clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
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

lint: $(STAMP)
	$(PY) -m ruff check hp_lightning
	$(PY) -m mypy --config-file mypy.ini hp_lightning

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
	rm -rf $(VENV) runs lightning_logs .pytest_cache
