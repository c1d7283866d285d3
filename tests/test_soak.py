"""A bounded chaos soak on the CPU with tiny checkpoints: mixed load through the gateway while faults happen.

Load: text, image and audio chats and latent decodes, from a few client threads, for SOAK_SECONDS.
Faults: one of two vision encoder replicas is killed (SIGKILL) and started again on its port; the LLM's
connections age out every few seconds (a short --max-connection-age). Then: no request that should
have succeeded failed, memory grew less than a stated bound, the KV pool is back to 0 used, and no
shared-memory object is left behind. The figures are printed (pytest -s shows them).
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import json
import os
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile as sf
import torch

from modalmesh import distributed, pb
from modalmesh.ops.launcher import ServiceProcess
from modalmesh.testing import tiny
from services.gateway.launch import GatewayProcess
from tests.test_gateway import COMMON, GATEWAY, png, post

SOAK_SECONDS = float(os.environ.get("MODALMESH_SOAK_SECONDS", "40"))
RSS_GROWTH_BOUND_MB = 400  # per process, from after warm-up to the end
CLIENTS = 3


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _shm_objects() -> set[str]:
    root = Path("/dev/shm")
    return {p.name for p in root.iterdir() if p.name.startswith("modalmesh-")} if root.is_dir() else set()


def _wav(seconds: float, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    sf.write(buf, (0.1 * rng.standard_normal(int(16000 * seconds))).astype(np.float32), 16000, format="WAV")
    return buf.getvalue()


def _vision(model_dir, port: int) -> ServiceProcess:
    """A vision encoder replica on a port of its own (a restarted replica comes back on it)."""
    return ServiceProcess("vision_encoder", ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
                                             "--device", "cpu", "--model", str(model_dir)]).start()


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_mixed_load_through_faults_fails_nothing_and_leaks_nothing(tmp_path_factory):
    root = tmp_path_factory.mktemp("soak")
    vl, aud, vae_dir = tiny.ensure("qwen2_vl", root), tiny.ensure("qwen2_audio", root), tiny.ensure("vae", root)
    shm_before = _shm_objects()
    ports = [distributed.free_port(), distributed.free_port()]
    vision = [_vision(vl, p) for p in ports]
    audio_enc = ServiceProcess("audio_encoder", [*COMMON, "--model", str(aud)]).start()
    vae = ServiceProcess("vae", [*COMMON, "--model", str(vae_dir)]).start()
    procs = [*vision, audio_enc, vae]
    try:
        for p in procs:
            p.wait_serving(timeout=180)
        aged = ["--max-connection-age", "3"]  # callers reconnect every few seconds; calls in flight finish
        llm = ServiceProcess("llm", [*COMMON, "--model", str(vl), "--kv-cache-tokens", "8192", *aged,
                                     "--vision-encoder", "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)]).start()
        audio_llm = ServiceProcess("llm", [*COMMON, "--model", str(aud), "--kv-cache-tokens", "8192", *aged,
                                           "--audio-encoder", f"ipv4:{audio_enc.target}"]).start()
        procs += [llm, audio_llm]
        for p in (llm, audio_llm):
            p.wait_serving(timeout=180)
        gw = GatewayProcess([*GATEWAY, "--llm", llm.target, "--vae", vae.target]).start()
        audio_gw = GatewayProcess([*GATEWAY, "--llm", audio_llm.target]).start()
        procs += [gw, audio_gw]
        for g in (gw, audio_gw):
            g.wait_serving(timeout=180)

        latents = base64.b64encode(torch.randn(1, 4, 8, 8).numpy().astype("<f4").tobytes()).decode()
        counter = iter(range(10**9))
        lock = threading.Lock()

        def one(kind: str) -> tuple[str, int, str]:
            with lock:
                n = next(counter)
            if kind == "text":
                body = {"max_tokens": 4, "messages": [{"role": "user", "content": f"count {n}"}]}
                status, _, answer = post(gw, "/v1/chat/completions", body)
            elif kind == "image":
                url = _data_url(png(56, 56 + 28 * (n % 3), n), "image/png")  # new content: the encoder works
                body = {"max_tokens": 2, "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": url}}]}]}
                status, _, answer = post(gw, "/v1/chat/completions", body)
            elif kind == "audio":
                clip = base64.b64encode(_wav(0.5, n)).decode()
                body = {"max_tokens": 2, "messages": [{"role": "user", "content": [
                    {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}},
                    {"type": "text", "text": "heard?"}]}]}
                status, _, answer = post(audio_gw, "/v1/chat/completions", body)
            else:
                status, _, answer = post(gw, "/v1/images/decode", {"latents": latents, "shape": [1, 4, 8, 8]})
            return kind, status, "" if status == 200 else json.dumps(answer)[:300]

        kinds = ("text", "image", "audio", "decode")
        for kind in kinds:  # warm-up, then the memory baseline
            got = one(kind)
            assert got[1] == 200, got
        # Each process of the LLM (its gRPC edge, its engine process) and of the others.
        watched = {f"{name}:{pid}": pid for name, p in (("llm", llm), ("gateway", gw), ("vision_encoder_1", vision[1]))
                   for pid in p.pids()}
        baseline = {name: _rss_mb(pid) for name, pid in watched.items()}
        results: list[tuple[str, int, str]] = []
        faults: list[str] = []
        deadline = time.monotonic() + SOAK_SECONDS

        def client(i: int) -> None:
            j = i
            while time.monotonic() < deadline:
                results.append(one(kinds[j % len(kinds)]))
                j += 1

        with cf.ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(client, i) for i in range(CLIENTS)]
            time.sleep(SOAK_SECONDS * 0.3)
            vision[0].kill()  # SIGKILL mid-load
            faults.append("vision encoder replica 0 killed")
            time.sleep(SOAK_SECONDS * 0.2)
            vision[0] = _vision(vl, ports[0])
            procs.append(vision[0])
            vision[0].wait_serving(timeout=120)
            faults.append("vision encoder replica 0 restarted")
            for f in futures:
                f.result()
        peak = {name: _rss_mb(pid) for name, pid in watched.items()}
        failed = [r for r in results if r[1] != 200]
        by_kind = {k: sum(1 for r in results if r[0] == k) for k in kinds}
        with grpc.insecure_channel(llm.target) as channel:
            used = pb.llm_pb2_grpc.LLMServiceStub(channel).Info(pb.InfoRequest(), timeout=10).pools[0].used_tokens
        print(f"\nsoak {SOAK_SECONDS:.0f} s: {len(results)} requests {by_kind}, {len(failed)} failed, faults "
              f"{faults} + connection ageing every 3 s; RSS MB after warm-up -> end: "
              + ", ".join(f"{n} {baseline[n]:.0f} -> {peak[n]:.0f}" for n in watched))
        assert not failed, failed[:5]
        assert all(by_kind[k] > 0 for k in kinds)
        assert used == 0
        for name in watched:
            assert peak[name] - baseline[name] < RSS_GROWTH_BOUND_MB, (name, baseline[name], peak[name])
    finally:
        for p in reversed(procs):
            p.send_sigterm()
        for p in reversed(procs):
            p.terminate(timeout=60)
    leftover = _shm_objects() - shm_before
    assert not leftover, leftover


pytestmark = pytest.mark.timeout(600)
