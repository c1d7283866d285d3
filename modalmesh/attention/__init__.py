"""Attention-backend dispatch shared by every service: models call `Attention`, never a kernel.

    from modalmesh.attention import Attention, VarlenMetadata
    attn = Attention(num_heads=16, head_dim=80, component="vision_encoder", layouts=("varlen",))
    out = attn(q, k, v, VarlenMetadata.from_seqlens(lengths, device))

Services call `configure(args.attention_backend, device=...)` at start-up and put
`attention_choices()` in their Info. See docs/attention.md.
"""

from modalmesh.attention.capability import BackendSpec, Needs, Target
from modalmesh.attention.layer import Attention
from modalmesh.attention.metadata import PagedMetadata, VarlenMetadata, attention_metadata, current_metadata
from modalmesh.attention.paged import store_kv
from modalmesh.attention.platform import Platform, detect_platform
from modalmesh.attention.registry import register
from modalmesh.attention.report import attention_choice, attention_choices
from modalmesh.attention.overrides import ENV_VAR, BackendOverrides, parse_backend_spec
from modalmesh.attention.selector import AttentionSelector, Selection, configure, current_selector, select_backend

__all__ = [
    "ENV_VAR",
    "Attention",
    "AttentionSelector",
    "BackendOverrides",
    "BackendSpec",
    "Needs",
    "PagedMetadata",
    "Platform",
    "Selection",
    "Target",
    "VarlenMetadata",
    "attention_choice",
    "attention_choices",
    "attention_metadata",
    "configure",
    "current_metadata",
    "current_selector",
    "detect_platform",
    "parse_backend_spec",
    "register",
    "select_backend",
    "store_kv",
]
