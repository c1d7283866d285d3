"""deploy/prometheus/alerts.yml: checked offline (every metric in the schema, loaded by prometheus.yml,
copied into the image), then by promtool itself (`check rules`, and `test rules` over alerts.test.yml)
inside the modalmesh-prometheus image, Debian's prometheus package, as the compose stack runs it.

The promtool tests need a Docker engine: `make test` starts one (scripts/test.sh); without one they
fail naming what is missing, as tests/test_compose.py does. A `promtool` on PATH is used when there
is no engine.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from modalmesh.metrics import SCHEMA_BY_NAME

ROOT = Path(__file__).resolve().parents[1]
PROM = ROOT / "deploy" / "prometheus"
IMAGE = "modalmesh-prometheus:latest"
BASE_IMAGE = "modalmesh-base:bookworm"
ALERTS = {"ModalmeshReplicaDown", "ModalmeshHighErrorRatio", "ModalmeshGatewayHighErrorRatio",
          "ModalmeshKVPoolSaturated", "ModalmeshTimeToFirstTokenHigh"}


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"] for rule in group["rules"]]


def test_rules_query_only_metrics_of_the_schema_and_their_own_records():
    rules = _rules()
    records = {r["record"] for r in rules if "record" in r}
    for rule in rules:
        for name in re.findall(r"\bmodalmesh[_:][\w:]+", rule["expr"]):
            if ":" in name:
                assert name in records, (rule, name)
            else:
                assert re.sub(r"_(bucket|sum|count)$", "", name) in SCHEMA_BY_NAME, (rule, name)
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    assert set(alerts) == ALERTS
    assert re.fullmatch(r"up\{job=\"modalmesh\"\} == 0", alerts["ModalmeshReplicaDown"]["expr"].strip())
    assert "modalmesh_kv_pool_usage_ratio" in alerts["ModalmeshKVPoolSaturated"]["expr"]
    assert all(a["labels"]["severity"] in ("warning", "critical") and a["annotations"]["summary"]
               for a in alerts.values())


def test_prometheus_loads_the_rules_and_the_image_carries_them():
    prom = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["alerts.yml"]  # next to prometheus.yml, in the image and in compose
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "modalmesh")
    assert job  # ModalmeshReplicaDown watches up{job="modalmesh"}
    assert re.search(r"^COPY prometheus\.yml alerts\.yml /etc/prometheus/$", (PROM / "Dockerfile").read_text(), re.M)
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    volumes = compose["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in volumes
    tests = yaml.safe_load((PROM / "alerts.test.yml").read_text())
    assert tests["rule_files"] == ["alerts.yml"]
    tested = {t["alertname"] for case in tests["tests"] for t in case.get("alert_rule_test", [])}
    assert tested == ALERTS  # every alert has a unit test


def _docker_reason() -> str | None:
    if shutil.which("docker") is None:
        return "docker is not on PATH"
    try:
        out = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                             timeout=30)
    except subprocess.TimeoutExpired:
        return "docker info timed out"
    if out.returncode != 0 or not out.stdout.strip():
        return f"no Docker engine answers: {(out.stderr or out.stdout).strip()[:300]}"
    return None


@pytest.fixture(scope="module")
def promtool():
    """A command prefix that runs promtool with deploy/prometheus as its working directory."""
    reason = _docker_reason()
    if reason is None:
        # The image as compose builds it (layers cached after the first build): its promtool is the
        # Prometheus version the stack runs.
        if subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True).returncode != 0:
            prep = subprocess.run([str(ROOT / "scripts" / "build-base-image.sh"), BASE_IMAGE], capture_output=True,
                                  text=True, timeout=900)
            assert prep.returncode == 0, prep.stdout[-2000:] + prep.stderr[-2000:]
        build = subprocess.run(["docker", "build", "-q", "-t", IMAGE, "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
                                str(PROM)], capture_output=True, text=True, timeout=900,
                               env={"DOCKER_BUILDKIT": "0", "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"})
        assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
        return ["docker", "run", "--rm", "--network", "none", "-v", f"{PROM}:/rules:ro", "-w", "/rules",
                "--entrypoint", "promtool", IMAGE]
    if shutil.which("promtool"):
        return ["promtool"]
    pytest.fail(f"no Docker ({reason}) and no promtool on PATH (`make test` starts an engine: scripts/test.sh)")


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=PROM, capture_output=True, text=True, timeout=300)


def test_promtool_checks_the_rules(promtool):
    out = _run([*promtool, "check", "rules", "alerts.yml"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_promtool_unit_tests_of_the_alerts_pass(promtool):
    out = _run([*promtool, "test", "rules", "alerts.test.yml"])
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_checks_the_config_with_its_rule_files(promtool):
    out = _run([*promtool, "check", "config", "prometheus.yml"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "alerts.yml" in out.stdout + out.stderr  # the rule file was found and checked
