"""How an embedding travels from an encoder to the LLM: the paths, thresholds, fallbacks and metric labels, once.

Paths (the `path` label of modalmesh_transfer_bytes_total):

    grpc           the bytes inside the answer message: any peer, anywhere
    shared_memory  a slab under /dev/shm (modalmesh.rpc.shm): only for a caller whose probe proves it
                   shares this host's /dev/shm (same host, IPC namespace and user)
    cuda_ipc       the encoder's GPU memory itself (modalmesh.rpc.cuda_ipc): a shared_memory caller that
                   runs on CUDA too, for answers on the encoder's GPU of at least CUDA_IPC_MIN_BYTES

`EmbeddingSender` (encoder side) picks the path per call from what the request offers and
makes the answer. `EmbeddingReceiver` (LLM side, one per encoder pool) offers what it can
take, reads each answer's tensor onto its device, and says what to do when a path fails:
a ref that is gone, stale or malformed -> `AskAgain` for that item without the path; one
that cannot be opened at all (another user's slab, a handle CUDA refuses) -> `AskAgain` and
the path is off for the pool. A failed CUDA IPC answer is asked again by shared memory, a
failed shared-memory one as bytes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from modalmesh import pb
from modalmesh.cuda_events import EventWaiter
from modalmesh.errors import InvalidArgument
from modalmesh.rpc import wire
from modalmesh.rpc.codec import (PINNED, copy_out, copy_to_host, from_payload, host_bytes_view, nbytes,
                                 payload_nbytes)
from modalmesh.rpc.shm import SharedMemoryGone, ShmExporter, ShmProbe, ShmReader

log = logging.getLogger(__name__)

GRPC = "grpc"
SHARED_MEMORY = "shared_memory"
CUDA_IPC = "cuda_ipc"
PATHS = (GRPC, SHARED_MEMORY, CUDA_IPC)

# Copies of at most this many bytes run on the event loop: a thread hop costs more than they do.
INLINE_BYTES = 4 << 20
# Smaller answers go by shared memory (or bytes) instead: opening a handle and its lease round trip
# cost more than copying a small answer through the host, and small answers must not be slower.
CUDA_IPC_MIN_BYTES = 1 << 20


async def _copying(nbytes: int, copy, *args, executor: Executor | None = None, **kwargs):
    """`copy(*args, **kwargs)`, which copies `nbytes`: on the event loop up to INLINE_BYTES (a thread hop
    would cost more than the copy), in `executor` (None: asyncio's default) beyond."""
    if nbytes <= INLINE_BYTES:
        return copy(*args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(copy, *args, **kwargs))


def path_of(message: pb.Tensor) -> str:
    """The path a wire Tensor took."""
    if message.HasField("cuda_ipc"):
        return CUDA_IPC
    return SHARED_MEMORY if message.HasField("shared_memory") else GRPC


def _count(metrics, direction: str, path: str, nbytes: int) -> None:
    if metrics is not None and nbytes:
        metrics.transfer_bytes_total.labels(direction=direction, path=path).inc(nbytes)


class EmbeddingSender:
    """Encoder side: an EncodeResponse holding `answers` by the fastest path the caller can take.

    An answer has `.meta` (a pb.Embedding whose tensor has dtype and shape, no data), `.tensor`
    (its embedding, on the model's device or the host) and `.ready` (a CUDA event recorded after
    the tensor was made, or None). Bytes are made only for the path that needs them: a slab for
    shared memory, the message for gRPC (from a device through a reused pinned buffer).
    """

    def __init__(self, *, shm: ShmExporter | None, executor: Executor, metrics=None, cuda_ipc: bool = False):
        self.shm = shm
        # For copies too large for the event loop (not the preprocessing pool, whose threads must keep preparing).
        self.executor = executor
        self.waiter = EventWaiter("answers-ready")
        self.metrics = metrics
        self.ipc = None
        if cuda_ipc and shm is not None:
            from modalmesh.rpc.cuda_ipc import CudaIpcExporter

            self.ipc = CudaIpcExporter(shm)

    def shares_memory(self, options: pb.TransferOptions | None) -> bool:
        return self.shm is not None and options is not None and self.shm.peer_shares(options)

    def plan(self, answers: Sequence, options: pb.TransferOptions | None) -> "Outgoing":
        """How `answers` will travel to the caller of `options`. Answers that go by CUDA IPC are exported here,
        their batch still running: the reader's copy waits for it on the GPU (modalmesh.rpc.cuda_ipc). The
        others (`Outgoing.waiting`) must wait for their batch (`ready`) before `send`."""
        shared = self.shares_memory(options)
        ipc = shared and self.ipc is not None and options.cuda_ipc
        refs = [self._export_ipc(a) if ipc else None for a in answers]
        return Outgoing(list(answers), refs, shared, [a for a, ref in zip(answers, refs) if ref is None])

    async def send(self, response: pb.EncodeResponse, outgoing: "Outgoing") -> pb.EncodeResponse | bytes:
        """`response` with the answers in it, or its wire bytes when bytes travel in it (one copy of them,
        spliced in by modalmesh.rpc.wire rather than protobuf's two). `outgoing.waiting` must be `ready`."""
        return await _copying(sum(nbytes(a.tensor) for a in outgoing.waiting), self._respond, response, outgoing,
                              executor=self.executor)

    async def respond(self, response: pb.EncodeResponse, answers: Sequence,
                      options: pb.TransferOptions | None) -> pb.EncodeResponse | bytes:
        """`plan`, `ready` and `send` in one."""
        outgoing = self.plan(answers, options)
        await self.ready(outgoing.waiting)
        return await self.send(response, outgoing)

    async def ready(self, answers: Sequence) -> bool:
        """Return once every answer's batch has run on its device (True: one had not yet).

        Never waits for the GPU on the event loop (while it waits, no request is taken in and batches
        shrink: measured 3.7 items a batch with 64 clients), nor in a thread per answer (the threads
        then capped the calls a second): one waiter thread wakes every answer of a batch at once."""
        waited = False
        for event in {id(a.ready): a.ready for a in answers if getattr(a, "ready", None) is not None}.values():
            waited = await self.waiter.wait(event) or waited
        return waited

    def close(self) -> None:
        self.waiter.close()

    def _export_ipc(self, answer) -> pb.Tensor | None:
        """The answer's GPU memory itself (no wait for its batch: see `respond`), or None (another path)."""
        if answer.tensor.device.type == "cuda" and nbytes(answer.tensor) >= CUDA_IPC_MIN_BYTES:
            return self.ipc.export(answer.meta.embedding, answer.tensor, answer.ready)
        return None

    def _respond(self, response: pb.EncodeResponse, outgoing: "Outgoing") -> pb.EncodeResponse | bytes:
        sources: list = []
        for a, ref in zip(outgoing.answers, outgoing.refs):
            if ref is None and outgoing.shared:
                ref = self.shm.export(a.meta.embedding, a.tensor, ready=a.ready)
            e = response.embeddings.add()
            e.CopyFrom(a.meta)
            if ref is not None:
                e.embedding.CopyFrom(ref)
            sources.append(None if ref is not None else a)
        sent = dict.fromkeys(PATHS, 0)
        for e in response.embeddings:
            sent[path_of(e.embedding)] += payload_nbytes(e.embedding)
        for path, n in sent.items():
            _count(self.metrics, "sent", path, n)
        if not any(a is not None and nbytes(a.tensor) for a in sources):
            return response
        lent: list[torch.Tensor] = []
        try:
            payloads = [None if a is None else self._host_bytes(a, lent) for a in sources]
            return wire.inject(response.SerializeToString(), wire.ENCODE_RESPONSE_BYTES, payloads)
        finally:
            for buffer in lent:
                PINNED.give_back(buffer)

    def _host_bytes(self, answer, lent: list) -> memoryview:
        """The answer's bytes on the host: the tensor's own memory there, else a pinned buffer's."""
        tensor = answer.tensor
        if tensor.device.type != "cuda":
            return host_bytes_view(tensor)
        size = nbytes(tensor)
        buffer = PINNED.take(size)
        lent.append(buffer)
        copy_to_host(tensor, buffer[:size], answer.ready)
        return memoryview(buffer[:size].numpy())


@dataclass
class Outgoing:
    """`EmbeddingSender.plan`'s answer: the answers, each one's CUDA IPC ref (or None), whether the caller
    shares this host's memory, and the answers still to wait for before `send` (those without a ref)."""

    answers: list
    refs: list
    shared: bool
    waiting: list


class AskAgain(Exception):
    """This answer's path failed: ask for the item again without `path` (the pool may have turned it off)."""

    def __init__(self, path: str, why: str):
        super().__init__(why)
        self.path = path


class EmbeddingReceiver:
    """LLM side, one per encoder pool: what to offer, and each answer's tensor on `device`."""

    def __init__(self, *, probe: ShmProbe | None = None, reader: ShmReader | None = None,
                 device: torch.device | None = None, metrics=None, cuda_ipc: bool | None = None):
        self.probe = probe  # None: shared memory is off (never on, or turned off after an unreadable answer)
        self.reader = reader if reader is not None else ShmReader()
        self.device = device  # None: the CPU, as a copy owning its memory
        self.metrics = metrics
        # CUDA IPC needs shared memory (the probe, the leases) and a CUDA device here; off for good once
        # a handle could not be opened.
        on_cuda = device is not None and torch.device(device).type == "cuda"
        self.cuda_ipc = on_cuda if cuda_ipc is None else (cuda_ipc and on_cuda)
        self._ipc_reader = None
        self._copies = EventWaiter("ipc-copies")  # CUDA IPC copies, awaited off the event loop
        self._finishing: set[asyncio.Task] = set()  # copies of cancelled reads, let go of once done

    def offer(self, request: pb.EncodeRequest, refused: set[str] = frozenset()) -> frozenset[str]:
        """Put the transfer options into `request`, leaving out `refused` paths; returns the paths offered."""
        offered = {GRPC}
        if self.probe is not None and SHARED_MEMORY not in refused:
            request.transfer.CopyFrom(self.probe.options())
            offered.add(SHARED_MEMORY)
            if self.cuda_ipc and CUDA_IPC not in refused:
                request.transfer.cuda_ipc = True
                offered.add(CUDA_IPC)
        return frozenset(offered)

    async def take(self, message: pb.Tensor, payload, *, name: str) -> torch.Tensor:
        """The tensor of an answer's wire Tensor (`payload`: its bytes, stripped from the message, or None),
        copied onto the device. Raises InvalidArgument for malformed bytes (the encoder's fault) and
        AskAgain when a same-host path failed."""
        path = path_of(message)
        if path == GRPC:
            view = from_payload(message, payload if payload is not None else message.data, name=name)
            # Out of the received message (read-only, any alignment, kept alive whole by a view),
            # onto the device in the same copy.
            tensor = await _copying(payload_nbytes(message), copy_out, view, self.device)
        elif path == SHARED_MEMORY:
            tensor = await self._read_shared_memory(message, name)
        else:
            tensor = await self._read_cuda_ipc(message, name)
        _count(self.metrics, "received", path, payload_nbytes(message))
        return tensor

    async def _read_cuda_ipc(self, message: pb.Tensor, name: str) -> torch.Tensor:
        if self._ipc_reader is None:
            from modalmesh.rpc.cuda_ipc import CudaIpcReader

            self._ipc_reader = CudaIpcReader(self.reader)
        try:
            # Queued on the GPU behind the producer's batch; the event loop goes on meanwhile.
            pending = self._ipc_reader.start(message, name=name, device=self.device)
            try:
                await self._copies.wait(pending.copied)
            except asyncio.CancelledError:
                # The copy may still be reading the producer's memory: let go of it only once it is done.
                task = asyncio.get_running_loop().create_task(self._finish_when_copied(pending))
                self._finishing.add(task)
                task.add_done_callback(self._finishing.discard)
                raise
            except BaseException:
                self._ipc_reader.finish(pending)
                raise
            self._ipc_reader.finish(pending)
            return pending.tensor
        except (InvalidArgument, SharedMemoryGone) as exc:
            raise AskAgain(CUDA_IPC, f"{exc}; asking again without CUDA IPC") from None
        except (OSError, RuntimeError) as exc:
            self.cuda_ipc = False  # CUDA refused the handle: it would refuse the next one too
            raise AskAgain(CUDA_IPC, f"CUDA IPC answer unreadable ({exc}); not offering CUDA IPC from now on") from None

    async def _finish_when_copied(self, pending) -> None:
        try:
            await self._copies.wait(pending.copied)
        finally:
            self._ipc_reader.finish(pending)

    async def _read_shared_memory(self, message: pb.Tensor, name: str) -> torch.Tensor:
        try:
            return await _copying(message.shared_memory.nbytes, self.reader.read, message, name=name, device=self.device)
        except (InvalidArgument, SharedMemoryGone) as exc:
            # A late read (the slab was retired) or a malformed ref: this item again, without it.
            raise AskAgain(SHARED_MEMORY, f"{exc}; asking again for bytes") from None
        except OSError as exc:
            self.probe = None  # not this user's, say: every later answer would fail the same way
            raise AskAgain(SHARED_MEMORY, f"shared-memory answer unreadable ({exc}); using message bytes "
                                          "from now on") from None

    def close(self) -> None:
        self._copies.close()
        if self._ipc_reader is not None:
            self._ipc_reader.close()
        self.reader.close()
