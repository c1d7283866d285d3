"""Property-based fuzzing (hypothesis) of the wire codec and of the services' request validation.

Random messages and random valid-but-extreme values: every answer is a result or a client error
(INVALID_ARGUMENT / RESOURCE_EXHAUSTED / FAILED_PRECONDITION over gRPC, 4xx over HTTP), never an
internal error; the service keeps serving, and its peak RSS stays under a stated bound.
Bounded: a fixed number of examples per property, no deadline games.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modalmesh import pb
from modalmesh.errors import InvalidArgument
from modalmesh.rpc.codec import from_proto
from modalmesh.testing import tiny
from services.llm.sampling import RequestLimits, SamplingParams
from tests.test_llm_service import LLM

EXAMPLES = 150
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.FAILED_PRECONDITION}
RSS_BOUND_MB = 2048  # the tiny LLM serves in well under 1 GB; a leak or an amplification shows past this

INT32 = st.integers(-(2**31), 2**31 - 1)
EXTREME_INT = st.one_of(INT32, st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, -1, 1, 2**31 - 1, 2**62]))
FLOAT = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                  st.sampled_from([0.0, -0.0, 1e-30, 1e30, -1.0, 2.0]))
TEXT = st.text(max_size=40)


# ---- the codec ----------------------------------------------------------------------------------------
@settings(max_examples=400, deadline=None)
@given(dtype=st.integers(-2, 20), shape=st.lists(st.one_of(st.integers(-3, 9), st.sampled_from([2**40, 2**62])),
                                                  max_size=6),
       data=st.binary(max_size=256))
def test_the_codec_returns_a_tensor_or_says_why_not(dtype, shape, data):
    message = pb.Tensor(dtype=dtype, shape=shape, data=data)
    try:
        tensor = from_proto(message, name="t")
    except InvalidArgument:
        return
    assert list(tensor.shape) == shape


# ---- sampling parameters --------------------------------------------------------------------------------
sampling_messages = st.builds(
    pb.SamplingParams,
    temperature=FLOAT, top_p=FLOAT, top_k=INT32, repetition_penalty=FLOAT,
    max_tokens=st.integers(0, 2**31 - 1), stop=st.lists(TEXT, max_size=5),
    stop_token_ids=st.lists(INT32, max_size=5), seed=st.integers(0, 2**64 - 1), ignore_eos=st.booleans(),
    logprobs=st.integers(0, 2**31 - 1),
)


@settings(max_examples=400, deadline=None)
@given(msg=sampling_messages)
def test_sampling_parameters_are_valid_or_refused(msg):
    try:
        params = SamplingParams.from_proto(msg, default_max_tokens=16, vocab_size=1000, limits=RequestLimits())
    except InvalidArgument:
        return
    assert params.temperature >= 0 and 0 < params.top_p <= 1 and params.top_k >= -1


# ---- the LLM service over gRPC ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    server = LLM(tiny.ensure("qwen2_vl", tmp_path_factory.mktemp("fuzz")), "--max-num-seqs", "4")
    yield server
    server.close()


def _embedding(rows_cols_dtype):
    rows, cols, dtype = rows_cols_dtype
    return pb.Tensor(dtype=dtype, shape=[rows, cols], data=b"\0" * max(0, min(rows * cols * 4, 1 << 16)))


items = st.builds(
    pb.MultimodalItem,
    modality=st.integers(0, 4),
    embedding=st.builds(pb.Embedding, embedding=st.tuples(st.integers(-2, 70), st.integers(-2, 70),
                                                          st.integers(0, 12)).map(_embedding),
                        grid_thw=st.lists(st.integers(-4, 16), max_size=4),
                        num_placeholder_tokens=st.integers(-1, 80)),
)
requests = st.builds(
    pb.GenerateRequest,
    text=st.one_of(st.just(""), TEXT, st.just("<|vision_start|><|image_pad|><|vision_end|> x")),
    items=st.lists(items, max_size=3),
    sampling=sampling_messages.map(lambda s: (s.__setattr__("max_tokens", s.max_tokens % 4), s)[1]),
)


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
@given(request=requests)
def test_random_generate_requests_get_an_answer_or_a_client_error(llm, request):
    try:
        for _ in llm.stub.Generate(request, timeout=60):
            pass
    except grpc.RpcError as exc:
        assert exc.code() in CLIENT_ERRORS, (exc.code(), exc.details(), request)
        assert "\n" not in (exc.details() or "")


def test_after_the_fuzzing_the_llm_serves_and_its_memory_stayed_bounded(llm):
    ids, _, last = llm.generate(text="still here", sampling=pb.SamplingParams(temperature=0, max_tokens=3))
    assert len(ids) == 3 and last.finish_reason == pb.LENGTH
    assert llm.kv_used() == 0
    for pid in llm.proc.pids():  # the gRPC edge and its engine process
        assert _peak_rss_mb(pid) < RSS_BOUND_MB, pid


# ---- the gateway over HTTP ----------------------------------------------------------------------------
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), EXTREME_INT, FLOAT.filter(lambda f: f == f and abs(f) != float("inf")),
              TEXT),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(TEXT, children, max_size=4)),
    max_leaves=12,
)
chat_bodies = st.fixed_dictionaries(
    {"messages": st.one_of(json_values, st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
         "content": st.one_of(TEXT, json_values)}), min_size=1, max_size=3))},
    optional={"max_tokens": st.one_of(EXTREME_INT, json_values), "top_k": st.one_of(EXTREME_INT, json_values),
              "temperature": st.one_of(FLOAT.filter(lambda f: f == f and abs(f) != float("inf")), json_values),
              "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3), json_values),
              "stop_token_ids": st.one_of(st.lists(EXTREME_INT, max_size=3), json_values),
              "stream": st.one_of(st.booleans(), json_values), "model": st.one_of(TEXT, json_values)},
)


@pytest.fixture(scope="module")
def gateway(llm):
    from services.gateway.launch import GatewayProcess
    from tests.test_gateway import GATEWAY

    gw = GatewayProcess([*GATEWAY, "--llm", llm.proc.target]).start()
    try:
        gw.wait_serving(timeout=120)
        yield gw
    finally:
        assert gw.terminate(timeout=30) == 0


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
@given(body=chat_bodies)
def test_random_chat_bodies_get_an_answer_or_a_4xx(gateway, body):
    from tests.test_gateway import post

    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = body["max_tokens"] % 4 or 1  # keep answers short; the extremes are in top_k
    status, _, answer = post(gateway, "/v1/chat/completions", json.dumps(body).encode(), raw=True)
    assert status in (200, 400, 404, 413, 422, 429), (status, answer[:300], body)


# ---- the encoders and the VAE over gRPC -------------------------------------------------------------
encode_items = st.builds(
    pb.EncodeItem,
    data=st.one_of(st.binary(max_size=64), st.sampled_from([b"\x89PNG\r\n\x1a\n" + b"\0" * 30, b"RIFF" + b"\0" * 40,
                                                           b"\xff\xd8\xff" + b"\0" * 20])),
    sample_rate=st.integers(0, 2**31 - 1),
    min_pixels=INT32, max_pixels=INT32,
)
pixel_items = st.builds(
    pb.EncodeItem,
    pixels=st.builds(pb.Tensor, dtype=st.integers(0, 12), shape=st.lists(st.integers(-2, 70), max_size=4),
                     data=st.binary(max_size=2048)),
    sample_rate=st.integers(0, 400_000),
)
pcm_items = st.builds(
    pb.EncodeItem,
    pcm=st.builds(pb.Tensor, dtype=st.integers(0, 12), shape=st.lists(st.integers(-2, 4000), max_size=3),
                  data=st.binary(max_size=4096)),
    sample_rate=st.one_of(st.integers(-5, 400_000), st.sampled_from([16000, 44100, 96001, 1_535_999])),
)
encode_requests = st.builds(pb.EncodeRequest, items=st.lists(st.one_of(encode_items, pixel_items, pcm_items),
                                                              max_size=3))


def _grpc_service(module: str, model_dir, *flags):
    from modalmesh.ops.launcher import ServiceProcess

    proc = ServiceProcess(module, ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--device", "cpu",
                                   "--model", str(model_dir), *flags]).start()
    proc.wait_serving(timeout=180)
    return proc


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-encoders")
    procs = {"vision": _grpc_service("vision_encoder", tiny.ensure("qwen2_vl", root)),
             "audio": _grpc_service("audio_encoder", tiny.ensure("qwen2_audio", root)),
             "vae": _grpc_service("vae", tiny.ensure("vae", root))}
    channels = {name: grpc.insecure_channel(p.target) for name, p in procs.items()}
    yield procs, channels
    for channel in channels.values():
        channel.close()
    for p in procs.values():
        assert p.terminate(timeout=60) == 0


def _client_error_or_ok(call):
    try:
        call()
    except grpc.RpcError as exc:
        assert exc.code() in CLIENT_ERRORS, (exc.code(), exc.details())
        assert "\n" not in (exc.details() or "")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
@given(request=encode_requests)
def test_random_encode_requests_get_an_answer_or_a_client_error(encoders, request):
    _, channels = encoders
    for name in ("vision", "audio"):
        stub = pb.encoder_pb2_grpc.EncoderServiceStub(channels[name])
        _client_error_or_ok(lambda: stub.Encode(request, timeout=60))


decode_requests = st.builds(
    pb.DecodeRequest,
    latents=st.builds(pb.Tensor, dtype=st.integers(0, 12),
                      shape=st.one_of(st.lists(st.integers(-2, 9), max_size=5),
                                      st.tuples(st.integers(1, 2), st.just(4), st.integers(1, 9),
                                                st.integers(1, 9)).map(list)),
                      data=st.binary(max_size=4096)),
    output=st.integers(0, 4), skip_scaling=st.booleans(),
    tiling=st.builds(pb.TilingOptions, mode=st.integers(0, 4), tile_latent_size=INT32, overlap_latent=INT32),
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
@given(request=decode_requests)
def test_random_decode_requests_get_an_answer_or_a_client_error(encoders, request):
    _, channels = encoders
    stub = pb.vae_pb2_grpc.VAEServiceStub(channels["vae"])
    _client_error_or_ok(lambda: stub.Decode(request, timeout=60))


def test_after_the_fuzzing_the_encoders_and_the_vae_serve_within_their_memory_bound(encoders):
    procs, channels = encoders
    for name, p in procs.items():
        stub = (pb.vae_pb2_grpc.VAEServiceStub if name == "vae" else pb.encoder_pb2_grpc.EncoderServiceStub)(
            channels[name])
        assert stub.Info(pb.InfoRequest(), timeout=10).ready
        assert _peak_rss_mb(p.proc.pid) < RSS_BOUND_MB, name
