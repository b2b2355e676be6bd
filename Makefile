# The two commands of the README. Each creates or reuses .venv itself.
PY := .venv/bin/python

.PHONY: demo test setup bench
setup:
	@scripts/setup.sh

# Engines run one set at a time on a shared machine (at most two fit in memory).
ENGINE_LOCK := flock /tmp/kvcompose-engines.lock

# The main job: P/D over NIXL plus the CPU tier between real vLLM engines, checked.
demo: setup
	$(PY) -m kvcompose.cli check examples/pd-prefill.yaml
	$(PY) -m kvcompose.cli check examples/pd-decode.yaml
	$(ENGINE_LOCK) $(PY) -m kvcompose.cli demo

test: setup
	$(PY) -m pytest -q -m "not engine" $(PYTEST_ARGS)
	$(ENGINE_LOCK) $(PY) -m pytest -q -m engine -p no:cacheprovider tests/engine plugins $(PYTEST_ARGS)

# Benchmarks (docs/performance.md): `make bench BENCH_ARGS=--quick` for the 2-minute run.
bench: setup
	$(PY) -m kvcompose.cli bench $(BENCH_ARGS)
