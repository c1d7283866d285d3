"""Same-host GPU-to-GPU handoff: the LLM reads an embedding straight from the encoder's GPU memory.

Negotiated per call on top of the shared-memory probe (modalmesh.rpc.shm): only a client that
proved it shares this host's /dev/shm (same host, IPC namespace and user) and says it runs on
CUDA (`TransferOptions.cuda_ipc`) is answered with a `Tensor.cuda_ipc` ref. A caller can never
send one: the codec refuses it everywhere else.

Ordered on the GPUs, never waited for by a host: the answer may go out while its batch still
runs. Its handle carries torch's IPC event, recorded (`share`) on this GPU's IPC stream after
the batch's own `ready` event, and the reader's copy waits for that event on its GPU. Before,
the encoder's event loop waited for the batch before answering and the reader's event loop for
its copy (`synchronize`): on the H200 with 64 clients the client spent 36 % of its event loop's
time in that read, and every call sat out the batch on both sides before the next could start.

Producer (`CudaIpcExporter`): the answer's storage is shared with torch's `_share_cuda_` (a
cudaIpcMemHandle of its allocation, plus torch's own IPC reference counter and event), and the
tensor is kept alive under a lease. The lease is a one-page slab of the shared-memory exporter
(its two header words: lease, returned), so expiry works as for shared memory: the tensor is
let go once the reader hands the lease back or the TTL passes.

Consumer (`CudaIpcReader`): `start` checks the lease is live, opens the handle on its own device
(torch maps it with lazy peer access: a peer copy when the GPUs differ) and queues the copy into
memory of its own on the IPC stream, after the producer's event; the caller awaits the copy's
event (modalmesh.cuda_events, off the event loop); `finish` then drops the mapping and hands the
lease back.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass

import torch

from modalmesh import pb
from modalmesh.errors import InvalidArgument
from modalmesh.rpc.codec import dtype_name, layout, nbytes, transfer_stream
from modalmesh.rpc.shm import ShmExporter, ShmReader

log = logging.getLogger(__name__)


FULL_SCAN_HELD = 256  # exports held beyond which every lease is looked at, not just the oldest


class CudaIpcExporter:
    """Encoder side: shares answers' GPU storage and keeps each alive while its lease is."""

    def __init__(self, shm: ShmExporter):
        self.shm = shm  # holds the lease words, and their TTL
        self._held: dict[tuple[str, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """How many exported tensors are kept alive now."""
        self._release()
        return len(self._held)

    def _release(self) -> None:
        """Let go of the tensors whose leases were handed back or expired. Leases come back about in the order
        they went out, so the oldest are looked at until one is still live; every lease is looked at only
        when many are held (a reader that never hands back must not hold the later ones to its TTL). A scan
        of them all on every export was 4 % of the encoder's event loop on the H200."""
        with self._lock:
            done = []
            for key in self._held:
                if self.shm.lease_live(*key):
                    break
                done.append(key)
            if len(self._held) - len(done) > FULL_SCAN_HELD:
                done = [k for k in self._held if not self.shm.lease_live(*k)]
            for key in done:
                del self._held[key]  # handed back or expired: the allocator may have it again
        if done:
            torch.cuda.ipc_collect()  # frees blocks torch kept for readers that have let go

    def export(self, meta: pb.Tensor, tensor: torch.Tensor, ready=None) -> pb.Tensor | None:
        """A Tensor of `meta`'s dtype and shape whose bytes are `tensor`'s (on CUDA), or None (send it
        another way) when no lease can be had or the storage cannot be shared."""
        self._release()
        if tensor.device.type != "cuda" or not tensor.is_contiguous():
            return None
        lease = self.shm.export(pb.Tensor(dtype=pb.UINT8, shape=[0]), b"")
        if lease is None:
            return None
        try:
            # torch records the reader's IPC event on the current stream, the first time a storage is shared.
            # On the IPC stream, made to wait for the batch that made the tensor (`ready`), it is reached
            # when that batch is done; on the compute stream it would be reached only after the batches
            # queued since, and the reader's copy would wait for them too.
            stream = ipc_stream(tensor.device)
            if ready is not None:
                stream.wait_event(ready)
            with torch.cuda.stream(stream):
                ref = share(tensor)
        except Exception as exc:  # noqa: BLE001 - e.g. memory from an allocator without IPC: send bytes
            log.warning("CUDA IPC export failed (%s); sending the embedding another way", exc)
            return None  # the lease slab expires unread
        ref.lease.CopyFrom(lease.shared_memory)
        with self._lock:
            self._held[(lease.shared_memory.name, lease.shared_memory.lease)] = tensor
        return pb.Tensor(dtype=meta.dtype, shape=meta.shape, cuda_ipc=ref)


@dataclass(eq=False)
class PendingCopy:
    """A CUDA IPC answer being copied: `tensor` is this process's copy, complete once `copied` is."""

    tensor: torch.Tensor
    copied: "torch.cuda.Event"
    storage: object  # the producer's mapped memory, held until the copy is done
    lease: pb.SharedMemoryRef
    name: str
    handle: bytes = b""  # the producer's allocation (cudaIpcMemHandle) the storage is in


class CudaIpcReader:
    """LLM side: copies CUDA IPC answers into its own device memory and hands their leases back."""

    def __init__(self, shm: ShmReader, keep_s: float = 1.0, max_mapped: int = 16):
        self.shm = shm  # maps the lease slabs
        # The last storage read from each producer allocation, and when. While one is alive torch keeps the
        # allocation mapped: the next read from it opens no handle, and a read that is done closes none
        # (freeing the mapping was 42 % of the client's busy event loop on the H200, 64 clients). Each
        # keeps one answer's memory from the producer's allocator (torch's IPC counter) until replaced or
        # unused for `keep_s`; at most `max_mapped` are kept.
        self.keep_s, self.max_mapped = keep_s, max_mapped
        self._mapped: collections.OrderedDict[bytes, tuple[object, float]] = collections.OrderedDict()
        self._device: torch.device | None = None  # where they are (the reader's device)

    def start(self, message: pb.Tensor, *, name: str, device: torch.device) -> PendingCopy:
        """Open the answer's handle and queue its copy onto `device` (CUDA) on the IPC stream, after the
        producer's event: the host waits for nothing. Await `copied`, then call `finish`. Raises
        InvalidArgument for a malformed ref, SharedMemoryGone when its lease is gone or stale (ask again),
        RuntimeError when the handle cannot be opened (the path is off for the pool)."""
        ref = message.cuda_ipc
        dtype, shape, expected = layout(message, name)
        if ref.nbytes != expected or ref.offset + expected > ref.storage_size_bytes:
            raise InvalidArgument(f"{name}: CUDA IPC ref of {ref.nbytes} bytes at {ref.offset} in a storage of "
                                  f"{ref.storage_size_bytes}; shape {list(shape)} of {dtype_name(message.dtype)} "
                                  f"needs {expected}")
        device = torch.device(device)
        if device.type != "cuda":
            raise InvalidArgument(f"{name}: a CUDA IPC answer to a receiver on {device}")
        self.shm.leased(ref.lease, 0, name)  # live before the handle is opened: the memory is still the answer
        out, copied, storage = copy_shared(ref, device)
        return PendingCopy(out.view(dtype).reshape(shape), copied, storage, ref.lease, name, bytes(ref.handle))

    def finish(self, pending: PendingCopy) -> None:
        """After `pending.copied` has completed (or failed): the storage let go of (kept mapped a while: see
        `_mapped`), the lease handed back."""
        now = time.monotonic()
        self._device = pending.tensor.device
        # torch synchronizes the current stream when it frees such a storage: the transfer stream, which
        # only ever holds work the host waits for at once. The IPC stream may hold copies still waiting for
        # the producer's batches.
        with torch.cuda.stream(transfer_stream(pending.tensor.device)):
            replaced = self._mapped.pop(pending.handle, None)
            self._mapped[pending.handle] = (pending.storage, now)
            pending.storage = replaced = None  # its allocation stays mapped by the one kept in its place
            while self._mapped and (len(self._mapped) > self.max_mapped
                                    or next(iter(self._mapped.values()))[1] < now - self.keep_s):
                self._mapped.popitem(last=False)  # its last reference: the mapping is closed
        self.shm.hand_back(pending.lease, pending.name)

    def close(self) -> None:
        """Close every mapping still kept (torch's IPC counters tell the producers)."""
        if self._mapped:
            with torch.cuda.stream(transfer_stream(self._device)):
                self._mapped.clear()

    def read(self, message: pb.Tensor, *, name: str, device: torch.device) -> torch.Tensor:
        """`start`, waiting for the copy on this thread, then `finish`: the tensor on `device`."""
        pending = self.start(message, name=name, device=device)
        try:
            pending.copied.synchronize()
        finally:
            self.finish(pending)
        return pending.tensor


_IPC_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def ipc_stream(device: torch.device) -> "torch.cuda.Stream":
    """This process's stream for the CUDA IPC handoff on `device`, whose work waits on the GPU for the other
    side's batches: the producer's IPC events, the reader's copies. No host ever synchronizes it (that is
    what the transfer stream is for: work the host waits for at once would wait behind these)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _IPC_STREAMS.get(index)
    if stream is None:
        stream = _IPC_STREAMS.setdefault(index, torch.cuda.Stream(index))
    return stream


def share(tensor: torch.Tensor) -> pb.CudaIpcRef:
    """The wire description of a CUDA tensor's memory that another process can open (torch's
    `_share_cuda_`: the allocation's cudaIpcMemHandle, torch's IPC reference counter and event); no
    lease yet. Raises when the memory cannot be shared."""
    (_device, handle, size, offset, counter, counter_offset, event,
     event_sync) = tensor.untyped_storage()._share_cuda_()
    return pb.CudaIpcRef(device=tensor.device.index or 0, handle=handle, storage_size_bytes=size,
                         storage_offset_bytes=offset, ref_counter_handle=counter, ref_counter_offset=counter_offset,
                         event_handle=event or b"", event_sync_required=bool(event_sync),
                         offset=tensor.storage_offset() * tensor.element_size(), nbytes=nbytes(tensor))


def copy_shared(ref: pb.CudaIpcRef, device: torch.device) -> tuple[torch.Tensor, "torch.cuda.Event", object]:
    """`ref.nbytes` bytes of another process's GPU memory, being copied into memory of this process's on
    `device` (uint8): (the copy, its event, the mapped storage to `release` once the event is done). The handle
    is opened and copied from on the IPC stream (within the GPU, or a peer copy from the producer's); torch
    makes the current stream wait for the producer's event when the handle opens. Raises RuntimeError when
    CUDA cannot open it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda._lazy_init()
    stream = ipc_stream(device)
    # On the caller's stream (the LLM engine's) the copy would wait for its queued steps as well.
    with torch.cuda.stream(stream):
        storage = torch.UntypedStorage._new_shared_cuda(
            index, ref.handle, ref.storage_size_bytes, ref.storage_offset_bytes, ref.ref_counter_handle,
            ref.ref_counter_offset, ref.event_handle, ref.event_sync_required)
        try:
            src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, ref.offset, (ref.nbytes,), (1,))
            out = torch.empty(ref.nbytes, dtype=torch.uint8, device=device)
            out.copy_(src, non_blocking=True)
            src = None
            copied = torch.cuda.Event()
            copied.record(stream)
        except BaseException:
            src = None
            with torch.cuda.stream(transfer_stream(device)):  # freed where its synchronize waits for nothing
                storage = None
            raise
    out.record_stream(torch.cuda.current_stream(device))  # made on the IPC stream, used on the caller's
    return out, copied, storage
