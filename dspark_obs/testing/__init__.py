"""Test-data generators and tiny models, shared by tests and benchmarks (not product code).

* :mod:`.synthetic` - a tiny, fully known DSpark world (Markov target and drafter): a compact
  run, its cap-accept companion and the truth, as schema tables (numpy/pandas);
* :mod:`.sample_store` - a store of synthetic runs for the dashboards' tests, screenshots and
  query benchmark;
* :mod:`.tiny_models` - tiny random targets and drafters of the real architecture (torch);
* :mod:`.compiled_check` - one batched runtime run eager and compiled on the same inputs
  (``tests/test_engine_batched.py``, ``bench/check_compiled.py``);
* :mod:`.otlp_drop` - a loopback OTLP/HTTP endpoint that drops everything (sink benchmarks);
* :mod:`.throughput_bench` - the engine throughput benchmark's queue, statistics, tables and
  plots (``bench/bench_throughput.py``, ``bench/bench_cpu_drafting.py``).

Why no re-exports here: ``synthetic`` is torch-free and used by analytics tests; eager
re-exports would load torch for them. Product packages never import this one (only the
``dspark-obs`` entry point does, for ``engine-server --tiny``; tests/test_house.py checks it).
"""

__all__: list[str] = []
