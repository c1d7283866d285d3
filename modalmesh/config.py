"""One normalised, frozen view of a Hugging Face config: the only reader of raw configs.

    cfg = ModelConfig.from_hf("/models/Qwen2-VL-7B-Instruct")        # the language model
    vis = ModelConfig.from_hf("/models/Qwen2-VL-7B-Instruct", part="vision")
    cfg.head_dim, cfg.v_head_dim, cfg.num_kv_heads, cfg.rope.mrope_section

Configs spell the same thing many ways (``num_key_value_heads``, ``n_head_kv``,
``multi_query_group_num``...), nest the language model differently
(transformers-4 flat Qwen2-VL, transformers-5 ``text_config``, DeepSeek-VL2
``language_config``, InternVL ``llm_config``, Omni ``thinker_config``), and use
sentinels: DeepSeek-VL2 writes ``v_head_dim: 0`` to mean "not MLA", which taken
literally sized a zero-width V cache. Every derived dimension is computed here,
once, by one rule: **absent, None or 0 means "derive it"** (`_dim`).

MLA models (DeepSeek-V2/V3: ``kv_lora_rank`` with ``qk_rope_head_dim``) are
described with their expanded, per-head geometry: ``head_dim = qk_nope +
qk_rope`` and ``num_kv_heads = num_heads``, which is what a naive (non-latent)
KV cache stores; the latent sizes are kept for a latent-cache backend.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from modalmesh.errors import ConfigError

log = logging.getLogger(__name__)

# Where each family keeps its language / vision / audio sub-config, first match wins.
_SECTIONS = {
    "text": (("text_config",), ("language_config",), ("llm_config",), ("thinker_config", "text_config")),
    "vision": (("vision_config",), ("thinker_config", "vision_config"), ("visual",)),
    "audio": (("audio_config",), ("thinker_config", "audio_config")),
}
# Keys that live at the top level of multimodal configs but describe the language model.
_MODEL_WIDE = ("tie_word_embeddings", "dtype", "torch_dtype", "image_token_id", "image_token_index",
               "video_token_id", "video_token_index", "audio_token_id", "audio_token_index",
               "vision_start_token_id", "vision_end_token_id")

# Spellings, in order of preference, per part (encoders name width/depth differently).
_SPELLINGS = {
    "hidden": ("hidden_size", "n_embd", "d_model", "dim", "embed_dim"),
    "layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "depth", "encoder_layers"),
    "heads": ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "n_kv_heads", "multi_query_group_num",
                 "num_query_groups"),
    "intermediate": ("intermediate_size", "ffn_dim", "n_inner", "encoder_ffn_dim", "ffn_hidden_size"),
    "max_pos": ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                "max_source_positions"),
    "eps": ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon"),
    "act": ("hidden_act", "activation_function", "hidden_activation"),
}
_ENCODER_FIRST = {"hidden": ("embed_dim", "d_model", "hidden_size"), "layers": ("depth", "encoder_layers"),
                  "heads": ("num_heads", "encoder_attention_heads")}


def _first(section: Mapping, keys, default=None):
    for key in keys:
        value = section.get(key)
        if value is not None:
            return value
    return default


def _dim(value, derived):
    """The one rule for derived sizes: absent, None or 0 -> the derived value."""
    return derived if value in (None, 0) else int(value)


def _frozen(value):
    if isinstance(value, Mapping):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


@dataclass(frozen=True)
class RopeConfig:
    type: str = "default"  # default, linear, dynamic, yarn, llama3, longrope, mrope, ...
    theta: float = 10000.0
    rotary_dim: int = 0  # dims of each head that rotate (partial rotary: < head_dim)
    partial_rotary_factor: float = 1.0
    factor: float = 1.0  # context scaling factor of linear/dynamic/yarn/llama3
    original_max_position_embeddings: int | None = None
    mrope_section: tuple[int, ...] | None = None  # M-RoPE (t, h, w) split of rotary_dim // 2
    mrope_interleaved: bool = False
    params: tuple[tuple[str, Any], ...] = ()  # the rest (beta_fast, low_freq_factor, long_factor, ...)

    def get(self, key: str, default=None):
        return dict(self.params).get(key, default)

    @classmethod
    def from_section(cls, section: Mapping, head_dim: int, rotary_dim: int | None = None) -> RopeConfig:
        # transformers 5: rope_parameters (maybe per layer type); 4: rope_theta + rope_scaling.
        params = section.get("rope_parameters") or {}
        if params and all(isinstance(v, Mapping) for v in params.values()):
            params = params.get("full_attention") or next(iter(params.values()))
        params = {**(section.get("rope_scaling") or {}), **params}
        theta = _first(params, ("rope_theta",), _first(section, ("rope_theta", "rotary_emb_base", "rope_base"), 10000.0))
        partial = _first(params, ("partial_rotary_factor",),
                         _first(section, ("partial_rotary_factor", "rotary_pct"), 1.0))
        rotary_dim = _dim(rotary_dim or section.get("rotary_dim"), int(head_dim * float(partial)))
        rope_type = _first(params, ("rope_type", "type"), "default")
        section_ = params.get("mrope_section")
        if section_ is not None:
            rope_type = "mrope" if rope_type == "default" else rope_type
            section_ = tuple(int(s) for s in section_)
            if sum(section_) != rotary_dim // 2:
                raise ConfigError(f"mrope_section {list(section_)} sums to {sum(section_)}, "
                                  f"but rotary_dim {rotary_dim} has {rotary_dim // 2} frequencies")
        known = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "mrope_section",
                 "mrope_interleaved", "original_max_position_embeddings"}
        return cls(
            type=str(rope_type),
            theta=float(theta),
            rotary_dim=rotary_dim,
            partial_rotary_factor=float(partial),
            factor=float(params.get("factor") or 1.0),
            original_max_position_embeddings=params.get("original_max_position_embeddings"),
            mrope_section=section_,
            mrope_interleaved=bool(params.get("mrope_interleaved", False)),
            params=_frozen({k: v for k, v in params.items() if k not in known}),
        )


@dataclass(frozen=True)
class ModelConfig:
    part: str  # "text", "vision" or "audio": which sub-model this describes
    model_type: str  # of the whole checkpoint
    architectures: tuple[str, ...]
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # of q and k
    v_head_dim: int
    intermediate_size: int
    vocab_size: int | None
    max_position_embeddings: int | None
    norm_eps: float
    hidden_act: str | None
    tie_word_embeddings: bool
    dtype: torch.dtype | None  # the checkpoint's dtype
    rope: RopeConfig
    # Sliding-window attention; layer_types[i] is "full_attention" or "sliding_attention".
    sliding_window: int | None
    layer_types: tuple[str, ...] = field(repr=False)
    swa_num_heads: int
    swa_num_kv_heads: int
    swa_head_dim: int
    swa_v_head_dim: int
    # MLA (DeepSeek-V2/V3); all None otherwise.
    kv_lora_rank: int | None
    q_lora_rank: int | None
    qk_nope_head_dim: int | None
    qk_rope_head_dim: int | None
    # Special tokens.
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    image_token_id: int | None
    video_token_id: int | None
    audio_token_id: int | None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    def layer_is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def kv_heads_per_rank(self, tp_size: int = 1, layer: int | None = None) -> int:
        """KV heads one TP rank stores: split when tp <= heads, else one (replicated) head."""
        total = self.swa_num_kv_heads if layer is not None and self.layer_is_sliding(layer) else self.num_kv_heads
        if tp_size >= total:
            if tp_size % total:
                raise ConfigError(f"TP size {tp_size} cannot replicate {total} KV heads evenly")
            return 1
        if total % tp_size:
            raise ConfigError(f"{total} KV heads are not divisible by TP size {tp_size}")
        return total // tp_size

    def get(self, key: str, default=None):
        """A model-specific knob of this part's raw section (e.g. ``use_parallel_residual``)."""
        return self.raw.get(key, default)

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def from_hf(cls, src, *, part: str = "text") -> ModelConfig:
        """From a checkpoint directory, a config.json path, a dict, or a transformers PretrainedConfig."""
        root = _load(src)
        section = _pick(root, part)
        return _normalise(root, section, part)


def _load(src) -> dict:
    if isinstance(src, Mapping):
        return dict(src)
    if hasattr(src, "to_dict"):  # a transformers PretrainedConfig: defaults already filled in
        return src.to_dict()
    path = Path(src)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"{src}: no config.json")
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    # Saved configs may omit class defaults (e.g. Qwen2-Audio's partial text_config);
    # let transformers fill them when it knows the model type. Unknown types stay raw.
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(file.parent), local_files_only=True).to_dict()
    except Exception as e:  # unknown model_type, remote code: the raw JSON is all there is
        log.debug("%s: transformers cannot parse (%s); using the raw JSON", file, e)
        return raw


def _pick(root: Mapping, part: str) -> Mapping:
    if part not in _SECTIONS:
        raise ConfigError(f"part {part!r}: expected one of {', '.join(_SECTIONS)}")
    for path in _SECTIONS[part]:
        node = root
        for key in path:
            node = node.get(key) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping) and node:
            return node
        if node is not None and hasattr(node, "to_dict"):
            return node.to_dict()
    if part == "text":
        return root  # a plain LM, or a transformers-4 flat multimodal config (Qwen2-VL)
    if part == "vision" and str(root.get("model_type", "")).endswith("vision_model"):
        return root  # a standalone vision tower (SigLIP's siglip_vision_model)
    raise ConfigError(f"config ({root.get('model_type')}) has no {part} sub-config")


def _normalise(root: Mapping, section: Mapping, part: str) -> ModelConfig:
    merged = dict(section)
    if part == "text":
        for key in _MODEL_WIDE:
            if merged.get(key) is None and root.get(key) is not None:
                merged[key] = root[key]

    def spelled(kind, default=None):
        keys = _SPELLINGS[kind]
        if part != "text" and kind in _ENCODER_FIRST:
            keys = _ENCODER_FIRST[kind] + keys
        return _first(merged, keys, default)

    hidden = spelled("hidden")
    layers = spelled("layers")
    heads = spelled("heads")
    if hidden is None or layers is None or heads is None:
        raise ConfigError(f"{part} config of {root.get('model_type')!r} lacks hidden size / layers / heads "
                          f"(keys: {sorted(merged)[:40]})")
    hidden, layers, heads = int(hidden), int(layers), int(heads)
    kv_heads = spelled("kv_heads")
    if kv_heads in (None, 0):
        kv_heads = 1 if merged.get("multi_query") else heads
    kv_heads = int(kv_heads)

    use_mla = merged.get("use_mla")
    kv_lora = merged.get("kv_lora_rank") or None
    qk_rope = merged.get("qk_rope_head_dim") or None
    qk_nope = merged.get("qk_nope_head_dim") or 0
    is_mla = bool(use_mla) if use_mla is not None else bool(kv_lora and qk_rope)
    if is_mla:
        if not (kv_lora and qk_rope):
            raise ConfigError("use_mla is set but kv_lora_rank / qk_rope_head_dim are missing or 0")
        head_dim = _dim(merged.get("qk_head_dim"), qk_nope + qk_rope)
        kv_heads = heads  # the expanded (naive) cache holds every head
        rotary_dim = qk_rope
    else:
        if hidden % heads and _dim(merged.get("head_dim"), 0) == 0:
            raise ConfigError(f"hidden size {hidden} is not divisible by {heads} heads and head_dim is absent")
        head_dim = _dim(_first(merged, ("head_dim", "kv_channels", "attention_head_dim")), hidden // heads)
        rotary_dim = None
    v_head_dim = _dim(merged.get("v_head_dim"), head_dim)

    swa_head_dim = _dim(merged.get("swa_head_dim"), head_dim)
    swa_v_default = v_head_dim if swa_head_dim == head_dim else swa_head_dim
    sliding_window = _dim(merged.get("sliding_window"), None)
    if merged.get("use_sliding_window") is False:
        sliding_window = None
    layer_types = _layer_types(merged, layers, sliding_window)

    intermediate = spelled("intermediate")
    if intermediate is None:
        intermediate = int(float(merged.get("mlp_ratio", 4)) * hidden)

    eos = merged.get("eos_token_id")
    eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list | tuple) else [eos]))
    dtype_name = _first(merged, ("dtype", "torch_dtype"))
    dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None) if dtype_name else None
    raw = MappingProxyType(dict(merged))
    return ModelConfig(
        part=part,
        model_type=str(root.get("model_type", "")),
        architectures=tuple(root.get("architectures") or ()),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        intermediate_size=int(intermediate),
        vocab_size=_opt_int(merged.get("vocab_size")),
        max_position_embeddings=_opt_int(spelled("max_pos")),
        norm_eps=float(spelled("eps", 1e-6)),
        hidden_act=spelled("act"),
        tie_word_embeddings=bool(merged.get("tie_word_embeddings", False)),
        dtype=dtype if isinstance(dtype, torch.dtype) else None,
        rope=RopeConfig.from_section(merged, head_dim, rotary_dim),
        sliding_window=sliding_window,
        layer_types=layer_types,
        swa_num_heads=_dim(merged.get("swa_num_attention_heads"), heads),
        swa_num_kv_heads=_dim(merged.get("swa_num_key_value_heads"), kv_heads),
        swa_head_dim=swa_head_dim,
        swa_v_head_dim=_dim(merged.get("swa_v_head_dim"), swa_v_default),
        kv_lora_rank=int(kv_lora) if is_mla else None,
        q_lora_rank=_opt_int(merged.get("q_lora_rank") or None) if is_mla else None,
        qk_nope_head_dim=int(qk_nope) if is_mla else None,
        qk_rope_head_dim=int(qk_rope) if is_mla else None,
        bos_token_id=_opt_int(merged.get("bos_token_id")),
        eos_token_ids=eos,
        pad_token_id=_opt_int(merged.get("pad_token_id")),
        image_token_id=_opt_int(_first(merged, ("image_token_id", "image_token_index"))),
        video_token_id=_opt_int(_first(merged, ("video_token_id", "video_token_index"))),
        audio_token_id=_opt_int(_first(merged, ("audio_token_id", "audio_token_index"))),
        raw=raw,
    )


def _opt_int(value) -> int | None:
    return None if value is None else int(value)


def _layer_types(section: Mapping, layers: int, sliding_window: int | None) -> tuple[str, ...]:
    full, sliding = "full_attention", "sliding_attention"
    if sliding_window is None:
        return (full,) * layers
    given = section.get("layer_types")
    if given and len(given) == layers:
        return tuple(str(t) for t in given)
    if given:
        log.warning("layer_types has %d entries for %d layers; deriving them instead", len(given), layers)
    pattern = _dim(section.get("sliding_window_pattern"), None)
    if pattern:  # Gemma-2/3: every pattern-th layer is global
        return tuple(full if (i + 1) % pattern == 0 else sliding for i in range(layers))
    first_sliding = section.get("max_window_layers")
    if first_sliding is not None:  # Qwen2: layers from max_window_layers on use the window
        return tuple(sliding if i >= first_sliding else full for i in range(layers))
    return (sliding,) * layers
