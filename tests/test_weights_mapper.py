"""WeightsMapper / StackedMapping rules, and vision attention renames against a real SigLIP checkpoint."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import SiglipVisionConfig, SiglipVisionModel

from modalmesh.config import ModelConfig
from modalmesh.layers import MLP, LayerNorm, QKVParallelLinear, RowParallelLinear
from modalmesh.weights import (
    IDENTITY,
    LEGACY_BUFFERS,
    QKV_GATE_UP,
    CheckpointReader,
    StackedMapping,
    UnexpectedWeightsError,
    WeightsMapper,
    load_weights,
)


def test_prefix_rewrites_and_drops():
    m = WeightsMapper(prefix={"gpt_neox.": "model.", "embed_out.": "lm_head.", "model.visual.": "visual."})
    assert m.apply("gpt_neox.layers.3.mlp.dense_h_to_4h.weight") == "model.layers.3.mlp.dense_h_to_4h.weight"
    assert m.apply("embed_out.weight") == "lm_head.weight"
    assert m.apply("model.visual.blocks.0.attn.qkv.weight") == "visual.blocks.0.attn.qkv.weight"
    assert m.apply("lm_head.weight") == "lm_head.weight"  # no rule: unchanged
    assert m.apply("xgpt_neox.w") == "xgpt_neox.w"  # prefixes anchor at the start
    assert WeightsMapper(prefix={"audio_tower.": None}).apply("audio_tower.conv1.weight") is None


def test_skip_rules():
    m = WeightsMapper(skip_prefixes=("visual.",), skip_substrs=("rotary_emb.inv_freq",), skip_suffixes=(".masked_bias",))
    assert m.apply("visual.blocks.0.norm1.weight") is None
    assert m.apply("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert m.apply("h.0.attn.masked_bias") is None
    assert m.apply("model.layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight"
    # The legacy-buffer rule drops the causal mask but not the attention output projection's bias.
    assert LEGACY_BUFFERS.apply("gpt_neox.layers.0.attention.bias") is None
    assert LEGACY_BUFFERS.apply("transformer.h.0.attn.bias") is None
    assert LEGACY_BUFFERS.apply("gpt_neox.layers.0.attention.dense.bias") == "gpt_neox.layers.0.attention.dense.bias"
    assert LEGACY_BUFFERS.apply("transformer.h.0.attn.c_proj.bias") == "transformer.h.0.attn.c_proj.bias"


def test_substring_suffix_and_regex_rewrites_apply_in_order():
    m = WeightsMapper(
        substr={".attention.wqkv.": ".attn.qkv_proj.", ".attention.wo.": ".attn.proj."},
        suffix={".gamma": ".weight", ".beta": ".bias"},
        regex=[(r"^layers\.(\d+)\.", r"blocks.\1.")],
    )
    assert m.apply("layers.12.attention.wqkv.weight") == "blocks.12.attn.qkv_proj.weight"
    assert m.apply("layers.0.attention.wo.bias") == "blocks.0.attn.proj.bias"
    assert m.apply("layers.0.norm.gamma") == "blocks.0.norm.weight"
    assert m.apply("layers.0.norm.beta") == "blocks.0.norm.bias"
    assert WeightsMapper(regex=[(r"\.lora_[AB]\.", None)]).apply("x.lora_A.weight") is None


def test_mappers_compose_left_to_right():
    a = WeightsMapper(prefix={"model.language_model.": "model."})
    b = WeightsMapper(substr={".self_attn.": ".attn."})
    c = WeightsMapper(skip_substrs=(".attn.",))
    assert (a | b).apply("model.language_model.layers.0.self_attn.q_proj.weight") == "model.layers.0.attn.q_proj.weight"
    assert (b | a).apply("model.language_model.layers.0.self_attn.q_proj.weight") == "model.layers.0.attn.q_proj.weight"
    # `c` sees what `b` produced, so it drops a name `b` rewrote...
    assert (b | c).apply("l.self_attn.q.weight") is None
    # ...but `c` first sees the original name, which has no ".attn.".
    assert (c | b).apply("l.self_attn.q.weight") == "l.attn.q.weight"
    assert ((a | b) | c) == (a | (b | c))
    assert (IDENTITY | b).apply("x.self_attn.y") == "x.attn.y"


def test_stacked_mapping_matches_whole_segments():
    assert QKV_GATE_UP.match("model.layers.0.self_attn.q_proj.weight") == ("model.layers.0.self_attn.qkv_proj.weight", "q")
    assert QKV_GATE_UP.match("model.layers.0.self_attn.v_proj.bias") == ("model.layers.0.self_attn.qkv_proj.bias", "v")
    assert QKV_GATE_UP.match("model.layers.0.mlp.up_proj.weight") == ("model.layers.0.mlp.gate_up_proj.weight", 1)
    assert QKV_GATE_UP.match("model.layers.0.self_attn.qkv_proj.weight") is None
    assert QKV_GATE_UP.match("model.layers.0.self_attn.kq_proj.weight") is None
    assert QKV_GATE_UP.match("model.layers.0.self_attn.o_proj.weight") is None
    neox = StackedMapping([("qkv_proj", "attention.query_key_value", "qkv_per_head")])
    assert neox.match("model.layers.2.attention.query_key_value.bias") == ("model.layers.2.qkv_proj.bias", "qkv_per_head")
    both = QKV_GATE_UP + neox
    assert len(both.entries) == len(QKV_GATE_UP.entries) + 1


# ---- vision attention renames, checked against a real SigLIP vision tower ---------------------


class SiglipLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.norm_eps)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = nn.Module()
        self.attn.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, bias=True)
        self.attn.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)


class SiglipTree(nn.Module):
    def __init__(self, cfg: ModelConfig, patch: int, positions: int):
        super().__init__()
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(3, cfg.hidden_size, patch, patch)
        self.embeddings.position_embedding = nn.Embedding(positions, cfg.hidden_size)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipLayer(cfg) for _ in range(cfg.num_layers))
        self.post_layernorm = LayerNorm(cfg.hidden_size, cfg.norm_eps)


SIGLIP_MAPPER = WeightsMapper(prefix={"vision_model.": ""}, substr={".self_attn.": ".attn.", ".out_proj.": ".proj."})


@pytest.fixture()
def siglip(tmp_path):
    torch.manual_seed(0)
    hf_cfg = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=28, patch_size=14, vision_use_head=False)
    ref = SiglipVisionModel(hf_cfg).eval()
    ref.save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(tmp_path, part="text")  # a bare vision config is its own "text" section
    with torch.device("meta"):
        tree = SiglipTree(cfg, 14, 4)
    return tmp_path, ref, tree


def _check_siglip(tree, ref):
    x = torch.randn(2, 4, 32)
    with torch.no_grad():
        for mine, theirs in zip(tree.encoder.layers, ref.encoder.layers):
            q, k, v = mine.attn.qkv_proj.split(mine.attn.qkv_proj(x))
            torch.testing.assert_close(q, theirs.self_attn.q_proj(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(k, theirs.self_attn.k_proj(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, theirs.self_attn.v_proj(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.attn.proj(x), theirs.self_attn.out_proj(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.mlp(x), theirs.mlp(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.layer_norm2(x), theirs.layer_norm2(x), atol=1e-5, rtol=1e-5)
        img = torch.randn(1, 3, 28, 28)
        torch.testing.assert_close(tree.embeddings.patch_embedding(img),
                                   ref.embeddings.patch_embedding(img), atol=1e-5, rtol=1e-5)


def test_q_k_v_out_proj_checkpoint_loads_into_qkv_proj_and_proj(siglip):
    path, ref, tree = siglip
    with pytest.raises(UnexpectedWeightsError, match=r"out_proj"):  # no rename: fails loudly
        load_weights(tree, CheckpointReader(path), stacked=QKV_GATE_UP, metrics=False)
    load_weights(tree, CheckpointReader(path), mapper=SIGLIP_MAPPER, stacked=QKV_GATE_UP, metrics=False)
    _check_siglip(tree, ref)


def test_fused_wqkv_wo_checkpoint_loads_into_the_same_tree(siglip):
    path, ref, tree = siglip
    sd = load_file(str(path / "model.safetensors"))
    fused = {}
    for name, t in sd.items():
        if ".self_attn.q_proj." in name:
            parts = [sd[name.replace(".q_proj.", f".{p}_proj.")] for p in "qkv"]
            fused[name.replace(".self_attn.q_proj.", ".attention.wqkv.")] = torch.cat(parts).contiguous()
        elif ".self_attn.out_proj." in name:
            fused[name.replace(".self_attn.out_proj.", ".attention.wo.")] = t
        elif ".self_attn." not in name:
            fused[name] = t
    # Hub SigLIP checkpoints (the full SiglipModel) also carry a "vision_model." prefix.
    fused = {f"vision_model.{name}": t for name, t in fused.items()}
    (path / "model.safetensors").unlink()
    save_file(fused, str(path / "model.safetensors"))
    mapper = WeightsMapper(prefix={"vision_model.": ""},
                           substr={".attention.wqkv.": ".attn.qkv_proj.", ".attention.wo.": ".attn.proj."})
    report = load_weights(tree, CheckpointReader(path), mapper=mapper, metrics=False)
    assert "vision_model.encoder.layers.0.attention.wqkv.weight" in report.loaded
    _check_siglip(tree, ref)
