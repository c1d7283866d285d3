"""load_weights against real transformers checkpoints: strict, mapped, stacked, materialised from meta.

The module trees here are built from modalmesh.layers only, with the names a
model file would use; each test compares the loaded tensors (and the layers'
outputs) with the reference model that wrote the checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError
from modalmesh.layers import (
    MLP,
    GatedMLP,
    LayerNorm,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from modalmesh.metrics import Metrics
from modalmesh.weights import (
    LEGACY_BUFFERS,
    QKV_GATE_UP,
    CheckpointReader,
    MissingWeightsError,
    StackedMapping,
    UnexpectedWeightsError,
    WeightMismatchError,
    WeightsMapper,
    load_checkpoint,
    load_dummy_weights,
    load_weights,
    materialize,
)

# ---- tiny reference checkpoints ------------------------------------------------------------


def save_tiny_llama(path, *, tie=False, max_shard_size=None, seed=0, kv_heads=2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    ref = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1: make them informative
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    ref.save_pretrained(path, **kwargs)
    return ref


def save_tiny_neox(path, seed=0):
    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5)
    ref = GPTNeoXForCausalLM(cfg).eval()
    ref.save_pretrained(path)
    return ref


# ---- module trees built from modalmesh.layers ------------------------------------------------


class LlamaAttentionWeights(nn.Module):
    def __init__(self, cfg: ModelConfig, **tp):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=False, **tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False, **tp)


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, **tp):
        super().__init__()
        self.self_attn = LlamaAttentionWeights(cfg, **tp)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, **tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class LlamaTree(nn.Module):
    """The parameter tree of a Llama causal LM (no attention math: that is modalmesh.attention's)."""

    def __init__(self, cfg: ModelConfig, *, tie: bool | None = None, **tp):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, **tp)
        self.model.layers = nn.ModuleList(LlamaLayer(cfg, **tp) for _ in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, **tp)
        if cfg.tie_word_embeddings if tie is None else tie:
            self.lm_head.tie_to(self.model.embed_tokens)


class NeoxLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = nn.Module()
        self.attention.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, bias=True)
        self.attention.dense = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, names=("dense_h_to_4h", "dense_4h_to_h"))


class NeoxTree(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_in = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(NeoxLayer(cfg) for _ in range(cfg.num_layers))
        self.model.final_layer_norm = LayerNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)


NEOX_MAPPER = WeightsMapper(prefix={"gpt_neox.": "model.", "embed_out.": "lm_head."}) | LEGACY_BUFFERS
NEOX_STACKED = StackedMapping([("qkv_proj", "query_key_value", "qkv_per_head")])


def build_llama(path, **kw) -> tuple[LlamaTree, ModelConfig]:
    cfg = ModelConfig.from_hf(path)
    with torch.device("meta"):
        model = LlamaTree(cfg, **kw)
    return model, cfg


def check_llama_matches(model: LlamaTree, ref: LlamaForCausalLM, atol=1e-6):
    sd = ref.state_dict()
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        torch.testing.assert_close(layer.self_attn.qkv_proj.weight, qkv, atol=atol, rtol=0)
        gate_up = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        torch.testing.assert_close(layer.mlp.gate_up_proj.weight, gate_up, atol=atol, rtol=0)
        for mine, theirs in [(layer.self_attn.o_proj.weight, "self_attn.o_proj.weight"),
                             (layer.mlp.down_proj.weight, "mlp.down_proj.weight"),
                             (layer.input_layernorm.weight, "input_layernorm.weight"),
                             (layer.post_attention_layernorm.weight, "post_attention_layernorm.weight")]:
            torch.testing.assert_close(mine, sd[p + theirs], atol=atol, rtol=0)
        # The layers compute what the reference's modules compute.
        x = torch.randn(3, 5, ref.config.hidden_size)
        hf = ref.model.layers[i]
        with torch.no_grad():
            torch.testing.assert_close(layer.mlp(x), hf.mlp(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(layer.input_layernorm(x), hf.input_layernorm(x), atol=1e-5, rtol=1e-5)
            q, k, v = layer.self_attn.qkv_proj.split(layer.self_attn.qkv_proj(x))
            torch.testing.assert_close(q, hf.self_attn.q_proj(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(k, hf.self_attn.k_proj(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, hf.self_attn.v_proj(x), atol=1e-5, rtol=1e-5)
    ids = torch.randint(0, ref.config.vocab_size, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model.model.embed_tokens(ids), ref.model.embed_tokens(ids))
        h = torch.randn(2, 7, ref.config.hidden_size)
        torch.testing.assert_close(model.lm_head(h), ref.lm_head(h), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.model.norm(h), ref.model.norm(h), atol=1e-5, rtol=1e-5)


# ---- Llama ---------------------------------------------------------------------------------


def test_llama_loads_strictly_from_meta_and_matches_reference(tmp_path):
    ref = save_tiny_llama(tmp_path)
    model, _ = build_llama(tmp_path)
    assert model.lm_head.weight.is_meta
    metrics = Metrics("t", process_metrics=False)
    report = load_weights(model, CheckpointReader(tmp_path), stacked=QKV_GATE_UP, device="cpu",
                          dtype=torch.float32, metrics=metrics)
    check_llama_matches(model, ref)
    assert sorted(report.loaded) == sorted(ref.state_dict())
    assert report.skipped == [] and report.missing == [] and report.unexpected == []
    assert report.bytes == sum(t.nbytes for t in ref.state_dict().values())
    assert metrics.registry.get_sample_value("modalmesh_weight_load_bytes", {"service": "t"}) == report.bytes
    assert metrics.registry.get_sample_value("modalmesh_weight_load_seconds", {"service": "t"}) == report.seconds > 0
    gbps = metrics.registry.get_sample_value("modalmesh_weight_load_bytes_per_second", {"service": "t"})
    assert gbps == pytest.approx(report.bytes / report.seconds)


def test_sharded_checkpoint_loads_every_shard(tmp_path):
    ref = save_tiny_llama(tmp_path, max_shard_size="8KB", seed=1)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 3 and (tmp_path / "model.safetensors.index.json").is_file()
    model, _ = build_llama(tmp_path)
    reader = CheckpointReader(tmp_path)
    load_weights(model, reader, stacked=QKV_GATE_UP, metrics=False)
    check_llama_matches(model, ref)
    assert sorted(reader.opened_files) == shards


def test_tied_embeddings_are_exempt_and_shared(tmp_path):
    ref = save_tiny_llama(tmp_path, tie=True)
    assert "lm_head.weight" not in CheckpointReader(tmp_path).keys()
    model, cfg = build_llama(tmp_path)
    assert cfg.tie_word_embeddings
    load_weights(model, CheckpointReader(tmp_path), stacked=QKV_GATE_UP, metrics=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after materialisation
    check_llama_matches(model, ref)


def test_untied_model_without_lm_head_tensor_names_the_missing_parameter(tmp_path):
    save_tiny_llama(tmp_path, tie=True)
    model, _ = build_llama(tmp_path, tie=False)
    with pytest.raises(MissingWeightsError, match=r"lm_head\.weight"):
        load_weights(model, CheckpointReader(tmp_path), stacked=QKV_GATE_UP, metrics=False)
    # ...unless the caller says it may stay missing.
    model, _ = build_llama(tmp_path, tie=False)
    report = load_weights(model, CheckpointReader(tmp_path), stacked=QKV_GATE_UP, metrics=False,
                          allow_missing=["lm_head.*"])
    assert report.missing == []


def test_half_loaded_fused_parameter_is_missing(tmp_path):
    ref = save_tiny_llama(tmp_path)
    model, _ = build_llama(tmp_path)
    pairs = [(k, v) for k, v in ref.state_dict().items() if k != "model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(MissingWeightsError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight \(shards \['v'\]\)"):
        load_weights(model, pairs, stacked=QKV_GATE_UP, metrics=False)


def test_unexpected_tensor_fails_loudly_with_nearest_names(tmp_path):
    ref = save_tiny_llama(tmp_path)
    sd = dict(ref.state_dict())
    sd["model.nrom.weight"] = sd.pop("model.norm.weight")  # a typo'd key
    model, _ = build_llama(tmp_path)
    with pytest.raises(UnexpectedWeightsError) as e:
        load_weights(model, sd.items(), stacked=QKV_GATE_UP, metrics=False)
    assert "model.nrom.weight" in str(e.value) and "nearest: model.norm.weight" in str(e.value)


def test_unexpected_key_fails_before_any_tensor_is_read(tmp_path, monkeypatch):
    ref = save_tiny_llama(tmp_path)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(sd, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(CheckpointReader, "_read", staticmethod(lambda *a: pytest.fail("read a tensor")))
    model, _ = build_llama(tmp_path)
    with pytest.raises(UnexpectedWeightsError, match=r"rotary_emb\.inv_freq"):
        load_weights(model, CheckpointReader(tmp_path), stacked=QKV_GATE_UP, metrics=False)
    monkeypatch.undo()
    # The skip rule for legacy buffers makes the same checkpoint load, and says what it dropped.
    report = load_weights(model, CheckpointReader(tmp_path), mapper=LEGACY_BUFFERS, stacked=QKV_GATE_UP,
                          metrics=False)
    assert report.skipped == ["model.layers.0.self_attn.rotary_emb.inv_freq"]
    check_llama_matches(model, ref)


def test_non_strict_load_reports_instead_of_raising(tmp_path):
    ref = save_tiny_llama(tmp_path)
    sd = dict(ref.state_dict())
    sd["extra.weight"] = torch.zeros(2)
    del sd["model.norm.weight"]
    model, _ = build_llama(tmp_path)
    report = load_weights(model, sd.items(), stacked=QKV_GATE_UP, strict=False, metrics=False)
    assert report.unexpected == ["extra.weight"] and report.missing == ["model.norm.weight"]


def test_shape_and_dtype_mismatches_name_the_tensor(tmp_path):
    ref = save_tiny_llama(tmp_path)
    sd = dict(ref.state_dict())
    sd["model.layers.0.mlp.down_proj.weight"] = torch.zeros(32, 47)
    model, _ = build_llama(tmp_path)
    with pytest.raises(WeightMismatchError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*\[32, 47\]"):
        load_weights(model, sd.items(), stacked=QKV_GATE_UP, metrics=False)
    sd = dict(ref.state_dict())
    sd["model.norm.weight"] = torch.ones(32, dtype=torch.int32)
    with pytest.raises(WeightMismatchError, match=r"model\.norm\.weight.*int32"):
        load_weights(model, sd.items(), stacked=QKV_GATE_UP, metrics=False)
    sd = dict(ref.state_dict())
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)  # one KV head short
    with pytest.raises(WeightMismatchError, match=r"k_proj\.weight -> model\.layers\.0\.self_attn\.qkv_proj\.weight shard 'k'"):
        load_weights(model, sd.items(), stacked=QKV_GATE_UP, metrics=False)


def test_target_dtype_is_applied(tmp_path):
    ref = save_tiny_llama(tmp_path)
    model, _ = build_llama(tmp_path)
    load_weights(model, CheckpointReader(tmp_path), stacked=QKV_GATE_UP, dtype=torch.bfloat16, metrics=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    torch.testing.assert_close(model.model.norm.weight, ref.model.norm.weight.to(torch.bfloat16), atol=0, rtol=0)


# ---- GPT-NeoX: prefixes, legacy buffers, per-head interleaved QKV ---------------------------


def test_gpt_neox_prefix_rules_skips_and_interleaved_qkv(tmp_path):
    ref = save_tiny_neox(tmp_path)
    # An old Pythia checkpoint also persisted the causal-mask buffers.
    sd = load_file(str(tmp_path / "model.safetensors"))  # the on-disk names (gpt_neox., embed_out.)
    assert "embed_out.weight" in sd
    sd["gpt_neox.layers.0.attention.bias"] = torch.tril(torch.ones(1, 1, 64, 64, dtype=torch.bool))
    sd["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    save_file(sd, str(tmp_path / "model.safetensors"))
    cfg = ModelConfig.from_hf(tmp_path)
    assert cfg.rope.rotary_dim == cfg.head_dim // 2

    with torch.device("meta"):
        model = NeoxTree(cfg)
    no_skips = WeightsMapper(prefix={"gpt_neox.": "model.", "embed_out.": "lm_head."})
    with pytest.raises(UnexpectedWeightsError, match=r"attention\.masked_bias"):
        load_weights(model, CheckpointReader(tmp_path), mapper=no_skips, stacked=NEOX_STACKED, metrics=False)

    report = load_weights(model, CheckpointReader(tmp_path), mapper=NEOX_MAPPER, stacked=NEOX_STACKED, metrics=False)
    assert sorted(report.skipped) == ["gpt_neox.layers.0.attention.bias", "gpt_neox.layers.0.attention.masked_bias"]
    torch.testing.assert_close(model.lm_head.weight, ref.lm_head.weight)
    torch.testing.assert_close(model.model.embed_in.weight, ref.gpt_neox.embed_in.weight)
    x = torch.randn(2, 5, cfg.hidden_size)
    H, D = cfg.num_heads, cfg.head_dim
    with torch.no_grad():
        for mine, theirs in zip(model.model.layers, ref.gpt_neox.layers):
            # Reference: GPTNeoXAttention views query_key_value's output as (heads, 3 * head_dim).
            fused = theirs.attention.query_key_value(x).view(2, 5, H, 3 * D)
            q_ref, k_ref, v_ref = fused.chunk(3, dim=-1)
            q, k, v = mine.attention.qkv_proj.split(mine.attention.qkv_proj(x))
            torch.testing.assert_close(q.view(2, 5, H, D), q_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(k.view(2, 5, H, D), k_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v.view(2, 5, H, D), v_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.attention.dense(x), theirs.attention.dense(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.mlp(x), theirs.mlp(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.input_layernorm(x), theirs.input_layernorm(x), atol=1e-5, rtol=1e-5)


# ---- meta materialisation and dummy weights --------------------------------------------------


def test_dummy_weights_have_the_same_shapes_and_are_reproducible(tmp_path):
    save_tiny_llama(tmp_path)
    real, _ = build_llama(tmp_path)
    load_weights(real, CheckpointReader(tmp_path), stacked=QKV_GATE_UP, metrics=False)
    a, _ = build_llama(tmp_path)
    b, _ = build_llama(tmp_path)
    metrics = Metrics("t", process_metrics=False)
    report = load_dummy_weights(a, dtype=torch.float16, seed=3, metrics=metrics)
    load_dummy_weights(b, dtype=torch.float16, seed=3, metrics=False)
    shapes = {n: tuple(p.shape) for n, p in real.named_parameters()}
    assert {n: tuple(p.shape) for n, p in a.named_parameters()} == shapes
    assert report.dummy and report.bytes == sum(p.numel() * 2 for p in a.parameters())
    assert metrics.registry.get_sample_value("modalmesh_weight_load_bytes", {"service": "t"}) == report.bytes
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert pa.dtype == torch.float16 and not pa.is_meta
        torch.testing.assert_close(pa, pb, atol=0, rtol=0)
        if "norm" in name:
            assert torch.all(pa == 1)
        else:
            assert pa.abs().max() <= 1e-3 and pa.std() > 0


def test_materialize_keeps_loaders_ties_and_computes_meta_buffers():
    class Rotaryish(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.empty(4), persistent=False)

        def reset_buffers(self):
            self.inv_freq.copy_(torch.arange(4.0))

    with torch.device("meta"):
        model = nn.Module()
        model.emb = VocabParallelEmbedding(10, 4)
        model.head = ParallelLMHead(10, 4)
        model.head.tie_to(model.emb)
        model.rot = Rotaryish()
    materialize(model, "cpu", torch.float32)
    assert model.head.weight is model.emb.weight and not model.emb.weight.is_meta
    assert model.emb.weight.weight_loader.__self__ is model.emb
    torch.testing.assert_close(model.rot.inv_freq, torch.arange(4.0))

    with torch.device("meta"):
        bad = nn.Module()
        bad.register_buffer("mask", torch.empty(3), persistent=False)
    with pytest.raises(ConfigError, match="reset_buffers"):
        materialize(bad, "cpu")


def test_progress_bar_on_request_and_load_checkpoint(tmp_path, capsys):
    ref = save_tiny_llama(tmp_path)
    capsys.readouterr()
    model, _ = build_llama(tmp_path)
    load_weights(model, CheckpointReader(tmp_path), stacked=QKV_GATE_UP, progress=True, metrics=False)
    assert "loading weights" in capsys.readouterr().err
    model, _ = build_llama(tmp_path)
    load_weights(model, CheckpointReader(tmp_path), stacked=QKV_GATE_UP, progress=False, metrics=False)
    assert "loading weights" not in capsys.readouterr().err

    # The one call a service makes, real or --dummy-weights.
    model, _ = build_llama(tmp_path)
    report = load_checkpoint(model, tmp_path, stacked=QKV_GATE_UP, prefixes=("model.", "lm_head."), metrics=False)
    assert not report.dummy
    check_llama_matches(model, ref)
    model, _ = build_llama(tmp_path)
    assert load_checkpoint(model, tmp_path, dummy=True, metrics=False).dummy
