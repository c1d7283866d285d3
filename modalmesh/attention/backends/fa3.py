"""fa3: FlashAttention-3 for Hopper, from upstream ``flash_attn_interface`` or the
forward-only ``fa3-fwd`` wheel's ``fa3_fwd_interface``.

The fa3-fwd wheel is built without fp16, local (sliding-window) and paged-KV
kernels, so when it is the one found `probe` narrows the record to bf16, no
window, no paged. Either import may fail in ways other than ImportError (a wheel
built for another arch or torch raises OSError/RuntimeError on load): the
registry records whatever it is as the reason.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys

import torch

from modalmesh.attention.backends.base import AttentionBackend, first
from modalmesh.attention.backends.torch_varlen import flash_window
from modalmesh.attention.capability import PAGED, WINDOW

MODULES = ("flash_attn_interface", "fa3_fwd_interface")


def _config_alias(module_name: str) -> None:
    """fa3-fwd 0.0.3 ships its build config as ``fa3_fwd_config``, but the interface it renamed still
    imports ``flash_attn_config`` inside every forward call (round_up_headdim): without this alias each
    call raised ModuleNotFoundError, so the selector's smoke test dropped fa3 for the next backend."""
    if module_name != "fa3_fwd_interface" or "flash_attn_config" in sys.modules:
        return
    for name in ("flash_attn_config", "fa3_fwd_config"):
        try:
            config = importlib.import_module(name)
        except ImportError:
            continue
        sys.modules["flash_attn_config"] = config
        return


class FlashAttn3(AttentionBackend):
    def probe(self) -> None:
        errors = []
        for module_name in MODULES:
            try:
                module = importlib.import_module(module_name)
                _config_alias(module_name)
                self._dense, self._varlen = module.flash_attn_func, module.flash_attn_varlen_func
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure means "try the next module"
                errors.append(f"{module_name}: {type(exc).__name__}: {str(exc).strip()[:200]}")
                continue
            self._kvcache = getattr(module, "flash_attn_with_kvcache", None)
            self.module_name = module_name
            break
        else:
            raise ImportError("; ".join(errors))
        drop, dtypes = set(), None
        if self._kvcache is None:
            drop.add(PAGED)
        if module_name == "fa3_fwd_interface":
            drop |= {PAGED, WINDOW}
            dtypes = frozenset({torch.bfloat16})
        if drop or dtypes:
            targets = tuple(
                dataclasses.replace(t, features=t.features - drop, dtypes=dtypes or t.dtypes) for t in self.spec.targets
            )
            self.spec = dataclasses.replace(self.spec, targets=targets, cast_dtype=torch.bfloat16)

    @staticmethod
    def _kw(causal, scale, window):
        kw = dict(softmax_scale=scale, causal=causal)
        if window is not None:
            kw["window_size"] = flash_window(causal, window)
        return kw

    def dense(self, q, k, v, *, causal, scale, window):
        return first(self._dense(q, k, v, **self._kw(causal, scale, window)))

    def varlen(self, q, k, v, meta, *, causal, scale, window):
        cu, n = meta.cu_seqlens, meta.max_seqlen
        return first(self._varlen(q, k, v, cu, cu, n, n, **self._kw(causal, scale, window)))

    def paged(self, q, k_cache, v_cache, meta, *, causal, scale, window):
        return first(self._kvcache(
            q, k_cache, v_cache,
            cache_seqlens=meta.context_lens, page_table=meta.block_table,
            cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q,
            **self._kw(causal, scale, window),
        ))
