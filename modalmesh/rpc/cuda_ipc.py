"""Same-host GPU-to-GPU handoff: the LLM reads an embedding straight from the encoder's GPU memory.

Negotiated per call on top of the shared-memory probe (modalmesh.rpc.shm): only a client that
proved it shares this host's /dev/shm (same host, IPC namespace and user) and says it runs on
CUDA (`TransferOptions.cuda_ipc`) is answered with a `Tensor.cuda_ipc` ref. A caller can never
send one: the codec refuses it everywhere else.

Producer (`CudaIpcExporter`): the answer's storage is shared with torch's `_share_cuda_` (a
cudaIpcMemHandle of its allocation, plus torch's own IPC reference counter and event), and the
tensor is kept alive under a lease. The lease is a one-page slab of the shared-memory exporter
(its two header words: lease, returned), so expiry works as for shared memory: the tensor is
let go once the reader hands the lease back or the TTL passes.

Consumer (`CudaIpcReader`): checks the lease is live, opens the handle on its own device
(torch maps it with lazy peer access: a peer copy when the GPUs differ), copies the bytes
into memory of its own, drops the mapping and hands the lease back.
"""

from __future__ import annotations

import logging
import threading

import torch

from modalmesh import pb
from modalmesh.errors import InvalidArgument
from modalmesh.rpc.codec import dtype_name, layout, nbytes, transfer_stream
from modalmesh.rpc.shm import ShmExporter, ShmReader

log = logging.getLogger(__name__)


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
        with self._lock:
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
        if ready is not None:
            ready.synchronize()  # the batch that made it has run: the reader may copy at once
        try:
            # torch records the reader's IPC event on the current stream: on the transfer stream, which holds
            # no compute, it is reached at once. On the compute stream it would be reached only after the
            # batches queued since, and the reader's stream would wait for them.
            with torch.cuda.stream(transfer_stream(tensor.device)):
                ref = share(tensor)
        except Exception as exc:  # noqa: BLE001 - e.g. memory from an allocator without IPC: send bytes
            log.warning("CUDA IPC export failed (%s); sending the embedding another way", exc)
            return None  # the lease slab expires unread
        ref.lease.CopyFrom(lease.shared_memory)
        with self._lock:
            self._held[(lease.shared_memory.name, lease.shared_memory.lease)] = tensor
        return pb.Tensor(dtype=meta.dtype, shape=meta.shape, cuda_ipc=ref)


class CudaIpcReader:
    """LLM side: copies CUDA IPC answers into its own device memory and hands their leases back."""

    def __init__(self, shm: ShmReader):
        self.shm = shm  # maps the lease slabs

    def read(self, message: pb.Tensor, *, name: str, device: torch.device) -> torch.Tensor:
        """The tensor, copied onto `device` (CUDA). Raises InvalidArgument for a malformed ref,
        SharedMemoryGone when its lease is gone or stale (ask again), RuntimeError when the handle
        cannot be opened (the path is off for the pool)."""
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
        out = copy_shared(ref, device)
        self.shm.hand_back(ref.lease, name)
        return out.view(dtype).reshape(shape)


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


def copy_shared(ref: pb.CudaIpcRef, device: torch.device) -> torch.Tensor:
    """`ref.nbytes` bytes of another process's GPU memory, copied into memory of this process's on `device`
    (uint8): the handle is opened, copied from on the transfer stream (within the GPU, or a peer copy
    from the producer's) and closed again. Raises RuntimeError when CUDA cannot open it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda._lazy_init()
    stream = transfer_stream(device)
    # Opened, copied from and closed on the transfer stream: torch makes the current stream wait for the
    # producer's event when the handle opens, and synchronizes the current stream when the mapping is freed;
    # on the caller's stream (the LLM engine's) both would wait for its queued steps.
    with torch.cuda.stream(stream):
        storage = torch.UntypedStorage._new_shared_cuda(
            index, ref.handle, ref.storage_size_bytes, ref.storage_offset_bytes, ref.ref_counter_handle,
            ref.ref_counter_offset, ref.event_handle, ref.event_sync_required)
        try:
            src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, ref.offset, (ref.nbytes,), (1,))
            out = torch.empty(ref.nbytes, dtype=torch.uint8, device=device)
            out.copy_(src)
            stream.synchronize()
        finally:
            src = storage = None  # closes the mapping here (torch's IPC counter tells the producer)
    out.record_stream(torch.cuda.current_stream(device))
    return out
