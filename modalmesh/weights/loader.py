"""Load checkpoint tensors into a model, strictly.

    with torch.device("meta"):
        model = MyModel(cfg)                       # built from modalmesh.layers
    reader = CheckpointReader(model_dir, prefixes=("model.", "lm_head."))
    report = load_weights(model, reader, mapper=MAPPER, stacked=QKV_GATE_UP,
                          device="cuda", dtype=torch.bfloat16)

For each checkpoint tensor: the mapper rewrites (or drops) its name, the
stacked mapping may route it to a shard of a fused parameter, and the
parameter's own ``weight_loader`` slices it for this TP rank and copies it.
Strict by default: a tensor that reaches no parameter, or a parameter (or a
shard of a fused one) that no tensor filled, is an error naming the keys and
the nearest names on the other side. When the weights come from a
CheckpointReader, names are resolved before any tensor byte is read, so a
mapping mistake fails in milliseconds, not after reading the whole checkpoint.
Parameters shared between modules (tied embeddings) count as loaded when
any of their names is.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from modalmesh import metrics as metrics_mod
from modalmesh.weights.errors import (
    MissingWeightsError,
    UnexpectedWeightsError,
    WeightMismatchError,
    describe_keys,
)
from modalmesh.weights.mapper import StackedMapping, WeightsMapper
from modalmesh.weights.materialize import has_meta, init_dummy_weights, materialize
from modalmesh.weights.param import default_weight_loader
from modalmesh.weights.reader import CheckpointReader

log = logging.getLogger(__name__)


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)      # checkpoint names copied into parameters
    skipped: list[str] = field(default_factory=list)     # checkpoint names dropped by a mapper rule
    unexpected: list[str] = field(default_factory=list)  # only non-empty when strict=False
    missing: list[str] = field(default_factory=list)     # only non-empty when strict=False
    opened_files: list[Path] = field(default_factory=list)  # checkpoint files whose bytes were read
    bytes: int = 0
    seconds: float = 0.0
    dummy: bool = False

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def export(self, metrics: metrics_mod.Metrics | None = None) -> None:
        m = metrics or metrics_mod.current()
        m.weight_load_seconds.set(self.seconds)
        m.weight_load_bytes.set(self.bytes)
        m.weight_load_bytes_per_second.set(self.bytes / self.seconds if self.seconds > 0 else 0.0)

    def summary(self) -> str:
        return (f"{'dummy ' if self.dummy else ''}weights: {len(self.loaded)} tensors, {self.bytes / 1e9:.3f} GB "
                f"in {self.seconds:.2f} s ({self.gb_per_s:.2f} GB/s); {len(self.skipped)} skipped by rule")


class _Targets:
    """The model's loadable tensors by name, with tied aliases and fused-shard bookkeeping."""

    def __init__(self, model: nn.Module):
        self.by_name: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            self.by_name[name] = param
        for mod_name, module in model.named_modules(remove_duplicate=False):
            for buf_name, buf in module._buffers.items():
                if buf is not None and buf_name not in module._non_persistent_buffers_set:
                    self.by_name[f"{mod_name}.{buf_name}" if mod_name else buf_name] = buf
        self.names_of: dict[int, list[str]] = {}
        for name, t in self.by_name.items():
            self.names_of.setdefault(id(t), []).append(name)
        self.filled: dict[int, set] = {}

    def resolve(self, name: str, mapper: WeightsMapper | None, stacked: StackedMapping | None):
        """(target name, shard id) for checkpoint tensor `name`; None target = dropped by rule; KeyError = unexpected."""
        target = mapper.apply(name) if mapper is not None else name
        if target is None:
            return None, None
        hit = stacked.match(target) if stacked is not None else None
        if hit is not None and hit[0] in self.by_name:
            return hit
        if target in self.by_name:
            return target, None
        raise KeyError(target)

    def mark(self, target: str, shard_id) -> None:
        self.filled.setdefault(id(self.by_name[target]), set()).add(shard_id)

    def missing(self, allow_missing: Iterable[str]) -> list[str]:
        patterns = tuple(allow_missing)
        out = []
        for key, names in self.names_of.items():
            t = self.by_name[names[0]]
            got = self.filled.get(key)
            need = set(getattr(t, "shard_ids", ()))
            done = got is not None and (not need or bool(got - need) or need <= got)
            if done or any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns):
                continue
            label = names[0] if not need or not got else f"{names[0]} (shards {sorted(map(str, need - got))})"
            out.append(label)
        return sorted(out)


def _raise_unexpected(unexpected: dict[str, str], targets: _Targets) -> None:
    keys = [f"{ckpt}" if ckpt == tgt else f"{ckpt} -> {tgt}" for ckpt, tgt in unexpected.items()]
    lines = describe_keys(unexpected.values(), targets.by_name)
    raise UnexpectedWeightsError(
        f"{len(unexpected)} checkpoint tensor(s) match no parameter and no skip rule "
        f"(add a mapper rewrite or skip rule; nothing is dropped silently):\n{lines}\n"
        f"checkpoint names: {', '.join(sorted(keys)[:10])}"
    )


def _raise_missing(missing: list[str], targets: _Targets, checkpoint_names: Iterable[str]) -> None:
    raise MissingWeightsError(
        f"{len(missing)} parameter(s) were not in the checkpoint:\n"
        f"{describe_keys(missing, checkpoint_names)}"
    )


def load_weights(
    model: nn.Module,
    weights: CheckpointReader | Iterable[tuple[str, torch.Tensor]],
    mapper: WeightsMapper | None = None,
    stacked: StackedMapping | None = None,
    strict: bool = True,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    allow_missing: Iterable[str] = (),
    progress: bool | None = None,
    metrics: metrics_mod.Metrics | None | bool = None,
) -> LoadReport:
    """Copy `weights` into `model`; see the module docstring. Returns what was loaded and how fast.

    `device`/`dtype`: materialise a meta-built model there first (meta models default to CPU).
    `allow_missing`: glob patterns of parameter names that may stay unloaded.
    `progress`: a tqdm bar in bytes (None: only on a terminal). `metrics=False` exports nothing.
    """
    start = time.perf_counter()
    if device is not None or dtype is not None or has_meta(model):
        materialize(model, device if device is not None else "cpu", dtype)
    targets = _Targets(model)
    report = LoadReport()
    allow_missing = tuple(allow_missing)

    total = None
    if isinstance(weights, CheckpointReader):
        # Resolve every name before reading a byte: fail fast on mapping mistakes.
        names = weights.keys()
        unexpected = {}
        for name in names:
            try:
                targets.resolve(name, mapper, stacked)
            except KeyError as e:
                unexpected[name] = e.args[0]
        if unexpected and strict:
            _raise_unexpected(unexpected, targets)
        total = weights.total_bytes()
        if strict:
            dry = _Targets(model)
            for name in names:
                with contextlib.suppress(KeyError):
                    target, shard_id = dry.resolve(name, mapper, stacked)
                    if target is not None:
                        dry.mark(target, shard_id)
            missing = dry.missing(allow_missing)
            if missing:
                _raise_missing(missing, targets, names)

    unexpected: dict[str, str] = {}
    seen_names: list[str] = []
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", leave=False,
               disable=(not progress) if progress is not None else None)
    with torch.no_grad(), bar:
        for name, tensor in weights:
            seen_names.append(name)
            try:
                target, shard_id = targets.resolve(name, mapper, stacked)
            except KeyError as e:
                unexpected[name] = e.args[0]
                continue
            if target is None:
                report.skipped.append(name)
                continue
            param = targets.by_name[target]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except (WeightMismatchError, ValueError) as e:
                where = name if name == target else f"{name} -> {target}"
                shard = f" shard {shard_id!r}" if shard_id is not None else ""
                raise WeightMismatchError(f"{where}{shard}: {e}") from None
            targets.mark(target, shard_id)
            report.loaded.append(name)
            report.bytes += tensor.nbytes
            bar.update(tensor.nbytes)

    if unexpected:
        if strict:
            _raise_unexpected(unexpected, targets)
        report.unexpected = sorted(unexpected)
    missing = targets.missing(allow_missing)
    if missing:
        if strict:
            _raise_missing(missing, targets, seen_names)
        report.missing = missing
    if isinstance(weights, CheckpointReader):
        report.opened_files = list(weights.opened_files)
    if _device_of(model).type == "cuda":
        torch.cuda.synchronize()
    report.seconds = time.perf_counter() - start
    if metrics is not False:
        report.export(metrics or None)
    log.info("%s", report.summary())
    if report.unexpected or report.missing:
        log.warning("non-strict load: %d unexpected, %d missing", len(report.unexpected), len(report.missing))
    return report


def _device_of(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def load_dummy_weights(
    model: nn.Module,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    metrics: metrics_mod.Metrics | None | bool = None,
) -> LoadReport:
    """``--dummy-weights``: the same parameters, shapes and sharding, random values."""
    start = time.perf_counter()
    materialize(model, device, dtype)
    report = LoadReport(dummy=True)
    report.bytes = init_dummy_weights(model, seed)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    report.seconds = time.perf_counter() - start
    if metrics is not False:
        report.export(metrics or None)
    log.info("%s", report.summary())
    return report


def load_checkpoint(
    model: nn.Module,
    model_dir,
    *,
    mapper: WeightsMapper | None = None,
    stacked: StackedMapping | None = None,
    prefixes=None,
    subfolder: str | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    dummy: bool = False,
    strict: bool = True,
    metrics: metrics_mod.Metrics | None | bool = None,
) -> LoadReport:
    """What a service's load() calls: the checkpoint's tensors (under `prefixes`), or dummy ones."""
    if dummy:
        return load_dummy_weights(model, device=device, dtype=dtype, metrics=metrics)
    reader = CheckpointReader(model_dir, subfolder=subfolder, prefixes=prefixes)
    return load_weights(model, reader, mapper, stacked, strict, device=device, dtype=dtype, metrics=metrics)
