"""Tensor-parallel process group: one per service, never across services.

A service that shards its model over N GPUs runs N ranks; `init_tp` joins the
group (``nccl`` on CUDA, ``gloo`` on CPU) and the layers in `modalmesh.layers`
read `tp_rank()` / `tp_size()` when they are built. Without `init_tp` the
process is rank 0 of 1 and every collective is a no-op, so single-GPU code
never touches torch.distributed.

    def worker(rank, world_size, x):
        ...  # build layers, load weights, run
    launch(2, worker, x)          # two processes, gloo, joined and cleaned up
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from modalmesh.process import end_multiprocessing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    group: object | None  # a torch.distributed ProcessGroup; None when size == 1


_SINGLE = TPGroup(rank=0, size=1, group=None)
_tp: TPGroup = _SINGLE
_joined = False  # this process has been a rank of a group of several (see exit_rank)
_abandoned = False  # it left one without a teardown (abandon_tp)


def tp_rank() -> int:
    return _tp.rank


def tp_size() -> int:
    return _tp.size


def tp_group() -> TPGroup:
    return _tp


def default_backend(device: torch.device | str | None = None) -> str:
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if kind == "cuda" else "gloo"


def init_tp(
    rank: int,
    world_size: int,
    *,
    backend: str | None = None,
    init_method: str | None = None,
    timeout_s: float = 300.0,
) -> TPGroup:
    """Join the tensor-parallel group of this service (all ranks of the process group)."""
    global _tp, _joined
    if world_size == 1:
        _tp = _SINGLE
        return _tp
    if _abandoned:
        raise RuntimeError("this process left a tensor-parallel group without a teardown; start a new process")
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=init_method or "env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    _tp = TPGroup(rank=dist.get_rank(), size=dist.get_world_size(), group=dist.group.WORLD)
    _joined = True
    return _tp


def joined_a_group() -> bool:
    """Whether this process has been a rank of a group of several: such a process ends with `exit_rank`."""
    return _joined


def destroy_tp() -> None:
    global _tp
    if _tp.group is not None and dist.is_initialized():
        dist.destroy_process_group()
    _tp = _SINGLE


def abandon_tp() -> None:
    """Forget the group without tearing it down, for a rank whose process ends soon after (`exit_rank`).

    NCCL's teardown waits on its peers and, while CUDA graphs that captured its collectives are alive,
    was seen to hang on two H200s (rank 0 and rank 1 both stuck in destroy_process_group); the end of
    the process frees all of it. This process cannot join another group afterwards.
    """
    global _tp, _abandoned
    if _tp.group is not None:
        _abandoned = True
    _tp = _SINGLE


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def agree_min(value: int) -> int:
    """The smallest of every rank's `value` (e.g. KV pages that fit on every GPU); identity at TP=1."""
    if _tp.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_tp.group)
    return int(t.item())


def all_gather_object(obj: object) -> list[object]:
    """Every rank's picklable `obj`, in rank order ([obj] at TP=1): start-up reports, not step data."""
    if _tp.size == 1:
        return [obj]
    out: list[object] = [None] * _tp.size
    dist.all_gather_object(out, obj, group=_tp.group)
    return out


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank `src`'s tensor on every rank (in place on the others); identity at TP=1."""
    if _tp.size > 1:
        dist.broadcast(x, src=src, group=_tp.group)
    return x


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group, in place; identity at TP=1."""
    if _tp.size > 1:
        dist.all_reduce(x, group=_tp.group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order; identity at TP=1."""
    if _tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp.size)]
    dist.all_gather(parts, x.contiguous(), group=_tp.group)
    return torch.cat(parts, dim=dim)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launched(rank: int, world_size: int, backend: str, port: int, fn: Callable, args: tuple) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # One thread per rank: N CPU ranks each using every core just thrash.
    torch.set_num_threads(1)
    init_tp(rank, world_size, backend=backend, timeout_s=120.0)
    ok = False
    try:
        fn(rank, world_size, *args)
        ok = True
    finally:
        if ok:
            # Tear down together: a rank destroying its group while a peer's gloo threads still talk to
            # it can abort the process ("terminate called without an active exception"). If a peer
            # failed, the barrier breaks: that peer's own error is the one the launcher must report.
            try:
                dist.barrier()
            except RuntimeError:
                pass
        destroy_tp()
    exit_rank()


def exit_rank(code: int = 0) -> None:
    """End a finished rank process without interpreter finalisation.

    Finalisation can still find gloo worker threads holding tensors after the group is destroyed;
    freeing them then needs the GIL of a dying interpreter and aborts the process
    ("terminate called without an active exception", SIGABRT), which a launcher reads as failure.
    """
    end_multiprocessing()  # multiprocessing's own exit work still runs (os._exit skips it)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(world_size: int, fn: Callable, *args, backend: str | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in `world_size` fresh processes sharing one TP group.

    `fn` must be importable (module level) because ranks are spawned, not forked
    (CUDA cannot be forked). Returns when every rank has finished; an exception
    in any rank is re-raised here and the other ranks are terminated.
    """
    backend = backend or default_backend()
    mp.start_processes(
        _launched,
        args=(world_size, backend, free_port(), fn, args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
