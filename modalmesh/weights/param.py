"""How one checkpoint tensor is copied into one parameter: the `weight_loader` protocol.

Every parameter may carry ``param.weight_loader(param, tensor, shard_id=None)``;
`load_weights` calls it with the checkpoint tensor and, for shards of a fused
parameter, the shard id from the model's `StackedMapping`. A loader slices the
full checkpoint tensor for this tensor-parallel rank and copies it through
`copy_into`, which checks shape and dtype. Parameters without a loader get
`default_weight_loader` (whole tensor, no slicing).

A fused parameter lists the shard ids it needs in ``param.shard_ids`` (e.g.
``("q", "k", "v")``) so the loader can tell a half-loaded QKV from a full one;
any other shard id (None, "qkv_per_head") means "the whole fused tensor".
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable

import torch

from modalmesh.weights.errors import WeightMismatchError

WeightLoader = Callable[..., None]


def _is_float8(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1 and dtype.is_floating_point


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src, after checking the shape and that the dtype converts without losing meaning."""
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightMismatchError(f"checkpoint shape {list(src.shape)} does not fit parameter shape {list(dst.shape)}")
    if dst.dtype != src.dtype:
        # float <-> float casts are fine (bf16 checkpoint into an fp32 model); anything else
        # (quantised fp8 bytes, ints into floats) would load numbers that mean something else.
        both_float = dst.dtype.is_floating_point and src.dtype.is_floating_point
        if not both_float or _is_float8(dst.dtype) != _is_float8(src.dtype):
            raise WeightMismatchError(f"checkpoint dtype {src.dtype} cannot be loaded into a {dst.dtype} parameter")
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if shard_id is not None:
        raise WeightMismatchError(f"shard {shard_id!r} given for a parameter that is not fused")
    copy_into(param, loaded)


def set_weight_loader(param: torch.nn.Parameter, loader: WeightLoader, shard_ids: tuple = ()) -> None:
    param.weight_loader = loader
    if shard_ids:
        param.shard_ids = tuple(shard_ids)


def set_weight_loaders(model: torch.nn.Module, rules: Iterable[tuple[str, WeightLoader]]) -> int:
    """Attach the loader of the first matching (parameter-name glob, weight_loader) rule to each parameter.

    Format rules as data (a 1x1-conv kernel stored for a linear weight, say), so the model has no
    format branch. Returns how many parameters got a loader.
    """
    rules = tuple(rules)
    count = 0
    for name, param in model.named_parameters():
        loader = next((loader for pattern, loader in rules if fnmatch.fnmatchcase(name, pattern)), None)
        if loader is not None:
            set_weight_loader(param, loader)
            count += 1
    return count


def narrow_checked(loaded: torch.Tensor, dim: int, full: int, start: int, size: int, what: str,
                   param: torch.Tensor | None = None) -> torch.Tensor:
    """`loaded`'s rank slice along `dim`, after checking that `loaded` is the full (unsharded) tensor
    and, given `param`, that its other dims match the parameter's."""
    if loaded.dim() <= dim or loaded.shape[dim] != full:
        raise WeightMismatchError(
            f"{what}: checkpoint shape {list(loaded.shape)} should have {full} along dim {dim} "
            "(the unsharded size)"
        )
    if param is not None:
        other = [n for i, n in enumerate(loaded.shape) if i != dim]
        if loaded.dim() != param.dim() or other != [n for i, n in enumerate(param.shape) if i != dim]:
            raise WeightMismatchError(
                f"{what}: checkpoint shape {list(loaded.shape)} does not fit parameter shape {list(param.shape)} "
                f"(sharded along dim {dim})"
            )
    return loaded.narrow(dim, start, size)
