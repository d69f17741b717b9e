"""docker-compose.yml is consistent with what it runs (no Docker engine here: a static check).

Services and profiles, published ports on loopback, volumes, every bind-mounted file, the
Prometheus scrape targets against the compose services and dspark-obs ports, Grafana's
provisioning against the mounted paths, and the dspark-obs commands against the CLI.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dspark_obs.cli import app
from dspark_obs.cli.dashboard import DEFAULT_PORT as DASHBOARD_PORT
from dspark_obs.cli.sinks import DEFAULT_PORT as METRICS_PORT

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _ports(svc: dict) -> list[tuple[str, int, int]]:
    out = []
    for p in svc.get("ports", []):
        host, hport, cport = str(p).split(":")
        out.append((host, int(hport), int(cport)))
    return out


def _binds(svc: dict) -> list[tuple[Path, str]]:
    out = []
    for v in svc.get("volumes", []):
        src, dst = str(v).split(":")[:2]
        if src.startswith((".", "/")):
            out.append(((ROOT / src).resolve(), dst))
    return out


def test_services_and_profiles() -> None:
    default = {n for n, s in SERVICES.items() if not s.get("profiles")}
    assert default == {"prometheus", "grafana", "dspark-serve", "dspark-dashboard"}
    gpu = {n for n, s in SERVICES.items() if "gpu" in s.get("profiles", [])}
    assert gpu == {"sglang-compact", "sglang-cap-accept", "dspark-collect"}
    for name in ("sglang-compact", "sglang-cap-accept"):
        devices = SERVICES[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    modes = {}
    for name in ("sglang-compact", "sglang-cap-accept"):  # the launch profiles' env files
        (profile,) = [e for e in SERVICES[name]["env_file"] if isinstance(e, str)]
        lines = (ROOT / profile).read_text().splitlines()
        env = dict(line.split("=", 1) for line in lines if "=" in line)
        modes[name] = env["SGLANG_RAGGED_VERIFY_MODE"]
        jsonl = env["SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH"]
        assert jsonl.startswith("/data/"), jsonl  # on the shared volume the collector reads
        assert jsonl in " ".join(SERVICES["dspark-collect"]["command"])
    assert modes == {"sglang-compact": "compact", "sglang-cap-accept": "cap-accept"}


def test_ports_are_loopback_and_unique() -> None:
    seen = set()
    for name, svc in SERVICES.items():
        for host, hport, _ in _ports(svc):
            assert host == "127.0.0.1", f"{name} publishes on {host}"
            assert hport not in seen, f"host port {hport} twice"
            seen.add(hport)
    assert (METRICS_PORT, METRICS_PORT) in {(h, c) for _, h, c in _ports(SERVICES["dspark-serve"])}
    assert (DASHBOARD_PORT, DASHBOARD_PORT) in {
        (h, c) for _, h, c in _ports(SERVICES["dspark-dashboard"])
    }
    assert f"--port {METRICS_PORT}" in " ".join(SERVICES["dspark-serve"]["command"])
    assert f"--port {DASHBOARD_PORT}" in " ".join(SERVICES["dspark-dashboard"]["command"])


def test_every_bind_mounted_file_exists_and_volumes_are_declared() -> None:
    declared = set(COMPOSE.get("volumes", {}))
    for name, svc in SERVICES.items():
        for src, _ in _binds(svc):
            assert src.exists(), f"{name} mounts {src}, which does not exist"
        for v in svc.get("volumes", []):
            src = str(v).split(":")[0]
            if not src.startswith((".", "/")):
                assert src in declared, f"{name} uses undeclared volume {src}"
        for env in svc.get("env_file", []):
            if isinstance(env, dict) and env.get("required", True) is False:
                continue
            path = env["path"] if isinstance(env, dict) else env
            assert (ROOT / path).exists(), f"{name} env_file {path} missing"
    # the store is one volume shared by serve, dashboard and collector
    for name in ("dspark-serve", "dspark-dashboard", "dspark-collect"):
        assert any(str(v).startswith("dspark-data:/data") for v in SERVICES[name]["volumes"])


def test_prometheus_scrapes_the_compose_services() -> None:
    mounts = dict((dst, src) for src, dst in _binds(SERVICES["prometheus"]))
    cfg_path = mounts["/etc/prometheus/prometheus.yml"]
    cfg = yaml.safe_load(cfg_path.read_text())
    targets = {
        t for job in cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    assert f"dspark-serve:{METRICS_PORT}" in targets
    for t in targets:
        host, port = t.split(":")
        assert host in SERVICES, f"scrape target {t} is no compose service"
        published = {c for _, _, c in _ports(SERVICES[host])}
        assert int(port) in published, f"{t}: {host} does not listen on {port}"
    promtool = shutil.which("promtool")
    if promtool:
        res = subprocess.run([promtool, "check", "config", str(cfg_path)], capture_output=True)
        assert res.returncode == 0, res.stdout + res.stderr


def test_grafana_provisioning_matches_the_mounts() -> None:
    mounts = {dst: src for src, dst in _binds(SERVICES["grafana"])}
    ds_dir = mounts["/etc/grafana/provisioning/datasources"]
    (ds,) = yaml.safe_load((ds_dir / "prometheus.yml").read_text())["datasources"]
    assert ds["type"] == "prometheus"
    assert ds["url"] == "http://prometheus:9090" and "prometheus" in SERVICES
    prov = yaml.safe_load(
        (mounts["/etc/grafana/provisioning/dashboards"] / "dspark.yml").read_text()
    )
    path = prov["providers"][0]["options"]["path"]
    assert path in mounts, f"dashboards provider reads {path}, which is not mounted"
    assert list(mounts[path].glob("*.json")), "no dashboard JSON in the mounted folder"
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (mounts[path] / Path(home).name).exists() and home.startswith(path)


@pytest.mark.parametrize("service", ["dspark-serve", "dspark-dashboard", "dspark-demo-run"])
def test_dspark_commands_exist_with_their_options(service: str) -> None:
    from typer.testing import CliRunner

    script = " ".join(SERVICES[service]["command"])
    call = re.search(r"exec dspark-obs (\S+)(.*)", script)
    assert call, script
    command, args = call.group(1), call.group(2)
    res = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for opt in re.findall(r"(--[a-z][a-z-]+)", args):
        assert opt in res.output, f"{service}: dspark-obs {command} has no {opt}"


def test_prometheus_loads_the_monitoring_mixin() -> None:
    """rule_files, read through the compose mounts, name exactly the mixin's rule files."""
    mounts = {dst: src for src, dst in _binds(SERVICES["prometheus"])}
    cfg = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    loaded = set()
    for pattern in cfg["rule_files"]:
        folder, _, glob = pattern.rpartition("/")
        assert folder in mounts, f"rule_files {pattern}: {folder} is not mounted"
        loaded |= set(mounts[folder].glob(glob))
    mixin = ROOT / "runtime" / "prometheus" / "rules"
    assert loaded == set(mixin.glob("*.yml")) and len(loaded) == 2
