# The two commands of the README. Each creates or reuses .venv itself.
PY := .venv/bin/python

.PHONY: demo test lint setup bench
setup:
	@scripts/setup.sh

# Engines run one set at a time on a shared machine (at most two fit in memory).
ENGINE_LOCK := flock /tmp/kvcompose-engines.lock

# The main job: P/D over NIXL plus the CPU tier between real vLLM engines, checked.
demo: setup
	$(PY) -m kvcompose.cli check examples/pd-prefill.yaml
	$(PY) -m kvcompose.cli check examples/pd-decode.yaml
	$(ENGINE_LOCK) $(PY) -m kvcompose.cli demo

# The engine tests let every thread of their engines use every CPU, except in engines whose
# cores are named (VLLM_CPU_OMP_THREADS_BIND) (docs/e2e.md, cold start).
test: setup lint
	$(PY) -m pytest -q -m "not engine" $(PYTEST_ARGS)
	KVCOMPOSE_SPREAD_ENGINE_THREADS=1 $(ENGINE_LOCK) $(PY) -m pytest -q -m engine -p no:cacheprovider tests/engine plugins $(PYTEST_ARGS)

# ruff's linter and formatter, configured in pyproject.toml; `make test` runs this first.
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# Benchmarks (docs/performance.md): `make bench BENCH_ARGS=--quick` for the 2-minute run.
bench: setup
	$(PY) -m kvcompose.cli bench $(BENCH_ARGS)
