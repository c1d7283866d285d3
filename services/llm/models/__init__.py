"""Language-model architectures of the LLM service, chosen from the checkpoint's config.

    cls = model_class(cfg)          # by cfg.architectures, then cfg.model_type
    model = cls(cfg, dtype=torch.bfloat16, page_size=16)   # usually via services.llm.loader.load_llm

One file per family, built from modalmesh.layers; see base.CausalLM for the
interface the engine calls.
"""

from __future__ import annotations

from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError
from services.llm.models.base import CausalLM
from services.llm.models.gpt_neox import GPTNeoXForCausalLM
from services.llm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from services.llm.models.qwen_mm import Qwen2_5_VLTextForCausalLM, Qwen2AudioTextForCausalLM, Qwen2VLTextForCausalLM

MODELS: tuple[type[CausalLM], ...] = (
    LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, GPTNeoXForCausalLM,
    Qwen2VLTextForCausalLM, Qwen2_5_VLTextForCausalLM, Qwen2AudioTextForCausalLM,
)
_BY_ARCH = {arch: cls for cls in MODELS for arch in cls.architectures}
_BY_TYPE = {t: cls for cls in MODELS for t in cls.model_types}


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCH)


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """The CausalLM class for a checkpoint: first known entry of `architectures`, else its model_type."""
    for arch in cfg.architectures:
        if arch in _BY_ARCH:
            return _BY_ARCH[arch]
    if cfg.model_type in _BY_TYPE:
        return _BY_TYPE[cfg.model_type]
    raise ConfigError(
        f"unsupported language model: architectures {list(cfg.architectures)}, model_type {cfg.model_type!r}; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )


__all__ = [
    "CausalLM", "GPTNeoXForCausalLM", "LlamaForCausalLM", "MODELS", "Qwen2AudioTextForCausalLM", "Qwen2ForCausalLM",
    "Qwen2VLTextForCausalLM", "Qwen2_5_VLTextForCausalLM", "Qwen3ForCausalLM", "model_class", "supported_architectures",
]
