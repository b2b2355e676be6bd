# The two commands of the README. Each creates or reuses .venv itself.
PY := .venv/bin/python

.PHONY: demo test setup bench
setup:
	@scripts/setup.sh

# The main job. Until `kvcompose demo` lands it validates and explains the shipped example.
demo: setup
	$(PY) -m kvcompose.cli check examples/pd-decode.yaml
	$(PY) -m kvcompose.cli explain examples/pd-prefill.yaml
	$(PY) -m kvcompose.cli vllm-args examples/pd-decode.yaml

test: setup
	$(PY) -m pytest -q -m "not engine" $(PYTEST_ARGS)

# Benchmarks (docs/performance.md): `make bench BENCH_ARGS=--quick` for the 2-minute run.
bench: setup
	$(PY) -m kvcompose.cli bench $(BENCH_ARGS)
