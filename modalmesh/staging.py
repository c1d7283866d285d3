"""Uploads to the device through pinned host memory that is reused, not allocated per batch.

    staging = HostStaging(device)                          # one per model (per worker thread)
    pixels, lengths = staging.upload([cpu_pixels, cpu_lengths])   # device tensors, same dtypes/shapes

`upload` packs the tensors into one pinned buffer (each at a 256-byte aligned
offset), makes one asynchronous host-to-device copy and returns views into the
device copy. Pinning fresh memory per batch (`tensor.pin_memory()`) costs a
page-locking syscall of the whole size every time; here a few buffers (two by
default: the next batch packs while the last one's copy runs) grow to the
largest batch seen and stay. A buffer is packed again only after the copy that
read it has finished (its CUDA event), so a copy never reads half-rewritten
memory.

On a CPU device `upload` returns the tensors themselves: there is nothing to copy.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

ALIGN = 256  # bytes: every dtype's alignment, and the device allocator's


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Slot:
    def __init__(self) -> None:
        self.host: torch.Tensor | None = None  # uint8, pinned
        self.copied: torch.cuda.Event | None = None  # recorded after the copy that last read `host`


class HostStaging:
    def __init__(self, device: torch.device | str, slots: int = 2):
        self.device = torch.device(device)
        self._slots = [_Slot() for _ in range(max(1, slots))]
        self._next = 0
        self._lock = threading.Lock()
        self.grown = 0  # how many times a buffer was (re)allocated: stays small once warm

    @property
    def pinned_bytes(self) -> int:
        return sum(s.host.numel() for s in self._slots if s.host is not None)

    def upload(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`tensors` (on the host) on this device, in one copy; the returned tensors are contiguous."""
        if self.device.type != "cuda":
            return [t.to(self.device) for t in tensors]
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += _aligned(n)
        if total == 0:
            return [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in tensors]
        with self._lock:
            slot = self._slots[self._next]
            self._next = (self._next + 1) % len(self._slots)
            if slot.copied is not None:
                slot.copied.synchronize()  # the copy that last read this buffer is done
            if slot.host is None or slot.host.numel() < total:
                slot.host = torch.empty(_aligned(total + total // 4), dtype=torch.uint8, pin_memory=True)
                self.grown += 1
            host = slot.host
            for t, off, n in zip(tensors, offsets, sizes):
                if n:
                    host[off:off + n].view(t.dtype).view(t.shape).copy_(t)
            device = host[:total].to(self.device, non_blocking=True)
            slot.copied = torch.cuda.Event()
            slot.copied.record()
        return [device[off:off + n].view(t.dtype).view(t.shape) for t, off, n in zip(tensors, offsets, sizes)]
