"""Same-host tensor transfer through POSIX shared memory (/dev/shm), negotiated over gRPC.

A client that wants the fast path creates one `ShmProbe` (a tiny object under
/dev/shm holding a random nonce) and names it in each request. A server whose
`ShmExporter.peer_shares` can read that nonce shares the client's /dev/shm —
same host, same IPC namespace, same user — and answers with
``Tensor.shared_memory`` refs instead of bytes. Anything else (another host,
another container, another user) fails the probe and gets plain bytes.

Slabs. The exporter keeps a few /dev/shm objects it allocates and maps once and
reuses, so an answer costs one memcpy into memory that already exists
(allocating fresh tmpfs pages per answer ran at ~1.5 GB/s, a fifth of memcpy).
A slab's header holds two words: the lease of its current content, written by
the exporter, and the lease last handed back, written by the reader once it
has copied the bytes out. The exporter reuses a slab only when the two are
equal — its reader is done, so no copy can overlap the next write, whatever
the CPU's memory ordering. A slab whose reader never came (a cancelled call)
is retired after the TTL: unlinked and replaced, never overwritten, so a late
reader still mapping it reads the old, consistent bytes, and one that is not
gets ENOENT and asks for bytes. Each live object carries an flock held by its
creator; `sweep_orphans` removes objects whose creator died without cleaning up.

No pickle; plain files, not `multiprocessing.shared_memory`, whose resource
tracker unlinks objects when any process that touched them exits.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import math
import mmap
import os
import re
import secrets
import stat
import threading
import time
from pathlib import Path

import torch

from modalmesh import pb
from modalmesh.errors import InvalidArgument

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_PROBE_NAME = re.compile(r"modalmesh-probe-[0-9a-f]{32}")
_EMB_NAME = re.compile(r"modalmesh-emb-[0-9a-f]{32}")
_NONCE_BYTES = 16
HEADER = 64  # two 8-byte words (lease, returned), padded to a cache line
_LEASE = slice(0, 8)
_RETURNED = slice(8, 16)
_MIN_SLAB = 1 << 20
_NEGATIVE_PROBE_TTL_S = 30.0  # a failed probe check is retried after this (a transient EMFILE, say)


class SharedMemoryGone(OSError):
    """The object named by a ref is gone, retired or handed back already: ask again for bytes."""


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def _open_flags(extra: int) -> int:
    # O_NONBLOCK: a FIFO planted under a probe's name must not hang the opener.
    return extra | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _open_own_regular(path: Path, flags: int) -> int:
    """An fd on `path` if it is a regular file owned by this user (what our peers create), else OSError."""
    fd = os.open(path, _open_flags(flags))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError(errno.EACCES, f"{path.name} is not a regular file of this user")
    return fd


def _create_locked(path: Path, size: int, flags: int = os.O_RDWR) -> int:
    """A new file of `size` allocated bytes with an exclusive flock held on the returned fd."""
    fd = os.open(path, _open_flags(os.O_CREAT | os.O_EXCL | flags), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if size:
            # Allocate every page now: a full /dev/shm is an OSError here, not a SIGBUS on a later
            # write into a sparse file; and the pages are allocated once, not per answer.
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:  # pragma: no cover - not Linux
                os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    return fd


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def sweep_orphans(directory: Path = SHM_DIR) -> int:
    """Remove modalmesh objects whose creator is gone (its flock died with it); returns how many."""
    removed = 0
    try:
        names = [n for n in os.listdir(directory) if _PROBE_NAME.fullmatch(n) or _EMB_NAME.fullmatch(n)]
    except OSError:
        return 0
    for name in names:
        try:
            fd = _open_own_regular(directory / name, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # succeeds only when nobody holds it
        except OSError:
            continue  # alive
        finally:
            os.close(fd)
        _unlink(directory / name)
        removed += 1
    return removed


class ShmProbe:
    """The client's proof of where it lives: /dev/shm/modalmesh-probe-<hex> holding a nonce."""

    def __init__(self, directory: Path = SHM_DIR):
        self.name = f"modalmesh-probe-{secrets.token_hex(16)}"
        self.nonce = secrets.token_bytes(_NONCE_BYTES)
        self.path = directory / self.name
        self._fd = _create_locked(self.path, 0, os.O_WRONLY)
        os.write(self._fd, self.nonce)

    def options(self) -> pb.TransferOptions:
        return pb.TransferOptions(shm_probe=self.name, shm_nonce=self.nonce)

    def close(self) -> None:
        if self._fd >= 0:
            _unlink(self.path)
            os.close(self._fd)
            self._fd = -1


def _word(view, where: slice) -> int:
    return int.from_bytes(view[where], "little")


def _size_class(n: int) -> int:
    """`n` rounded up to one of 8 steps per power of two (at most 12.5 % slack), at least 1 MiB."""
    if n <= _MIN_SLAB:
        return _MIN_SLAB
    step = 1 << max(0, n.bit_length() - 4)
    return -(-n // step) * step


class _Slab:
    def __init__(self, directory: Path, capacity: int):
        self.name = f"modalmesh-emb-{secrets.token_hex(16)}"
        self.path = directory / self.name
        self.fd = _create_locked(self.path, capacity)
        try:
            self.map = mmap.mmap(self.fd, capacity, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.close(self.fd)
            _unlink(self.path)
            raise
        self.capacity = capacity
        self.deadline = math.inf  # when an unreturned lease is given up on

    def returned(self) -> bool:
        return _word(self.map, _LEASE) == _word(self.map, _RETURNED)

    def close(self) -> None:
        _unlink(self.path)
        self.map.close()
        os.close(self.fd)


class ShmExporter:
    """Server side: checks probes and puts answers' bytes into reusable shared-memory slabs.

    Thread-safe: the encoder writes answers from a thread pool.
    """

    def __init__(self, *, ttl_s: float = 30.0, max_bytes: int = 1 << 30, directory: Path = SHM_DIR,
                 max_probes: int = 1024):
        self.directory = directory
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._probes: collections.OrderedDict[tuple[str, bytes], tuple[bool, float]] = collections.OrderedDict()
        self._max_probes = max_probes
        # Idle or leased, by name (a slab being written is not here): lease_live looks one up per held CUDA
        # IPC answer on every export, and a scan of the list there was O(held x slabs) on the event loop.
        self._slabs: dict[str, _Slab] = {}
        self._reserved = 0  # bytes of slabs being created outside the lock
        self._closed = False
        self._lock = threading.Lock()
        if sweep_orphans(directory):
            log.info("removed shared-memory objects left by processes that died")

    @property
    def slab_bytes(self) -> int:
        """Bytes of every slab, in use or being made (read it under `_lock`, or as a snapshot for tests)."""
        return sum(s.capacity for s in self._slabs.values()) + self._reserved

    def peer_shares(self, options: pb.TransferOptions) -> bool:
        """True when the probe named in `options` is this user's regular file holding its nonce (cached)."""
        if not options.shm_probe:
            return False
        key = (options.shm_probe, bytes(options.shm_nonce))
        now = time.monotonic()
        with self._lock:
            cached = self._probes.get(key)
            if cached is not None and (cached[0] or cached[1] > now):
                self._probes.move_to_end(key)
                return cached[0]
        ok = False
        if _PROBE_NAME.fullmatch(options.shm_probe) and len(key[1]) == _NONCE_BYTES:
            try:
                fd = _open_own_regular(self.directory / options.shm_probe, os.O_RDONLY)
                try:
                    ok = os.read(fd, _NONCE_BYTES + 1) == key[1]
                finally:
                    os.close(fd)
            except OSError:
                ok = False
        with self._lock:
            self._probes[key] = (ok, now + _NEGATIVE_PROBE_TTL_S)
            while len(self._probes) > self._max_probes:
                self._probes.popitem(last=False)
        return ok

    def _take_slab(self, need: int) -> _Slab | None:
        """A slab of at least `need` bytes, out of the list (the caller writes it and puts it back)."""
        now = time.monotonic()
        retired = []
        with self._lock:
            if self._closed:
                return None
            for s in [s for s in self._slabs.values() if not s.returned() and s.deadline <= now]:
                del self._slabs[s.name]  # its reader never came: replace it, never overwrite it
                retired.append(s)
            # Reuse a returned slab that fits without wasting more than half of it.
            fitting = [s for s in self._slabs.values()
                       if s.returned() and need <= s.capacity <= max(2 * need, _MIN_SLAB)]
            slab = min(fitting, key=lambda s: s.capacity, default=None)
            capacity = _size_class(need) if need > HEADER else mmap.PAGESIZE  # a lease alone: one page
            if slab is None and capacity <= self.max_bytes:
                idle = sorted((s for s in self._slabs.values() if s.returned()), key=lambda s: s.capacity)
                while idle and self.slab_bytes + capacity > self.max_bytes:  # make room from idle slabs
                    victim = idle.pop(0)
                    del self._slabs[victim.name]
                    retired.append(victim)
                if self.slab_bytes + capacity <= self.max_bytes:
                    self._reserved += capacity
                else:
                    capacity = 0
            elif slab is None:
                capacity = 0  # larger than the whole budget
            if slab is not None:
                del self._slabs[slab.name]
        for s in retired:
            s.close()
        if slab is not None or not capacity:
            return slab
        try:
            return _Slab(self.directory, capacity)  # allocating can take a while: outside the lock
        except OSError as exc:  # /dev/shm full or gone: this answer goes as bytes
            log.warning("no shared-memory slab of %d bytes: %s", capacity, exc)
            return None
        finally:
            with self._lock:
                self._reserved -= capacity

    def export(self, meta: pb.Tensor, data, *, ready=None) -> pb.Tensor | None:
        """A Tensor of `meta`'s dtype and shape whose bytes are in a slab, or None when there is no room
        (send bytes). `data`: the bytes, or a tensor (on any device; a CUDA one is copied straight into
        the slab, after `ready`, its CUDA event)."""
        from modalmesh.rpc.codec import copy_to_host  # codec imports nothing from here

        size = data.numel() * data.element_size() if isinstance(data, torch.Tensor) else len(data)
        slab = self._take_slab(HEADER + size)
        if slab is None:
            return None
        lease = secrets.randbits(64) or 1
        try:
            if not isinstance(data, torch.Tensor):
                slab.map[HEADER:HEADER + size] = data
            elif size:
                # Never page-locked (cudaHostRegister): where the driver refuses a /dev/shm mapping (the
                # H200 host does), the failure stays behind as the thread's CUDA error and the next kernel
                # launched there raised it. A device answer comes through a pinned bounce buffer instead.
                copy_to_host(data, torch.frombuffer(slab.map, dtype=torch.uint8, count=size, offset=HEADER), ready)
        except BaseException:
            slab.close()  # half written: never handed out
            raise
        slab.map[_LEASE] = lease.to_bytes(8, "little")  # after the bytes; its reader cannot be mid-copy
        slab.deadline = time.monotonic() + self.ttl_s
        with self._lock:
            closed = self._closed
            if not closed:
                self._slabs[slab.name] = slab
        if closed:
            slab.close()
            return None
        return pb.Tensor(dtype=meta.dtype, shape=meta.shape, shared_memory=pb.SharedMemoryRef(
            name=slab.name, nbytes=size, offset=HEADER, lease=lease))

    def lease_live(self, name: str, lease: int) -> bool:
        """Whether the slab `name` still holds `lease`, not yet handed back nor past its TTL (the CUDA IPC
        exporter keeps a tensor alive exactly that long)."""
        now = time.monotonic()
        with self._lock:
            s = self._slabs.get(name)
            return s is not None and _word(s.map, _LEASE) == lease and not s.returned() and s.deadline > now

    def close(self) -> None:
        with self._lock:
            self._closed = True
            slabs, self._slabs = list(self._slabs.values()), {}
        for slab in slabs:
            slab.close()


class ShmReader:
    """Client side: copies shared-memory answers out and hands their slabs back.

    Recently used slabs stay mapped (up to `max_mapped_bytes`): mapping and populating a slab
    costs about as much as copying it. A mapping whose object has been removed is dropped when
    next used, and every mapping of a removed object whenever a new slab is mapped (an encoder
    that restarted never names its old slabs again), so retired slabs are not kept alive here.
    """

    def __init__(self, directory: Path = SHM_DIR, max_mapped_bytes: int = 1 << 30):
        self.directory = directory
        self.max_mapped_bytes = max_mapped_bytes
        self._maps: collections.OrderedDict[str, tuple[mmap.mmap, int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _map(self, slab: str, end: int, name: str) -> mmap.mmap:
        with self._lock:  # the fd is only closed under this lock
            entry = self._maps.get(slab)
            if entry is not None:
                if os.fstat(entry[1]).st_nlink == 0:
                    del self._maps[slab]
                    os.close(entry[1])
                    raise SharedMemoryGone(f"{name}: shared-memory object {slab} was retired")
                self._maps.move_to_end(slab)
        if entry is None:
            fd = _open_own_regular(self.directory / slab, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                if end > size:
                    raise InvalidArgument(f"{name}: shared-memory object {slab} has {size} bytes, the ref needs {end}")
                view = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            except BaseException:
                os.close(fd)
                raise
            entry = (view, fd)
            with self._lock:
                # A new slab is the moment to look: an encoder that restarted retired all of its old ones,
                # which no answer will name again, so "dropped when next used" would keep them forever.
                self._drop_retired()
                self._maps[slab] = entry
                mapped = sum(len(m) for m, _ in self._maps.values())
                while self._maps and mapped > self.max_mapped_bytes:
                    # Dropped, not closed: a reader still copying holds its own reference; the last one unmaps.
                    old_view, old_fd = self._maps.popitem(last=False)[1]
                    mapped -= len(old_view)
                    os.close(old_fd)
        if end > len(entry[0]):
            raise InvalidArgument(f"{name}: shared-memory object {slab} has {len(entry[0])} bytes, the ref needs {end}")
        return entry[0]

    def _drop_retired(self) -> None:
        """Unmap slabs whose objects are gone (caller holds the lock)."""
        for slab, (_view, fd) in list(self._maps.items()):
            if os.fstat(fd).st_nlink == 0:
                del self._maps[slab]
                os.close(fd)  # the mapping goes with the last reference to the view

    @property
    def mapped_slabs(self) -> list[str]:
        with self._lock:
            return list(self._maps)

    def read(self, message: pb.Tensor, *, name: str = "tensor",
             device: torch.device | str | None = None) -> torch.Tensor:
        """Copy a shared-memory Tensor out (to `device`, default the CPU) and hand its slab back.

        Raises InvalidArgument for a malformed ref, SharedMemoryGone (an OSError) when the slab is
        gone or holds other content, and OSError when it cannot be opened: the caller asks again
        for bytes.
        """
        from modalmesh.rpc.codec import copy_out, dtype_name, layout  # codec imports nothing from here

        ref = message.shared_memory
        dtype, shape, expected = layout(message, name)
        if ref.nbytes != expected:
            raise InvalidArgument(f"{name}: shared memory holds {ref.nbytes} bytes but shape {list(shape)} of "
                                  f"{dtype_name(message.dtype)} needs {expected}")
        view = self.leased(ref, expected, name)
        target = torch.device(device) if device is not None else torch.device("cpu")
        if expected:
            src = torch.frombuffer(view, dtype=torch.uint8, count=expected, offset=ref.offset)
            out = copy_out(src, target)  # the bytes are out before the slab goes back
            del src
        else:
            out = torch.empty(0, dtype=torch.uint8, device=target)
        view[_RETURNED] = ref.lease.to_bytes(8, "little")  # hand back; a stale lease here frees nothing
        return out.view(dtype).reshape(shape)

    def leased(self, ref: pb.SharedMemoryRef, nbytes: int, name: str) -> mmap.mmap:
        """The mapping of `ref`'s slab, holding `nbytes` at its offset under its lease, still live."""
        if not _EMB_NAME.fullmatch(ref.name):
            raise InvalidArgument(f"{name}: shared-memory name {ref.name!r} is not one modalmesh writes")
        if ref.offset < HEADER or ref.lease == 0:
            raise InvalidArgument(f"{name}: shared-memory ref has offset {ref.offset} and lease {ref.lease}")
        try:
            view = self._map(ref.name, ref.offset + nbytes, name)
        except FileNotFoundError as exc:
            raise SharedMemoryGone(f"{name}: shared-memory object {ref.name} is gone") from exc
        if _word(view, _LEASE) != ref.lease or _word(view, _RETURNED) == ref.lease:
            raise SharedMemoryGone(f"{name}: shared-memory object {ref.name} holds other content now")
        return view

    def hand_back(self, ref: pb.SharedMemoryRef, name: str = "tensor") -> None:
        """Tell the producer that `ref`'s content (or what its lease guards) is no longer read."""
        self.leased(ref, 0, name)[_RETURNED] = ref.lease.to_bytes(8, "little")

    def close(self) -> None:
        with self._lock:
            entries, self._maps = list(self._maps.values()), collections.OrderedDict()
        for _, fd in entries:
            os.close(fd)


def read_tensor(message: pb.Tensor, *, name: str = "tensor", device: torch.device | str | None = None,
                directory: Path = SHM_DIR) -> torch.Tensor:
    """`ShmReader.read` without keeping the slab mapped."""
    reader = ShmReader(directory, max_mapped_bytes=0)
    try:
        return reader.read(message, name=name, device=device)
    finally:
        reader.close()
