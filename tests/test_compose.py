"""docker-compose.yml: valid structure, the services production needs, and every command it
runs exists in the package (checked by asking the CLI itself)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from replay_audit.cli import app

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"


def _services() -> dict[str, dict[str, object]]:
    doc = yaml.safe_load(COMPOSE.read_text())
    services: dict[str, dict[str, object]] = doc["services"]
    return services


def test_production_services_are_there() -> None:
    services = _services()
    for name in ("postgres", "redis", "migrate", "api", "cpu-worker", "gpu-worker-0", "scheduler"):
        assert name in services, name
    for name in ("postgres", "redis", "api"):
        assert "healthcheck" in services[name], name
    gpu = services["gpu-worker-0"]
    env = gpu["environment"]
    assert isinstance(env, dict) and env["CUDA_VISIBLE_DEVICES"] == "0"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]  # type: ignore[index]
    assert devices[0]["driver"] == "nvidia" and devices[0]["device_ids"] == ["0"]
    assert services["migrate"]["command"] == ["replay-audit", "db", "upgrade"]


@pytest.mark.parametrize("service", sorted(_services()))
def test_every_command_exists(service: str) -> None:
    command = _services()[service].get("command")
    if command is None or service in ("postgres", "redis"):
        return
    assert isinstance(command, list)
    if command[0] == "rq":
        assert shutil.which("rq") or (ROOT / ".venv" / "bin" / "rq").exists()
        return
    assert command[0] == "replay-audit", command
    words = [w for w in command[1:] if not w.startswith("-")][:2]
    # `replay-audit <group> <command> --help` (or `<command> --help`) must succeed.
    result = CliRunner().invoke(app, [*words, "--help"])
    if result.exit_code != 0:
        result = CliRunner().invoke(app, [words[0], "--help"])
    assert result.exit_code == 0, (command, result.output)
    # Every long option it passes is one the command knows.
    help_text = result.output
    for option in (w for w in command if w.startswith("--")):
        assert option in help_text, (command, option)


def test_docker_compose_config_accepts_it(tmp_path: Path) -> None:
    """Debian's docker-compose validates without an engine (scripts/test.sh installs it)."""
    (tmp_path / ".env").write_text((ROOT / ".env.example").read_text())
    (tmp_path / "docker-compose.yml").write_text(COMPOSE.read_text())
    proc = subprocess.run(
        ["docker-compose", "config", "-q"], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_prometheus_scrapes_the_api_and_workers_and_grafana_has_the_dashboard() -> None:
    services = _services()
    assert {"prometheus", "grafana"} <= set(services)
    mounts = [str(v) for s in ("prometheus", "grafana") for v in services[s]["volumes"]]  # type: ignore[attr-defined]
    for mount in mounts:
        source = mount.split(":")[0]
        assert not source.startswith("./") or (ROOT / source).exists(), mount
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {
        t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]
    }
    api_env = services["api"]["environment"]
    assert isinstance(api_env, dict)
    assert f"api:{api_env['REPLAY_AUDIT_API_METRICS_PORT']}" in targets
    workers = [n for n, s in services.items() if list(s.get("command", []))[1:2] == ["worker"]]  # type: ignore[call-overload]
    assert workers and {f"{w}:9101" for w in workers} <= targets


def test_every_dashboard_panel_reads_a_metric_the_service_exports() -> None:
    import json
    import re

    from replay_audit.telemetry import metric

    exported = {m._name for m in vars(metric).values() if hasattr(m, "_name")}
    exported |= set(
        re.findall(r'"(replay_audit_\w+)"', (ROOT / "replay_audit/api/metrics.py").read_text())
    )
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/replay-audit.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) > 15
    for expr in exprs:
        for name in re.findall(r"replay_audit_\w+", expr):
            base = re.sub(r"_(bucket|count|sum|total)$", "", name)
            assert name in exported or base in exported, (name, expr)
