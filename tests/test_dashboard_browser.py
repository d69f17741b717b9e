"""Every page of the running app in Debian's headless chromium while a run is being ingested.

Real parts: `dspark-obs dashboard` (a real Streamlit server on loopback), /usr/bin/chromium
driven through /usr/bin/chromedriver, a store written step by step by a writer thread during
the page loads. Each screenshot is checked to be a rendered page: not blank, not an error.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "dashboards"))

import screenshots  # noqa: E402

from dspark_obs.store import Store  # noqa: E402
from dspark_obs.testing import sample_store  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (Path(screenshots.CHROMIUM).exists() and Path(screenshots.CHROMEDRIVER).exists())
    or shutil.which("chromium") is None,
    reason="Debian chromium + chromium-driver are not installed (apt-get install chromium "
    "chromium-driver)",
)


def _ingest(store: Store, stop: threading.Event, done: threading.Event) -> None:
    """Write a compact run + companion in step slices, as a live producer would."""
    tables = sample_store.synthetic_tables(n_requests=24, max_new_tokens=40, seed=7, prefix="live")
    sample_store.write_in_slices(store, tables, slices=12, pause=1.5, stop=stop)
    done.set()


def _looks_rendered(png: Path) -> tuple[bool, str]:
    from PIL import Image

    img = np.asarray(Image.open(png).convert("L"), dtype=np.float64)
    ink = float((img < 200).mean())  # share of non-background pixels
    return img.std() > 10 and ink > 0.01, f"std={img.std():.1f} ink={ink:.3f}"


def test_every_page_renders_while_ingesting(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    stop, done = threading.Event(), threading.Event()
    writer = threading.Thread(target=_ingest, args=(store, stop, done), daemon=True)
    writer.start()
    time.sleep(0.5)  # the first slice is in: pages have something to draw
    shots = tmp_path / "shots"
    try:
        with screenshots.running_app(store.root) as url:
            seen = screenshots.capture_all(url, shots)
            still_ingesting = not done.is_set()
    finally:
        stop.set()
        writer.join(timeout=30)
    assert still_ingesting or len(seen) == len(screenshots.PAGES)
    expected = {
        "overview": "Overview", "windows": "Windows", "ceiling": "Ceiling",
        "calibration": "Calibration", "cost_model": "Cost model", "requests": "Requests",
        "compare": "Compare",
    }  # fmt: skip
    assert set(seen) == set(expected)
    for name, info in seen.items():
        assert info["title"] == expected[name], info
        assert not info["errors"], f"{name}: {info['errors']}"
        assert info["charts"] >= 1, f"{name}: no chart drawn"
        ok, why = _looks_rendered(Path(info["file"]))
        assert ok, f"{name} screenshot looks blank: {why}"
