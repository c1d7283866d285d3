"""How a service turns a checkpoint into a loaded model: one protocol for every model class.

A model class says, as class data (`CheckpointModel`), which checkpoints it serves and
how their tensors reach its parameters:

    architectures        HF ``architectures`` entries it serves (diffusers: the ``_class_name``)
    model_types          HF ``model_type``s it serves when no architecture entry is known
    checkpoint_prefixes  the tensor-name prefixes it reads; the reader opens nothing else
                         (a multimodal checkpoint's other towers stay on disk). None: every tensor
    weights_mapper       checkpoint names -> module names (`WeightsMapper`); None: the same names
    stacked_params       checkpoint tensors that are shards of one fused parameter (`StackedMapping`)
    weight_loaders       (parameter-name glob, weight_loader) format rules attached before loading

Each service keeps one tuple of its classes, ``ARCHITECTURES``, and loads with

    cls = pick(cfg, ARCHITECTURES, what="language model")    # by architecture, then model_type
    model, report = build_and_load(cls, cfg, model_dir, device="cuda", dtype=torch.bfloat16, dummy=False,
                                   page_size=16)              # extra keywords go to the constructor

`build_model` constructs ``cls(cfg, dtype=dtype, **kwargs)`` on the meta device (no memory), in
eval mode without gradients, with the class's weight loaders attached; `load_model_weights` reads
only the model's prefixes and copies strictly (modalmesh/weights/loader.py): a tensor no parameter
takes, or a parameter no tensor fills, is an error naming the keys. A service that builds at
start-up and loads later (to fail fast on a bad configuration) calls the two halves itself.
An instance may refine its class's rules (SigLIP without its pooling head skips ``head.*``):
loading reads them from the model, not the class.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import ClassVar, TypeVar

import torch
from torch import nn

from modalmesh.errors import ConfigError
from modalmesh.weights.loader import LoadReport, load_checkpoint
from modalmesh.weights.mapper import StackedMapping, WeightsMapper
from modalmesh.weights.param import WeightLoader, set_weight_loaders

M = TypeVar("M", bound=nn.Module)


class CheckpointModel:
    """The class data `pick` and `build_and_load` read (mixed into an nn.Module). See the module docstring."""

    architectures: ClassVar[tuple[str, ...]] = ()
    model_types: ClassVar[tuple[str, ...]] = ()
    checkpoint_prefixes: ClassVar[tuple[str, ...] | None] = None
    weights_mapper: ClassVar[WeightsMapper | None] = None
    stacked_params: ClassVar[StackedMapping | None] = None
    weight_loaders: ClassVar[tuple[tuple[str, WeightLoader], ...]] = ()


def supported_architectures(candidates: Iterable[type]) -> list[str]:
    return sorted({arch for cls in candidates for arch in cls.architectures})


def pick(config, candidates: Sequence[type[M]], *, what: str = "model") -> type[M]:
    """The class for a checkpoint: the first entry of ``config.architectures`` a candidate serves,
    else the candidate serving ``config.model_type``; a ConfigError naming the supported ones otherwise."""
    architectures = tuple(getattr(config, "architectures", None) or ())
    model_type = getattr(config, "model_type", None) or ""
    for arch in architectures:
        for cls in candidates:
            if arch in cls.architectures:
                return cls
    for cls in candidates:
        if model_type and model_type in cls.model_types:
            return cls
    raise ConfigError(
        f"architectures {list(architectures)} (model_type {model_type!r}) name no {what} this service serves; "
        f"supported architectures: {', '.join(supported_architectures(candidates))}"
    )


def build_model(cls: type[M], config, *, dtype: torch.dtype | None, **kwargs) -> M:
    """``cls(config, dtype=dtype, **kwargs)`` on the meta device, for inference, its weight loaders attached."""
    with torch.device("meta"):
        model = cls(config, dtype=dtype, **kwargs)
    set_weight_loaders(model, model.weight_loaders)
    return model.eval().requires_grad_(False)


def load_model_weights(model: nn.Module, model_dir: str | Path, *, device: torch.device | str,
                       dtype: torch.dtype | None, dummy: bool = False, metrics=None) -> LoadReport:
    """Read the model's tensors from `model_dir` by its rules and copy them strictly (or dummy ones)."""
    return load_checkpoint(model, model_dir, mapper=model.weights_mapper, stacked=model.stacked_params,
                           prefixes=model.checkpoint_prefixes, device=device, dtype=dtype, dummy=dummy,
                           metrics=metrics)


def build_and_load(cls: type[M], config, model_dir: str | Path, *, device: torch.device | str,
                   dtype: torch.dtype | None, dummy: bool = False, metrics=None,
                   **kwargs) -> tuple[M, LoadReport]:
    """`build_model` then `load_model_weights`: the model on `device` in `dtype`, and how it loaded."""
    model = build_model(cls, config, dtype=dtype, **kwargs)
    report = load_model_weights(model, model_dir, device=device, dtype=dtype, dummy=dummy, metrics=metrics)
    return model, report


__all__ = ["CheckpointModel", "build_and_load", "build_model", "load_model_weights", "pick",
           "supported_architectures"]
