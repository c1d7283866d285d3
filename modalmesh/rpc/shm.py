"""Same-host tensor transfer through POSIX shared memory (/dev/shm), negotiated over gRPC.

A client that wants the fast path creates one `ShmProbe` (a tiny object under
/dev/shm holding a random nonce) and names it in each request. A server whose
`ShmExporter.peer_shares` can read that nonce shares the client's /dev/shm —
same host, same IPC namespace, permission to read — and answers with
``Tensor.shared_memory`` refs instead of bytes. Anything else (another host,
another container, another user) fails the probe and gets plain bytes.

The exporter keeps a few "slabs": /dev/shm objects it maps once and reuses, so
an answer costs one memcpy into memory that is already allocated (allocating
fresh tmpfs pages per answer ran at ~1.5 GB/s, a fifth of memcpy). The first
8 bytes of a slab hold the lease of its current content. `read_tensor` copies
the bytes out (straight to the GPU when the LLM runs on one), checks the lease
before and after the copy, and writes 0 to hand the slab back. A slab nobody
handed back is taken back after the TTL; a reader that comes later sees a
changed lease and asks again for bytes, so a slow reader can get an error but
never wrong numbers. No pickle; plain files, not `multiprocessing.shared_memory`,
whose resource tracker unlinks objects when any process that touched them exits.
"""

from __future__ import annotations

import collections
import logging
import math
import mmap
import os
import re
import secrets
import threading
import time
from pathlib import Path

import torch

from modalmesh import pb
from modalmesh.errors import InvalidArgument

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_PROBE_NAME = re.compile(r"^modalmesh-probe-[0-9a-f]{32}$")
_EMB_NAME = re.compile(r"^modalmesh-emb-[0-9a-f]{32}$")
_NONCE_BYTES = 16


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


HEADER = 64  # the lease word, padded to a cache line
_MIN_SLAB = 1 << 20
_LEASE = slice(0, 8)


def _size_class(n: int) -> int:
    """`n` rounded up to one of 8 steps per power of two (at most 12.5 % slack), at least 1 MiB."""
    if n <= _MIN_SLAB:
        return _MIN_SLAB
    step = 1 << max(0, n.bit_length() - 4)
    return -(-n // step) * step


class SharedMemoryGone(OSError):
    """The object named by a ref is gone or holds other content now: ask again for bytes."""


def _lease(view) -> int:
    return int.from_bytes(view[_LEASE], "little")


class _Slab:
    def __init__(self, directory: Path, capacity: int):
        self.name = f"modalmesh-emb-{secrets.token_hex(16)}"
        self.path = directory / self.name
        fd = os.open(self.path, _open_flags(os.O_CREAT | os.O_EXCL | os.O_RDWR), 0o600)
        try:
            # Allocate every page now: a full /dev/shm is an OSError here (the answer goes as bytes),
            # not a SIGBUS on a later write into a sparse file; and pages are allocated once, not per answer.
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, capacity)
            else:  # pragma: no cover - not Linux
                os.ftruncate(fd, capacity)
            self.map = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.capacity = capacity
        self.deadline = 0.0  # when an unreturned lease may be taken back

    def free(self, now: float) -> bool:
        return _lease(self.map) == 0 or self.deadline <= now

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.map.close()


class ShmExporter:
    """Server side: checks probes and puts answers' bytes into reusable shared-memory slabs."""

    def __init__(self, *, ttl_s: float = 120.0, max_bytes: int = 1 << 30, directory: Path = SHM_DIR,
                 max_probes: int = 1024):
        self.directory = directory
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._probes: collections.OrderedDict[tuple[str, bytes], bool] = collections.OrderedDict()
        self._max_probes = max_probes
        self._slabs: list[_Slab] = []
        self._busy: set[str] = set()  # slabs being written by this process right now
        self._lock = threading.Lock()

    @property
    def slab_bytes(self) -> int:
        return sum(s.capacity for s in self._slabs)

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

    def _lease_slab(self, need: int) -> _Slab | None:
        now = time.monotonic()
        with self._lock:
            fitting = [s for s in self._slabs if s.capacity >= need and s.name not in self._busy and s.free(now)]
            slab = min(fitting, key=lambda s: s.capacity, default=None)
            if slab is None:
                capacity = _size_class(need)
                if self.slab_bytes + capacity > self.max_bytes:
                    # Full: drop free slabs too small to be of use, else answer with bytes.
                    spare = [s for s in self._slabs if s.name not in self._busy and s.free(now)]
                    while spare and self.slab_bytes + capacity > self.max_bytes:
                        victim = spare.pop(0)
                        self._slabs.remove(victim)
                        victim.close()
                    if self.slab_bytes + capacity > self.max_bytes:
                        return None
                try:
                    slab = _Slab(self.directory, capacity)
                except OSError as exc:  # /dev/shm full or gone: this answer goes as bytes
                    log.warning("no shared-memory slab of %d bytes: %s", capacity, exc)
                    return None
                self._slabs.append(slab)
            self._busy.add(slab.name)
            return slab

    def export(self, meta: pb.Tensor, data: bytes) -> pb.Tensor | None:
        """A Tensor of `meta`'s dtype and shape whose bytes (`data`) are in a slab, or None when the
        slabs are full (send bytes)."""
        slab = self._lease_slab(HEADER + len(data))
        if slab is None:
            return None
        try:
            lease = secrets.randbits(64) or 1
            # The new lease goes in before the bytes: a late reader of the old content sees it change.
            slab.map[_LEASE] = lease.to_bytes(8, "little")
            slab.deadline = time.monotonic() + self.ttl_s
            slab.map[HEADER:HEADER + len(data)] = data
        finally:
            with self._lock:
                self._busy.discard(slab.name)
        return pb.Tensor(dtype=meta.dtype, shape=meta.shape, shared_memory=pb.SharedMemoryRef(
            name=slab.name, nbytes=len(data), offset=HEADER, lease=lease))

    def close(self) -> None:
        with self._lock:
            slabs, self._slabs = self._slabs, []
        for slab in slabs:
            slab.close()


class ShmReader:
    """Client side: copies shared-memory answers out and hands their slabs back.

    Recently used slabs stay mapped (up to `max_mapped_bytes`): mapping and populating a slab
    costs about as much as copying it. A mapping of a slab its exporter has since removed only
    pins memory until it ages out here.
    """

    def __init__(self, directory: Path = SHM_DIR, max_mapped_bytes: int = 1 << 30):
        self.directory = directory
        self.max_mapped_bytes = max_mapped_bytes
        self._maps: collections.OrderedDict[str, mmap.mmap] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _map(self, slab: str, end: int, name: str) -> mmap.mmap:
        with self._lock:
            view = self._maps.get(slab)
            if view is not None:
                self._maps.move_to_end(slab)
        if view is None:
            fd = os.open(self.directory / slab, _open_flags(os.O_RDWR))
            try:
                size = os.fstat(fd).st_size
                if end > size:
                    raise InvalidArgument(f"{name}: shared-memory object {slab} has {size} bytes, the ref needs {end}")
                view = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)
            with self._lock:
                self._maps[slab] = view
                mapped = sum(len(m) for m in self._maps.values())
                while self._maps and mapped > self.max_mapped_bytes:
                    # Dropped, not closed: a reader still copying holds its own reference; the last one unmaps.
                    mapped -= len(self._maps.popitem(last=False)[1])
        if end > len(view):
            raise InvalidArgument(f"{name}: shared-memory object {slab} has {len(view)} bytes, the ref needs {end}")
        return view

    def read(self, message: pb.Tensor, *, name: str = "tensor",
             device: torch.device | str | None = None) -> torch.Tensor:
        """Copy a shared-memory Tensor out (to `device`, default the CPU) and hand its slab back.

        Raises InvalidArgument for a malformed ref, SharedMemoryGone when the slab holds other
        content now, and OSError when it cannot be opened (gone, or not this user's): the caller
        asks again for bytes.
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
        if ref.offset < _LEASE.stop or ref.lease == 0:
            raise InvalidArgument(f"{name}: shared-memory ref has offset {ref.offset} and lease {ref.lease}")
        view = self._map(ref.name, ref.offset + expected, name)
        if _lease(view) != ref.lease:
            raise SharedMemoryGone(f"{name}: shared-memory object {ref.name} holds other content now")
        target = torch.device(device) if device is not None else torch.device("cpu")
        if expected:
            src = torch.frombuffer(view, dtype=torch.uint8, count=expected, offset=ref.offset)
            out = src.to(target, copy=True) if target.type != "cpu" else src.clone()
            if target.type == "cuda":
                torch.cuda.current_stream(target).synchronize()  # the bytes are out before the slab goes back
            del src
        else:
            out = torch.empty(0, dtype=torch.uint8, device=target)
        if _lease(view) != ref.lease:  # taken back during the copy: the copy may be torn
            raise SharedMemoryGone(f"{name}: shared-memory object {ref.name} was taken back while it was read")
        view[_LEASE] = bytes(8)  # hand the slab back
        return out.view(dtype).reshape(shape)

    def close(self) -> None:
        with self._lock:
            self._maps.clear()


def read_tensor(message: pb.Tensor, *, name: str = "tensor", device: torch.device | str | None = None,
                directory: Path = SHM_DIR) -> torch.Tensor:
    """`ShmReader.read` without keeping the slab mapped."""
    return ShmReader(directory, max_mapped_bytes=0).read(message, name=name, device=device)
