# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check
STORE ?= store

.PHONY: install demo test lint bench

install:
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'

# Runs a mixed workload on SmolLM2-135M with the shipped drafter: a compact run plus its
# cap-accept companion, then the per-workload report (windows, ceiling, estimator, ECE).
demo: install
	dspark-obs fetch-model
	dspark-obs run --workload mixed --requests 24 --mode compact --companion --store $(STORE) --run-id demo
	dspark-obs report demo --store $(STORE) --out out/demo

test: install
	$(PY) -m pytest -q -p no:cacheprovider

lint:
	ruff check dspark_obs tests bench

bench: install
	$(PY) bench/bench_ingest.py
	$(PY) bench/bench_engine.py
