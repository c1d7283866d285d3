"""`modalmesh up`: the four services as local processes, SERVING, then drained on Ctrl-C."""

import os
import re
import signal
import subprocess
import sys
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modalmesh import pb


def test_stack_up_serves_all_four_and_stops_cleanly_on_ctrl_c(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "modalmesh.stack", "up", "--base-port", "0", "--metrics-base-port", "0",
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
        assert set(endpoints) == {"audio_encoder", "vision_encoder", "llm", "vae"}, "".join(lines)
        assert "their outputs are meaningless" in "".join(lines)
        stubs = {"llm": pb.llm_pb2_grpc.LLMServiceStub, "vae": pb.vae_pb2_grpc.VAEServiceStub,
                 "vision_encoder": pb.encoder_pb2_grpc.EncoderServiceStub,
                 "audio_encoder": pb.encoder_pb2_grpc.EncoderServiceStub}
        models = {"llm": "qwen2_vl", "vision_encoder": "qwen2_vl", "audio_encoder": "qwen2_audio", "vae": "vae"}
        for name, target in endpoints.items():
            with grpc.insecure_channel(target) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                info = stubs[name](channel).Info(pb.InfoRequest(), timeout=10)
                assert info.ready and info.model_id == models[name]  # the default tiny checkpoints
        proc.send_signal(signal.SIGINT)
        rest = proc.stdout.read()
        assert proc.wait(timeout=60) == 0, rest
        assert "stopped: audio_encoder=0, vision_encoder=0, llm=0, vae=0" in rest
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
