"""The audio encoder through gRPC: batching across requests, resampled stereo, bad items, the CLI."""

import asyncio
import io

import grpc
import numpy as np
import pytest
import soundfile as sf
import torch
from transformers import (
    AutoTokenizer,
    Qwen2AudioForConditionalGeneration,
    Qwen2AudioProcessor,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
)

from modalmesh import pb
from modalmesh.metrics import Metrics
from modalmesh.ops.launcher import ServiceProcess
from modalmesh.rpc.codec import from_proto, to_proto
from modalmesh.rpc.server import GrpcServer, ServerConfig
from modalmesh.service import build_parser
from modalmesh.testing import tiny
from services.audio_encoder.audio import downmix, resample
from services.audio_encoder.server import AudioEncoderService

SR = 16000
TOL = 1e-4


def synth(seconds: float, rate: int = SR, seed: int = 0, channels: int = 1) -> np.ndarray:
    n = int(round(seconds * rate))
    t = np.arange(n) / rate
    rng = np.random.default_rng(seed)
    out = []
    for c in range(channels):
        x = 0.4 * np.sin(2 * np.pi * (300 + 200 * c + 50 * seed) * t) + 0.2 * np.sin(2 * np.pi * (80 * t + 400 * t**2))
        out.append(x + 0.03 * rng.standard_normal(n))
    return np.stack(out).astype(np.float32) if channels > 1 else out[0].astype(np.float32)


def pcm_item(samples: np.ndarray, rate: int = SR) -> pb.EncodeItem:
    return pb.EncodeItem(pcm=to_proto(torch.from_numpy(np.ascontiguousarray(samples))), sample_rate=rate)


def file_item(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> pb.EncodeItem:
    buf = io.BytesIO()
    sf.write(buf, samples.T if samples.ndim == 2 else samples, rate, format=fmt, subtype=subtype)
    return pb.EncodeItem(data=buf.getvalue())


def decoded_mono_16k(item: pb.EncodeItem) -> np.ndarray:
    """The reference pipeline's input: the same samples, downmixed and resampled by our resampler."""
    if item.HasField("data"):
        samples, rate = sf.read(io.BytesIO(item.data), dtype="float32", always_2d=True)
        wave = torch.from_numpy(samples.T.copy())
    else:
        wave, rate = from_proto(item.pcm).float(), item.sample_rate
        wave = wave[None] if wave.dim() == 1 else wave
    return resample(downmix(wave), rate, SR).numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio_service")
    return {name: tiny.ensure(name, root) for name in ("qwen2_audio", "whisper")}


@pytest.fixture(scope="module")
def qwen2_reference(checkpoints):
    path = checkpoints["qwen2_audio"]
    ref = Qwen2AudioForConditionalGeneration.from_pretrained(path).eval()
    processor = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor.from_pretrained(path),
                                    tokenizer=AutoTokenizer.from_pretrained(path))

    def rows(samples: np.ndarray) -> tuple[torch.Tensor, int]:
        """(spliced rows, valid mel frames) of Qwen2AudioForConditionalGeneration for a clip <= 30 s."""
        inputs = processor(text="<|audio_bos|><|AUDIO|><|audio_eos|>", audio=samples, sampling_rate=SR,
                           return_tensors="pt")
        captured = {}
        hook = ref.model.language_model.register_forward_pre_hook(
            lambda m, a, kw: captured.update(e=kw["inputs_embeds"]), with_kwargs=True)
        try:
            with torch.no_grad():
                ref(**inputs)
        finally:
            hook.remove()
        return (captured["e"][0][inputs["input_ids"][0] == ref.config.audio_token_id],
                int(inputs["feature_attention_mask"].sum()))

    return rows


async def _serve(model_dir, *flags):
    parser = build_parser("audio_encoder", "")
    AudioEncoderService.add_arguments(parser)
    args = parser.parse_args(["--model", str(model_dir), "--device", "cpu", *flags])
    metrics = Metrics("audio_encoder", process_metrics=False)
    service = AudioEncoderService(args, metrics)
    server = GrpcServer(ServerConfig(host="127.0.0.1", port=0), metrics)
    service.register(server)
    port = await server.start()
    await service._startup()
    await server.set_serving(True)
    return service, server, port, metrics


def run(body, timeout=120):
    asyncio.run(asyncio.wait_for(body(), timeout))


def test_concurrent_requests_are_batched_and_split_back(checkpoints, qwen2_reference):
    clips = [synth(s, seed=i) for i, s in enumerate([0.3, 2.2, 5.0, 9.9, 1.1, 14.0, 0.8, 3.3])]
    items = [pcm_item(c) if i % 2 else file_item(c, SR, "FLAC" if i % 4 else "WAV", "PCM_24" if i % 4 else "FLOAT")
             for i, c in enumerate(clips)]
    requests = [pb.EncodeRequest(items=items[i:i + 2], request_id=f"r{i}") for i in range(0, len(items), 2)]

    async def body():
        service, server, port, metrics = await _serve(checkpoints["qwen2_audio"], "--batch-window-ms", "300",
                                                      "--max-batch-tokens", "100000")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                replies = await asyncio.gather(*(stub.Encode(r) for r in requests))
                info = await stub.Info(pb.InfoRequest())
            assert service.batcher.batches_run < len(items)  # requests shared batches
            assert info.architecture == "Qwen2AudioEncoder" and info.output_hidden_size == 64
            assert info.extra["rows"] == "qwen2_audio" and info.extra["n_mels"] == "128"
            assert info.pools[0].name == "embedding_cache"
            for r, reply in enumerate(replies):
                assert reply.modality == pb.AUDIO and reply.weights_fingerprint == service.weights_fingerprint
                for j, emb in enumerate(reply.embeddings):
                    item = requests[r].items[j]
                    expected, frames = qwen2_reference(decoded_mono_16k(item))
                    got = from_proto(emb.embedding)
                    assert emb.num_placeholder_tokens == got.shape[0] == expected.shape[0]
                    assert emb.valid_length == frames and not emb.cache_hit
                    assert (got - expected).abs().max() <= TOL
        finally:
            await server.stop(0)
            await service.close()

    run(body)


@pytest.mark.parametrize("as_file", [False, True])
def test_resampled_44k1_stereo_equals_the_reference_given_the_same_mono_signal(checkpoints, qwen2_reference, as_file):
    stereo = synth(6.5, rate=44100, seed=7, channels=2)
    item = file_item(stereo, 44100, "WAV", "FLOAT") if as_file else pcm_item(stereo, 44100)
    mono = resample(downmix(torch.from_numpy(stereo)), 44100, SR).numpy()
    expected, frames = qwen2_reference(mono)

    async def body():
        service, server, port, _ = await _serve(checkpoints["qwen2_audio"])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = await pb.encoder_pb2_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(items=[item]))
        finally:
            await server.stop(0)
            await service.close()
        emb = reply.embeddings[0]
        got = from_proto(emb.embedding)
        assert emb.valid_length == frames == int(np.ceil(len(mono) / 160))
        assert got.shape == expected.shape and (got - expected).abs().max() <= TOL

    run(body)


def test_bad_items_fail_cleanly_while_other_requests_succeed(checkpoints):
    good = [pcm_item(synth(1.5, seed=1)), file_item(synth(2.5, 22050, seed=2), 22050, "OGG", "VORBIS")]
    bad = [
        (pcm_item(np.array([0.1, np.nan, 0.2], np.float32)), "items[1]: audio contains NaN or infinite samples"),
        (pb.EncodeItem(data=b"definitely not audio"), "items[1]: cannot decode audio bytes"),
        (pcm_item(synth(5.0)), "items[1]: audio is 5.0 s long; this server accepts at most 4 s"),
        (pb.EncodeItem(pcm=to_proto(torch.zeros(0)), sample_rate=SR), "items[1]: audio holds no samples"),
        (pb.EncodeItem(pcm=to_proto(torch.zeros(100))), "items[1]: pcm needs its sample_rate"),
        (pcm_item(synth(1.0, channels=2).T), "items[1]: pcm shape [16000, 2] has 16000 channels"),
        (pb.EncodeItem(data=file_item(synth(1.0), SR, "WAV").data, sample_rate=8000),
         "contradicts the file's 16000 Hz"),
        (pb.EncodeItem(pixels=to_proto(torch.zeros(4, 4, 3, dtype=torch.uint8))), "items[1]: pixels are an image"),
    ]

    async def body():
        service, server, port, metrics = await _serve(checkpoints["whisper"], "--max-audio-seconds", "4",
                                                      "--batch-window-ms", "50")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                calls = [stub.Encode(pb.EncodeRequest(items=[good[0], b])) for b, _ in bad]
                calls.append(stub.Encode(pb.EncodeRequest(items=good)))
                results = await asyncio.gather(*calls, return_exceptions=True)
                for (_, message), err in zip(bad, results[:-1]):
                    assert isinstance(err, grpc.aio.AioRpcError), err
                    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.details()
                ok = results[-1]
                assert [e.num_placeholder_tokens for e in ok.embeddings] == [75, 125]  # ceil(frames / 2), Whisper
                again = await stub.Encode(pb.EncodeRequest(items=good[:1]))  # the cache answers repeats
                assert again.embeddings[0].cache_hit
                assert again.embeddings[0].embedding.data == ok.embeddings[0].embedding.data
        finally:
            await server.stop(0)
            await service.close()
        get = metrics.registry.get_sample_value
        assert get("modalmesh_requests_total", {"service": "audio_encoder", "rpc": "Encode",
                                                "code": "INVALID_ARGUMENT"}) == len(bad)

    run(body)


def test_python_m_services_audio_encoder_serves_a_whisper_checkpoint(checkpoints):
    path = checkpoints["whisper"]
    clip = synth(3.0, seed=5)
    fe = WhisperFeatureExtractor.from_pretrained(path)
    with torch.no_grad():
        encoder = WhisperForConditionalGeneration.from_pretrained(path).model.encoder.eval()
        expected = encoder(fe(clip, sampling_rate=SR, return_tensors="pt").input_features).last_hidden_state[0]
    proc = ServiceProcess("audio_encoder", ["--model", str(path), "--host", "127.0.0.1", "--port", "0",
                                            "--metrics-port", "-1", "--device", "cpu", "--whisper-rows", "full"])
    with proc.start():
        proc.wait_serving(timeout=120)
        with grpc.insecure_channel(proc.target) as channel:
            stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
            info = stub.Info(pb.InfoRequest(), timeout=30)
            reply = stub.Encode(pb.EncodeRequest(items=[pcm_item(clip)]), timeout=60)
        proc.send_sigterm()
        assert proc.terminate(timeout=30) == 0
    assert info.architecture == "WhisperEncoder" and info.modality == pb.AUDIO and info.ready
    assert info.extra["rows"] == "whisper_full" and info.attention[0].component == "audio_encoder"
    got = from_proto(reply.embeddings[0].embedding)
    assert got.shape == (1500, 32) and (got - expected).abs().max() <= TOL
    assert reply.embeddings[0].valid_length == 300
