"""Language-model architectures of the LLM service, chosen from the checkpoint's config.

    cls = pick(cfg, ARCHITECTURES, what="language model")    # by cfg.architectures, then cfg.model_type
    model = cls(cfg, selector=selector, dtype=torch.bfloat16, page_size=16)   # usually via loader.load_llm

One file per family, built from modalmesh.layers; see base.CausalLM for the
interface the engine calls and modalmesh/models.py for the class data each declares.
"""

from __future__ import annotations

from services.llm.models.base import CausalLM
from services.llm.models.gpt_neox import GPTNeoXForCausalLM
from services.llm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from services.llm.models.qwen_mm import Qwen2_5_VLTextForCausalLM, Qwen2AudioTextForCausalLM, Qwen2VLTextForCausalLM

ARCHITECTURES: tuple[type[CausalLM], ...] = (
    LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, GPTNeoXForCausalLM,
    Qwen2VLTextForCausalLM, Qwen2_5_VLTextForCausalLM, Qwen2AudioTextForCausalLM,
)

__all__ = [
    "ARCHITECTURES", "CausalLM", "GPTNeoXForCausalLM", "LlamaForCausalLM", "Qwen2AudioTextForCausalLM",
    "Qwen2ForCausalLM", "Qwen2VLTextForCausalLM", "Qwen2_5_VLTextForCausalLM", "Qwen3ForCausalLM",
]
