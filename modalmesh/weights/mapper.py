"""Checkpoint names -> module names, as data.

A model declares how its checkpoints' tensor names differ from its module tree
instead of branching in code:

    NEOX = WeightsMapper(
        prefix={"gpt_neox.": "model.", "embed_out.": "lm_head."},
        skip_substrs=(".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq"),
    )
    NEOX.apply("gpt_neox.layers.0.mlp.dense_h_to_4h.weight")  # "model.layers.0.mlp.dense_h_to_4h.weight"
    NEOX.apply("gpt_neox.layers.0.attention.bias")             # None: dropped by rule

Each mapper checks its skip rules against the incoming name, then rewrites in
the order prefix -> substring -> suffix -> regex; within a kind, every rule
whose pattern matches is applied, in the order given. A rewrite to ``None``
drops the tensor. ``a | b`` composes: `b` sees what `a` produced.

A `StackedMapping` says which checkpoint tensors are shards of one fused
parameter: ``("qkv_proj", "q_proj", "q")`` loads ``...q_proj.weight`` into
``...qkv_proj.weight`` through that parameter's ``weight_loader(param, t, "q")``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

Rules = tuple[tuple[str, "str | None"], ...]


def _rules(value: Mapping[str, str | None] | Iterable[tuple[str, str | None]]) -> Rules:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple((str(k), v) for k, v in items)


@dataclass(frozen=True)
class WeightsMapper:
    prefix: Rules = ()
    substr: Rules = ()
    suffix: Rules = ()
    regex: Rules = ()  # (pattern, replacement with \\1 groups); re.sub, first match only
    skip_prefixes: tuple[str, ...] = ()
    skip_substrs: tuple[str, ...] = ()
    skip_suffixes: tuple[str, ...] = ()
    then: WeightsMapper | None = None
    _compiled: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        for kind in ("prefix", "substr", "suffix", "regex"):
            object.__setattr__(self, kind, _rules(getattr(self, kind)))
        for kind in ("skip_prefixes", "skip_substrs", "skip_suffixes"):
            value = getattr(self, kind)
            object.__setattr__(self, kind, (value,) if isinstance(value, str) else tuple(value))
        object.__setattr__(self, "_compiled", tuple((re.compile(p), r) for p, r in self.regex))

    def __or__(self, other: WeightsMapper) -> WeightsMapper:
        if not isinstance(other, WeightsMapper):
            return NotImplemented
        return replace(self, then=other if self.then is None else (self.then | other))

    def skips(self, name: str) -> bool:
        return (
            name.startswith(self.skip_prefixes)
            or any(s in name for s in self.skip_substrs)
            or name.endswith(self.skip_suffixes)
        )

    def apply(self, name: str) -> str | None:
        """The module name for checkpoint tensor `name`, or None when a rule drops it."""
        if self.skips(name):
            return None
        for old, new in self.prefix:
            if name.startswith(old):
                if new is None:
                    return None
                name = new + name[len(old):]
        for old, new in self.substr:
            if old in name:
                if new is None:
                    return None
                name = name.replace(old, new, 1)
        for old, new in self.suffix:
            if name.endswith(old):
                if new is None:
                    return None
                name = name[: len(name) - len(old)] + new
        for pattern, new in self._compiled:
            if pattern.search(name):
                if new is None:
                    return None
                name = pattern.sub(new, name, count=1)
        return self.then.apply(name) if self.then is not None else name


IDENTITY = WeightsMapper()

# Buffers older checkpoints persisted and today's module trees compute (or lack):
# causal masks of GPT-2/GPT-NeoX/GPT-J style attention and rotary frequency tables.
LEGACY_BUFFERS = WeightsMapper(
    skip_suffixes=(".attention.bias", ".attention.masked_bias", ".attn.bias", ".attn.masked_bias",
                   ".rotary_emb.inv_freq", ".rotary_emb.cos_cached", ".rotary_emb.sin_cached"),
)


@dataclass(frozen=True)
class StackedMapping:
    """(fused param name, checkpoint shard name, shard id) triples, matched on whole dotted segments."""

    entries: tuple[tuple[str, str, object], ...] = ()

    def __init__(self, entries: Iterable[tuple[str, str, object]] = ()):
        object.__setattr__(self, "entries", tuple((p, s, i) for p, s, i in entries))

    def __add__(self, other: StackedMapping) -> StackedMapping:
        return StackedMapping(self.entries + other.entries)

    def match(self, name: str) -> tuple[str, object] | None:
        """(parameter name, shard id) when `name` is a shard of a fused parameter, else None."""
        dotted = f".{name}."
        for param, shard, shard_id in self.entries:
            needle = f".{shard}."
            if needle in dotted:
                return dotted.replace(needle, f".{param}.", 1)[1:-1], shard_id
        return None


NO_STACKING = StackedMapping()

# The common fused projections (Llama, Qwen2/3, Mistral, Qwen2-Audio's LM, ...).
QKV_GATE_UP = StackedMapping([
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
])
