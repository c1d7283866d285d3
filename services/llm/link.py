"""The link between the LLM's gRPC edge and its engine process: framed messages over a socket pair.

    edge_end, engine_end = socket_pair()
    sender = FrameSender(engine_end)                 # blocking, thread-safe: the engine thread sends too
    sender.send(StepDeltas(rows))                    # one frame: every request's delta of one step
    reader = await FrameReader.open(edge_end)        # asyncio, on the edge's event loop
    message = await reader.recv()                    # None: the other end has gone

Why a process boundary here: grpc's per-message work on the event loop and the engine thread's
scheduling and detokenising shared one GIL, and each took about half of it under 256 streams (py-spy
on the H200, issue 17). The engine process sends one frame per step whatever the batch; the edge
turns it into each stream's messages. A frame is an 8-byte length and a msgpack array: the message's
index in `MESSAGES`, then its fields (plain values only: no pickle, so a frame names data, never code;
requests cross as their protobuf bytes). msgpack is what vLLM's engine-core link uses too.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import struct
import threading
from typing import Any, NamedTuple

import msgpack
import numpy as np

_HEADER = struct.Struct("<Q")
_BUFFER_BYTES = 4 << 20  # a step's frame (256 sequences) is a few KB; an image request may be MBs


# ---- edge -> engine ----------------------------------------------------------------------------------
class GenerateCall(NamedTuple):
    call_id: int
    request: bytes  # the GenerateRequest as the client sent it (validated in the engine process)
    timeout: float | None  # what the caller's deadline left when the edge took the call
    metadata: tuple[tuple[str, str], ...]  # x-request-id and the Generate span's traceparent, for the engine's logs
    # and the encoders' calls
    sent_at: float  # time.perf_counter() when the edge sent it (one clock for the service's processes): the
    # engine process observes the link's share of a call's set-up from it


class EndCall(NamedTuple):
    """The edge is done with a call: `complete` (every choice finished) or not (cancelled, failed): the engine
    aborts what of it still runs and forgets it."""

    call_id: int
    complete: bool


class Query(NamedTuple):
    """Info (the engine's part of ServiceInfo) or metrics (its registry's exposition text)."""

    query_id: int
    what: str  # "info" | "metrics"


class Shutdown(NamedTuple):
    pass


# ---- engine -> edge ----------------------------------------------------------------------------------
class Ready(NamedTuple):
    pass


class LoadFailed(NamedTuple):
    error: ErrorInfo


class CallFailed(NamedTuple):
    """A call refused or failed before its choices reached the engine (bad request, encoders, queue full)."""

    call_id: int
    error: ErrorInfo


class StepDeltas(NamedTuple):
    """One engine step's deltas for every call it served: rows of `DeltaRow`."""

    rows: list


class Answer(NamedTuple):
    query_id: int
    value: Any  # info: the serialized pb.ServiceInfo part; metrics: metrics.plain_families


class Stopped(NamedTuple):
    pass


class ErrorInfo(NamedTuple):
    """An exception as the edge re-raises it: `status` a grpc.StatusCode name for the project's errors
    (modalmesh.errors), None for anything else (INTERNAL, the type name only)."""

    status: str | None
    message: str
    type_name: str


# A delta row, kept a plain tuple (a step's frame is built on the engine thread):
#   (call_id, index, token_ids, text, logprobs, finish, extra)
#   finish: None, or (finish_reason, prompt_tokens, completion_tokens, cached_tokens)
#   extra:  None, or a dict with any of "tokens" (each token's text), "top" ([(ids, logprobs, texts)] per
#           token), "arrival" / "scheduled_at" (time.perf_counter, on a request's first delta), "error" (ErrorInfo),
#           "prompt" ((ids, texts, logprobs, ranks, [(ids, logprobs, texts)] per scored token): prompt logprobs)
DeltaRow = tuple


def error_info(exc: BaseException) -> ErrorInfo:
    from modalmesh.errors import ModalmeshError

    if isinstance(exc, ModalmeshError):
        return ErrorInfo(exc.status.name, str(exc), type(exc).__name__)
    return ErrorInfo(None, str(exc), type(exc).__name__)


def raise_error(info: ErrorInfo | tuple, during: str = "generation") -> None:
    """Re-raise an engine-side error on the edge, with the status it had there (`info` as sent: a row's
    "error" arrives as the plain triple)."""
    import grpc

    from modalmesh import errors

    info = ErrorInfo(*info)
    if info.status is not None:
        status = grpc.StatusCode[info.status]
        cls = next((c for c in _error_classes(errors.ModalmeshError) if c.status is status), errors.ModalmeshError)
        exc = cls(info.message)
        if cls is errors.ModalmeshError:
            exc.status = status
        raise exc
    raise RuntimeError(f"{during} failed: {info.type_name}")


def _error_classes(base):
    for cls in base.__subclasses__():
        if cls.__name__ != "ConfigError":
            yield cls
        yield from _error_classes(cls)


# ---- transport ---------------------------------------------------------------------------------------
def socket_pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER_BYTES)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER_BYTES)
    return a, b


MESSAGES = (GenerateCall, EndCall, Query, Shutdown, Ready, LoadFailed, CallFailed, StepDeltas, Answer, Stopped)
_TAGS = {cls: tag for tag, cls in enumerate(MESSAGES)}
_ERROR_FIELD = {LoadFailed, CallFailed}  # their `error` (last field) is an ErrorInfo again once read


def encode(message) -> bytes:
    payload = msgpack.packb((_TAGS[type(message)], *message), use_bin_type=True)
    return _HEADER.pack(len(payload)) + payload


def decode(payload: bytes | memoryview):
    tag, *fields = msgpack.unpackb(payload, raw=False, use_list=False)
    cls = MESSAGES[tag]
    if cls in _ERROR_FIELD:
        fields[-1] = ErrorInfo(*fields[-1])
    return cls(*fields)


class FrameSender:
    """Blocking sends from any thread (the engine thread's steps, the event loop's replies), one frame at a
    time. A send blocks only while the other end's buffer is full: the engine then waits for the edge."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._sock.setblocking(True)
        self._lock = threading.Lock()
        self.closed = False

    def send(self, message) -> bool:
        """False when the other end has gone (the caller's message is dropped)."""
        data = encode(message)
        with self._lock:
            if self.closed:
                return False
            try:
                self._sock.sendall(data)
            except OSError:
                self.closed = True
                return False
        return True

    def close(self) -> None:
        with self._lock:
            self.closed = True
            try:
                self._sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass


class FrameReader:
    """Frames off a socket on an event loop; `recv` gives None once the other end has closed.

    The socket is read with `recv_into` (`_FrameProtocol`), which lets go of the GIL for the kernel's copy: a frame
    larger than the shared buffer straight into a buffer of its own, smaller ones many to a read. asyncio's
    StreamReader received 256 KB `bytes`, appended each to its buffer and sliced the frame out again, all holding
    the GIL: for the 1.8 MB frame of an image embedding's request that was 19 % of the engine process's loop's GIL
    samples, while the engine thread waited for the GIL to launch its step (py-spy on the H200, issue 17). And
    each read is a retake of the GIL, which beside a thread running Python can wait a whole switch interval:
    fewer, larger reads wait fewer times (`bench/link.py`).
    """

    def __init__(self, protocol: _FrameProtocol):
        self._protocol = protocol  # it holds the transport: the connection lives as long as this reader

    @classmethod
    async def open(cls, sock: socket.socket) -> FrameReader:
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        _transport, protocol = await loop.connect_accepted_socket(_FrameProtocol, sock=sock)
        return cls(protocol)

    async def recv(self):
        payload = await self._protocol.next_payload()
        return None if payload is None else decode(payload)


class _FrameProtocol(asyncio.BufferedProtocol):
    """Frames as they arrive: small ones read many at a time into one reused buffer (and copied out whole), a frame
    larger than it read into a buffer of its own size. Reading pauses while `_PAUSE_BYTES` of frames wait for
    `next_payload`, so a slow consumer holds the other end's sender back instead of growing this process."""

    _SHARED_BYTES = 256 << 10
    _PAUSE_BYTES = 2 * _BUFFER_BYTES

    def __init__(self):
        self._buf = bytearray(self._SHARED_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # the unread bytes of `_buf`
        self._big: memoryview | None = None  # a frame too large for `_buf`, being filled
        self._big_filled = 0
        self._frames: collections.deque = collections.deque()
        self._queued_bytes = 0
        self._waiter: asyncio.Future | None = None
        self._transport: asyncio.Transport | None = None  # set by connection_made, before any data
        self._paused = False
        self._closed = False

    def connection_made(self, transport) -> None:
        self._transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big is not None:
            return self._big[self._big_filled:]
        if self._end == len(self._buf):  # full: the unread part of a frame moves to the front
            unread = self._end - self._start
            self._view[:unread] = self._view[self._start:self._end]
            self._start, self._end = 0, unread
        return self._view[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._big is not None:
            self._big_filled += nbytes
            if self._big_filled == len(self._big):
                self._queue(self._big)
                self._big = None
        else:
            self._end += nbytes
            self._take_frames()
        self._wake()

    def _take_frames(self) -> None:
        while self._end - self._start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buf, self._start)
            begin = self._start + _HEADER.size
            if self._end - begin >= size:
                self._queue(bytes(self._view[begin:begin + size]))
                self._start = begin + size
            elif size > len(self._buf) - _HEADER.size:  # will never fit: its own buffer, the part read so far in it
                have = self._end - begin
                # Uninitialised (a bytearray would be zeroed first, holding the GIL): the kernel's copy fills it.
                self._big = memoryview(np.empty(size, dtype=np.uint8)).cast("B")
                self._big[:have] = self._view[begin:self._end]
                self._big_filled = have
                self._start = self._end = 0
                return
            else:
                break
        if self._start == self._end:
            self._start = self._end = 0

    def _queue(self, payload) -> None:
        self._frames.append(payload)
        self._queued_bytes += len(payload)
        if not self._paused and self._queued_bytes > self._PAUSE_BYTES:
            self._paused = True
            self._transport.pause_reading()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def eof_received(self) -> bool:
        self._closed = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc) -> None:
        self._closed = True
        self._wake()

    async def next_payload(self):
        """The next frame's payload; None once the other end has closed and every frame before it was taken."""
        while not self._frames:
            if self._closed:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        payload = self._frames.popleft()
        self._queued_bytes -= len(payload)
        if self._paused and self._queued_bytes <= self._PAUSE_BYTES // 2:
            self._paused = False
            self._transport.resume_reading()
        return payload


class FrameWriter:
    """Frames onto a socket from an event loop, without blocking it (an image request can be MBs)."""

    def __init__(self, writer: asyncio.StreamWriter):
        self._writer = writer

    @classmethod
    async def open(cls, sock: socket.socket) -> FrameWriter:
        sock.setblocking(False)
        _reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(writer)

    def send(self, message) -> None:
        """Queued on the loop's transport; `drain` waits while a large backlog has not gone out."""
        if not self._writer.is_closing():
            self._writer.write(encode(message))

    async def drain(self) -> None:
        try:
            await self._writer.drain()
        except ConnectionError:
            pass

    def close(self) -> None:
        self._writer.close()
