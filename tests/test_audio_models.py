"""Whisper encoder and Qwen2-Audio tower + projector against transformers, loaded from tiny checkpoints."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    AutoTokenizer,
    Qwen2AudioForConditionalGeneration,
    Qwen2AudioProcessor,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
)

from modalmesh import pb
from modalmesh.errors import ConfigError, InvalidArgument
from modalmesh.rpc.codec import to_proto
from modalmesh.testing import tiny
from modalmesh.weights import CheckpointReader, MissingWeightsError
from services.audio_encoder.model import build_encoder_model
from services.audio_encoder.models.qwen2_audio import output_rows

SR = 16000
WINDOW = 30 * SR
TOL = 1e-4


def synth(seconds: float, seed: int = 0) -> np.ndarray:
    n = int(round(seconds * SR))
    t = np.arange(n) / SR
    rng = np.random.default_rng(seed)
    x = 0.4 * np.sin(2 * np.pi * (220 + 60 * seed) * t) + 0.3 * np.sin(2 * np.pi * (100 * t + 900 * t**2 / 2))
    return (x + 0.05 * rng.standard_normal(n)).astype(np.float32)


def pcm_item(samples: np.ndarray, rate: int = SR) -> pb.EncodeItem:
    return pb.EncodeItem(pcm=to_proto(torch.from_numpy(np.ascontiguousarray(samples))), sample_rate=rate)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("audio_ckpts")


@pytest.fixture(scope="module")
def whisper(root):
    path = tiny.ensure("whisper", root)
    ref = WhisperForConditionalGeneration.from_pretrained(path).model.encoder.eval()
    return path, ref, WhisperFeatureExtractor.from_pretrained(path)


@pytest.fixture(scope="module")
def qwen2_audio(root):
    path = tiny.ensure("qwen2_audio", root)
    ref = Qwen2AudioForConditionalGeneration.from_pretrained(path).eval()
    processor = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor.from_pretrained(path),
                                    tokenizer=AutoTokenizer.from_pretrained(path))
    return path, ref, processor


def whisper_reference(ref, fe, samples: np.ndarray, rows: str = "valid") -> torch.Tensor:
    """WhisperEncoder on each 30 s window; the rows covering valid audio (or all of them)."""
    out = []
    for start in range(0, max(len(samples), 1), WINDOW):
        chunk = samples[start:start + WINDOW]
        feats = fe(chunk, sampling_rate=SR, return_tensors="pt", return_attention_mask=True)
        with torch.no_grad():
            hidden = ref(feats.input_features.to(ref.device, ref.dtype)).last_hidden_state[0]
        positions = (int(feats.attention_mask.sum()) - 1) // 2 + 1
        out.append(hidden if rows == "full" else hidden[:positions])
    return torch.cat(out)


def qwen2_audio_reference(ref, processor, samples: np.ndarray) -> torch.Tensor:
    """What Qwen2AudioForConditionalGeneration splices at its <|AUDIO|> tokens, window by window."""
    captured = {}
    hook = ref.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(embeds=kwargs["inputs_embeds"]), with_kwargs=True)
    out = []
    try:
        for start in range(0, len(samples), WINDOW):
            inputs = processor(text="<|audio_bos|><|AUDIO|><|audio_eos|>Describe.", audio=samples[start:start + WINDOW],
                               sampling_rate=SR, return_tensors="pt")
            with torch.no_grad():
                ref(**inputs)
            mask = inputs["input_ids"][0] == ref.config.audio_token_id
            assert int(mask.sum()) == int(output_rows(inputs["feature_attention_mask"].sum()))
            out.append(captured["embeds"][0][mask])
    finally:
        hook.remove()
    return torch.cat(out)


# -- Whisper ------------------------------------------------------------------------------------
def test_whisper_module_equals_whisper_encoder(whisper):
    path, ref, _ = whisper
    model = build_encoder_model(path)
    mel = torch.randn(3, 80, 3000, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model.module(mel) - ref(mel).last_hidden_state).abs().max() <= TOL
        assert (model.module(mel[1:2]) - ref(mel[1:2]).last_hidden_state).abs().max() <= TOL
    # Only the encoder's tensors were read; k has no bias in the checkpoint and stays zero.
    assert model.load_report.loaded and all(n.startswith("model.encoder.") for n in model.load_report.loaded)
    qkv = model.module.encoder.layers[0].self_attn.qkv_proj
    assert torch.all(qkv.bias[qkv.q_size:qkv.q_size + qkv.kv_size] == 0)
    assert model.output_hidden_size == model.hidden_size == 32 and model.architecture == "WhisperEncoder"


def test_whisper_layers_run_on_row_major_hidden_states(whisper):
    """The stem's transpose must not reach the layers: an add keeps its input's layout, so every residual
    would stay transposed, each LayerNorm copying it and each residual add running strided (HF's encoder
    does; it was 31 % of the encoder's kernel time at batch 16 on an H100)."""
    path, ref, _ = whisper
    model = build_encoder_model(path)
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous()))
             for layer in model.module.encoder.layers]
    mel = torch.randn(2, 80, 3000, generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            out = model.module(mel)
    finally:
        for hook in hooks:
            hook.remove()
    assert seen == [True] * len(model.module.encoder.layers) and out.is_contiguous()
    with torch.no_grad():
        assert (out - ref(mel).last_hidden_state).abs().max() <= TOL


@pytest.mark.parametrize("rows", ["valid", "full"])
def test_whisper_batched_clips_of_different_lengths(whisper, rows):
    path, ref, fe = whisper
    model = build_encoder_model(path, options={"whisper_rows": rows})
    clips = [synth(0.43, 1), synth(7.31, 2), synth(30.0, 3), synth(41.7, 4)]
    prepared = [model.prepare(pcm_item(c), i) for i, c in enumerate(clips)]
    batched = model.encode(prepared)
    for clip, p, got in zip(clips, prepared, batched):
        expected = whisper_reference(ref, fe, clip, rows)
        assert got.embedding.shape == expected.shape
        assert (got.embedding - expected).abs().max() <= TOL
        frames = [math.ceil(min(WINDOW, len(clip) - s) / 160) for s in range(0, len(clip), WINDOW)]
        assert got.valid_length == sum(frames) == p.meta["valid_length"]
        assert p.cost == 3000 * len(frames)  # every Whisper window runs in full
    alone = model.encode([prepared[1]])[0]
    assert (alone.embedding - batched[1].embedding).abs().max() <= 1e-5


# -- Qwen2-Audio --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen2_audio_t5_layout(qwen2_audio, root):
    """The transformers-5 in-memory layout (model.audio_tower.*, ...) next to the same config."""
    path, ref, _ = qwen2_audio
    out = root / "qwen2_audio_t5"
    out.mkdir(exist_ok=True)
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(path / name, out / name)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert any(k.startswith("model.audio_tower.") for k in state)
    save_file(state, str(out / "model.safetensors"))
    return out


def test_qwen2_audio_batched_equals_what_the_reference_splices(qwen2_audio):
    path, ref, processor = qwen2_audio
    model = build_encoder_model(path)
    assert model.output_hidden_size == 64 and model.hidden_size == 32 and model.architecture == "Qwen2AudioEncoder"
    clips = [synth(0.05, 1), synth(0.91, 2), synth(12.34, 3), synth(33.3, 5)]  # 33.3 s: a full window + 3.3 s
    prepared = [model.prepare(pcm_item(c), i) for i, c in enumerate(clips)]
    batched = model.encode(prepared)
    for clip, p, got in zip(clips, prepared, batched):
        expected = qwen2_audio_reference(ref, processor, clip)
        assert got.embedding.shape == expected.shape, (len(clip), got.embedding.shape, expected.shape)
        assert (got.embedding - expected).abs().max() <= TOL
        frames = torch.tensor([math.ceil(min(WINDOW, len(clip) - s) / 160) for s in range(0, len(clip), WINDOW)])
        assert got.valid_length == int(frames.sum())
        assert got.embedding.shape[0] == int(output_rows(frames).sum())
    # Packed batches give each clip the rows it gets alone.
    for i in (0, 2):
        alone = model.encode([prepared[i]])[0]
        assert (alone.embedding - batched[i].embedding).abs().max() <= 1e-5


def test_qwen2_audio_hub_and_transformers5_layouts_load_the_same(qwen2_audio, qwen2_audio_t5_layout):
    hub = build_encoder_model(qwen2_audio[0])
    t5 = build_encoder_model(qwen2_audio_t5_layout)
    assert all(n.startswith(("audio_tower.", "multi_modal_projector.")) for n in hub.load_report.loaded)
    assert all(n.startswith(("model.audio_tower.", "model.multi_modal_projector.")) for n in t5.load_report.loaded)
    assert len(hub.load_report.loaded) == len(t5.load_report.loaded)
    item = pcm_item(synth(5.5))
    a, b = (m.encode([m.prepare(item, 0)])[0].embedding for m in (hub, t5))
    assert torch.equal(a, b)


def test_qwen2_audio_opens_only_shards_with_audio_tensors(qwen2_audio, root):
    path, ref, _ = qwen2_audio
    sharded = root / "qwen2_audio_sharded"
    ref.save_pretrained(sharded, max_shard_size="40KB")
    shutil.copy(path / "preprocessor_config.json", sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    audio_files = {f for k, f in index.items() if k.startswith(("audio_tower.", "multi_modal_projector."))}
    assert len(set(index.values())) > len(audio_files)  # some shards hold only language-model tensors
    model = build_encoder_model(sharded)
    assert {p.name for p in model.opened_files} == audio_files
    reader = CheckpointReader(sharded, prefixes=type(model.module).checkpoint_prefixes)
    assert not any(k.startswith(("language_model.", "lm_head.")) for k in reader.keys())


def test_a_checkpoint_k_bias_is_loaded_when_present(whisper, root):
    path = whisper[0]
    with_k = root / "whisper_k_bias"
    with_k.mkdir(exist_ok=True)
    shutil.copy(path / "config.json", with_k)
    reader = CheckpointReader(path, prefixes=("model.encoder.",))
    state = {k: v.clone() for k, v in reader}
    k_bias = torch.arange(32, dtype=torch.float32)
    state["model.encoder.layers.1.self_attn.k_proj.bias"] = k_bias
    save_file(state, str(with_k / "model.safetensors"))
    model = build_encoder_model(with_k)
    qkv = model.module.encoder.layers[1].self_attn.qkv_proj
    assert torch.equal(qkv.bias[32:64], k_bias)
    other = model.module.encoder.layers[0].self_attn.qkv_proj
    assert torch.all(other.bias[32:64] == 0)


@pytest.mark.parametrize("name, gone, param", [
    ("whisper", "model.encoder.layer_norm.weight", r"encoder\.layer_norm\.weight"),
    ("qwen2_audio", "multi_modal_projector.linear.bias", r"multi_modal_projector\.linear\.bias"),
])
def test_a_missing_tower_tensor_is_named(name, gone, param, whisper, qwen2_audio, root, tmp_path):
    src = {"whisper": whisper, "qwen2_audio": qwen2_audio}[name][0]
    dst = tiny.without_tensors(src, tmp_path / name, gone)
    with pytest.raises(MissingWeightsError, match=param):
        build_encoder_model(dst)


def test_dummy_weights_and_unsupported_checkpoints(qwen2_audio, root):
    model = build_encoder_model(qwen2_audio[0], dummy=True)
    out = model.encode([model.prepare(pcm_item(synth(2.0)), 0)])[0].embedding
    assert out.shape == (50, 64) and torch.isfinite(out).all() and model.opened_files == []
    llama = tiny.ensure("llama", root)
    with pytest.raises(ConfigError, match="no audio tower this service serves"):
        build_encoder_model(llama)
    with pytest.raises(ConfigError, match="whisper_rows"):
        build_encoder_model(qwen2_audio[0], options={"whisper_rows": "some"})


def test_too_short_and_wrong_items_are_rejected(qwen2_audio):
    model = build_encoder_model(qwen2_audio[0], options={"max_audio_seconds": 10, "warmup": False})
    with pytest.raises(InvalidArgument, match=r"items\[4\]: audio of 100 samples .* too short"):
        model.prepare(pcm_item(synth(100 / SR)), 4)
    with pytest.raises(InvalidArgument, match=r"items\[1\]: pixels are an image"):
        model.prepare(pb.EncodeItem(pixels=to_proto(torch.zeros(2, 2, 3, dtype=torch.uint8))), 1)
    with pytest.raises(InvalidArgument, match=r"items\[0\]: no audio"):
        model.prepare(pb.EncodeItem(), 0)
    with pytest.raises(InvalidArgument, match=r"items\[3\]: audio is 11.0 s long; this server accepts at most 10 s"):
        model.prepare(pcm_item(synth(11.0)), 3)


def test_cache_keys_follow_content_and_preprocessing(whisper):
    path = whisper[0]
    valid = build_encoder_model(path, options={"warmup": False})
    full = build_encoder_model(path, options={"whisper_rows": "full", "warmup": False})
    a, b = synth(1.0, 1), synth(1.0, 2)
    key = lambda m, x, rate=SR: m.prepare(pcm_item(x, rate), 0).cache_key  # noqa: E731
    assert key(valid, a) == key(valid, a.copy())
    assert len({key(valid, a), key(valid, b), key(full, a), key(valid, a, 22050)}) == 4


# -- CUDA ---------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["whisper", "qwen2_audio"])
def test_bf16_on_cuda_is_as_close_to_fp32_as_the_reference_in_bf16(name, whisper, qwen2_audio):
    clips = [synth(3.3, 1), synth(30.0, 2), synth(0.7, 3)]
    path = whisper[0] if name == "whisper" else qwen2_audio[0]
    fp32 = build_encoder_model(path)
    bf16 = build_encoder_model(path, device="cuda", dtype=torch.bfloat16)
    exact = fp32.encode([fp32.prepare(pcm_item(c), i) for i, c in enumerate(clips)])
    ours = bf16.encode([bf16.prepare(pcm_item(c), i) for i, c in enumerate(clips)])
    if name == "whisper":
        ref = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).model.encoder.cuda().eval()
        fe = whisper[2]
        theirs = [whisper_reference(ref, fe, c) for c in clips]
    else:
        ref = Qwen2AudioForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
        processor = qwen2_audio[2]
        theirs = []
        for c in clips:
            inputs = processor(text="<|AUDIO|>", audio=c, sampling_rate=SR, return_tensors="pt")
            captured = {}
            hook = ref.model.language_model.register_forward_pre_hook(
                lambda m, a, kw: captured.update(e=kw["inputs_embeds"]), with_kwargs=True)
            with torch.no_grad():
                ref(**{k: v.cuda() for k, v in inputs.items()})
            hook.remove()
            theirs.append(captured["e"][0][inputs["input_ids"][0].cuda() == ref.config.audio_token_id])
    for e, o, t in zip(exact, ours, theirs):
        assert o.embedding.dtype == torch.bfloat16 and o.embedding.shape == e.embedding.shape
        our_err = (o.embedding.float().cpu() - e.embedding).abs().max().item()
        their_err = (t.float().cpu() - e.embedding).abs().max().item()
        assert our_err <= 2 * their_err + 2e-2 * e.embedding.abs().max().item()
