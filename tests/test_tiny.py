"""The tiny checkpoints load with their reference classes and are deterministic."""

import hashlib

import pytest
import torch

from modalmesh.testing import tiny


def _digest(path):
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(path.glob("*.safetensors")))).hexdigest()


def test_checkpoints_are_deterministic(tmp_path):
    a = tiny.make_qwen2(tmp_path / "a")
    b = tiny.make_qwen2(tmp_path / "b")
    assert _digest(a) == _digest(b)


def test_tokenizer_round_trips_unicode_and_has_the_special_tokens(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.make_qwen2(tmp_path / "q"))
    text = "Héllo 🙂 日本 <|vision_start|><|image_pad|><|vision_end|>"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    for special in tiny.QWEN_SPECIALS:
        assert len(tok(special)["input_ids"]) == 1
    assert max(tok.get_vocab().values()) < tiny.VOCAB_SIZE


@pytest.mark.parametrize("name, cls", [
    ("llama", "AutoModelForCausalLM"), ("qwen3", "AutoModelForCausalLM"), ("gpt_neox", "AutoModelForCausalLM"),
    ("qwen2_vl", "Qwen2VLForConditionalGeneration"), ("qwen2_audio", "Qwen2AudioForConditionalGeneration"),
])
def test_reference_classes_load_them(tmp_path, name, cls):
    import transformers

    path = tiny.ensure(name, tmp_path)
    model = getattr(transformers, cls).from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert tiny.ensure(name, tmp_path) == path  # made once, then reused


def test_vaes_load_with_diffusers(tmp_path):
    from diffusers import AutoencoderKL

    sd = AutoencoderKL.from_pretrained(tiny.ensure("vae", tmp_path))
    sd3 = AutoencoderKL.from_pretrained(tiny.ensure("vae16", tmp_path))
    assert sd.config.latent_channels == 4 and sd.post_quant_conv is not None
    assert sd3.config.latent_channels == 16 and sd3.config.shift_factor == pytest.approx(0.0609)
    with torch.no_grad():
        assert sd3.decode(torch.zeros(1, 16, 4, 4)).sample.shape == (1, 3, 8, 8)
