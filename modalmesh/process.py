"""Process lifetime of a launched service: die with the launcher, never outlive it as an orphan.

The runtime half of launching (what a child process does for itself); the parent half, which
starts children and follows them to SERVING, is the operator tool `modalmesh.ops.launcher`.
Services, the gateway and tensor-parallel ranks call these; nothing here imports the launcher.
"""

from __future__ import annotations

import os
import signal
import sys
import time

# Set by the launcher in a child's environment: the pid that child must not outlive.
PARENT_PID_ENV = "MODALMESH_PARENT_PID"


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel for `sig` when this process's parent dies (Linux PR_SET_PDEATHSIG); False if not set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig) == 0
    except Exception:  # noqa: BLE001 - best effort: a missing libc only loses orphan cleanup
        return False


def die_with_parent() -> None:
    """Called first thing in a launched child: SIGTERM it when the launcher dies (Linux), so nothing is orphaned.

    Done in the child after exec, not as a ``preexec_fn``: Python code between fork and exec in a
    process with threads (gRPC's, the log pumps) can deadlock or crash the child (CI saw SIGSEGV).
    If the launcher died before this ran, the child is already orphaned: it exits at once.
    """
    expected = os.environ.pop(PARENT_PID_ENV, None)
    if expected is None or not set_parent_death_signal(signal.SIGTERM):
        return
    try:
        os.kill(int(expected), 0)  # the launcher (not necessarily our parent: a wrapper may sit between)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGTERM)
    except (PermissionError, ValueError):
        pass


def end_multiprocessing(timeout: float = 5.0) -> None:
    """multiprocessing's exit work, done before this process ends rather than left to run after it.

    Its finalisers run first: a named semaphore (tqdm's lock, made while loading weights) is unlinked,
    or the resource tracker finds it leaked and warns on stderr after we are gone. Then, if this process
    started the resource tracker (the LLM's edge spawns its engine process), the tracker is reaped: left
    alone it exits only once it reads the end of its pipe, after this process has exited, so a clean stop
    left a process of ours still running (CI saw it in state R after the service's exit code came back).
    Bounded: a tracker held open by a child that has not exited yet is left to end by itself.
    """
    try:
        import multiprocessing.util
        from multiprocessing import resource_tracker

        multiprocessing.util._run_finalizers(0)
        tracker = resource_tracker._resource_tracker
        with tracker._lock:
            fd, pid = tracker._fd, tracker._pid
            if fd is None or pid is None:  # never started, or started by our parent (its pid is not ours)
                return
            tracker._fd = tracker._pid = None
            os.close(fd)  # its end of file: the tracker cleans up what is still registered and exits
    except Exception:  # noqa: BLE001 - best effort: the exit itself must happen
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done or time.monotonic() >= deadline:
            return
        time.sleep(0.005)
