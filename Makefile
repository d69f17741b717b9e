# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check
STORE ?= store
RUN := demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: install demo test lint bench

install:
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'

# Runs a mixed workload on SmolLM2-135M with the shipped drafter: a compact run plus its
# cap-accept companion, then the per-workload report (windows, ceiling, estimator, ECE).
demo: install
	$(PY) -m dspark_obs fetch-model
	$(PY) -m dspark_obs run --workload mixed --requests 12 --max-new-tokens 96 --mode compact \
		--companion --store $(STORE) --run-id $(RUN)
	$(PY) -m dspark_obs report $(RUN) --store $(STORE) --out out/demo

test: install
	$(PY) -m pytest -q -p no:cacheprovider

lint:
	ruff check dspark_obs tests bench

bench: install
	$(PY) bench/bench_ingest.py
	$(PY) bench/bench_engine.py
	$(PY) bench/bench_estimator.py
