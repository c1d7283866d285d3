"""ModelConfig.from_hf: one normalised view of many config layouts and sentinels."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    LlamaConfig,
    Qwen2AudioConfig,
    Qwen2VLConfig,
)

from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=100,
             max_position_embeddings=256, rms_norm_eps=1e-5, hidden_act="silu", rope_theta=500000.0,
             torch_dtype="bfloat16", eos_token_id=[2, 3], bos_token_id=1)


def test_plain_llama_dict():
    cfg = ModelConfig.from_hf(LLAMA)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (64, 2, 4, 2)
    assert cfg.head_dim == 16 and cfg.v_head_dim == 16  # head_dim absent: hidden / heads
    assert cfg.rope.theta == 500000.0 and cfg.rope.rotary_dim == 16 and cfg.rope.type == "default"
    assert cfg.dtype == torch.bfloat16 and cfg.eos_token_ids == (2, 3) and cfg.max_position_embeddings == 256
    assert cfg.layer_types == ("full_attention",) * 2 and cfg.sliding_window is None and not cfg.is_mla


@pytest.mark.parametrize(("given", "expected"), [(None, 16), (0, 16), (24, 24)])
def test_v_head_dim_absent_or_zero_means_head_dim(given, expected):
    raw = dict(LLAMA)
    if given is not None:
        raw["v_head_dim"] = given
    assert ModelConfig.from_hf(raw).v_head_dim == expected


@pytest.mark.parametrize(("given", "expected"), [(None, 16), (0, 16), (32, 32)])
def test_head_dim_absent_or_zero_is_derived(given, expected):
    raw = dict(LLAMA, head_dim=given)
    cfg = ModelConfig.from_hf(raw)
    assert cfg.head_dim == expected and cfg.v_head_dim == expected and cfg.rope.rotary_dim == expected


def test_head_dim_absent_and_not_derivable():
    with pytest.raises(ConfigError, match="not divisible by 5 heads"):
        ModelConfig.from_hf(dict(LLAMA, num_attention_heads=5, num_key_value_heads=5))


def test_deepseek_vl2_language_config_with_zero_sentinels_is_not_mla():
    raw = {
        "model_type": "deepseek_vl_v2", "architectures": ["DeepseekVLV2ForCausalLM"],
        "language_config": {"model_type": "deepseek_v2", "hidden_size": 1280, "num_hidden_layers": 12,
                            "num_attention_heads": 10, "num_key_value_heads": 10, "intermediate_size": 6848,
                            "vocab_size": 129280, "kv_lora_rank": 512, "q_lora_rank": None,
                            "qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "v_head_dim": 0, "use_mla": False,
                            "rope_theta": 10000.0, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"},
        "vision_config": {"model_type": "vision", "layers": 27, "width": 1152},
    }
    cfg = ModelConfig.from_hf(raw)
    assert not cfg.is_mla and cfg.kv_lora_rank is None
    assert cfg.head_dim == 128 and cfg.v_head_dim == 128  # never a zero-width V cache
    assert cfg.num_kv_heads == 10 and cfg.dtype == torch.bfloat16


def test_mla_config():
    hf = DeepseekV3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                          kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                          intermediate_size=96, moe_intermediate_size=32, vocab_size=100)
    cfg = ModelConfig.from_hf(hf)
    assert cfg.is_mla and (cfg.kv_lora_rank, cfg.q_lora_rank) == (16, 24)
    assert cfg.head_dim == 12 and cfg.v_head_dim == 6  # q/k: nope + rope; v: its own
    assert cfg.rope.rotary_dim == 4 and cfg.num_kv_heads == 4
    # The same as a raw dict, without transformers' derived fields.
    raw = {"model_type": "deepseek_v2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 0}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.is_mla and cfg.head_dim == 12 and cfg.v_head_dim == 12  # v_head_dim 0: derived as always


def test_qwen2_vl_transformers5_nested_saved_checkpoint(tmp_path):
    hf = Qwen2VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=3, embed_dim=48, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=14),
        image_token_id=60, video_token_id=61)
    hf.save_pretrained(tmp_path)
    assert "text_config" in json.loads((tmp_path / "config.json").read_text())
    cfg = ModelConfig.from_hf(tmp_path)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 2, 4, 2, 8)
    assert cfg.rope.type == "mrope" and cfg.rope.mrope_section == (2, 1, 1) and cfg.rope.theta == 1e6
    assert cfg.image_token_id == 60 and cfg.video_token_id == 61  # top-level keys reach the LM's view
    assert cfg.model_type == "qwen2_vl" and cfg.part == "text"
    vis = ModelConfig.from_hf(tmp_path, part="vision")
    assert (vis.hidden_size, vis.num_layers, vis.num_heads, vis.head_dim) == (48, 3, 4, 12)
    assert vis.intermediate_size == 96  # mlp_ratio * embed_dim
    with pytest.raises(ConfigError, match="no audio sub-config"):
        ModelConfig.from_hf(tmp_path, part="audio")


def test_qwen2_vl_transformers4_flat_layout():
    raw = {"model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"], "hidden_size": 3584,
           "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
           "vocab_size": 152064, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
           "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "image_token_id": 151655,
           "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 28,
           "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "num_heads": 16, "mlp_ratio": 4}}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.head_dim == 128 and cfg.num_kv_heads == 4 and cfg.rope.mrope_section == (16, 24, 24)
    assert cfg.rope.type == "mrope" and cfg.rope.theta == 1e6
    assert cfg.sliding_window is None and not any(map(cfg.layer_is_sliding, range(28)))
    vis = ModelConfig.from_hf(raw, part="vision")
    assert (vis.hidden_size, vis.num_layers, vis.head_dim) == (1280, 32, 80)  # embed_dim, not the LM's width


def test_mrope_section_must_fit_rotary_dim():
    raw = dict(LLAMA, rope_scaling={"type": "mrope", "mrope_section": [4, 4, 4]})
    with pytest.raises(ConfigError, match="sums to 12"):
        ModelConfig.from_hf(raw)


def test_qwen2_audio_nested_text_and_audio(tmp_path):
    hf = Qwen2AudioConfig(
        text_config={"model_type": "qwen2", "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 6,
                     "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 120},
        audio_config={"d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 4, "encoder_ffn_dim": 64,
                      "num_mel_bins": 16, "max_source_positions": 50},
        audio_token_index=110)
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(tmp_path)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (48, 6, 2, 8, 120)
    assert cfg.audio_token_id == 110
    audio = ModelConfig.from_hf(tmp_path, part="audio")
    assert (audio.hidden_size, audio.num_layers, audio.num_heads, audio.intermediate_size) == (32, 2, 4, 64)
    assert audio.max_position_embeddings == 50 and audio.head_dim == 8


def test_partial_saved_text_config_gets_class_defaults(tmp_path):
    # Qwen2-Audio-7B's config.json lists only a few text_config keys; the rest are Qwen2 defaults.
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2_audio", "architectures": ["Qwen2AudioForConditionalGeneration"],
        "text_config": {"model_type": "qwen2", "vocab_size": 156032, "intermediate_size": 11008,
                        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"},
        "audio_config": {"model_type": "qwen2_audio_encoder"}}))
    cfg = ModelConfig.from_hf(tmp_path)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (4096, 32, 32, 32)
    assert cfg.vocab_size == 156032 and cfg.max_position_embeddings == 8192


def test_unknown_model_type_directory_reads_raw_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, model_type="my_private_lm")))
    cfg = ModelConfig.from_hf(tmp_path / "config.json")
    assert cfg.model_type == "my_private_lm" and cfg.head_dim == 16


@pytest.mark.parametrize(("extra", "kv"), [
    ({"num_key_value_heads": 2}, 2),
    ({"n_head_kv": 1}, 1),
    ({"multi_query_group_num": 2}, 2),
    ({"num_kv_heads": 4}, 4),
    ({"multi_query": True}, 1),
    ({}, 4),
    ({"num_key_value_heads": 0}, 4),
])
def test_kv_head_spellings(extra, kv):
    raw = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    assert ModelConfig.from_hf({**raw, **extra}).num_kv_heads == kv


def test_other_spellings_gpt2_style():
    raw = {"model_type": "gpt2", "n_embd": 48, "n_layer": 3, "n_head": 6, "n_positions": 128,
           "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new", "vocab_size": 50}
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim) == (48, 3, 6, 8)
    assert cfg.intermediate_size == 192 and cfg.hidden_act == "gelu_new" and cfg.norm_eps == 1e-5


def test_rope_normalisation_v4_and_v5_spellings():
    neox4 = {"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
             "rotary_pct": 0.25, "rotary_emb_base": 10000}
    r = ModelConfig.from_hf(neox4).rope
    assert r.rotary_dim == 4 and r.partial_rotary_factor == 0.25 and r.theta == 10000
    neox5 = {**neox4, "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.5}}
    r = ModelConfig.from_hf(neox5).rope
    assert r.rotary_dim == 8 and r.theta == 20000.0
    llama3 = dict(LLAMA, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    r = ModelConfig.from_hf(llama3).rope
    assert (r.type, r.factor, r.original_max_position_embeddings) == ("llama3", 8.0, 8192)
    assert r.get("high_freq_factor") == 4.0 and r.theta == 500000.0
    hf = ModelConfig.from_hf(LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                          "original_max_position_embeddings": 2048}))
    assert hf.rope.type == "yarn" and hf.rope.factor == 4.0


def test_sliding_window_variants():
    mistral = dict(LLAMA, sliding_window=4096)
    assert ModelConfig.from_hf(mistral).layer_types == ("sliding_attention",) * 2
    assert ModelConfig.from_hf(dict(LLAMA, sliding_window=0)).sliding_window is None  # 0: no window
    gemma = dict(LLAMA, num_hidden_layers=6, sliding_window=512, sliding_window_pattern=3)
    assert [ModelConfig.from_hf(gemma).layer_is_sliding(i) for i in range(6)] == [True, True, False] * 2
    qwen2 = dict(LLAMA, num_hidden_layers=4, sliding_window=64, use_sliding_window=True, max_window_layers=2)
    assert ModelConfig.from_hf(qwen2).layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    explicit = dict(mistral, layer_types=["full_attention", "sliding_attention"])
    assert ModelConfig.from_hf(explicit).layer_types == ("full_attention", "sliding_attention")


@pytest.mark.parametrize(("swa", "expected"), [
    ({}, (4, 2, 16, 16)),
    ({"swa_num_attention_heads": 0, "swa_num_key_value_heads": 0, "swa_head_dim": 0, "swa_v_head_dim": 0}, (4, 2, 16, 16)),
    ({"swa_num_attention_heads": 8, "swa_num_key_value_heads": 1, "swa_head_dim": 24, "swa_v_head_dim": 0}, (8, 1, 24, 24)),
    ({"swa_head_dim": 0, "swa_v_head_dim": 12}, (4, 2, 16, 12)),
])
def test_sliding_window_attention_dimensions_follow_the_same_rule(swa, expected):
    cfg = ModelConfig.from_hf(dict(LLAMA, sliding_window=128, **swa))
    assert (cfg.swa_num_heads, cfg.swa_num_kv_heads, cfg.swa_head_dim, cfg.swa_v_head_dim) == expected


def test_kv_heads_per_rank():
    cfg = ModelConfig.from_hf(LLAMA)  # 2 KV heads
    assert [cfg.kv_heads_per_rank(tp) for tp in (1, 2, 4, 8)] == [2, 1, 1, 1]
    with pytest.raises(ConfigError, match="cannot replicate 2 KV heads"):
        cfg.kv_heads_per_rank(3)


def test_frozen_and_hashable():
    cfg = ModelConfig.from_hf(LLAMA)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.head_dim = 3
    assert hash(cfg) == hash(ModelConfig.from_hf(dict(LLAMA)))
    assert cfg.get("rms_norm_eps") == 1e-5 and cfg.get("absent", 7) == 7
    with pytest.raises(TypeError):
        cfg.raw["hidden_size"] = 1  # read-only view


def test_missing_core_sizes_is_a_config_error():
    with pytest.raises(ConfigError, match="lacks hidden size"):
        ModelConfig.from_hf({"model_type": "x", "vocab_size": 10})
    with pytest.raises(ConfigError, match="part 'video'"):
        ModelConfig.from_hf(LLAMA, part="video")


def test_standalone_vision_model_is_its_own_vision_part(tmp_path):
    from modalmesh.testing import tiny

    cfg = ModelConfig.from_hf(tiny.ensure("siglip", tmp_path), part="vision")
    assert cfg.part == "vision" and cfg.hidden_size == 32 and cfg.num_layers == 2 and cfg.num_heads == 4
