"""RoPE against transformers' own rope functions and rotary applications."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from modalmesh.errors import ConfigError
from modalmesh.layers.rotary import RotaryEmbedding, rope_inv_freq

PARAMS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
     "beta_fast": 16, "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.5},
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p["rope_type"])
def test_inv_freq_matches_transformers(params):
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=512, rope_parameters=dict(params))
    if params["rope_type"] == "default":  # transformers computes it inline in each model
        ref_freq, ref_scale = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64)), 1.0
    else:
        ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    freq, scale = rope_inv_freq(64, params, 512)
    torch.testing.assert_close(freq, ref_freq.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rotation_matches_hf_apply_rotary(rotary_dim):
    torch.manual_seed(0)
    T, H, D = 7, 3, 16
    q, k = torch.randn(T, H, D), torch.randn(T, 2, D)
    positions = torch.tensor([0, 1, 2, 5, 9, 100, 3])
    rope = RotaryEmbedding(D, rotary_dim, 64, {"rope_theta": 10000.0})
    out_q, out_k = rope(positions, q, k)
    inv = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = positions[:, None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    ref_q, ref_k = apply_rotary_pos_emb(q[None, :, :, :rotary_dim].transpose(1, 2), k[None, :, :, :rotary_dim].transpose(1, 2),
                                        emb.cos()[None], emb.sin()[None])
    torch.testing.assert_close(out_q[..., :rotary_dim], ref_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k[..., :rotary_dim], ref_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_q[..., rotary_dim:], q[..., rotary_dim:])  # the pass-through part


def test_mrope_matches_qwen2_vl_rotary():
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb as vl_apply

    torch.manual_seed(0)
    text = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    config = Qwen2VLConfig(text_config=text).text_config
    ref = Qwen2VLRotaryEmbedding(config)
    T = 9
    positions = torch.stack([torch.arange(T), torch.arange(T) % 3, torch.arange(T) // 2 + 1])
    q, k = torch.randn(T, 4, 16), torch.randn(T, 2, 16)
    cos, sin = ref(q[None], positions[:, None, :])
    ref_q, ref_k = vl_apply(q[None].transpose(1, 2), k[None].transpose(1, 2), cos, sin)
    ours = RotaryEmbedding(16, 16, 64, {"rope_theta": 10000.0}, mrope_section=(2, 3, 3))
    out_q, out_k = ours(positions, q, k)
    torch.testing.assert_close(out_q, ref_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k, ref_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_positions_past_the_table_grow_it():
    rope = RotaryEmbedding(8, 8, 4, {"rope_theta": 10000.0})
    q = torch.randn(2, 1, 8)
    out, _ = rope(torch.tensor([3, 10]), q, q)
    ref = RotaryEmbedding(8, 8, 32, {"rope_theta": 10000.0})(torch.tensor([3, 10]), q, q)[0]
    torch.testing.assert_close(out, ref)


def test_bad_rope_configs_are_clear_errors():
    with pytest.raises(ConfigError, match="rope_type 'longrope' is not supported"):
        RotaryEmbedding(8, 8, 16, {"rope_type": "longrope"})
    with pytest.raises(ConfigError, match="must sum to"):
        RotaryEmbedding(16, 16, 16, {}, mrope_section=(1, 1, 1))


def test_rotary_module_moves_and_casts_like_any_module():
    """Regression: its rotation helper was named `_apply`, shadowing nn.Module._apply, so `.to()` on the
    rotary module, or on any model holding one, raised TypeError."""
    rotary = RotaryEmbedding(16, 16, 64, {"rope_theta": 10000.0})
    rotary.to(torch.float64)
    assert rotary.cos_sin.dtype == torch.float64
    rotary.to("cpu", torch.float32)
    q = torch.randn(3, 2, 16)
    out_q, out_k = rotary(torch.arange(3), q, q)
    assert out_q.shape == q.shape and torch.equal(out_q[0], q[0])  # position 0 is the identity
