"""torch SDPA, pinned to one kernel each: sdpa_cudnn, sdpa_flash, sdpa_efficient, sdpa_math.

Pinning (``sdpa_kernel``) makes the choice ours and observable: SDPA's own
dispatcher would silently fall back to math when a kernel declines an input.
A pinned kernel that declines raises instead, which the capability records
are written to prevent.

Masks (sliding windows, packed and paged batches) go through `attn_mask`, which
on CUDA only the math and efficient kernels accept; on CPU all do. Packed and
paged batches become one SDPA call with masks/indices built once per forward
(see masks.py for the block-diagonal vs padded trade-off).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from modalmesh.attention import masks
from modalmesh.attention.backends.base import AttentionBackend, repeat_kv
from modalmesh.attention.paged import gather_pages


@lru_cache(maxsize=None)
def sdpa_has_enable_gqa() -> bool:
    """torch >= 2.5 takes enable_gqa; older versions need the kv heads repeated."""
    q = torch.zeros(1, 2, 1, 8, device="cpu")
    kv = torch.zeros(1, 1, 1, 8, device="cpu")
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


class _Sdpa(AttentionBackend):
    kernel_name = ""  # member of torch.nn.attention.SDPBackend
    native_gqa = False  # passes enable_gqa instead of repeating kv heads
    cuda_masks = False  # accepts attn_mask on CUDA (on CPU every kernel does)

    def probe(self) -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self._kernel = getattr(SDPBackend, self.kernel_name)
        self._pin = sdpa_kernel

    def _masks_ok(self, device: torch.device) -> bool:
        return device.type == "cpu" or self.cuda_masks

    def _sdpa(self, q, k, v, mask, is_causal: bool, scale: float) -> torch.Tensor:
        """(B, S, H, D) in and out; SDPA itself wants (B, H, S, D)."""
        extra = {}
        if k.shape[2] != q.shape[2]:
            if self.native_gqa and sdpa_has_enable_gqa():
                extra["enable_gqa"] = True
            else:
                k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
        with self._pin(self._kernel):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=mask, is_causal=is_causal, scale=scale, **extra,
            )
        return out.transpose(1, 2)

    def dense(self, q, k, v, *, causal, scale, window):
        s_q, s_k = q.shape[1], k.shape[1]
        if not masks.needs_mask(causal, window, s_q, s_k):
            return self._sdpa(q, k, v, None, causal, scale)
        if not self._masks_ok(q.device):
            raise ValueError(f"{self.name} takes no mask on {q.device.type}: window or causal with S_q != S_k")
        return self._sdpa(q, k, v, masks.dense_mask(s_q, s_k, causal, window, q.device), False, scale)

    def varlen(self, q, k, v, meta, *, causal, scale, window):
        if masks.varlen_strategy(meta) == "block_diag":
            mask = masks.block_diag_mask(meta, causal, window)
            return self._sdpa(q[None], k[None], v[None], mask, False, scale)[0]
        index, batch, width = masks.varlen_pad_index(meta), meta.batch_size, meta.max_seqlen
        out = self._sdpa(
            masks.pad(q, index, batch, width),
            masks.pad(k, index, batch, width),
            masks.pad(v, index, batch, width),
            masks.padded_mask(meta, causal, window),
            False,
            scale,
        )
        return masks.unpad(out, index)

    def paged(self, q, k_cache, v_cache, meta, *, causal, scale, window):
        # Reference-grade paged path: gather each sequence's pages into a dense (B, L) block.
        # Fine for CPU and FP32; on GPUs a native paged kernel (fa3, fa2, triton) is ranked first.
        slots = masks.paged_slots(meta)
        k = gather_pages(k_cache, slots).to(q.dtype)
        v = gather_pages(v_cache, slots).to(q.dtype)
        index = masks.paged_q_index(meta)
        out = self._sdpa(
            masks.pad(q, index, meta.batch_size, meta.max_seqlen_q),
            k, v, masks.paged_mask(meta, causal, window), False, scale,
        )
        return masks.unpad(out, index)


class SdpaCudnn(_Sdpa):
    kernel_name = "CUDNN_ATTENTION"


class SdpaFlash(_Sdpa):
    kernel_name = "FLASH_ATTENTION"
    native_gqa = True


class SdpaEfficient(_Sdpa):
    kernel_name = "EFFICIENT_ATTENTION"
    cuda_masks = True


class SdpaMath(_Sdpa):
    kernel_name = "MATH"
    native_gqa = True
    cuda_masks = True
