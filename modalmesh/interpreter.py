"""The interpreter settings a service process takes from its flags: the GIL's switch interval.

`--switch-interval-ms` means the same in every service that has it (the encoders' process, the
LLM's engine process): how long a thread that wants the GIL waits before it asks the holder to
let go. Python's default is 5 ms; None keeps it.
"""

from __future__ import annotations

import math
import sys

from modalmesh.errors import ConfigError

SWITCH_INTERVAL_FLAG = "--switch-interval-ms"


def switch_interval_s(ms: float | None) -> float | None:
    """The flag's milliseconds as seconds; a value that is not a positive finite number is refused naming it."""
    if ms is None:
        return None
    if not (math.isfinite(ms) and ms > 0):
        raise ConfigError(f"{SWITCH_INTERVAL_FLAG} must be positive, not {ms}")
    return ms / 1e3


def set_switch_interval(seconds: float | None) -> None:
    """This process's GIL switch interval; None leaves Python's own."""
    if seconds is not None:
        sys.setswitchinterval(seconds)
