"""A process of ours ends with nothing of its own left running: `modalmesh.process.end_multiprocessing`.

multiprocessing's resource tracker exits only when it reads the end of its pipe, which left alone happens
after the process that started it is gone: the LLM service's exit code came back while its tracker still
ran (CI: state R). The service-level check is in test_llm_link (a clean stop).
"""

import os
import subprocess
import sys

_SCRIPT = """
import multiprocessing, os, sys
from multiprocessing import resource_tracker
from modalmesh.process import end_multiprocessing

lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore: the tracker starts and registers it
tracker = resource_tracker._resource_tracker._pid
assert tracker is not None and os.path.exists(f"/proc/{tracker}")
end_multiprocessing()
print(tracker, os.path.exists(f"/proc/{tracker}"), flush=True)
"""


def test_the_resource_tracker_is_reaped_before_the_process_ends_and_warns_of_nothing():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    tracker, alive = done.stdout.split()
    assert alive == "False", f"the resource tracker {tracker} still runs after end_multiprocessing"
    assert not os.path.exists(f"/proc/{tracker}")
    # The semaphore was unlinked by its finaliser before the tracker ended: it found nothing leaked.
    assert "leaked" not in done.stderr, done.stderr

