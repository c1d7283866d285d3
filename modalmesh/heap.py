"""The Python heap of a serving process: the start-up heap frozen out of the collector, and its pauses measured.

A service's start-up leaves hundreds of thousands of long-lived objects (torch, transformers, the
model's modules, the tokenizer). CPython's oldest-generation collection walks all of them, with the
GIL held: one pass took about 200 ms on a CPU with a tiny model, and on the serving path it stops the
engine thread and the event loop at once. Serving allocates steadily (deltas, protos, per-step
lists), so such passes recur. `freeze_startup_heap` moves everything alive once the model is loaded
into the permanent generation (`gc.freeze`, as vLLM's engine does after start-up), so later passes
walk only what serving allocated. `observe_pauses` puts every collection's pause in
modalmesh_gc_pause_seconds, by generation, so the effect is visible on any service.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then freeze what is left; returns the number of objects frozen."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d start-up objects out of the garbage collector (%.0f ms)", frozen,
             (time.perf_counter() - start) * 1e3)
    return frozen


class PauseObserver:
    """A `gc.callbacks` entry timing each collection into a histogram with a `generation` label."""

    def __init__(self, histogram):
        self._histogram = histogram
        self._children = {g: histogram.labels(generation=str(g)) for g in range(3)}
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self._children[info["generation"]].observe(time.perf_counter() - self._start)


def observe_pauses(histogram) -> PauseObserver:
    """Time every collection of this process from now on, until `stop_observing`."""
    observer = PauseObserver(histogram)
    gc.callbacks.append(observer)
    return observer


def stop_observing(observer: PauseObserver) -> None:
    if observer in gc.callbacks:
        gc.callbacks.remove(observer)
