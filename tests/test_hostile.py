"""Hostile input and faults, one test per defect of the hardening issue: each fails on the code before its fix.

Every service runs on 127.0.0.1 with ephemeral ports and is stopped by its test.
"""

import time
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from modalmesh import pb
from modalmesh.rpc.codec import to_proto
from modalmesh.testing import tiny
from tests.test_llm_service import LLM, greedy


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile-ckpts")


# ---- the LLM -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(ckpts):
    server = LLM(tiny.ensure("qwen2", ckpts), "--max-stop-strings", "4", "--max-stop-string-chars", "16",
                 "--max-stop-token-ids", "3", "--max-items-per-request", "2")
    yield server
    server.close()


def _refused(llm, **kw):
    with pytest.raises(grpc.RpcError) as err:
        llm.generate(**kw)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details()


@pytest.mark.parametrize("sampling, flag", [
    (greedy(4, stop=[f"s{i}" for i in range(100_000)]), "--max-stop-strings"),
    (greedy(4, stop=["x" * 17]), "--max-stop-string-chars"),
    (greedy(4, stop_token_ids=[1, 2, 3, 4]), "--max-stop-token-ids"),
])
def test_stop_lists_past_the_limits_are_refused_naming_the_flag(llm, sampling, flag):
    # 100,000 stop strings once took every other client from 0.1 s to 26-54 s (checked per token).
    assert flag in _refused(llm, text="hi", sampling=sampling)
    ids, _, _ = llm.generate(text="still fine", sampling=greedy(3, stop=["zz", "yy", "xx", "ww"]))
    assert len(ids) == 3


def test_too_many_items_are_refused_before_any_encoder_is_asked(llm):
    item = pb.MultimodalItem(modality=pb.IMAGE, input=pb.EncodeItem(data=b"png"))
    # No --vision-encoder: past the limit the count is the error, not the missing encoder.
    assert "--max-items-per-request" in _refused(llm, text="a", items=[item] * 3)
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=[pb.ContentPart(item=item)] * 3)])
    assert "--max-items-per-request" in _refused(llm, chat=chat)


@pytest.fixture(scope="module")
def vl(ckpts):
    server = LLM(tiny.ensure("qwen2_vl", ckpts))
    yield server
    server.close()


def _image_item(rows, grid):
    return pb.MultimodalItem(modality=pb.IMAGE, embedding=pb.Embedding(embedding=to_proto(rows), grid_thw=grid))


IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"


def test_nan_or_infinite_embeddings_are_refused(vl):
    hidden = vl.stub.Info(pb.InfoRequest(), timeout=10).hidden_size
    for bad in (float("nan"), float("inf")):
        rows = torch.zeros(4, hidden)
        rows[1, 3] = bad
        details = _refused(vl, text=IMAGE_TEXT, items=[_image_item(rows, [1, 4, 4])], sampling=greedy(2))
        assert "items[0].embedding contains NaN or infinite values" in details


def test_negative_grids_and_overflowing_empty_shapes_are_invalid_argument(vl):
    hidden = vl.stub.Info(pb.InfoRequest(), timeout=10).hidden_size
    # (-1) * (-4 // 2) * (4 // 2) == 4 rows: the count alone let a negative grid through to INTERNAL.
    details = _refused(vl, text=IMAGE_TEXT, items=[_image_item(torch.zeros(4, hidden), [-1, -4, 4])],
                       sampling=greedy(2))
    assert "grid_thw [-1, -4, 4] does not describe its 4 rows" in details
    empty = pb.Tensor(dtype=pb.FLOAT32, shape=[0, 2**62, hidden])
    item = pb.MultimodalItem(modality=pb.IMAGE, embedding=pb.Embedding(embedding=empty, grid_thw=[1, 4, 4]))
    assert "is too large" in _refused(vl, text=IMAGE_TEXT, items=[item], sampling=greedy(2))
    assert vl.generate(text="fine", sampling=greedy(2))[0]


def _requests_total(llm, rpc, code):
    body = urllib.request.urlopen(f"http://127.0.0.1:{llm.proc.metrics_port}/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples
               if s.name == "modalmesh_requests_total" and s.labels.get("rpc") == rpc
               and s.labels.get("code") == code)


def test_corrupt_messages_and_bad_utf8_are_invalid_argument_and_counted(llm):
    good = pb.GenerateRequest(text="ab", sampling=greedy(2)).SerializeToString()
    generate = llm.channel.unary_stream("/modalmesh.v1.LLMService/Generate")
    info = llm.channel.unary_unary("/modalmesh.v1.LLMService/Info")
    before = _requests_total(llm, "Generate", "INVALID_ARGUMENT")
    for raw, why in ((b"\xff\xff\xff", "Wire format was corrupt"),
                     (good.replace(b"ab", b"\xff\xfe"), "String field had bad UTF-8")):
        with pytest.raises(grpc.RpcError) as err:
            list(generate(raw, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == f"the request is not a valid Generate message: {why}"
    with pytest.raises(grpc.RpcError) as err:
        info(b"\xff\xff\xff", timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _requests_total(llm, "Generate", "INVALID_ARGUMENT") == before + 2
    assert len(list(generate(good, timeout=30))) >= 1  # raw bytes that parse are served as before


def _kv_used_metric(llm):
    body = urllib.request.urlopen(f"http://127.0.0.1:{llm.proc.metrics_port}/metrics", timeout=10).read().decode()
    return next(s.value for f in text_string_to_metric_families(body) for s in f.samples
                if s.name == "modalmesh_kv_pool_used_tokens")


def test_the_kv_pool_gauge_drops_when_a_request_is_cancelled(llm):
    call = llm.stub.Generate(pb.GenerateRequest(text="Hello " * 20, sampling=greedy(400)), timeout=60)
    assert next(call).token_ids
    call.cancel()
    deadline = time.monotonic() + 10  # no other request follows: the abort itself must publish
    while _kv_used_metric(llm) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _kv_used_metric(llm) == 0


# ---- the audio encoder ---------------------------------------------------------------------------------
def _wav(samples, rate):
    import io

    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _tone(freq, rate, seconds):
    import math

    return torch.sin(2 * math.pi * freq * torch.arange(int(seconds * rate), dtype=torch.float64) / rate)


def test_odd_sample_rates_resample_accurately_from_a_table_bounded_by_the_filter():
    # 96,001 Hz once took a per-sample path: 36 s for a 5 s clip (0.17 s at 96,000 Hz).
    from services.audio_encoder.audio import Resampler

    resampler = Resampler()
    y = resampler(_tone(1000.0, 96_001, 1.0), 96_001, 16_000)
    assert y.shape[-1] == -(-96_001 * 16_000 // 96_001)
    assert (y - _tone(1000.0, 16_000, 1.0)[:y.shape[-1]])[800:-800].abs().max() < 1e-4
    for rate in (96_001, 383_999, 44_101):
        g = __import__("math").gcd(rate, 16_000)
        assert resampler._table("fine", rate // g, 16_000 // g).numel() <= 2 * resampler.max_fine_table


def test_resampling_past_its_budget_is_refused_before_any_work():
    from services.audio_encoder.audio import Resampler, ResampleTooCostly

    small = Resampler(max_work=10**6)
    assert small.work(16_000, 96_001, 16_000) > small.max_work
    with pytest.raises(ResampleTooCostly, match="multiply-adds; the limit is"):
        small(torch.zeros(16_000), 96_001, 16_000)


def test_audio_files_that_lie_are_refused_and_errors_hold_no_addresses(ckpts):
    import asyncio

    from tests.test_audio_service import _serve, synth

    whisper = tiny.ensure("whisper", ckpts)
    wav = _wav(synth(1.0), 16_000)
    cases = [
        (pb.EncodeItem(data=_wav(synth(0.01, 1_535_999), 1_535_999)), "sample rate 1535999 Hz is outside"),
        (pb.EncodeItem(data=wav[:len(wav) - 10_000]), "the audio file is truncated (data : 32000 (should be 22000))"),
    ]

    async def body():
        service, server, port, _ = await _serve(whisper)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                for item, message in cases:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.Encode(pb.EncodeRequest(items=[item]))
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(data=b"RIFF" + b"x" * 40)]))
                assert "cannot decode audio bytes" in err.value.details() and "0x" not in err.value.details()
                # A declared rate that contradicts the file is refused on a warm cache too.
                await stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(data=wav)]))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(data=wav, sample_rate=8000)]))
                assert "contradicts the file's 16000 Hz" in err.value.details()
        finally:
            await server.stop(0)
            await service.close()

    asyncio.run(asyncio.wait_for(body(), 120))


# ---- connection ageing ----------------------------------------------------------------------------------
class _Slow(pb.encoder_pb2_grpc.EncoderServiceServicer):
    async def Encode(self, request, context):
        import asyncio

        await asyncio.sleep(float(request.request_id or 0))
        return pb.EncodeResponse(model_id="slow")

    async def Info(self, request, context):
        return pb.ServiceInfo(service="slow", ready=True)


async def _code(awaitable) -> grpc.StatusCode:
    """The status an awaited call ends with (OK when it returns)."""
    try:
        await awaitable
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


async def _drain(call) -> None:
    async for _ in call:
        pass


async def _aged_server(*flags):
    from modalmesh.rpc.server import GrpcServer
    from modalmesh.service import build_parser, server_config

    args = build_parser("slow", "").parse_args(["--host", "127.0.0.1", "--port", "0", *flags])
    server = GrpcServer(server_config(args))
    server.add_service(pb.ENCODER_SERVICE, pb.encoder_pb2_grpc.add_EncoderServiceServicer_to_server, _Slow())
    port = await server.start()
    await server.set_serving(True)
    return server, port


def test_an_aged_connection_never_cuts_a_call_in_flight_unless_told_to():
    # Calls outlive the connection's age (0.3 s) several times over: by default they finish.
    import asyncio

    async def body():
        for flags, expect in ((["--max-connection-age", "0.3"], grpc.StatusCode.OK),
                              (["--max-connection-age", "0.3", "--max-connection-age-grace", "0.3"],
                               grpc.StatusCode.UNAVAILABLE)):
            server, port = await _aged_server(*flags)
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                    code = await _code(stub.Encode(pb.EncodeRequest(request_id="1.5"), timeout=30))
                    assert code == expect, flags
            finally:
                await server.stop(0)

    asyncio.run(asyncio.wait_for(body(), 60))


def test_the_gateway_keeps_a_healthy_backend_up_across_connection_ageing():
    # Each GOAWAY ended the health stream and marked the backend UNREACHABLE: 503s every ~5 minutes.
    import asyncio

    from services.gateway.backends import Backend

    async def body():
        # A finite grace, so the health stream itself is cut as each connection ages out.
        server, port = await _aged_server("--max-connection-age", "0.2", "--max-connection-age-grace", "0.2")
        seen = []
        backend = Backend("vision_encoder", f"127.0.0.1:{port}", pb.encoder_pb2_grpc.EncoderServiceStub,
                          max_message_bytes=1 << 20, on_change=lambda: seen.append(backend.status))
        backend.start()
        try:
            deadline = asyncio.get_running_loop().time() + 2.5  # about a dozen aged connections
            while asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
        finally:
            await backend.close()
            await server.stop(0)
        assert seen and seen[0] == "SERVING" and "UNREACHABLE" not in seen, seen

    asyncio.run(asyncio.wait_for(body(), 60))


# ---- attention selection ----------------------------------------------------------------------------
def test_a_global_override_goes_only_where_it_fits(monkeypatch):
    # --attention-backend fa3 (global) on an H200 made FP32 head-dim-512 (the SD VAE mid-block) and paged
    # components a start-up error; docs/attention.md promises they go to the best backend that fits.
    import sys

    from prometheus_client import CollectorRegistry

    from modalmesh.attention import AttentionSelector, Needs, registry
    from modalmesh.metrics import Metrics
    from tests.test_attention_selection import HOPPER, _kernel_module

    for name in ("flash_attn", "triton"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", _kernel_module("flash_attn_interface"))
    registry.forget_probes()
    try:
        selector = AttentionSelector("fa3", platform=HOPPER, metrics=Metrics("t", CollectorRegistry()))
        vae = selector.select("vae", Needs(torch.float32, 512, seqlen_hint=4096))
        paged = selector.select("llm", Needs(torch.float32, 128, layouts=("paged",), page_size=16))
        taken = selector.select("vision_encoder", Needs(torch.bfloat16, 128))
    finally:
        registry.forget_probes()
    assert vae.backend != "fa3" and vae.rejected["fa3"].startswith("global override skipped")
    assert paged.backend != "fa3" and "dtype float32 unsupported" in paged.rejected["fa3"]
    assert (taken.backend, taken.reason) == ("fa3", "global override")


# ---- the gateway -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gateway(ckpts, llm):
    from modalmesh.ops.launcher import ServiceProcess
    from services.gateway.launch import GatewayProcess
    from tests.test_gateway import COMMON, GATEWAY

    vae = ServiceProcess("vae", [*COMMON, "--model", str(tiny.ensure("vae", ckpts))]).start()
    try:
        vae.wait_serving(timeout=180)
        gw = GatewayProcess([*GATEWAY, "--llm", llm.proc.target, "--vae", vae.target]).start()
        try:
            gw.wait_serving(timeout=120)
            yield gw
        finally:
            assert gw.terminate(timeout=30) == 0
    finally:
        vae.terminate(timeout=60)


def _latents_body(**options):
    import base64

    return {"latents": base64.b64encode(torch.zeros(1, 4, 4, 4).numpy().tobytes()).decode(), "shape": [1, 4, 4, 4],
            **options}


@pytest.mark.parametrize("path, body, param", [
    # Deeply nested JSON: the parser's RecursionError was a 500.
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    # Integers past the int32 gRPC fields they land in.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_k": 2**40}, "top_k"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [2**40]},
     "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, 2**40]}, "prompt"),
    ("/v1/images/decode", _latents_body(tile_latent_size=2**40), "tile_latent_size"),
    # A lone surrogate cannot be UTF-8 (protobuf strings are).
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages[0].content"),
])
def test_client_errors_at_the_gateway_are_400_not_500(gateway, path, body, param):
    from tests.test_gateway import assert_openai_error, post

    status, _, answer = post(gateway, path, body)
    assert_openai_error(status, answer, 400, param=param)
    status, _, _ = post(gateway, "/v1/completions", {"prompt": "still", "max_tokens": 2})
    assert status == 200


def test_a_drain_ends_when_the_calls_end_not_when_the_health_watches_do():
    # A gateway's health Watch never finishes: every LLM drain waited its whole grace period (30 s).
    import asyncio

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def body():
        server, port = await _aged_server("--grace-period", "120")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            slow = asyncio.ensure_future(pb.encoder_pb2_grpc.EncoderServiceStub(channel).Encode(
                pb.EncodeRequest(request_id="1.0"), timeout=60))
            await asyncio.sleep(0.3)  # in the server's hands
            await asyncio.wait_for(server.drain(), 20)  # far inside the 120 s grace
            assert (await slow).model_id == "slow"  # the call in flight finished first
            watch.cancel()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_with_every_encoder_down_a_request_fails_at_once_as_unavailable(ckpts):
    # It waited for a READY replica until its deadline (60 s by default), then DEADLINE_EXCEEDED.
    from modalmesh import distributed

    server = LLM(tiny.ensure("qwen2_vl", ckpts), "--vision-encoder", f"ipv4:127.0.0.1:{distributed.free_port()}")
    try:
        item = pb.MultimodalItem(modality=pb.IMAGE, input=pb.EncodeItem(data=b"png"))
        with pytest.raises(grpc.RpcError) as err:
            server.generate(timeout=30, text=IMAGE_TEXT, items=[item], sampling=greedy(2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "items[0]" in err.value.details()
    finally:
        server.close()


# ---- the vision encoder ---------------------------------------------------------------------------------
def _png(width, height, mode):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (width, height), (10, 200, 30, 128)[:len(mode)]).save(buf, format="PNG")
    return buf.getvalue()


def test_images_are_refused_by_what_they_decode_to_and_decodes_share_one_memory_budget(ckpts):
    # A 261 KB 8192^2 RGBA PNG cost 1.3 GB; four in one request peaked at 4.7 GB. Here in miniature: an
    # RGBA image decodes to a third more than an RGB one of the same pixels, and its conversion peaks higher.
    import asyncio

    from tests.test_vision_service import _serve

    model_dir = tiny.ensure("qwen2_vl", ckpts)

    async def body():
        service, server, port, _, _ = await _serve(model_dir, "--max-image-decoded-mb", "1.2",
                                                   "--decode-memory-mb", "4")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                ok = await stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(data=_png(600, 600, "RGB"))]))
                assert ok.embeddings[0].num_placeholder_tokens > 0
                for data, message in ((_png(600, 600, "RGBA"), "decodes to 1 MiB; the server's limit is 1 MiB "
                                                               "(--max-image-decoded-mb)"),
                                      (_png(500, 500, "RGBA"), "(--decode-memory-mb)")):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(data=data)]))
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert message in err.value.details(), err.value.details()
        finally:
            await server.stop(0)
            await service.close()
        assert service.model.decode_budget.held == 0

    asyncio.run(asyncio.wait_for(body(), 120))


def test_a_decode_waits_for_its_share_of_the_budget():
    import threading

    from modalmesh.errors import ResourceExhausted
    from services.vision_encoder.decode_memory import DecodeBudget

    budget = DecodeBudget(100, wait_s=30)
    first_in, release, second_in = threading.Event(), threading.Event(), threading.Event()

    def first():
        with budget.hold(70, "a"):
            first_in.set()
            release.wait(10)

    def second():
        with budget.hold(70, "b"):
            second_in.set()

    a = threading.Thread(target=first)
    a.start()
    assert first_in.wait(10)
    b = threading.Thread(target=second)
    b.start()
    assert not second_in.wait(0.3)  # 70 + 70 > 100: it waits
    release.set()
    assert second_in.wait(10)
    a.join(10)
    b.join(10)
    assert budget.held == 0
    busy = DecodeBudget(100, wait_s=0.2)
    with busy.hold(70, "a"):
        with pytest.raises(ResourceExhausted, match="busy decoding other large images"):
            with busy.hold(70, "b"):
                pass
    assert busy.held == 0


# ---- the VAE ------------------------------------------------------------------------------------------
def test_a_decode_nobody_waits_for_stops_between_blocks(ckpts):
    from services.vae.engine import DecodeAbandoned, TilingRequest, VAEEngine
    from services.vae.models.autoencoder_kl import ResnetBlock

    engine = VAEEngine.load(tiny.ensure("vae", ckpts), device=torch.device("cpu"), dtype=torch.float32, tile=8,
                            overlap=2, tile_batch=1)
    calls = []
    hook = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for m in engine.model.modules()
            if isinstance(m, ResnetBlock)]
    z = torch.randn(1, engine.cfg.latent_channels, 32, 32)
    engine.decode(z, TilingRequest(mode=1))  # ON: every tile, to count the blocks of the whole decode
    whole = len(calls)
    calls.clear()
    with pytest.raises(DecodeAbandoned):
        engine.decode(z, TilingRequest(mode=1), should_stop=lambda: len(calls) >= 5)
    assert len(calls) == 5 < whole  # it stopped at the next block, not at the end
    calls.clear()
    from modalmesh.errors import DeadlineExceeded

    with pytest.raises(DeadlineExceeded, match="--max-decode-seconds"):  # a time budget stops it the same way
        engine.decode(z, TilingRequest(mode=1), budget_s=1e-9)
    assert len(calls) <= 1
    for h in hook:
        h.remove()


def test_an_abandoned_decode_frees_the_worker_and_untiled_decodes_are_guarded(ckpts):
    # An abandoned 512x512-latent decode held the worker: the next small decode waited 134 s.
    import asyncio

    from modalmesh.metrics import Metrics
    from modalmesh.rpc.server import GrpcServer, ServerConfig
    from modalmesh.service import build_parser
    from services.vae.server import VAEDecoderService

    async def body():
        parser = build_parser("vae", "")
        VAEDecoderService.add_arguments(parser)
        args = parser.parse_args(["--model", str(tiny.ensure("vae", ckpts)), "--device", "cpu",
                                  "--max-untiled-mb", "4"])
        service = VAEDecoderService(args, Metrics("vae", process_metrics=False))
        server = GrpcServer(ServerConfig(host="127.0.0.1", port=0))
        service.register(server)
        port = await server.start()
        await service._startup()
        engine = service.engine
        real = engine._decode_or_tile
        slow = {"first": True}

        def decode_or_tile(z, req):  # the first decode runs "forever", block after block
            if slow.pop("first", False):
                small = torch.zeros(1, engine.cfg.latent_channels, 4, 4)
                for _ in range(100_000):
                    real(small, req)
            return real(z, req)

        engine._decode_or_tile = decode_or_tile
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.vae_pb2_grpc.VAEServiceStub(channel)
                z = to_proto(torch.zeros(1, engine.cfg.latent_channels, 8, 8))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Decode(pb.DecodeRequest(latents=z, output=pb.TENSOR_UINT8), timeout=0.5)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                reply = await stub.Decode(pb.DecodeRequest(latents=z, output=pb.TENSOR_UINT8), timeout=30)
                assert list(reply.pixels.shape)[1:3] == [8 * engine.cfg.scale_factor] * 2
                # Untiled on request, past the memory for it (--max-untiled-mb 4): refused, not attempted.
                big = to_proto(torch.zeros(1, engine.cfg.latent_channels, 128, 128))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Decode(pb.DecodeRequest(latents=big, output=pb.TENSOR_UINT8,
                                                       tiling=pb.TilingOptions(mode=pb.TilingOptions.OFF)),
                                      timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "untiled needs about" in err.value.details() and "leave tiling AUTO or ON" in err.value.details()
        finally:
            await server.stop(0)
            await service.close()

    asyncio.run(asyncio.wait_for(body(), 120))


# ---- secure by default ----------------------------------------------------------------------------------
def _certificates(tmp_path):
    """A CA, a server certificate for 127.0.0.1 / localhost, and a client certificate, all PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(name, key, issuer_name, issuer_key, *, ca=False, san=None):
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                   .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(name, cert, key):
        (tmp_path / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            (tmp_path / f"{name}.key").write_bytes(key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        return str(tmp_path / f"{name}.crt"), str(tmp_path / f"{name}.key")

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "modalmesh test CA")])
    ca = issue("modalmesh test CA", ca_key, ca_name, ca_key, ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server = issue("server", server_key, ca_name, ca_key,
                   san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = issue("client", client_key, ca_name, ca_key)
    return {"ca": write("ca", ca, None)[0], "server": write("server", server, server_key),
            "client": write("client", client, client_key)}


def test_services_bind_loopback_unless_told_and_reflection_can_be_turned_off():
    import asyncio

    from modalmesh.service import build_parser
    from services.gateway.server import build_parser as gateway_parser

    assert build_parser("llm", "").parse_args([]).host == "127.0.0.1"
    assert gateway_parser().parse_args([]).host == "127.0.0.1"

    async def body():
        for flags, code in (([], grpc.StatusCode.OK), (["--no-reflection"], grpc.StatusCode.UNIMPLEMENTED)):
            server, port = await _aged_server(*flags)
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    call = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")(
                        iter([b"\x3a\x00"]))  # list_services
                    got = await _code(_drain(call))
                    assert got == code, flags
            finally:
                await server.stop(0)

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_shared_token_and_mutual_tls_keep_other_callers_out(tmp_path):
    import asyncio

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from modalmesh.rpc.channel import aio_channel
    from modalmesh.rpc.security import Security

    certs = _certificates(tmp_path)
    (tmp_path / "token").write_text("s3cret-token\n")
    server_flags = ["--auth-token-file", str(tmp_path / "token"), "--tls-cert", certs["server"][0],
                    "--tls-key", certs["server"][1], "--tls-client-ca", certs["ca"]]
    good = Security.from_files(token_file=str(tmp_path / "token"), cert=certs["client"][0], key=certs["client"][1],
                               ca=certs["ca"])

    async def call(security, timeout=5):
        async with aio_channel(f"127.0.0.1:{port}", security=security) as channel:
            return await _code(pb.encoder_pb2_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(),
                                                                                       timeout=timeout))

    async def body():
        nonlocal port
        from modalmesh.rpc.server import GrpcServer
        from modalmesh.service import build_parser, server_config

        args = build_parser("slow", "").parse_args(["--port", "0", *server_flags])
        server = GrpcServer(server_config(args, Security.from_args(args)))
        server.add_service(pb.ENCODER_SERVICE, pb.encoder_pb2_grpc.add_EncoderServiceServicer_to_server, _Slow())
        port = await server.start()
        await server.set_serving(True)
        try:
            assert await call(good) == grpc.StatusCode.OK
            wrong = Security(token="guess", cert=good.cert, key=good.key, ca=good.ca)
            assert await call(wrong) == grpc.StatusCode.UNAUTHENTICATED
            assert await call(Security(cert=good.cert, key=good.key, ca=good.ca)) == grpc.StatusCode.UNAUTHENTICATED
            # No client certificate, or no TLS at all: the handshake fails before any method runs.
            assert await call(Security(token=good.token, ca=good.ca), timeout=3) == grpc.StatusCode.UNAVAILABLE
            assert await call(Security(token=good.token), timeout=3) == grpc.StatusCode.UNAVAILABLE
            # Health stays open to probes that carry no token (they still need the TLS handshake).
            async with aio_channel(f"127.0.0.1:{port}", security=Security(cert=good.cert, key=good.key,
                                                                          ca=good.ca)) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(0)

    port = 0
    asyncio.run(asyncio.wait_for(body(), 60))


def test_the_token_travels_from_the_gateway_to_the_llm_and_from_the_llm_to_its_encoder(ckpts, tmp_path):
    from modalmesh.ops.launcher import ServiceProcess
    from services.gateway.launch import GatewayProcess
    from tests.test_gateway import COMMON, GATEWAY, png, post

    token = tmp_path / "token"
    token.write_text("shared")
    auth = ["--auth-token-file", str(token)]
    model_dir = tiny.ensure("qwen2_vl", ckpts)
    vision = ServiceProcess("vision_encoder", [*COMMON, "--model", str(model_dir), *auth]).start()
    procs = [vision]
    try:
        vision.wait_serving(timeout=120)
        llm_proc = ServiceProcess("llm", [*COMMON, "--model", str(model_dir), "--kv-cache-tokens", "2048",
                                          "--vision-encoder", f"ipv4:{vision.target}", *auth]).start()
        procs.append(llm_proc)
        llm_proc.wait_serving(timeout=120)
        gw = GatewayProcess([*GATEWAY, "--llm", llm_proc.target, *auth]).start()
        procs.append(gw)
        gw.wait_serving(timeout=120)
        import base64

        image = "data:image/png;base64," + base64.b64encode(png(56, 56, 3)).decode()
        status, _, answer = post(gw, "/v1/chat/completions", {"max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": image}}]}]})
        assert status == 200, answer
        with grpc.insecure_channel(vision.target) as channel:  # the encoder itself refuses a caller without it
            with pytest.raises(grpc.RpcError) as err:
                pb.encoder_pb2_grpc.EncoderServiceStub(channel).Info(pb.InfoRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        import subprocess
        import sys

        cli = [sys.executable, "-m", "modalmesh.ops.cli", "info", "--target", llm_proc.target]
        assert subprocess.run([*cli, *auth], capture_output=True, timeout=60).returncode == 0
        refused = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    finally:
        for p in reversed(procs):
            p.send_sigterm()
        for p in reversed(procs):
            assert p.terminate(timeout=60) == 0


def test_the_gateway_serves_https(llm, tmp_path):
    import http.client
    import ssl

    from services.gateway.launch import GatewayProcess
    from tests.test_gateway import GATEWAY

    certs = _certificates(tmp_path)
    gw = GatewayProcess([*GATEWAY, "--llm", llm.proc.target, "--ssl-certfile", certs["server"][0],
                         "--ssl-keyfile", certs["server"][1]]).start()
    try:
        gw.wait_listening(60)
        context = ssl.create_default_context(cafile=certs["ca"])
        deadline = time.monotonic() + 60
        while True:  # until the LLM's Info has reached it (bounded)
            conn = http.client.HTTPSConnection("127.0.0.1", gw.http_port, timeout=10, context=context)
            conn.request("GET", "/v1/models")
            response = conn.getresponse()
            body = response.read()
            conn.close()
            if response.status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert response.status == 200 and b"qwen2" in body
        with pytest.raises(ssl.SSLError):  # a client that does not trust our CA
            conn = http.client.HTTPSConnection("127.0.0.1", gw.http_port, timeout=10,
                                               context=ssl.create_default_context())
            conn.request("GET", "/v1/models")
    finally:
        assert gw.terminate(timeout=30) == 0


def test_request_bodies_in_flight_share_one_budget(llm):
    # Eight 53 MB bodies at once took the gateway to 2.4 GB: past the budget a body is refused, not read.
    import socket

    from services.gateway.launch import GatewayProcess
    from tests.test_gateway import GATEWAY, post

    gw = GatewayProcess([*GATEWAY, "--llm", llm.proc.target, "--max-request-mb", "1",
                         "--max-inflight-body-mb", "1.5"]).start()
    try:
        gw.wait_serving(timeout=120)
        # One client declares a 1 MB body and sends it slowly: its share is held while it is read.
        slow = socket.create_connection(("127.0.0.1", gw.http_port), timeout=30)
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000\r\n\r\n{")
        deadline = time.monotonic() + 30
        while True:
            status, headers, body = post(gw, "/v1/completions", {"prompt": "x" * 700_000, "max_tokens": 1})
            if status == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 503 and body["error"]["code"] == "server_busy" and headers.get("Retry-After") == "1"
        assert "--max-inflight-body-mb" in body["error"]["message"]
        slow.close()
        deadline = time.monotonic() + 30
        while True:  # the share comes back when that request ends
            status, _, body = post(gw, "/v1/completions", {"prompt": "hello", "max_tokens": 1})
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 200, body
    finally:
        assert gw.terminate(timeout=30) == 0


def test_a_request_whose_images_cannot_fit_is_refused_before_any_encode(ckpts):
    # 300 images were encoded, then the request was refused for its length.
    from modalmesh.image_grid import ImageGrid
    from modalmesh.ops.launcher import ServiceProcess
    from tests.test_gateway import COMMON, png
    from tests.test_hostile import _requests_total as requests_total

    model_dir = tiny.ensure("qwen2_vl", ckpts)
    vision = ServiceProcess("vision_encoder", [*COMMON, "--model", str(model_dir)]).start()
    procs = [vision]
    try:
        vision.wait_serving(timeout=120)
        server = LLM(model_dir, "--vision-encoder", f"ipv4:{vision.target}")
        procs.append(server.proc)
        # The LLM's count from the header equals the encoder's rows, odd sizes and per-item budgets included.
        import json

        grid = ImageGrid.from_preprocessor(json.loads((model_dir / "preprocessor_config.json").read_text()),
                                           patch_size=14, merge_size=2)
        with grpc.insecure_channel(vision.target) as channel:
            stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
            for (h, w), budget in (((56, 84), 0), ((300, 200), 0), ((448, 448), 0), ((1000, 40), 0),
                                   ((448, 448), 28 * 28 * 8)):
                reply = stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(data=png(h, w, 1), max_pixels=budget)]),
                                    timeout=60)
                assert reply.embeddings[0].num_placeholder_tokens == grid.rows(w, h, max_pixels=budget), (h, w)
        vision_metrics = type("P", (), {"proc": vision})  # _requests_total reads .proc.metrics_port
        before = requests_total(vision_metrics, "Encode", "OK")
        items = [pb.MultimodalItem(modality=pb.IMAGE, input=pb.EncodeItem(data=png(448, 448, i))) for i in range(9)]
        text = "<|vision_start|><|image_pad|><|vision_end|>" * 9  # 9 x 64 rows > 512
        details = _refused(server, text=text, items=items, sampling=greedy(2))
        assert "at least 594 tokens with its items' rows (counted before encoding)" in details  # 576 + 18
        assert requests_total(vision_metrics, "Encode", "OK") == before  # not one image was encoded
        ids, _, _ = server.generate(text=text[:45], items=items[:1], sampling=greedy(2))  # one fits
        assert len(ids) == 2
        server.close()
        procs.remove(server.proc)
    finally:
        for p in procs:
            p.terminate(timeout=60)


def test_slabs_of_an_encoder_that_restarted_do_not_stay_mapped_in_the_llm(tmp_path):
    from modalmesh.rpc.codec import to_payload
    from modalmesh.rpc.shm import ShmExporter, ShmReader

    reader = ShmReader(directory=tmp_path)
    before = ShmExporter(directory=tmp_path)
    first = before.export(*to_payload(torch.ones(1000)))
    assert torch.equal(reader.read(first), torch.ones(1000))
    assert reader.mapped_slabs == [first.shared_memory.name]
    before.close()  # the encoder went away: its slabs are unlinked, and no answer names them again
    after = ShmExporter(directory=tmp_path)
    second = after.export(*to_payload(torch.zeros(1000)))
    assert torch.equal(reader.read(second), torch.zeros(1000))
    assert reader.mapped_slabs == [second.shared_memory.name]
    after.close()
    reader.close()


def test_half_sent_requests_are_cut_off(llm):
    # 300 half-sent connections stayed open: headers and bodies now have a time limit each.
    import socket

    from services.gateway.launch import GatewayProcess
    from tests.test_gateway import GATEWAY

    gw = GatewayProcess([*GATEWAY, "--llm", llm.proc.target, "--header-timeout", "1", "--body-timeout", "1"]).start()
    try:
        gw.wait_serving(timeout=120)
        headers = socket.create_connection(("127.0.0.1", gw.http_port), timeout=20)
        headers.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # ... and never the rest
        assert headers.recv(1024) == b""  # closed by the gateway (within the 20 s socket bound)
        body = socket.create_connection(("127.0.0.1", gw.http_port), timeout=20)
        body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        answer = body.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer, answer[:200]
        headers.close()
        body.close()
    finally:
        assert gw.terminate(timeout=30) == 0


def test_a_jpeg_past_the_decoded_limit_is_decoded_smaller_and_a_png_is_refused(ckpts):
    import asyncio
    import io

    from PIL import Image

    from tests.test_vision_service import _serve

    def encoded(fmt):
        buf = io.BytesIO()
        Image.new("RGB", (600, 600), (200, 30, 90)).save(buf, format=fmt)
        return buf.getvalue()

    async def body():
        service, server, port, _, _ = await _serve(tiny.ensure("qwen2_vl", ckpts), "--max-image-decoded-mb", "0.5")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                # 600 x 600 RGB decodes to 1 MiB: the JPEG decoder's own 1/2 scale fits the 0.5 MiB limit.
                ok = await stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(data=encoded("JPEG"))]))
                assert ok.embeddings[0].num_placeholder_tokens > 0
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(data=encoded("PNG"))]))
                assert "(--max-image-decoded-mb)" in err.value.details()
        finally:
            await server.stop(0)
            await service.close()

    asyncio.run(asyncio.wait_for(body(), 120))


def test_bad_security_and_ageing_flags_fail_start_up_naming_the_flag(tmp_path):
    from modalmesh.errors import ConfigError
    from modalmesh.rpc.security import Security
    from modalmesh.service import build_parser, server_config

    with pytest.raises(ConfigError, match="--tls-cert and --tls-key go together"):
        Security.from_files(cert=str(tmp_path / "a.crt"))
    with pytest.raises(ConfigError, match="--tls-client-ca needs --tls-cert"):
        Security.from_files(client_ca=str(tmp_path / "ca.crt"))
    with pytest.raises(ConfigError, match="--auth-token-file .*cannot read it"):
        Security.from_files(token_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="the file is empty"):
        Security.from_files(token_file=str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="--max-connection-age"):
        server_config(build_parser("x", "").parse_args(["--max-connection-age", "-1"]))
    assert "token" not in repr(Security(token="secret")) and "secret" not in repr(Security(token="secret"))
