"""Deterministic tiny random checkpoints of every supported architecture.

Built with the reference classes' ``save_pretrained`` (transformers, diffusers),
with a byte-level BPE tokenizer made by the `tokenizers` library (a small
vocabulary plus the family's special tokens) and the processor / feature
extractor configs. Tests, the demo's default models and benchmarks use them.
Their outputs are meaningless: they exist to exercise real loading and to
compare against the references.

    python -m modalmesh.testing.tiny OUT_DIR [--only qwen2_vl,vae]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import torch

# transformers 4 and 5 spell RoPE settings and the PIL image processors differently; the makers
# write the installed major's own layout (the layout its hub checkpoints have), which the
# runtime's config reader reads in both spellings.
TRANSFORMERS_4 = int(version("transformers").split(".")[0]) < 5

VOCAB_SIZE = 512  # model vocab; the tokenizer uses fewer ids, the rest are padding rows
INIT_RANGE = 0.2  # large enough that greedy decoding of a random model does not collapse to one token

QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
    "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>",
]
LLAMA_SPECIALS = ["<s>", "</s>", "<unk>"]
NEOX_SPECIALS = ["<|endoftext|>", "<|padding|>"]

QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.",
    "Describe this image. What do you hear in this audio clip? Transcribe the speech.",
    "modalmesh serves multimodal models as gRPC microservices: encoders, a language model and a VAE.",
    "Il était une fois un petit chat. Ünïcödé tëxt, 日本語のテキスト, emoji 🙂🚀 and numbers 0123456789.",
    "def forward(self, x): return self.proj(torch.relu(x)) # code, punctuation: {}[]()<>!?;:'\"",
]


def build_tokenizer(specials: list[str], *, vocab_size: int = 400, chat_template: str | None = None,
                    bos: str | None = None, eos: str | None = None, pad: str | None = None,
                    unk: str | None = None, fill_to: int | None = None):
    """A byte-level BPE tokenizer trained on a fixed corpus: deterministic, any text encodes.

    `fill_to`: the vocabulary padded with distinct words (" ab", " ac", ...) up to this many ids, which
    encoding never produces (they have no merges) but decoding turns into text, as a real checkpoint's
    tokenizer covers its model's vocabulary. Benchmarks with random weights sample any of the model's
    ids: past a small tokenizer's vocabulary every id decodes to nothing, which no real model does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    if fill_to is not None and fill_to > tok.get_vocab_size(with_added_tokens=True):
        tok = Tokenizer.from_str(json.dumps(_filled(json.loads(tok.to_str()), fill_to)))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk)
    if chat_template:
        fast.chat_template = chat_template
    return fast


def _filled(spec: dict, size: int) -> dict:
    """A tokenizer.json's BPE vocabulary with words added (byte-level: "Ġ" is a space) up to `size` ids."""
    vocab = spec["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in spec["added_tokens"]}
    next_id = 1 + max([*vocab.values(), *(t["id"] for t in spec["added_tokens"])])
    n = 0
    while next_id < size:
        n, word = n + 1, ""
        k = n
        while k:  # n in bijective base 26: a .. z, aa .. zz, aaa ...
            k, r = divmod(k - 1, 26)
            word = chr(97 + r) + word
        if "Ġ" + word not in taken:
            vocab["Ġ" + word] = next_id
            next_id += 1
    return spec


def _qwen_tokenizer():
    return build_tokenizer(QWEN_SPECIALS, chat_template=QWEN_CHAT_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>")


def _ids(tokenizer, *tokens: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


def _save(model, tokenizer, out: Path, *extra) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    for processor in extra:
        processor.save_pretrained(out)
    return out


def _rope(rope_type: str = "default", theta: float = 10000.0, **params) -> dict:
    """Config kwargs for RoPE: transformers 5 `rope_parameters`; 4 `rope_theta` + `rope_scaling`."""
    if not TRANSFORMERS_4:
        return {"rope_parameters": {"rope_type": rope_type, "rope_theta": theta, **params}}
    if "mrope_section" in params:  # Qwen2-VL's transformers-4 spelling
        return {"rope_theta": theta, "rope_scaling": {"type": "mrope", **params}}
    return {"rope_theta": theta, "rope_scaling": {"rope_type": rope_type, **params} if params else None}


def _image_processor(name: str, **kwargs):
    """The PIL (slow) image processor: `XImageProcessorPil` in later transformers 5, `XImageProcessor` before."""
    import transformers

    return (getattr(transformers, f"{name}ImageProcessorPil", None) or getattr(transformers, f"{name}ImageProcessor"))(**kwargs)


def _text_dims(**overrides) -> dict:
    dims = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                initializer_range=INIT_RANGE, rms_norm_eps=1e-6)
    dims.update(overrides)
    return dims


def make_llama(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = build_tokenizer(LLAMA_SPECIALS, chat_template=LLAMA_CHAT_TEMPLATE, bos="<s>", eos="</s>", unk="<unk>")
    bos, eos = _ids(tok, "<s>", "</s>")
    config = LlamaConfig(**_text_dims(), bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False,
                         **_rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64))
    return _save(LlamaForCausalLM(config), tok, out)


def make_qwen2(out: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    tok = _qwen_tokenizer()
    eot, im_end = _ids(tok, "<|endoftext|>", "<|im_end|>")
    config = Qwen2Config(**_text_dims(), bos_token_id=eot, eos_token_id=im_end, tie_word_embeddings=True)
    return _save(Qwen2ForCausalLM(config), tok, out)


def make_qwen3(out: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    tok = _qwen_tokenizer()
    eot, im_end = _ids(tok, "<|endoftext|>", "<|im_end|>")
    config = Qwen3Config(**_text_dims(head_dim=24), bos_token_id=eot, eos_token_id=im_end, tie_word_embeddings=False)
    return _save(Qwen3ForCausalLM(config), tok, out)


def make_gpt_neox(out: Path) -> Path:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(3)
    tok = build_tokenizer(NEOX_SPECIALS, bos="<|endoftext|>", eos="<|endoftext|>", pad="<|padding|>")
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    config = GPTNeoXConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=512, rotary_pct=0.25,
                           use_parallel_residual=True, initializer_range=INIT_RANGE, bos_token_id=eot,
                           eos_token_id=eot, tie_word_embeddings=False)
    return _save(GPTNeoXForCausalLM(config), tok, out)


def _qwen2_vl_image_processor():
    # Small pixel budget: tiny test images give a handful of patches.
    return _image_processor("Qwen2VL", min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)


def make_qwen2_vl(out: Path) -> Path:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(4)
    tok = _qwen_tokenizer()
    eot, im_end, vs, ve, img, vid = _ids(tok, "<|endoftext|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                                        "<|image_pad|>", "<|video_pad|>")
    text = _text_dims(**_rope(mrope_section=[2, 3, 3]), bos_token_id=eot, eos_token_id=im_end)
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, initializer_range=INIT_RANGE)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=img, video_token_id=vid,
                           vision_start_token_id=vs, vision_end_token_id=ve, tie_word_embeddings=False)
    return _save(Qwen2VLForConditionalGeneration(config), tok, out, _qwen2_vl_image_processor())


def make_qwen2_5_vl(out: Path) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(5)
    tok = _qwen_tokenizer()
    eot, im_end, vs, ve, img, vid = _ids(tok, "<|endoftext|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                                        "<|image_pad|>", "<|video_pad|>")
    text = _text_dims(**_rope(mrope_section=[2, 3, 3]), bos_token_id=eot, eos_token_id=im_end)
    vision = dict(depth=4, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=56,
                  fullatt_block_indexes=[1, 3], initializer_range=INIT_RANGE)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=img, video_token_id=vid,
                              vision_start_token_id=vs, vision_end_token_id=ve, tie_word_embeddings=False)
    return _save(Qwen2_5_VLForConditionalGeneration(config), tok, out, _qwen2_vl_image_processor())


def make_qwen2_audio(out: Path) -> Path:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor

    torch.manual_seed(6)
    tok = _qwen_tokenizer()
    eot, im_end, audio = _ids(tok, "<|endoftext|>", "<|im_end|>", "<|AUDIO|>")
    text = dict(model_type="qwen2", **_text_dims(bos_token_id=eot, eos_token_id=im_end))
    audio_config = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                        d_model=32, max_source_positions=1500, initializer_range=INIT_RANGE)
    config = Qwen2AudioConfig(text_config=text, audio_config=audio_config, audio_token_index=audio)
    config.initializer_range = INIT_RANGE
    return _save(Qwen2AudioForConditionalGeneration(config), tok, out, WhisperFeatureExtractor(feature_size=128))


def make_whisper(out: Path) -> Path:
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    torch.manual_seed(7)
    config = WhisperConfig(vocab_size=VOCAB_SIZE, num_mel_bins=80, d_model=32, encoder_layers=2, decoder_layers=1,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, max_source_positions=1500, max_target_positions=64,
                           init_std=INIT_RANGE, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2)
    return _save(WhisperForConditionalGeneration(config), None, out, WhisperFeatureExtractor(feature_size=80))


def make_siglip(out: Path) -> Path:
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(8)
    config = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=8, initializer_range=INIT_RANGE)
    processor = _image_processor("Siglip", size={"height": 32, "width": 32})
    return _save(SiglipVisionModel(config), None, out, processor)


def make_vae(out: Path, latent_channels: int = 4) -> Path:
    """SD-style (4 channels, quant convs) or SD3/FLUX-style (16 channels, shift_factor, no quant convs)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(9 + latent_channels)
    sd3 = latent_channels == 16
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4, sample_size=32,
        scaling_factor=1.5305 if sd3 else 0.18215, shift_factor=0.0609 if sd3 else None,
        use_quant_conv=not sd3, use_post_quant_conv=not sd3,
    )
    out.mkdir(parents=True, exist_ok=True)
    vae.save_pretrained(out, safe_serialization=True)
    return out


MAKERS: dict[str, Callable[[Path], Path]] = {
    "llama": make_llama,
    "qwen2": make_qwen2,
    "qwen3": make_qwen3,
    "gpt_neox": make_gpt_neox,
    "qwen2_vl": make_qwen2_vl,
    "qwen2_5_vl": make_qwen2_5_vl,
    "qwen2_audio": make_qwen2_audio,
    "whisper": make_whisper,
    "siglip": make_siglip,
    "vae": make_vae,
    "vae16": lambda out: make_vae(out, 16),
}


def without_tensors(src: Path, dst: Path, *names: str) -> Path:
    """A copy of checkpoint `src` at `dst` whose weights lack the tensors `names` (strict-loading tests)."""
    import shutil

    from safetensors.torch import save_file

    from modalmesh.weights import CheckpointReader

    state = {k: v.clone() for k, v in CheckpointReader(src)}
    absent = [n for n in names if n not in state]
    if absent:
        raise KeyError(f"{src} has no tensors {absent}")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file({k: v for k, v in state.items() if k not in names}, str(dst / "model.safetensors"))
    return dst


def ensure(name: str, root: Path) -> Path:
    """The checkpoint `name` under root, made once and reused (a marker file says it is complete)."""
    out = Path(root) / name
    marker = out / ".modalmesh-tiny"
    if not marker.exists():
        MAKERS[name](out)
        marker.write_text(json.dumps({"name": name}))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m modalmesh.testing.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", default=",".join(MAKERS), help="comma-separated names")
    args = parser.parse_args(argv)
    for name in [n.strip() for n in args.only.split(",") if n.strip()]:
        if name not in MAKERS:
            parser.error(f"unknown checkpoint {name!r}; choose from {', '.join(MAKERS)}")
        print(ensure(name, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
