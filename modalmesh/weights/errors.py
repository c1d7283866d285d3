"""Errors of weight loading: all start-up problems (ConfigError), each naming keys and files."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from modalmesh.errors import ConfigError


class CheckpointError(ConfigError):
    """The checkpoint directory or one of its files cannot be read as claimed."""


class WeightMismatchError(ConfigError):
    """A tensor does not fit the parameter it maps to (shape, dtype, shard id)."""


class MissingWeightsError(ConfigError):
    """Parameters of the model that no checkpoint tensor filled."""


class UnexpectedWeightsError(ConfigError):
    """Checkpoint tensors that match no parameter and no skip rule."""


def nearest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    return difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.5)


def describe_keys(keys: Iterable[str], candidates: Iterable[str], *, limit: int = 10) -> str:
    """One line per key (at most `limit`), each with the nearest candidate names."""
    keys = sorted(keys)
    pool = sorted(candidates)
    lines = []
    for key in keys[:limit]:
        close = nearest(key, pool)
        lines.append(f"  {key}" + (f"  (nearest: {', '.join(close)})" if close else ""))
    if len(keys) > limit:
        lines.append(f"  ... and {len(keys) - limit} more")
    return "\n".join(lines)
