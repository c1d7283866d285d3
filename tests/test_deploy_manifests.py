"""Deployment files, checked offline: Kubernetes manifests against the API schemas bundled in
the pinned kubernetes-validate wheel (strict: unknown fields fail), the compose files, the
Prometheus config, the Grafana dashboard and the image's version pins. No network, no engine.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from modalmesh.metrics import SCHEMA

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"  # the manifests; deploy/k8s and deploy/k8s/cpu build on it
SERVICES = {"audio-encoder": "audio_encoder", "vision-encoder": "vision_encoder", "llm": "llm", "vae": "vae"}
TINY = {"qwen2_vl", "qwen2_audio", "vae"}
# Native gRPC probes are GA from 1.27; the newest schema bundled in the pinned validator too.
K8S_VERSIONS = ["1.27.0", "1.37.0"]


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization(path: Path) -> dict:
    return yaml.safe_load((path / "kustomization.yaml").read_text())


def _base_resources() -> list[dict]:
    assert _kustomization(K8S)["resources"] == ["base"]
    kust = _kustomization(BASE)
    return [d for name in kust["resources"] for d in _docs(BASE / name)]


def _pointer(doc, path: str):
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]
    for part in parts[:-1]:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc, parts[-1]


def _json_patch(doc: dict, ops: list[dict]) -> dict:
    """The JSON-patch subset the overlays use (test, replace, remove, add), as kustomize applies it."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parent, key = _pointer(doc, op["path"])
        if isinstance(parent, list):
            key = len(parent) if key == "-" else int(key)
        if op["op"] == "test":
            assert parent[key] == op["value"], op
        elif op["op"] == "replace":
            assert (key < len(parent)) if isinstance(parent, list) else key in parent, op
            parent[key] = op["value"]
        elif op["op"] == "remove":
            del parent[key]
        elif op["op"] == "add":
            parent.insert(key, op["value"]) if isinstance(parent, list) else parent.__setitem__(key, op["value"])
        else:
            raise AssertionError(f"unsupported op {op}")
    return doc


def _cpu_resources() -> list[dict]:
    kust = _kustomization(K8S / "cpu")
    assert kust["resources"] == ["../base"]
    out = []
    for doc in _base_resources():
        for patch in kust["patches"]:
            t = patch["target"]
            if doc["kind"] == t["kind"] and doc["metadata"]["name"] == t["name"]:
                doc = _json_patch(doc, yaml.safe_load(patch["patch"]))
        out.append(doc)
    return out


def _by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", ["base", "cpu"])
def test_k8s_manifests_validate_against_the_api_schemas(version, overlay):
    docs = _base_resources() if overlay == "base" else _cpu_resources()
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_what_it_should():
    deploy = copy.deepcopy(_by_kind(_base_resources(), "Deployment")["llm"])
    deploy["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 50051}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, K8S_VERSIONS[0], strict=True)
    deploy = copy.deepcopy(_by_kind(_base_resources(), "Deployment")["llm"])
    deploy["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "50051"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, K8S_VERSIONS[0], strict=True)


def test_kustomization_lists_every_manifest():
    listed = set(_kustomization(BASE)["resources"])
    assert listed == {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert {p.name for p in K8S.glob("*.yaml")} == {"kustomization.yaml"}


def test_deployments_probe_grpc_health_and_are_scraped():
    docs = _base_resources()
    deployments, services = _by_kind(docs, "Deployment"), _by_kind(docs, "Service")
    assert set(deployments) == {*SERVICES, "gateway"}
    for name, module in SERVICES.items():
        pod = deployments[name]["spec"]["template"]
        spec = pod["spec"]
        assert deployments[name]["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        # Kubernetes would otherwise inject e.g. MODALMESH_PORT=tcp://... for a Service named modalmesh.
        assert spec["enableServiceLinks"] is False
        (c,) = spec["containers"]
        assert c["command"] == ["python", "-m", f"services.{module}"]
        env = _env(c)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"grpc": int(env["MODALMESH_PORT"]), "metrics": int(env["MODALMESH_METRICS_PORT"])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": ports["grpc"]}, (name, probe)
        ann = pod["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == ports["metrics"]
        assert ann["prometheus.io/path"] == "/metrics"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert env["MODALMESH_DEVICE"] == "cuda"
        assert spec["terminationGracePeriodSeconds"] > float(env["MODALMESH_GRACE_PERIOD"])
        # The model comes from the shared volume the Job fills; the init container waits for it.
        model = Path(env["MODALMESH_MODEL"])
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert model.parent == Path(mounts["models"]["mountPath"]) and model.name in TINY
        assert mounts["models"]["readOnly"] is True
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "modalmesh-models"
        (init,) = spec["initContainers"]
        assert _env(init)["MODALMESH_MODEL"] == env["MODALMESH_MODEL"]
        # A Service per deployment; headless for the encoder pools (one DNS record per ready pod).
        svc = services[name]["spec"]
        assert svc["selector"] == pod["metadata"]["labels"]
        assert {p["name"]: p["port"] for p in svc["ports"]} == ports
        # Headless for every gRPC service: round_robin clients see each pod (a ClusterIP pinned one).
        assert svc.get("clusterIP") == "None"


def test_llm_fans_out_to_the_headless_encoder_services():
    docs = _base_resources()
    env = _env(_by_kind(docs, "Deployment")["llm"]["spec"]["template"]["spec"]["containers"][0])
    services = _by_kind(docs, "Service")
    for flag, svc in (("MODALMESH_VISION_ENCODER", "vision-encoder"), ("MODALMESH_AUDIO_ENCODER", "audio-encoder")):
        port = next(p["port"] for p in services[svc]["spec"]["ports"] if p["name"] == "grpc")
        assert env[flag] == f"dns:///{svc}:{port}"
        assert services[svc]["spec"]["clusterIP"] == "None"


def test_gateway_fronts_the_llm_and_vae_over_http():
    docs = _base_resources()
    pod = _by_kind(docs, "Deployment")["gateway"]["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    env = _env(c)
    assert c["command"] == ["python", "-m", "services.gateway"]
    assert env["MODALMESH_LLM"] == "dns:///llm:50051" and env["MODALMESH_VAE"] == "dns:///vae:50051"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": int(env["MODALMESH_PORT"]), "metrics": int(env["MODALMESH_METRICS_PORT"])}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    svc = _by_kind(docs, "Service")["gateway"]["spec"]
    assert svc["selector"] == pod["metadata"]["labels"]


def test_models_job_makes_the_checkpoints_the_pods_load():
    docs = _base_resources()
    job = _by_kind(docs, "Job")["modalmesh-models"]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    script = " ".join(c["command"])
    made = set(re.search(r"--only ([\w,]+)", script).group(1).split(","))
    assert made == TINY
    assert job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "modalmesh-models"
    assert _by_kind(docs, "PersistentVolumeClaim")["modalmesh-models"]


def test_cpu_overlay_drops_gpus():
    for name, d in _by_kind(_cpu_resources(), "Deployment").items():
        if name == "gateway":
            continue
        c = d["spec"]["template"]["spec"]["containers"][0]
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {}), name
        assert _env(c)["MODALMESH_DEVICE"] == "cpu"
    assert _kustomization(K8S / "cpu")["images"][0]["newTag"] == "cpu"


# ---- compose -------------------------------------------------------------------------------

def _compose(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


def _extended(service: dict) -> dict:
    ext = service["extends"]
    return yaml.safe_load((ROOT / ext["file"]).read_text())["services"][ext["service"]]


def test_compose_services_health_gpus_and_cpu_override():
    base, cpu = _compose("docker-compose.yml"), _compose("docker-compose.cpu.yml")
    services = base["services"]
    assert {"models", "gateway", "prometheus", "grafana", *SERVICES.values()} == set(services)
    for module in SERVICES.values():
        s = services[module]
        assert s["command"] == ["python", "-m", f"services.{module}"]
        assert s["healthcheck"]["test"] == ["CMD", "modalmesh", "health", "--target", "127.0.0.1:50051"]
        assert s["depends_on"]["models"]["condition"] == "service_completed_successfully"
        assert s["environment"]["MODALMESH_PORT"] == "50051" and s["environment"]["MODALMESH_METRICS_PORT"] == "9400"
        model = s["environment"]["MODALMESH_MODEL"]
        assert re.fullmatch(r"\$\{MODALMESH_\w+_MODEL:-/models/(\w+)\}", model).group(1) in TINY
        gpu = _extended(s)
        (dev,) = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"] and gpu["environment"]["MODALMESH_DEVICE"] == "cuda"
        swapped = _extended(cpu["services"][module])
        assert "deploy" not in swapped and swapped["environment"]["MODALMESH_DEVICE"] == "cpu"
    llm = services["llm"]["environment"]
    assert llm["MODALMESH_VISION_ENCODER"] == "dns:///vision_encoder:50051"
    assert llm["MODALMESH_AUDIO_ENCODER"] == "dns:///audio_encoder:50051"
    assert services["models"]["command"][-1] == ",".join(sorted(TINY, key=["qwen2_vl", "qwen2_audio", "vae"].index))
    assert services["grafana"]["profiles"] == ["grafana"]
    gateway = services["gateway"]
    assert gateway["command"] == ["python", "-m", "services.gateway"] and "deploy" not in gateway
    assert gateway["environment"]["MODALMESH_LLM"] == "dns:///llm:50051"
    assert gateway["environment"]["MODALMESH_VAE"] == "dns:///vae:50051"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_docker_compose_resolves_the_cpu_override_without_gpu_reservations():
    def config(*files):
        out = subprocess.run(["docker-compose", *[a for f in files for a in ("-f", f)], "config"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/usr/local/bin:/bin"})
        assert out.returncode == 0, out.stderr
        return yaml.safe_load(out.stdout)["services"]

    gpu = config("docker-compose.yml")
    cpu = config("docker-compose.yml", "docker-compose.cpu.yml")
    for module in SERVICES.values():
        assert gpu[module]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        assert "deploy" not in cpu[module] and cpu[module]["environment"]["MODALMESH_DEVICE"] == "cpu"
        assert cpu[module]["image"] == "modalmesh:cpu"
    assert cpu["models"]["build"]["args"]["TORCH_SPEC"] == "torch==2.13.0+cpu"


def test_prometheus_discovers_every_replica_of_every_service():
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "modalmesh")
    (sd,) = job["dns_sd_configs"]
    assert set(sd["names"]) == {*SERVICES.values(), "gateway"} and sd["type"] == "A" and sd["port"] == 9400


DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "modalmesh.json"


def _dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in dash["panels"] for target in panel["targets"]]


def test_grafana_dashboard_queries_only_metrics_that_exist():
    names = {spec.name for spec in SCHEMA}
    dash = json.loads(DASHBOARD.read_text())
    used = set()
    for title, expr in _dashboard_exprs(dash):
        for metric in re.findall(r"\bmodalmesh_\w+", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", metric)
            assert base in names, (title, metric)
            used.add(base)
    assert {"modalmesh_requests_total", "modalmesh_kv_pool_usage_ratio", "modalmesh_attention_backend_info"} <= used


def test_grafana_dashboard_imports_into_any_grafana():
    """No datasource uid of ours: every panel and query goes through the `datasource` variable, which an
    import (its __inputs) or the provisioned default fills; service / instance / model narrow every query."""
    text = DASHBOARD.read_text()
    dash = json.loads(text)
    ds = yaml.safe_load((ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["uid"] not in text  # the compose stack's uid is not baked in
    (inp,) = dash["__inputs"]
    assert inp["type"] == "datasource" and inp["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"datasource", "service", "instance", "model"} <= set(variables)
    for name in ("service", "instance", "model"):
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"

    def datasources(node):
        if isinstance(node, dict):
            if "datasource" in node:
                yield node["datasource"]
            for value in node.values():
                yield from datasources(value)
        elif isinstance(node, list):
            for value in node:
                yield from datasources(value)

    for panel in dash["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
    assert all(d == {"type": "prometheus", "uid": "${datasource}"} for d in datasources(dash["panels"]))
    for title, expr in _dashboard_exprs(dash):
        assert 'instance=~"$instance"' in expr, (title, expr)
        if "model_name" in expr:
            assert 'model_name=~"$model"' in expr, (title, expr)
    # the provisioned stack still resolves the variable: its one Prometheus is the default
    assert ds["datasources"][0]["type"] == "prometheus" and ds["datasources"][0]["isDefault"] is True
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_grafana_dashboard_has_error_queue_preemption_panels_and_never_adds_the_two_ttfts():
    dash = json.loads(DASHBOARD.read_text())
    exprs = dict()
    for title, expr in _dashboard_exprs(dash):
        exprs.setdefault(title, []).append(expr)
    joined = {title: " ".join(e) for title, e in exprs.items()}
    error = [t for t, e in joined.items() if "modalmesh_http_requests_total" in e and 'status=~"5.."' in e
             and "code=~" in e]
    assert error, "no error ratio panel"
    assert any("modalmesh_request_queue_time_seconds" in e for e in joined.values())
    assert any("modalmesh_num_preemptions_total" in e for e in joined.values())
    for title, expr in _dashboard_exprs(dash):
        # the engine's and the gateway's TTFT are one query each, never summed into one series
        assert not ("modalmesh_gateway_time_to_first_token_seconds" in expr
                    and re.search(r"\bmodalmesh_time_to_first_token_seconds", expr)), (title, expr)
        if re.search(r"\bmodalmesh_time_to_first_token_seconds", expr):
            assert 'service="llm"' in expr, (title, expr)  # older gateways exported the same name
        if "modalmesh_requests_total" in expr:
            assert 'service!="gateway"' in expr, (title, expr)  # the gateway's HTTP statuses are in modalmesh_http_*
    ttft = [t for t, e in joined.items() if "modalmesh_gateway_time_to_first_token_seconds" in e]
    assert ttft and all("modalmesh_time_to_first_token_seconds" in joined[t] for t in ttft)  # side by side


# ---- image pins ------------------------------------------------------------------------------

def test_image_installs_only_pinned_versions():
    dockerfile = (ROOT / "Dockerfile").read_text()
    (pins,) = re.findall(r'ARG APT_PINS="([^"]+)"', dockerfile)
    packages = pins.replace("\\\n", " ").split()
    assert packages and all(re.fullmatch(r"[\w.+-]+=[\w.+~:-]+", p) for p in packages), packages
    assert "apt-get install -y --no-install-recommends ${APT_PINS}" in dockerfile
    prom = (ROOT / "deploy" / "prometheus" / "Dockerfile").read_text()
    assert re.search(r"install -y --no-install-recommends prometheus=\S+", prom)
    reqs = [line.strip() for line in (ROOT / "deploy" / "docker" / "requirements.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert reqs and all(re.fullmatch(r"[\w.-]+==[\w.+]+", r) for r in reqs), reqs
    assert re.search(r'ARG TORCH_SPEC=torch==[\d.]+\n', dockerfile) and '"pip==' in dockerfile
    # The image runs the same test-reference versions the project pins for its dev extras.
    pyproject = (ROOT / "pyproject.toml").read_text()
    for pin in re.findall(r'"((?:transformers|diffusers|tokenizers)==[\d.]+)"', pyproject):
        assert pin in reqs, pin
    # The stubs are committed: the image builds the wheel without generating anything.
    assert not any(r.startswith("grpcio-tools==") for r in reqs)


def test_install_requirements_are_ranges_and_the_image_lock_pins_each():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    exact = [d for d in deps if "==" in d]
    assert not exact, f"exact pins belong in deploy/docker/requirements.txt, not in install requirements: {exact}"
    locked = {line.split("==")[0].lower().replace("_", "-")
              for line in (ROOT / "deploy" / "docker" / "requirements.txt").read_text().splitlines()
              if "==" in line and not line.startswith("#")}
    names = {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower().replace("_", "-") for d in deps}
    assert names - {"torch"} <= locked, names - locked  # torch: the image's TORCH_SPEC build argument


def test_network_policies_let_each_service_be_called_only_by_its_caller():
    policies = _by_kind(_base_resources(), "NetworkPolicy")
    callers = {}
    for policy in policies.values():
        spec = policy["spec"]
        (selected,) = spec["podSelector"]["matchExpressions"]
        grpc_rules = [r for r in spec["ingress"] if any(p["port"] == "grpc" for p in r.get("ports", []))]
        (rule,) = grpc_rules
        (source,) = rule["from"]
        for component in selected["values"]:
            callers[component] = source["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        # Every other rule opens the metrics port only (the scraper), never gRPC.
        assert all(r.get("ports") == [{"port": "metrics"}] and "from" not in r
                   for r in spec["ingress"] if r is not rule)
    assert callers == {"vision-encoder": "llm", "audio-encoder": "llm", "llm": "gateway", "vae": "gateway"}


def test_the_models_job_never_removes_a_directory_it_did_not_make():
    job = _by_kind(_base_resources(), "Job")["modalmesh-models"]
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    removed = re.findall(r"rm -rf (\S+)", script)
    assert removed == ['"$scratch"'], removed  # only its own scratch directory
    assert 'if [ ! -e "/models/$name" ]' in script


def test_the_compose_models_job_writes_only_its_named_volume():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["models"]["volumes"] == ["models:/models"]
    for name in ("llm", "vae", "vision_encoder", "audio_encoder"):
        mounts = compose["services"][name].get("volumes") or compose["x-service"]["volumes"]
        assert all(m.endswith(":ro") for m in mounts if ":/models" in m)


def test_compose_publishes_only_the_gateway_and_grafana_unless_told():
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    published = {name for name, svc in base.items() if svc.get("ports")}
    assert published == {"gateway", "grafana"}
    extra = yaml.safe_load((ROOT / "docker-compose.publish.yml").read_text())["services"]
    assert {name for name, svc in extra.items() if svc.get("ports")} == {"llm", "vae", "prometheus"}


# ---- the KEDA overlay: kubernetes-validate has no schema for KEDA's CRD, so its shape is checked here ----
KEDA = K8S / "keda"
# ScaledObject spec fields, keda.sh/v1alpha1 (KEDA 2.x).
SCALED_OBJECT_FIELDS = {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
                        "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers"}


def _keda_resources() -> tuple[list[dict], list[dict]]:
    """(the base's resources, the overlay's own): the overlay is applied next to the base, into its namespace."""
    kust = _kustomization(KEDA)
    assert kust["namespace"] == _kustomization(BASE)["namespace"]
    assert ".." not in kust["resources"]  # kustomize refuses a base that contains its overlay (a cycle)
    return _base_resources(), [d for name in kust["resources"] for d in _docs(KEDA / name)]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
@pytest.mark.parametrize("layout", ["", "cpu"])
def test_the_documented_layouts_build_with_kustomize(layout):
    """`kubectl apply -k deploy/k8s` and `... deploy/k8s/cpu` as the README has them: the cpu overlay used
    to name `..` as its base, which contains it, and kustomize refused it ("cycle detected")."""
    out = subprocess.run(["kubectl", "kustomize", str(K8S / layout)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    built = [d for d in yaml.safe_load_all(out.stdout) if d]
    want = _base_resources() if layout == "" else _cpu_resources()
    assert sorted((d["kind"], d["metadata"]["name"]) for d in built) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in want)
    deployments = [d for d in built if d["kind"] == "Deployment"]
    gpus = [c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") for d in deployments
            for c in d["spec"]["template"]["spec"]["containers"]]
    assert any(gpus) if layout == "" else not any(gpus)
    assert all(d["metadata"].get("namespace") == "modalmesh" for d in built if d["kind"] != "Namespace")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
def test_keda_overlay_builds_with_kustomize():
    out = subprocess.run(["kubectl", "kustomize", str(KEDA)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (so,) = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert so["kind"] == "ScaledObject" and so["metadata"]["namespace"] == "modalmesh"


def test_keda_scaled_object_scales_the_vision_encoder_on_its_queue_depth():
    base, own = _keda_resources()
    (so,) = own
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["kind"] == "ScaledObject"
    assert set(so) == {"apiVersion", "kind", "metadata", "spec"} and so["metadata"]["name"]
    spec = so["spec"]
    assert set(spec) <= SCALED_OBJECT_FIELDS, set(spec) - SCALED_OBJECT_FIELDS
    ref = spec["scaleTargetRef"]
    target = _by_kind(base, "Deployment").get(ref["name"])
    assert ref == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vision-encoder"} and target is not None
    assert target["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "vision-encoder"
    for key in ("minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod"):
        assert isinstance(spec[key], int) and spec[key] >= 0, key
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert set(behavior) <= {"scaleUp", "scaleDown"}
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] in ("AverageValue", "Value", "Utilization")
    meta = trigger["metadata"]
    assert all(isinstance(v, str) for v in meta.values()), meta  # KEDA's trigger metadata is strings only
    assert {"serverAddress", "query", "threshold"} <= set(meta)
    assert re.fullmatch(r"https?://[\w.-]+(:\d+)?/?", meta["serverAddress"])
    assert float(meta["threshold"]) > 0
    # the query reads the vision encoder's queue, under the names the service exports
    metrics = re.findall(r"\bmodalmesh_\w+", meta["query"])
    assert metrics == ["modalmesh_queue_depth"] and all(m in {s.name for s in SCHEMA} for m in metrics)
    assert f'service="{SERVICES["vision-encoder"]}"' in meta["query"]
    # the pods it counts are the ones Prometheus scrapes
    assert target["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
