"""The four `python -m services.<name>` processes: start, SERVING, Info, metrics, SIGTERM -> 0."""

import json
import subprocess
import sys
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from modalmesh import pb
from modalmesh.metrics import SCHEMA
from modalmesh.ops.launcher import ServiceProcess
from modalmesh.testing import tiny

SERVICES = {
    "llm": (pb.llm_pb2_grpc.LLMServiceStub, pb.LLM_SERVICE),
    "vision_encoder": (pb.encoder_pb2_grpc.EncoderServiceStub, pb.ENCODER_SERVICE),
    "audio_encoder": (pb.encoder_pb2_grpc.EncoderServiceStub, pb.ENCODER_SERVICE),
    "vae": (pb.vae_pb2_grpc.VAEServiceStub, pb.VAE_SERVICE),
}
COMMON = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--device", "cpu", "--grace-period", "10"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The model each service serves here: one tiny Qwen2-VL checkpoint shared by the LLM and the vision
    encoder (as pods of one real checkpoint would), its own for the others; None = started without one."""
    root = tmp_path_factory.mktemp("ckpts")
    qwen2_vl = tiny.ensure("qwen2_vl", root)
    return {"llm": qwen2_vl, "vision_encoder": qwen2_vl, "audio_encoder": tiny.ensure("qwen2_audio", root),
            "vae": tiny.ensure("vae", root)}


def _model_flags(path):
    return [] if path is None else ["--model", str(path)]


@pytest.fixture(scope="module")
def running(checkpoints):
    procs = {name: ServiceProcess(name, [*COMMON, "--kv-cache-tokens", "1024", *_model_flags(checkpoints[name])]
                                  if name == "llm" else [*COMMON, *_model_flags(checkpoints[name])]).start()
             for name in SERVICES}
    try:
        for proc in procs.values():
            proc.wait_serving(timeout=120)
        yield procs
    finally:
        for proc in procs.values():
            proc.send_sigterm()
        for proc in procs.values():
            proc.terminate(timeout=30)


@pytest.mark.parametrize("name", list(SERVICES))
def test_service_answers_info_and_health(running, checkpoints, name):
    proc = running[name]
    stub_cls, full_name = SERVICES[name]
    with grpc.insecure_channel(proc.target) as channel:
        info = stub_cls(channel).Info(pb.InfoRequest(), timeout=10)
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=full_name), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert info.service == name
    assert info.ready
    assert info.device == "cpu"
    assert info.dtype == "float32"
    assert info.modality == {"vision_encoder": pb.IMAGE, "audio_encoder": pb.AUDIO}.get(name, pb.MODALITY_UNSPECIFIED)
    if checkpoints[name] is not None:
        assert info.model_id == checkpoints[name].name
        assert info.weights_fingerprint.startswith("sha256:")
    if name == "llm":
        assert info.hidden_size == 64 and info.vocab_size == tiny.VOCAB_SIZE and info.max_model_len == 512
        assert info.pools[0].name == "kv" and info.pools[0].capacity_tokens == 1024
        assert info.attention[0].component == "llm" and info.attention[0].backend


def test_pods_of_one_checkpoint_share_a_fingerprint(running, checkpoints):
    by_dir = {}
    for name, proc in running.items():
        if checkpoints[name] is None:
            continue
        with grpc.insecure_channel(proc.target) as channel:
            fingerprint = SERVICES[name][0](channel).Info(pb.InfoRequest(), timeout=10).weights_fingerprint
        by_dir.setdefault(checkpoints[name], set()).add(fingerprint)
    assert all(len(prints) == 1 for prints in by_dir.values())
    assert len({p for prints in by_dir.values() for p in prints}) == len(by_dir)  # different checkpoints differ


WITHOUT_MODEL_CALLS = {
    "llm": lambda ch: list(pb.llm_pb2_grpc.LLMServiceStub(ch).Generate(pb.GenerateRequest(text="hi"), timeout=10)),
    "vision_encoder": lambda ch: pb.encoder_pb2_grpc.EncoderServiceStub(ch).Encode(
        pb.EncodeRequest(items=[pb.EncodeItem(data=b"x")]), timeout=10),
    "audio_encoder": lambda ch: pb.encoder_pb2_grpc.EncoderServiceStub(ch).Encode(
        pb.EncodeRequest(items=[pb.EncodeItem(data=b"x")]), timeout=10),
    "vae": lambda ch: pb.vae_pb2_grpc.VAEServiceStub(ch).Decode(pb.DecodeRequest(), timeout=10),
}


def test_services_started_without_a_model_serve_health_and_refuse_work_clearly():
    procs = {name: ServiceProcess(name, COMMON).start() for name in SERVICES}
    try:
        for name, proc in procs.items():
            proc.wait_serving(timeout=120)
            with grpc.insecure_channel(proc.target) as channel:
                with pytest.raises(grpc.RpcError) as err:
                    WITHOUT_MODEL_CALLS[name](channel)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, name
            assert "--model" in err.value.details()
    finally:
        for proc in procs.values():
            proc.send_sigterm()
        assert {name: proc.terminate(timeout=30) for name, proc in procs.items()} == {n: 0 for n in SERVICES}


def test_llm_generates(running):
    with grpc.insecure_channel(running["llm"].target) as channel:
        replies = list(pb.llm_pb2_grpc.LLMServiceStub(channel).Generate(
            pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(temperature=0, max_tokens=3)), timeout=60))
    assert sum(len(r.token_ids) for r in replies) == 3 and replies[-1].finish_reason == pb.LENGTH


@pytest.mark.parametrize("name", list(SERVICES))
def test_metrics_endpoint_exposes_the_schema(running, checkpoints, name):
    proc = running[name]
    with grpc.insecure_channel(proc.target) as channel:  # one counted RPC
        SERVICES[name][0](channel).Info(pb.InfoRequest(), timeout=10)
    body = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    exposed = {s.name for f in families.values() for s in f.samples} | set(families)
    for spec in SCHEMA:
        family = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
        assert family in families, f"{spec.name} missing from {name}'s /metrics"
    assert "modalmesh_ready" in exposed

    def value(sample_name, **labels):
        for f in families.values():
            for s in f.samples:
                if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return None

    assert value("modalmesh_ready", service=name) == 1
    assert value("modalmesh_requests_total", service=name, rpc="Info", code="OK") >= 1
    model_id = checkpoints[name].name if checkpoints[name] is not None else ""
    assert value("modalmesh_service_info", service=name, model_id=model_id, device="cpu") == 1


def test_all_services_drain_and_exit_0_on_sigterm(running):
    # Runs after the tests above in this module (definition order): stops the shared processes.
    for proc in running.values():
        proc.send_sigterm()
    codes = {name: proc.terminate(timeout=30) for name, proc in running.items()}
    assert codes == {name: 0 for name in SERVICES}
    assert all("stopped" in proc.log_tail() for proc in running.values())


def _run_main(args, env=None, timeout=60):
    import os

    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("name", list(SERVICES))
def test_missing_model_directory_is_a_clear_error(name, tmp_path):
    result = _run_main([f"services.{name}", "--model", str(tmp_path / "nope"), "--port", "0", "--metrics-port", "-1"])
    assert result.returncode == 2
    assert f"--model {tmp_path / 'nope'}: no such directory" in result.stderr


def test_directory_without_config_is_a_clear_error(tmp_path):
    result = _run_main(["services.llm", "--model", str(tmp_path), "--port", "0", "--metrics-port", "-1"])
    assert result.returncode == 2
    assert "no config.json" in result.stderr


def test_flags_are_read_from_modalmesh_environment(tmp_path):
    env = {"MODALMESH_MODEL": str(tmp_path / "from-env"), "MODALMESH_PORT": "0", "MODALMESH_METRICS_PORT": "-1"}
    result = _run_main(["services.vae"], env=env)
    assert result.returncode == 2
    assert "from-env: no such directory" in result.stderr


def test_bad_environment_value_names_the_variable():
    result = _run_main(["services.vae"], env={"MODALMESH_PORT": "fifty"})
    assert result.returncode == 2
    assert "MODALMESH_PORT='fifty'" in result.stderr


def test_env_flag_starts_a_service_and_cli_probe_reports_serving():
    proc = ServiceProcess("vae", ["--host", "127.0.0.1", "--metrics-port", "-1"], env={"MODALMESH_PORT": "0"})
    with proc:
        proc.wait_serving(timeout=120)
        probe = _run_main(["modalmesh.ops.cli", "health", "--target", proc.target])
        assert probe.returncode == 0, probe.stderr
        assert "SERVING" in probe.stdout
        info = _run_main(["modalmesh.ops.cli", "info", "--kind", "vae", "--target", proc.target])
        assert json.loads(info.stdout)["service"] == "vae"
        assert proc.terminate(timeout=30) == 0
    probe = _run_main(["modalmesh.ops.cli", "health", "--target", proc.target, "--timeout", "2"])
    assert probe.returncode == 1


def test_unrunnable_attention_override_fails_start_up_with_alternatives():
    result = _run_main(["services.vision_encoder", "--attention-backend", "vision_encoder=fa3", "--device", "cpu",
                        "--port", "0", "--metrics-port", "-1"])
    assert result.returncode == 2
    assert "fa3 (for vision_encoder) cannot run on cpu" in result.stderr and "Usable here:" in result.stderr
    result = _run_main(["services.llm", "--attention-backend", "llm=warp_drive", "--port", "0", "--metrics-port", "-1"])
    assert result.returncode == 2 and "warp_drive" in result.stderr
