"""`modalmesh up`: the four services and the gateway as local processes, SERVING, then drained on Ctrl-C."""

import base64
import io
import os
import re
import signal
import subprocess
import sys
import threading

import grpc
import numpy as np
import openai
import pytest
import soundfile as sf
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modalmesh import pb


def test_stack_up_serves_all_four_and_stops_cleanly_on_ctrl_c(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "modalmesh.ops.stack", "up", "--base-port", "0", "--metrics-base-port", "0",
         "--device", "cpu", "--models-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    timer = threading.Timer(180, proc.kill)  # bound the test even if the stack hangs
    timer.start()
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "all services SERVING" in line:
                break
        endpoints = dict(re.findall(r"^(\w+)\s+(127\.0\.0\.1:\d+)\s+http://", "".join(lines), re.M))
        assert set(endpoints) == {"audio_encoder", "vision_encoder", "llm", "vae", "audio_llm"}, "".join(lines)
        assert "their outputs are meaningless" in "".join(lines)
        stubs = {"llm": pb.llm_pb2_grpc.LLMServiceStub, "vae": pb.vae_pb2_grpc.VAEServiceStub,
                 "vision_encoder": pb.encoder_pb2_grpc.EncoderServiceStub,
                 "audio_encoder": pb.encoder_pb2_grpc.EncoderServiceStub, "audio_llm": pb.llm_pb2_grpc.LLMServiceStub}
        models = {"llm": "qwen2_vl", "vision_encoder": "qwen2_vl", "audio_encoder": "qwen2_audio", "vae": "vae",
                  "audio_llm": "qwen2_audio"}
        for name, target in endpoints.items():
            with grpc.insecure_channel(target) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                info = stubs[name](channel).Info(pb.InfoRequest(), timeout=10)
                assert info.ready and info.model_id == models[name]  # the default tiny checkpoints
        # The gateway in front of the LLM: its base URL printed, the LLM's model served through it.
        base_url = re.search(r"^OpenAI API: (http://127\.0\.0\.1:\d+/v1)", "".join(lines), re.M)[1]
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["qwen2_vl", "qwen2_audio"]
        r = client.completions.create(model="qwen2_vl", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        # Audio: the model id picks the audio LLM, which sends the clip to the audio encoder.
        t = np.arange(16000) / 16000
        buf = io.BytesIO()
        sf.write(buf, (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), 16000, format="WAV", subtype="FLOAT")
        clip = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(),
                                                       "format": "wav"}}
        heard = client.chat.completions.create(model="qwen2_audio", max_tokens=2, messages=[
            {"role": "user", "content": [clip, {"type": "text", "text": "What is it?"}]}])
        plain = client.chat.completions.create(model="qwen2_audio", max_tokens=2, messages=[
            {"role": "user", "content": "What is it?"}])
        assert heard.usage.prompt_tokens > plain.usage.prompt_tokens + 10  # the clip's rows are in the prompt
        with pytest.raises(openai.BadRequestError):  # the image LLM takes no audio
            client.chat.completions.create(model="qwen2_vl", max_tokens=2, messages=[
                {"role": "user", "content": [clip, {"type": "text", "text": "What is it?"}]}])
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model="nope", prompt="x", max_tokens=1)
        assert "`qwen2_vl`, `qwen2_audio`" in err.value.message
        proc.send_signal(signal.SIGINT)
        rest = proc.stdout.read()
        assert proc.wait(timeout=60) == 0, rest
        assert "stopped: llm=0, vision_encoder=0, audio_encoder=0, vae=0, audio_llm=0, gateway=0" in rest
        for target in endpoints.values():  # nothing left listening
            with grpc.insecure_channel(target) as channel:
                try:
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                    raise AssertionError(f"{target} still answers after the stack stopped")
                except grpc.RpcError as exc:
                    assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_demo_runs_three_requests_and_stops(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "modalmesh.ops.cli", "demo", "--base-port", "0", "--metrics-base-port", "0",
         "--device", "cpu", "--models-dir", str(tmp_path / "models"), "--out-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    out = result.stdout
    assert "1. image + text" in out and "2. audio + text" in out and "16 completion tokens" in out
    assert (tmp_path / "out" / "demo.png").read_bytes().startswith(b"\x89PNG")
    assert "1 images encoded" in out
    assert "stopped: llm=0, vision_encoder=0, audio_encoder=0, vae=0" in out


def test_cli_generate_and_decode_against_a_running_stack(tmp_path):
    import torch
    from safetensors.torch import save_file

    proc = subprocess.Popen(
        [sys.executable, "-m", "modalmesh.ops.stack", "up", "--base-port", "0", "--metrics-base-port", "0",
         "--device", "cpu", "--models-dir", str(tmp_path / "models"), "--services", "vision_encoder,llm,vae"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    timer = threading.Timer(240, proc.kill)
    timer.start()
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "all services SERVING" in line:
                break
        endpoints = dict(re.findall(r"^(\w+)\s+(127\.0\.0\.1:\d+)\s+http://", "".join(lines), re.M))
        from PIL import Image

        Image.new("RGB", (64, 48), (200, 30, 90)).save(tmp_path / "a.png")
        gen = subprocess.run([sys.executable, "-m", "modalmesh.ops.cli", "generate", "What colour?", "--image",
                              str(tmp_path / "a.png"), "--max-tokens", "5", "--target", endpoints["llm"]],
                             capture_output=True, text=True, timeout=120)
        assert gen.returncode == 0, gen.stderr
        assert "[length:" in gen.stderr and "5 completion tokens" in gen.stderr
        save_file({"latents": torch.zeros(1, 4, 8, 8)}, str(tmp_path / "z.safetensors"))
        dec = subprocess.run([sys.executable, "-m", "modalmesh.ops.cli", "decode", str(tmp_path / "z.safetensors"),
                              "-o", str(tmp_path / "z.png"), "--target", endpoints["vae"]],
                             capture_output=True, text=True, timeout=120)
        assert dec.returncode == 0, dec.stderr
        assert Image.open(tmp_path / "z.png").size == (16, 16)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
