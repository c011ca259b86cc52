# make run: set up .venv, generate on the Ray cluster (PP=2) with the embedded default model, check PP=1 agrees.
# make test: set up .venv (with test extras) and run the whole suite.
# make test-fast: the same without the Ray cluster tests and the slow ones (kernels, stages, formats).
PYTHON ?= python3
# make test-fast runs in two pytest-xdist workers. make test does not: its Ray tests leave the 2-core CI machine
# idle ~40% of the time, but two workers starting Ray clusters at once overloaded it (a raylet past Ray's 30 s to
# register, a runtime-env package lost), for 1.3x.
TEST_WORKERS ?= 2
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup setup-test run test test-fast bench bench-deps bench-serve serve protos clean

# installing also generates the gRPC stubs from protos/*.proto (setup.py)
$(VENV)/.installed: pyproject.toml setup.py $(wildcard protos/*.proto)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

run: setup
	mkdir -p out
	$(PY) -m raymoe.deploy.demo --model tiny-qwen35moe --input examples/prompts.jsonl --output out/generations.jsonl

test: setup-test
	$(VENV)/bin/pytest

test-fast: setup-test
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile -m "not cluster and not slow"

bench-deps: setup-test
	$(PY) -m pip install --quiet -e ".[test,bench]"

bench: setup-test
	mkdir -p out
	$(PY) -m raymoe.tools.bench --json out/bench.json --plot out/bench.png

bench-serve: setup
	$(PY) -m raymoe.tools.bench_serve

serve: setup
	$(PY) -m raymoe.deploy.serve --model tiny-qwen35moe

# regenerate the gRPC stubs (protos/*_pb2*.py) after editing a .proto
protos: setup
	$(PY) -m pip install --quiet --no-deps -e .

clean:
	rm -rf $(VENV) out
