# The two commands of the README. Each creates or reuses .venv itself.
PY := .venv/bin/python

.PHONY: demo test test-long lint setup bench setup-next test-vllm-next
setup:
	@scripts/setup.sh

# What test-vllm-next runs on vLLM 0.33 (engines cannot: docs/versions.md).
NEXT_SUITES := tests/unit tests/scheduler tests/worker tests/kit plugins/nixl/tests plugins/cpu_offload/tests
# Asserts how vLLM's own CPU-offload worker fails with CPU torch; CUDA torch without a driver
# fails it earlier, in CUDA's initialisation (docs/versions.md).
NEXT_DESELECT := --deselect plugins/cpu_offload/tests/test_cpu_offload_worker.py::test_vllm_worker_fails_here_and_the_connector_swaps_it

# The next vLLM (0.33) in .venv-next, beside .venv's 0.32 (docs/versions.md).
setup-next:
	@scripts/setup-next.sh

# Engines run one set at a time on a shared machine (at most two fit in memory).
ENGINE_LOCK := flock /tmp/kvcompose-engines.lock

# The main job: P/D over NIXL plus the CPU tier between real vLLM engines, checked.
# The shipped examples read their deployment key from $KVCOMPOSE_PD_KEY: a fresh one unless set.
demo: export KVCOMPOSE_PD_KEY ?= $(shell python3 -c "import secrets; print(secrets.token_hex(32))")
demo: setup
	$(PY) -m kvcompose.cli check examples/pd-prefill.yaml
	$(PY) -m kvcompose.cli check examples/pd-decode.yaml
	$(ENGINE_LOCK) $(PY) -m kvcompose.cli demo

# The engine tests let every thread of their engines use every CPU, except in engines whose
# cores are named (VLLM_CPU_OMP_THREADS_BIND) (docs/e2e.md, cold start).
test: setup lint
	$(PY) -m pytest -q -m "not engine" $(PYTEST_ARGS)
	KVCOMPOSE_SPREAD_ENGINE_THREADS=1 $(ENGINE_LOCK) $(PY) -m pytest -q -m "engine and not long" -p no:cacheprovider tools/tests/engine plugins $(PYTEST_ARGS)

# The long engine scenarios, kept out of `make test` (and CI) for its time: the short soak across
# hosts, the link cut under ucx_error_handling: peer, pd-load's and the burst's controls.
test-long: setup
	KVCOMPOSE_SPREAD_ENGINE_THREADS=1 $(ENGINE_LOCK) $(PY) -m pytest -q -m long -p no:cacheprovider tools/tests/engine plugins $(PYTEST_ARGS)

# ruff's linter and formatter, and the layer contracts (lint-imports: an import the wrong way
# fails), all configured in pyproject.toml; `make test` runs this first.
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/lint-imports --no-cache

# Benchmarks (docs/performance.md): `make bench BENCH_ARGS=--quick` for the 2-minute run.
bench: setup
	$(PY) -m kvcompose.cli bench $(BENCH_ARGS)

# The suites that run against the next vLLM on a CPU host (docs/versions.md): the composite
# against the next wheel's base.py (parsed, in .venv), then NEXT_SUITES without engines on vLLM
# 0.33 (CUDA torch on a CPU: VLLM_TARGET_DEVICE picks vLLM's CPU platform).
test-vllm-next: setup setup-next
	$(PY) -m pytest -q -p no:cacheprovider tests/adapter/test_vllm_surface.py $(PYTEST_ARGS)
	VLLM_TARGET_DEVICE=cpu .venv-next/bin/python -m pytest -q -p no:cacheprovider -m "not engine" $(NEXT_DESELECT) $(NEXT_SUITES) $(PYTEST_ARGS)
