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
# cap-accept companion, then the per-workload report (windows, ceiling, estimator, ECE), then
# serves /metrics (Prometheus) and the Streamlit dashboard over the store until Ctrl-C.
# Sized to finish its runs in under 5 minutes on a 2-core CPU; bigger:
#   make demo DEMO_REQUESTS=48 DEMO_TOKENS=128        automated (no serving): make demo SERVE=0
DEMO_REQUESTS ?= 9
DEMO_TOKENS ?= 40
SERVE ?= 1
METRICS_PORT ?= 9464
DASHBOARD_PORT ?= 8501

demo: install
	$(PY) -m dspark_obs fetch-model
	@start=$$(date +%s); \
	$(PY) -m dspark_obs run --workload mixed --requests $(DEMO_REQUESTS) \
		--max-new-tokens $(DEMO_TOKENS) --mode compact --companion --store $(STORE) \
		--run-id $(RUN) && \
	echo "demo runs (compact + cap-accept companion) took $$(( $$(date +%s) - start )) s"
	$(PY) -m dspark_obs report $(RUN) --store $(STORE) --out out/demo
ifeq ($(SERVE),1)
	@$(PY) -m dspark_obs serve --follow --store $(STORE) --port $(METRICS_PORT) & \
	serve_pid=$$!; trap 'kill $$serve_pid 2>/dev/null' EXIT INT TERM; \
	echo ""; \
	echo "Prometheus metrics: http://127.0.0.1:$(METRICS_PORT)/metrics"; \
	echo "Dashboard:          http://127.0.0.1:$(DASHBOARD_PORT)/   (Ctrl-C stops both)"; \
	$(PY) -m dspark_obs dashboard --store $(STORE) --port $(DASHBOARD_PORT)
endif

# What CI runs: the same install step (Prometheus + promtool, Chromium + ChromeDriver, the
# SGLang wheel; it prints what it could not install and which tests skip), then every test,
# in two pytest-xdist workers, each test file on one worker (module fixtures set up once), the
# slowest files handed out first (tests/conftest.py: SLOW_MODULES_FIRST, torch one thread each).
test: install
	PY=$(PY) ./scripts/install-test-deps.sh
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder

lint:
	ruff check dspark_obs tests bench

bench: install
	$(PY) bench/bench_ingest.py
	$(PY) bench/bench_throughput.py --device cpu
	$(PY) bench/bench_estimator.py
