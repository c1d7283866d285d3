"""Build the LLM service's language model from a checkpoint directory.

    model, cfg, report = load_llm("/models/Qwen2-VL-7B-Instruct", device="cuda", dtype=torch.bfloat16,
                                  selector=AttentionSelector("llm=fa3", device="cuda"))

The family is picked from ``models.ARCHITECTURES`` and built on the meta device
(no memory), then only the language model's tensors are read (the family's
``checkpoint_prefixes``: a multimodal checkpoint's vision / audio towers are never
opened), mapped by its rules and copied strictly into parameters materialised on
`device` in `dtype` (modalmesh/models.py).
``dummy=True`` gives random weights of the same shapes (benchmarks). The
attention selector is the caller's (each TP rank builds one from the service's
config); without one, a selector with automatic choices for `device` is built
here — never the process-wide one. ``fused_kernels=True`` lets the layers run
their Triton kernels on CUDA (`modalmesh.kernels`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from modalmesh.attention import AttentionSelector
from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError
from modalmesh.models import build_and_load, pick
from modalmesh.weights import LoadReport
from services.llm.models import ARCHITECTURES, CausalLM

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None, cfg: ModelConfig) -> torch.dtype:
    """A torch dtype, a name (``bfloat16``, ``fp16``...), or None / ``auto``: the checkpoint's dtype, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return cfg.dtype if cfg.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ConfigError(f"--dtype {dtype!r}: expected auto or one of {', '.join(_DTYPES)}") from None


def load_llm(model_dir: str | Path, *, device: torch.device | str, dtype: torch.dtype | str | None,
             page_size: int = 16, dummy: bool = False, selector: AttentionSelector | None = None,
             fused_kernels: bool = False) -> tuple[CausalLM, ModelConfig, LoadReport]:
    cfg = ModelConfig.from_hf(model_dir)
    cls = pick(cfg, ARCHITECTURES, what="language model")
    dtype = resolve_dtype(dtype, cfg)
    if selector is None:
        selector = AttentionSelector("", device=device)
    model, report = build_and_load(cls, cfg, model_dir, device=device, dtype=dtype, dummy=dummy,
                                   selector=selector, page_size=page_size, fused_kernels=fused_kernels)
    return model, cfg, report
