"""What the dashboard shows, as functions over the store: one module per page, plus ``shared``.

Why a package of its own: the pages stay layout only, the same functions are benchmarked
over a 10-million-row store (bench/bench_dashboard_queries.py) and tested without a browser.
Every function is read-only (``Store.query`` refuses writes) and returns a pandas DataFrame
(or a small dataclass of them); the store may be ingesting while they run, and each query
sees every segment acknowledged so far.

Pages, tests and the benchmark import the modules by their full name
(``from dashboards.streamlit.queries import windows``), never by a bare module name found
on Streamlit's script path: the repository root is on ``sys.path`` (``dspark-obs dashboard``
puts it there; so does running from the checkout).

* ``shared``: the sidebar's :class:`~shared.Filters` (one SQL predicate, applied to the store
  and to the per-segment rollups alike), the runs table, how a ceiling is known.
* ``overview``, ``windows``, ``ceiling``, ``calibration``, ``cost_model``, ``requests``,
  ``compare``: each page's figures.
"""

__all__ = [
    "calibration",
    "ceiling",
    "compare",
    "cost_model",
    "overview",
    "requests",
    "shared",
    "windows",
]
