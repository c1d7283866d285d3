"""Same-host tensor transfer through POSIX shared memory (/dev/shm), negotiated over gRPC.

A client that wants the fast path creates one `ShmProbe` (a tiny object under
/dev/shm holding a random nonce) and names it in each request. A server whose
`ShmExporter.peer_shares` can read that nonce shares the client's /dev/shm —
same host, same IPC namespace, permission to read — and answers with
``Tensor.shared_memory`` refs instead of bytes: one copy into shared memory on
the server, one copy out of it on the client, no protobuf serialisation of
the payload and nothing through the socket. Anything else (another host,
another container, another user) fails the probe and gets plain bytes.

Lifetime: the reader unlinks an object once it has read it; the exporter
unlinks what nobody took after `ttl_s`, and everything outstanding when it
closes. Names are random, so a late unlink never removes someone else's object.
Plain files under /dev/shm, not `multiprocessing.shared_memory`, whose resource
tracker unlinks objects at exit of whichever process touched them. No pickle.
"""

from __future__ import annotations

import collections
import math
import os
import re
import secrets
import threading
import time
from pathlib import Path

import torch

from modalmesh import pb
from modalmesh.errors import InvalidArgument

SHM_DIR = Path("/dev/shm")
_PROBE_NAME = re.compile(r"^modalmesh-probe-[0-9a-f]{32}$")
_EMB_NAME = re.compile(r"^modalmesh-emb-[0-9a-f]{32}$")
_NONCE_BYTES = 16
_CHUNK = 1 << 30  # one write()/readinto() moves at most ~2 GiB on Linux


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def _open_flags(extra: int) -> int:
    return extra | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class ShmProbe:
    """The client's proof of where it lives: /dev/shm/modalmesh-probe-<hex> holding a nonce."""

    def __init__(self, directory: Path = SHM_DIR):
        self.name = f"modalmesh-probe-{secrets.token_hex(16)}"
        self.nonce = secrets.token_bytes(_NONCE_BYTES)
        self.path = directory / self.name
        fd = os.open(self.path, _open_flags(os.O_CREAT | os.O_EXCL | os.O_WRONLY), 0o600)
        try:
            os.write(fd, self.nonce)
        finally:
            os.close(fd)

    def options(self) -> pb.TransferOptions:
        return pb.TransferOptions(shm_probe=self.name, shm_nonce=self.nonce)

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def write_object(directory: Path, data: memoryview | bytes) -> str:
    """A new /dev/shm object holding `data`; returns its name."""
    name = f"modalmesh-emb-{secrets.token_hex(16)}"
    fd = os.open(directory / name, _open_flags(os.O_CREAT | os.O_EXCL | os.O_WRONLY), 0o600)
    try:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:done + _CHUNK])
    except BaseException:
        os.close(fd)
        os.unlink(directory / name)
        raise
    os.close(fd)
    return name


class ShmExporter:
    """Server side: checks probes and turns Tensor bytes into shared-memory refs."""

    def __init__(self, *, ttl_s: float = 120.0, directory: Path = SHM_DIR, max_probes: int = 1024):
        self.directory = directory
        self.ttl_s = ttl_s
        self._probes: collections.OrderedDict[tuple[str, bytes], bool] = collections.OrderedDict()
        self._max_probes = max_probes
        self._outstanding: collections.deque[tuple[float, str]] = collections.deque()
        self._lock = threading.Lock()

    def peer_shares(self, options: pb.TransferOptions) -> bool:
        """True when the probe named in `options` is readable here and holds its nonce (cached)."""
        if not options.shm_probe:
            return False
        key = (options.shm_probe, bytes(options.shm_nonce))
        with self._lock:
            if key in self._probes:
                self._probes.move_to_end(key)
                return self._probes[key]
        ok = False
        if _PROBE_NAME.match(options.shm_probe) and len(key[1]) == _NONCE_BYTES:
            try:
                fd = os.open(self.directory / options.shm_probe, _open_flags(os.O_RDONLY))
                try:
                    ok = os.read(fd, _NONCE_BYTES + 1) == key[1]
                finally:
                    os.close(fd)
            except OSError:
                ok = False
        with self._lock:
            self._probes[key] = ok
            while len(self._probes) > self._max_probes:
                self._probes.popitem(last=False)
        return ok

    def export(self, tensor: pb.Tensor) -> pb.Tensor:
        """The same tensor with its bytes moved into a new shared-memory object."""
        self.sweep()
        name = write_object(self.directory, tensor.data)
        with self._lock:
            self._outstanding.append((time.monotonic() + self.ttl_s, name))
        return pb.Tensor(dtype=tensor.dtype, shape=tensor.shape,
                         shared_memory=pb.SharedMemoryRef(name=name, nbytes=len(tensor.data)))

    def sweep(self, now: float | None = None) -> int:
        """Unlink objects nobody took within the TTL; returns how many were still there."""
        now = time.monotonic() if now is None else now
        expired = []
        with self._lock:
            while self._outstanding and self._outstanding[0][0] <= now:
                expired.append(self._outstanding.popleft()[1])
        return sum(_unlink(self.directory / name) for name in expired)

    def close(self) -> None:
        self.sweep(now=math.inf)


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def read_tensor(message: pb.Tensor, *, name: str = "tensor", directory: Path = SHM_DIR) -> torch.Tensor:
    """Client side: take a shared-memory Tensor (read it into a new tensor, unlink the object).

    Raises InvalidArgument for a malformed ref and OSError when the object cannot be read
    (gone, or not readable by this user): the caller falls back to bytes.
    """
    from modalmesh.rpc.codec import TORCH_DTYPES, dtype_name  # codec imports nothing from here

    ref = message.shared_memory
    dtype = TORCH_DTYPES.get(message.dtype)
    if dtype is None:
        raise InvalidArgument(f"{name}: unknown dtype {dtype_name(message.dtype)}")
    if not _EMB_NAME.match(ref.name):
        raise InvalidArgument(f"{name}: shared-memory name {ref.name!r} is not one modalmesh writes")
    shape = tuple(int(d) for d in message.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{name}: negative dimension in shape {list(shape)}")
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if ref.nbytes != expected:
        raise InvalidArgument(f"{name}: shared memory holds {ref.nbytes} bytes but shape {list(shape)} of "
                              f"{dtype_name(message.dtype)} needs {expected}")
    path = directory / ref.name
    fd = os.open(path, _open_flags(os.O_RDONLY))
    try:
        size = os.fstat(fd).st_size
        if size != expected:
            raise InvalidArgument(f"{name}: shared-memory object {ref.name} has {size} bytes, expected {expected}")
        out = torch.empty(expected, dtype=torch.uint8)
        view = memoryview(out.numpy()) if expected else memoryview(b"")
        done = 0
        with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
            while done < expected:
                n = f.readinto(view[done:done + _CHUNK])
                if not n:
                    raise InvalidArgument(f"{name}: shared-memory object {ref.name} ended after {done} bytes")
                done += n
    finally:
        os.close(fd)
        _unlink(path)
    return out.view(dtype).reshape(shape)
