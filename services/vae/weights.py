"""How AutoencoderKL checkpoints map onto the decoder, as data (names and tensor-shape rules).

* Only ``decoder.*`` and ``post_quant_conv.*`` are read (`PREFIXES`): encoder and
  quant-conv tensors stay on disk.
* `LEGACY_ATTENTION`: diffusers < 0.14 named the mid-block attention ``query`` /
  ``key`` / ``value`` / ``proj_attn``; today it is ``to_q`` / ``to_k`` / ``to_v`` /
  ``to_out.0`` (what diffusers' own ``_convert_deprecated_attention_blocks`` does).
* `LOADER_RULES`: some checkpoints store those projections as 1x1 convolution
  weights ``(C, C, 1, 1)``; the parameters are linears ``(C, C)``. The rule is a
  ``weight_loader`` on the matching parameters, so the model has no format branch.
"""

from __future__ import annotations

import fnmatch
import logging
from pathlib import Path

import torch
from torch import nn

from modalmesh.weights import LoadReport, WeightMismatchError, WeightsMapper, default_weight_loader, load_checkpoint
from modalmesh.weights.param import set_weight_loader
from services.vae.config import VAEConfig
from services.vae.models import AutoencoderKLDecoder

log = logging.getLogger(__name__)

PREFIXES = ("decoder.", "post_quant_conv.")

_ATTN = r"(\.mid_block\.attentions\.\d+)\."
LEGACY_ATTENTION = WeightsMapper(regex=(
    (_ATTN + r"query\.", r"\1.to_q."),
    (_ATTN + r"key\.", r"\1.to_k."),
    (_ATTN + r"value\.", r"\1.to_v."),
    (_ATTN + r"proj_attn\.", r"\1.to_out.0."),
))
# WeightsMapper applies only the first matching regex per name, and each name matches one of these.
MAPPER = LEGACY_ATTENTION


def conv1x1_as_linear(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Load a linear weight from either a (out, in) matrix or an (out, in, 1, 1) 1x1-conv kernel."""
    if loaded.dim() == 4:
        if tuple(loaded.shape[2:]) != (1, 1):
            raise WeightMismatchError(f"a {list(loaded.shape)} kernel is not a 1x1 convolution")
        loaded = loaded[:, :, 0, 0]
    default_weight_loader(param, loaded, shard_id)


# (parameter-name glob, weight_loader): attached to the parameters before loading.
LOADER_RULES = (
    ("decoder.mid_block.attentions.*.to_[qkv].weight", conv1x1_as_linear),
    ("decoder.mid_block.attentions.*.to_out.0.weight", conv1x1_as_linear),
)


def apply_loader_rules(model: nn.Module, rules=LOADER_RULES) -> int:
    count = 0
    for name, param in model.named_parameters():
        for pattern, loader in rules:
            if fnmatch.fnmatchcase(name, pattern):
                set_weight_loader(param, loader)
                count += 1
                break
    return count


def build_decoder(cfg: VAEConfig, *, dtype: torch.dtype, seqlen_hint: int | None = None) -> AutoencoderKLDecoder:
    """The decoder on the meta device with its loader rules attached (no memory yet)."""
    with torch.device("meta"):
        model = AutoencoderKLDecoder(cfg, dtype=dtype, seqlen_hint=seqlen_hint)
    apply_loader_rules(model)
    return model.eval().requires_grad_(False)


def load_decoder(model: AutoencoderKLDecoder, vae_dir: str | Path, *, device, dtype: torch.dtype,
                 dummy: bool = False, metrics=None) -> LoadReport:
    return load_checkpoint(model, vae_dir, mapper=MAPPER, prefixes=PREFIXES, device=device, dtype=dtype,
                           dummy=dummy, metrics=metrics)


def load_decoder_state(model: AutoencoderKLDecoder, state, *, device, dtype: torch.dtype,
                       metrics=False) -> LoadReport:
    """Load from an in-memory AutoencoderKL state dict (benchmarks, GPU parity tests); encoder entries ignored."""
    from modalmesh.weights import load_weights

    items = ((k, v) for k, v in (state.items() if hasattr(state, "items") else state) if k.startswith(PREFIXES))
    return load_weights(model, items, MAPPER, device=device, dtype=dtype, metrics=metrics)
