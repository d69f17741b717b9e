"""Screenshots of every page of the running Streamlit app, with Debian's headless chromium.

    python dashboards/screenshots.py --out docs/screenshots            # sample store, own app
    python dashboards/screenshots.py --url http://127.0.0.1:8501 --out shots   # a running app

Used by tests/test_dashboard_browser.py too. The browser is the system's /usr/bin/chromium
driven by /usr/bin/chromedriver through selenium (never a downloaded browser), with a fresh
profile and every background network feature off.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHROMIUM = os.environ.get("DSPARK_OBS_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("DSPARK_OBS_CHROMEDRIVER", "/usr/bin/chromedriver")
# page URL path -> screenshot name (file-based pages: the URL path is the file's name)
PAGES = {
    "": "overview",
    "Windows": "windows",
    "Ceiling": "ceiling",
    "Calibration": "calibration",
    "Cost_model": "cost_model",
    "Requests": "requests",
    "Compare": "compare",
}
CHROMIUM_FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--hide-scrollbars",
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")
        time.sleep(0.3)


@contextlib.contextmanager
def running_app(store: Path, port: int | None = None) -> Iterator[str]:
    """``dspark-obs dashboard`` over ``store`` on a free loopback port; yields its URL."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "dspark_obs", "dashboard", "--store", str(store),
           "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/_stcore/health")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def browser(width: int = 1440, height: int = 1800) -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="dspark-chromium-") as profile:
        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                     f"--window-size={width},{height}"):  # fmt: skip
            opts.add_argument(flag)
        driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
        try:
            yield driver
        finally:
            driver.quit()


def capture_page(driver, url: str, out: Path, timeout: float = 60.0) -> dict[str, object]:
    """Load one page, wait until its title and charts have rendered, save a PNG.

    Returns what the page showed: title, chart count, error texts (Streamlit exceptions).
    """
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    wait = WebDriverWait(driver, timeout, poll_frequency=0.5)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "h1"))

    def settled(d) -> bool:  # the script run finished, no placeholder left, every chart drawn
        app = d.find_elements(By.CSS_SELECTOR, '[data-testid="stApp"]')
        if not app or app[0].get_attribute("data-test-script-state") != "notRunning":
            return False
        if d.find_elements(By.CSS_SELECTOR, '[data-testid*="keleton"]'):
            return False
        charts = d.find_elements(By.CSS_SELECTOR, '[data-testid="stPlotlyChart"]')
        drawn = d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot .main-svg")
        return len(drawn) >= len(charts)

    wait.until(settled)
    time.sleep(1.0)  # let Plotly finish its transitions before the picture
    driver.save_screenshot(str(out))
    return {
        "title": driver.find_element(By.CSS_SELECTOR, "h1").text,
        "charts": len(driver.find_elements(By.CSS_SELECTOR, '[data-testid="stPlotlyChart"]')),
        "errors": [
            e.text for e in driver.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]')
        ],
    }


def capture_all(url: str, out_dir: Path) -> dict[str, dict[str, object]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    seen = {}
    with browser() as driver:
        for path, name in PAGES.items():
            seen[name] = capture_page(driver, f"{url}/{path}", out_dir / f"{name}.png")
            seen[name]["file"] = str(out_dir / f"{name}.png")
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    ap.add_argument("--url", help="A running app; default: start one over a sample store.")
    ap.add_argument("--store", type=Path, help="Store for the app it starts (default: sample).")
    args = ap.parse_args()
    if args.url:
        seen = capture_all(args.url, args.out)
    else:
        from dspark_obs.testing import sample_store

        with tempfile.TemporaryDirectory() as tmp:
            store = args.store
            if store is None:
                store = Path(tmp) / "store"
                sample_store.write_sample_store(store, n_requests=36, max_new_tokens=64)
            with running_app(store) as url:
                seen = capture_all(url, args.out)
    for name, info in seen.items():
        print(f"{name:12s} {info['title']!r:24s} charts={info['charts']} -> {info['file']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
