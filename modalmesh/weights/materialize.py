"""Meta-device models -> real tensors on the target device and dtype; dummy weights.

Models are built under ``with torch.device("meta")`` so a 70B tree costs no
memory until its shard is allocated, once, directly on the GPU in the serving
dtype. `nn.Module.to_empty` is not used because it creates fresh Parameter
objects (dropping each parameter's ``weight_loader``) and unties shared
parameters; here each parameter object is replaced once and every module
that shared it receives the same replacement.

Buffers that a module computes rather than loads (rotary tables, masks) should
be created on an explicit device; a meta buffer is allocated empty and filled
by its module's ``reset_buffers()`` hook, or is an error if it has none.
"""

from __future__ import annotations

import torch
from torch import nn

from modalmesh.errors import ConfigError


def _target_dtype(t: torch.Tensor, dtype: torch.dtype | None, keep: bool) -> torch.dtype:
    if dtype is None or keep or not t.dtype.is_floating_point:
        return t.dtype
    return dtype


def materialize(model: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None) -> nn.Module:
    """Allocate every meta parameter/buffer on `device`; move the rest. Floating params take `dtype`.

    A parameter with ``param.keep_dtype = True`` (e.g. an fp32 router) keeps its own dtype.
    Values of already-real tensors are kept (converted); meta tensors are left uninitialised.
    """
    device = torch.device(device)
    replaced: dict[int, nn.Parameter] = {}
    needs_reset: list[nn.Module] = []
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            new = replaced.get(id(param))
            if new is None:
                keep = getattr(param, "keep_dtype", False)
                target = _target_dtype(param, dtype, keep)
                if param.is_meta:
                    data = torch.empty(param.shape, dtype=target, device=device)
                else:
                    data = param.detach().to(device=device, dtype=target)
                new = nn.Parameter(data, requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)  # weight_loader, shard_ids, ...
                replaced[id(param)] = new
            module._parameters[name] = new
        for name, buf in list(module._buffers.items()):
            if buf is None:
                continue
            if buf.is_meta:
                module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
                if module not in needs_reset:
                    needs_reset.append(module)
            else:
                module._buffers[name] = buf.to(device)
    for module in needs_reset:
        reset = getattr(module, "reset_buffers", None)
        if reset is None:
            names = [n for n, m in model.named_modules() if m is module]
            raise ConfigError(
                f"module {names[0] if names else type(module).__name__} ({type(module).__name__}) has buffers "
                "on the meta device and no reset_buffers() to compute them: create computed buffers on an "
                "explicit device or add reset_buffers()"
            )
        with torch.no_grad():
            reset()
    return model


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def init_dummy_weights(model: nn.Module, seed: int = 0, low: float = -1e-3, high: float = 1e-3) -> int:
    """Fill every floating parameter with uniform noise (vLLM's --load-format dummy); returns bytes filled.

    Small values keep activations finite in fp16/bf16 at real model sizes. Norm
    weights get 1 (norms scaled by ~0 would zero every activation).
    """
    nbytes = 0
    generators: dict[torch.device, torch.Generator] = {}
    seen: set[int] = set()
    norm_scales = {id(m.weight) for m in model.modules()
                   if type(m).__name__.endswith("Norm") and isinstance(getattr(m, "weight", None), torch.Tensor)}
    with torch.no_grad():
        for param in model.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            nbytes += param.nbytes
            if not param.dtype.is_floating_point:
                param.zero_()
                continue
            if id(param) in norm_scales:
                param.fill_(1.0)
                continue
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            if param.element_size() == 1:  # fp8: fill through a wider dtype
                param.copy_(torch.empty(param.shape, device=param.device).uniform_(low, high, generator=gen))
            else:
                param.uniform_(low, high, generator=gen)
    return nbytes
