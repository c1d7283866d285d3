"""The compose stack for real: build the image, `docker-compose up` with the CPU override and
the tiny default checkpoints, wait for health, send requests from the host (gRPC with the
project's client and CLI, the OpenAI gateway over HTTP), scale the vision encoder to two
replicas and see both serve, read the real Prometheus, `down -v`.

Needs a Docker engine and docker-compose (v1.29 or newer): `make test` starts one
(scripts/test.sh). Without them these tests fail, naming what is missing.
Build and start-up times are printed and written to .cache/compose-timings.json.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from modalmesh import pb

ROOT = Path(__file__).resolve().parents[1]
FILES = ["-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml", "-f", "docker-compose.publish.yml"]
SERVICES = ("audio_encoder", "vision_encoder", "llm", "vae")
MODELS = {"llm": "qwen2_vl", "vision_encoder": "qwen2_vl", "audio_encoder": "qwen2_audio", "vae": "vae"}
HEALTH_DEADLINE_S = 600
TIMINGS = ROOT / ".cache" / "compose-timings.json"

pytestmark = pytest.mark.timeout(1800)

# A CPU image built offline: local debootstrap base, wheels from deploy/docker/wheels, and
# every published port on an ephemeral loopback port (no clash with anything on the host).
COMPOSE_ENV = {
    "DOCKER_BUILDKIT": "0",
    "COMPOSE_DOCKER_CLI_BUILD": "0",
    "MODALMESH_IMAGE": "modalmesh:cpu",
    "MODALMESH_PROMETHEUS_IMAGE": "modalmesh-prometheus:latest",
    "MODALMESH_BASE_IMAGE": "modalmesh-base:bookworm",
    "MODALMESH_TORCH_SPEC": "torch==2.13.0+cpu",
    "MODALMESH_TORCH_INDEX_URL": "",
    "MODALMESH_PIP_EXTRA_ARGS": "--no-index",
    "MODALMESH_LLM_PUBLISH": "127.0.0.1:",
    "MODALMESH_VAE_PUBLISH": "127.0.0.1:",
    "MODALMESH_PROMETHEUS_PUBLISH": "127.0.0.1:",
    "MODALMESH_GRAFANA_PUBLISH": "127.0.0.1:",
    "MODALMESH_GATEWAY_PUBLISH": "127.0.0.1:",
}


def _no_docker() -> str | None:
    for tool in ("docker", "docker-compose"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH"
    try:
        out = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                             text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "docker info timed out"
    if out.returncode != 0 or not out.stdout.strip():
        return f"no Docker engine answers: {(out.stderr or out.stdout).strip()[:300]}"
    return None


class Stack:
    """One compose project: commands, containers, addresses, timings."""

    def __init__(self, project: str):
        self.project = project
        self.env = {**os.environ, **COMPOSE_ENV}
        self.timings: dict[str, float] = {}

    def compose(self, *args: str, timeout: float = 600, check: bool = True, input: str | None = None):
        cmd = ["docker-compose", "-p", self.project, *FILES, *args]
        out = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout,
                             input=input)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} -> {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out

    def containers(self, service: str | None = None) -> list[dict]:
        """`docker inspect` of the project's containers (of one service): the Go CLI, cheap to poll."""
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        ids = subprocess.run(["docker", "ps", "-aq", *filters], capture_output=True, text=True,
                             check=True).stdout.split()
        if not ids:
            return []
        out = subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    def ips(self, service: str) -> list[str]:
        ips = []
        for c in self.containers(service):
            if c["State"]["Status"] == "running":
                ips += [n["IPAddress"] for n in c["NetworkSettings"]["Networks"].values() if n.get("IPAddress")]
        return sorted(ips)

    def published(self, service: str, port: int) -> str:
        addr = self.compose("port", service, str(port)).stdout.strip()
        assert addr, f"{service}:{port} is not published"
        return addr.replace("0.0.0.0", "127.0.0.1")

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", check=False).stdout[-12000:]

    def wait_healthy(self, services: dict[str, int], deadline_s: float = HEALTH_DEADLINE_S) -> float:
        """Bounded polling of the containers' healthchecks (`modalmesh health`)."""
        start = time.monotonic()
        while True:
            states: dict[str, list[str]] = {s: [] for s in services}
            for c in self.containers():
                service, state = c["Config"]["Labels"].get("com.docker.compose.service"), c["State"]
                if service not in services:
                    continue
                if state["Status"] in {"exited", "dead"} or state.get("Restarting"):
                    raise AssertionError(f"{service} exited ({state.get('ExitCode')})\n{self.logs()}")
                states[service].append((state.get("Health") or {}).get("Status", state["Status"]))
            if all(len(states[s]) == n and all(h == "healthy" for h in states[s]) for s, n in services.items()):
                return time.monotonic() - start
            if time.monotonic() - start > deadline_s:
                raise AssertionError(f"not healthy after {deadline_s}s: {states}\n{self.logs()}")
            time.sleep(2.0)


@pytest.fixture(scope="module")
def stack(request):
    reason = _no_docker()
    if reason:
        pytest.fail(f"no Docker: {reason} (`make test` starts an engine: scripts/test.sh)")
    s = Stack(f"mmtest{os.getpid()}")
    t0 = time.monotonic()
    prep = subprocess.run([str(ROOT / "scripts" / "docker-prepare.sh")], cwd=ROOT, env={**s.env, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=900)
    assert prep.returncode == 0, prep.stdout[-3000:] + prep.stderr[-3000:]
    s.timings["prepare_s"] = time.monotonic() - t0  # base image (debootstrap when missing), wheels, CA certs
    t0 = time.monotonic()
    s.compose("build", timeout=1200)
    s.timings["build_s"] = time.monotonic() - t0
    try:
        t0 = time.monotonic()
        s.compose("up", "-d", timeout=600)
        s.wait_healthy({**{n: 1 for n in SERVICES}, "gateway": 1, "prometheus": 1})
        # From `up` (which runs the models job first) to every healthcheck passing.
        s.timings["up_to_healthy_s"] = time.monotonic() - t0
        yield s
    finally:
        down = s.compose("down", "-v", "--remove-orphans", "-t", "45", timeout=300, check=False)
        left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={s.project}"],
                              capture_output=True, text=True).stdout.split()
        TIMINGS.parent.mkdir(exist_ok=True)
        TIMINGS.write_text(json.dumps({k: round(v, 1) for k, v in s.timings.items()}, indent=1))
        reporter = request.config.pluginmanager.getplugin("terminalreporter")
        capture = request.config.pluginmanager.getplugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line("\ncompose timings (s): " + ", ".join(f"{k}={v:.1f}" for k, v in s.timings.items()))
        assert down.returncode == 0 and not left, f"down -v failed: {down.stderr[-2000:]} left={left}"


def _png(seed: int, size: int = 56) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _metric(ip: str, name: str, **labels) -> float:
    body = urllib.request.urlopen(f"http://{ip}:9400/metrics", timeout=10).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def _encode_counts(stack: Stack) -> dict[str, float]:
    return {ip: _metric(ip, "modalmesh_requests_total", rpc="Encode", code="OK") for ip in stack.ips("vision_encoder")}


def _generate(target: str, **request) -> tuple[list[int], str, pb.GenerateResponse]:
    with grpc.insecure_channel(target) as channel:
        stub = pb.llm_pb2_grpc.LLMServiceStub(channel)
        ids, text, last = [], "", None
        for delta in stub.Generate(pb.GenerateRequest(**request), timeout=120):
            ids += list(delta.token_ids)
            text += delta.text
            last = delta
    return ids, text, last


def _greedy(n: int) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_stack_serves_requests_from_the_host(stack):
    llm = stack.published("llm", 50051)
    vae = stack.published("vae", 50051)
    # The same probe the containers' healthcheck runs, from the host.
    probe = subprocess.run([sys.executable, "-m", "modalmesh.ops.cli", "health", "--target", llm],
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0 and "SERVING" in probe.stdout, probe.stderr
    targets = {"llm": llm, "vae": vae, "vision_encoder": f"{stack.ips('vision_encoder')[0]}:50051",
               "audio_encoder": f"{stack.ips('audio_encoder')[0]}:50051"}
    stubs = {"llm": pb.llm_pb2_grpc.LLMServiceStub, "vae": pb.vae_pb2_grpc.VAEServiceStub,
             "vision_encoder": pb.encoder_pb2_grpc.EncoderServiceStub,
             "audio_encoder": pb.encoder_pb2_grpc.EncoderServiceStub}
    for name, target in targets.items():
        with grpc.insecure_channel(target) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            info = stubs[name](channel).Info(pb.InfoRequest(), timeout=10)
        assert info.ready and info.model_id == MODELS[name] and info.device == "cpu", (name, info)

    # Encode an image on the vision encoder, then hand its embedding to the LLM.
    with grpc.insecure_channel(targets["vision_encoder"]) as channel:
        enc = pb.encoder_pb2_grpc.EncoderServiceStub(channel).Encode(
            pb.EncodeRequest(items=[pb.EncodeItem(data=_png(0))]), timeout=60)
    emb = enc.embeddings[0]
    assert emb.num_placeholder_tokens > 0 and list(emb.grid_thw)[0] == 1 and enc.model_id == "qwen2_vl"

    ids, text, last = _generate(llm, text="Describe the picture.", sampling=_greedy(8))
    assert len(ids) == 8 and last.finish_reason == pb.LENGTH and last.usage.completion_tokens == 8
    image = pb.MultimodalItem(modality=pb.IMAGE, embedding=emb)
    ids2, _, last2 = _generate(llm, text="Look: <|vision_start|><|image_pad|><|vision_end|> what is it?",
                               items=[image], sampling=_greedy(6))
    assert len(ids2) == 6 and last2.usage.prompt_tokens > emb.num_placeholder_tokens


# The project's own client (round_robin over dns:///, retries) inside the compose network.
_RR_CLIENT = """
import io, json, numpy as np
from PIL import Image
from modalmesh import pb
from modalmesh.rpc.channel import sync_channel
rng = np.random.default_rng(1)
with sync_channel("dns:///vision_encoder:50051") as ch:
    stub = pb.encoder_pb2_grpc.EncoderServiceStub(ch)
    rows = []
    for i in range(8):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(buf, "PNG")
        r = stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(data=buf.getvalue())]), timeout=60,
                        wait_for_ready=True)
        rows.append(r.embeddings[0].num_placeholder_tokens)
print(json.dumps(rows))
"""


def test_scaled_vision_encoder_spreads_encode_load(stack):
    t0 = time.monotonic()
    stack.compose("up", "-d", "--no-recreate", "--scale", "vision_encoder=2", timeout=600)
    stack.wait_healthy({"vision_encoder": 2})
    stack.timings["scale_to_2_healthy_s"] = time.monotonic() - t0
    ips = stack.ips("vision_encoder")
    assert len(ips) == 2
    before = _encode_counts(stack)
    out = stack.compose("exec", "-T", "llm", "python", "-", input=_RR_CLIENT, timeout=300)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [4] * 8  # 56x56: 4x4 patches, 2x2 merged
    after = _encode_counts(stack)
    served = {ip: after[ip] - before.get(ip, 0.0) for ip in ips}
    assert sum(served.values()) == 8 and all(n >= 1 for n in served.values()), served


def test_llm_fans_out_over_the_scaled_pool(stack):
    # The LLM's first raw image comes now, after the scale-up: its channel resolves
    # dns:///vision_encoder lazily and sees both replicas. (A channel that resolved before a
    # scale-up finds new replicas within the servers' max connection age, 5 min.)
    ips = stack.ips("vision_encoder")
    assert len(ips) == 2
    llm = stack.published("llm", 50051)
    before = _encode_counts(stack)
    llm_ip = stack.ips("llm")[0]
    received = {path: _metric(llm_ip, "modalmesh_transfer_bytes_total", direction="received", path=path)
                for path in ("grpc", "shared_memory")}
    for seed in range(4):
        items = [pb.MultimodalItem(modality=pb.IMAGE, input=pb.EncodeItem(data=_png(100 + 2 * seed + k)))
                 for k in range(2)]
        ids, _, last = _generate(llm, text="<|vision_start|><|image_pad|><|vision_end|> and "
                                           "<|vision_start|><|image_pad|><|vision_end|>?",
                                 items=items, sampling=_greedy(4))
        assert len(ids) == 4 and last.finish_reason == pb.LENGTH
    after = _encode_counts(stack)
    served = {ip: after[ip] - before.get(ip, 0.0) for ip in ips}
    assert sum(served.values()) == 8 and all(n >= 1 for n in served.values()), served
    # ipc: host shares /dev/shm between the containers: every embedding came through shared memory.
    assert _metric(llm_ip, "modalmesh_transfer_bytes_total", direction="received", path="shared_memory") > \
        received["shared_memory"]
    assert _metric(llm_ip, "modalmesh_transfer_bytes_total", direction="received", path="grpc") == received["grpc"]


def test_cli_and_gateway_from_the_host(stack, tmp_path):
    """The user's path: `modalmesh generate --image` (the LLM fans the image out to its encoder
    pool), `modalmesh decode` on the VAE, and an OpenAI chat completion through the gateway."""
    llm, vae = stack.published("llm", 50051), stack.published("vae", 50051)
    (tmp_path / "a.png").write_bytes(_png(7))
    out = subprocess.run([sys.executable, "-m", "modalmesh.ops.cli", "generate", "What is in the picture?",
                          "--image", str(tmp_path / "a.png"), "--max-tokens", "8", "--temperature", "0",
                          "--target", llm], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"\[(length|stop): \d+ prompt \+ \d+ completion tokens\]", out.stderr), out.stderr

    np.save(tmp_path / "latents.npy", np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32))
    out = subprocess.run([sys.executable, "-m", "modalmesh.ops.cli", "decode", str(tmp_path / "latents.npy"),
                          "-o", str(tmp_path / "out.png"), "--target", vae], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    with Image.open(tmp_path / "out.png") as img:
        assert img.mode == "RGB" and img.width >= 8

    gateway = stack.published("gateway", 8000)
    image = "data:image/png;base64," + base64.b64encode(_png(8)).decode()
    body = {"model": "qwen2_vl", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": "Describe the image."}]}]}
    req = urllib.request.Request(f"http://{gateway}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    reply = json.loads(urllib.request.urlopen(req, timeout=120).read())
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] == 6, reply
    assert isinstance(reply["choices"][0]["message"]["content"], str)


def _query(prom: str, expr: str) -> list[dict]:
    url = f"http://{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_scrapes_every_replica(stack):
    prom = stack.published("prometheus", 9090)
    instances = {f"{ip}:9400" for s in (*SERVICES, "gateway") for ip in stack.ips(s)}
    deadline = time.monotonic() + 120  # dns_sd refresh and scrape interval are 5 s
    while True:
        up = {r["metric"]["instance"] for r in _query(prom, 'up{job="modalmesh"} == 1')}
        if instances <= up:
            break
        assert time.monotonic() < deadline, f"Prometheus scrapes {sorted(up)}, want {sorted(instances)}"
        time.sleep(1.0)
    pools = _query(prom, "modalmesh_kv_pool_capacity_tokens")
    got = {(r["metric"]["service"], r["metric"]["pool"], r["metric"]["instance"]) for r in pools
           if float(r["value"][1]) > 0}
    want = {("llm", "kv", f"{ip}:9400") for ip in stack.ips("llm")}
    want |= {(s, "embedding_cache", f"{ip}:9400") for s in ("vision_encoder", "audio_encoder") for ip in stack.ips(s)}
    assert want <= got, sorted(got)
    backends = _query(prom, "modalmesh_attention_backend_info")
    by_instance = {r["metric"]["instance"]: r["metric"] for r in backends}
    for s in SERVICES:
        for ip in stack.ips(s):
            m = by_instance.get(f"{ip}:9400")
            assert m and m["service"] == s and m["backend"] and m["reason"], (s, ip, m)
    # Both vision replicas' Encode counters, as Prometheus sees them. A counter series exists from a
    # replica's first Encode on, and Prometheus has it from its next scrape (5 s): wait, bounded.
    replicas = {f"{ip}:9400" for ip in stack.ips("vision_encoder")}
    deadline = time.monotonic() + 60
    while True:
        enc = _query(prom, 'modalmesh_requests_total{service="vision_encoder",rpc="Encode"}')
        seen = {r["metric"]["instance"] for r in enc}
        if seen == replicas or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert seen == replicas
