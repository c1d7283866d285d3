"""torch.Tensor <-> modalmesh.v1.Tensor: raw little-endian C-order bytes.

Encoding makes exactly one copy (into the protobuf bytes field). Decoding
aliases the message's immutable bytes unless ``copy=True``: callers that write
in place must ask for a copy (most move the tensor to a device, which copies).
"""

from __future__ import annotations

import math
import sys
import threading
import warnings

import numpy as np
import torch

from modalmesh import pb
from modalmesh.errors import InvalidArgument

if sys.byteorder != "little":  # pragma: no cover - no big-endian host in sight
    raise ImportError("modalmesh's tensor codec assumes a little-endian host")

# Aliasing read-only protobuf bytes is intended (see module docstring).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

TORCH_DTYPES: dict[int, torch.dtype] = {
    pb.FLOAT32: torch.float32,
    pb.FLOAT16: torch.float16,
    pb.BFLOAT16: torch.bfloat16,
    pb.INT64: torch.int64,
    pb.INT32: torch.int32,
    pb.INT16: torch.int16,
    pb.INT8: torch.int8,
    pb.UINT8: torch.uint8,
    pb.BOOL: torch.bool,
}
WIRE_DTYPES: dict[torch.dtype, int] = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(wire_dtype: int) -> str:
    try:
        return pb.DType.Name(wire_dtype)
    except ValueError:
        return str(wire_dtype)


def payload_nbytes(message: pb.Tensor) -> int:
    """The element bytes `message` describes (shape x itemsize), without touching `data` (reading it copies)."""
    dtype = TORCH_DTYPES.get(message.dtype)
    return 0 if dtype is None else math.prod(message.shape) * dtype.itemsize


def describe(tensor: torch.Tensor) -> pb.Tensor:
    """A wire Tensor without its bytes: dtype and shape."""
    wire = WIRE_DTYPES.get(tensor.dtype)
    if wire is None:
        raise InvalidArgument(
            f"tensor dtype {tensor.dtype} has no wire encoding "
            f"(supported: {', '.join(str(d) for d in WIRE_DTYPES)})"
        )
    return pb.Tensor(dtype=wire, shape=list(tensor.shape))


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def host_bytes_view(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a host tensor, without a copy where it is contiguous (a buffer for b"".join)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def layout(message: pb.Tensor, name: str = "tensor") -> tuple[torch.dtype, tuple[int, ...], int]:
    """A wire Tensor's dtype, shape and byte count, checked (known dtype, no negative dimension): what
    every reader (message bytes, a shared-memory slab, a CUDA IPC handle) must know before it copies."""
    dtype = TORCH_DTYPES.get(message.dtype)
    if dtype is None:
        raise InvalidArgument(f"{name}: unknown or unspecified dtype {dtype_name(message.dtype)} "
                              f"(expected one of {', '.join(pb.DType.Name(d) for d in TORCH_DTYPES)})")
    shape = tuple(int(d) for d in message.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{name}: negative dimension in shape {list(shape)}")
    return dtype, shape, math.prod(shape) * dtype.itemsize


def to_payload(tensor: torch.Tensor) -> tuple[pb.Tensor, bytes]:
    """A wire Tensor without its bytes (dtype, shape), and the bytes: one copy off the tensor."""
    meta = describe(tensor)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return meta, data


def to_proto(tensor: torch.Tensor) -> pb.Tensor:
    """Encode a tensor (any device, any strides) as a wire Tensor."""
    meta, data = to_payload(tensor)
    meta.data = data
    return meta


MAX_DIMS = 32
MAX_EXTENT = 1 << 48


def from_proto(
    message: pb.Tensor,
    *,
    name: str = "tensor",
    device: torch.device | str | None = None,
    copy: bool = False,
) -> torch.Tensor:
    """Decode a wire Tensor; malformed input raises InvalidArgument naming `name`."""
    if message.HasField("shared_memory"):
        # Only an answer to a request that offered the same-host path may point into /dev/shm
        # (modalmesh.rpc.shm reads those); anywhere else it would let a caller name files here.
        raise InvalidArgument(f"{name}: a shared-memory reference is not accepted here; send the bytes in data")
    if message.HasField("cuda_ipc"):
        # Only an encoder's answer to a request that offered CUDA IPC may carry a handle: from a caller it
        # would make this process map another process's GPU memory.
        raise InvalidArgument(f"{name}: a CUDA IPC handle (cuda_ipc) is not accepted here; send the bytes in data")
    return from_payload(message, message.data, name=name, device=device, copy=copy)


def from_payload(
    meta: pb.Tensor,
    data,
    *,
    name: str = "tensor",
    device: torch.device | str | None = None,
    copy: bool = False,
) -> torch.Tensor:
    """Decode `meta`'s dtype and shape over `data` (bytes or a memoryview, aliased unless `copy`); onto
    a GPU through `copy_out` (a pinned bounce buffer, the transfer stream)."""
    dtype, shape, expected = layout(meta, name)
    if len(shape) > MAX_DIMS or math.prod(d for d in shape if d) > MAX_EXTENT:
        # Even an empty tensor (a 0 dimension) has strides: torch cannot lay out one this large.
        raise InvalidArgument(f"{name}: shape {list(shape)} is too large (at most {MAX_DIMS} dimensions and "
                              f"{MAX_EXTENT} elements ignoring zero dimensions)")
    if len(data) != expected:
        raise InvalidArgument(
            f"{name}: data holds {len(data)} bytes but shape {list(shape)} of "
            f"{dtype_name(meta.dtype)} needs {expected}"
        )
    if expected == 0:
        out = torch.empty(shape, dtype=dtype)
    else:
        out = torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)
        if copy:
            out = out.clone()
    if device is None:
        return out
    return copy_out(out, device) if torch.device(device).type == "cuda" else out.to(device)


_TRANSFER_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def transfer_stream(device: torch.device) -> "torch.cuda.Stream":
    """One stream per GPU for transfer copies, so they wait for nothing but what they are told to."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _TRANSFER_STREAMS.get(index)
    if stream is None:
        stream = _TRANSFER_STREAMS.setdefault(index, torch.cuda.Stream(index))
    return stream


class PinnedBuffers:
    """Reused page-locked host buffers, so a copy between the host and a GPU is one DMA with no allocation
    per call: the encoder's device answers on their way into a message, the LLM's received embeddings on
    their way onto its GPU. A buffer is lent for one copy and given back after it."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            # By position, never list.remove: that compares tensors with ==, elementwise (it raised on the
            # H200 once two buffers of different sizes were free).
            fitting = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            best = min(fitting, key=lambda i: self._free[i].numel(), default=None)
            buffer = self._free.pop(best) if best is not None else None
        if buffer is None:
            buffer = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
            if len(self._free) > self.keep:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


PINNED = PinnedBuffers()  # every copy between pageable host memory and a GPU in this process


def copy_out(src: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """An owned copy of `src` (a contiguous host view into a received message or a shared-memory slab) on
    `device` (default the CPU); `src`'s memory may be reused as soon as this returns.

    On the host: one single-threaded memcpy (numpy's). torch's copy of a few MB goes through its
    intra-op thread pool, and in a service process, whose gRPC pollers and engine thread hold the
    cores, waking that pool cost 3-8 ms per 1.8 MB copy against 0.2 ms on one thread (measured).
    To CUDA: on a stream of its own, waited for alone: the caller's stream is the engine's, and a
    copy queued behind a running step would wait for the step (a pageable copy syncs its stream).
    """
    target = torch.device(device) if device is not None else torch.device("cpu")
    if target.type == "cuda":
        # Through a reused pinned buffer: one single-threaded memcpy, then a DMA. A copy straight from
        # pageable memory (a slab, the message) moved 250-400 MB/s on the H200 host (the driver stages
        # it in small pinned chunks, synchronously): 7 ms per 1.8 MB image, the whole LLM-side cost.
        n = src.numel() * src.element_size()
        bounce = PINNED.take(n) if n and src.is_contiguous() and not src.is_pinned() else None
        stream = transfer_stream(target)
        try:
            if bounce is not None:
                np.copyto(bounce[:n].numpy(), src.reshape(-1).view(torch.uint8).numpy())
                staged = bounce[:n].view(src.dtype).view(src.shape)
            else:
                staged = src
            with torch.cuda.stream(stream):
                out = staged.to(target, copy=True, non_blocking=True)
            stream.synchronize()  # done before the buffer (or the caller's source) is used again
        finally:
            if bounce is not None:
                PINNED.give_back(bounce)
        out.record_stream(torch.cuda.current_stream(target))  # its memory is the caller's stream's once freed
        return out
    if target.type != "cpu":
        return src.to(target, copy=True)
    if not src.is_contiguous() or src.numel() == 0:
        return src.clone()
    out = torch.empty(src.shape, dtype=src.dtype)
    np.copyto(out.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
    return out


def copy_to_host(tensor: torch.Tensor, dst: torch.Tensor, ready: "torch.cuda.Event | None" = None) -> None:
    """`tensor`'s raw bytes into `dst`, a host uint8 tensor of exactly that size (a pinned buffer, a slab).

    From CUDA: on the transfer stream, after `ready` (recorded where the tensor was made: the
    copy waits for that work alone, not for the next batch queued behind it). Into pinned memory
    it is one DMA; into pageable memory (a shared-memory slab) a DMA into a reused pinned bounce
    buffer, then one memcpy: a device-to-pageable copy moved
    about 400 MB/s on the H200 host, and every answer of the encoder went through it. Done when
    this returns.
    """
    if tensor.device.type == "cuda":
        n = dst.numel()
        bounce = PINNED.take(n) if n and not dst.is_pinned() else None
        stream = transfer_stream(tensor.device)
        try:
            with torch.cuda.stream(stream):
                if ready is not None:
                    stream.wait_event(ready)
                target = dst if bounce is None else bounce[:n]
                target.copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
            stream.synchronize()
            if bounce is not None:
                np.copyto(dst.numpy(), bounce[:n].numpy())
        finally:
            if bounce is not None:
                PINNED.give_back(bounce)
        return
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    if flat.numel():
        np.copyto(dst.numpy(), flat.numpy())  # one thread: see copy_out
