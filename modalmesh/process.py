"""Process lifetime of a launched service: die with the launcher, never outlive it as an orphan.

The runtime half of launching (what a child process does for itself); the parent half, which
starts children and follows them to SERVING, is the operator tool `modalmesh.ops.launcher`.
Services, the gateway and tensor-parallel ranks call these; nothing here imports the launcher.
"""

from __future__ import annotations

import os
import signal
import sys

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
