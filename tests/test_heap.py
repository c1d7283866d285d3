"""modalmesh.heap: the start-up heap frozen out of the collector, and collections timed into the schema's histogram."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry

from modalmesh import heap
from modalmesh import metrics as metrics_mod


def _count(registry: CollectorRegistry, generation: str) -> float:
    return registry.get_sample_value("modalmesh_gc_pause_seconds_count",
                                     {"service": "t", "generation": generation}) or 0.0


def test_every_collection_is_timed_by_generation():
    registry = CollectorRegistry()
    metrics = metrics_mod.Metrics("t", registry=registry, process_metrics=False)
    observer = heap.observe_pauses(metrics.gc_pause_seconds)
    try:
        before = [_count(registry, str(g)) for g in range(3)]
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        after = [_count(registry, str(g)) for g in range(3)]
    finally:
        heap.stop_observing(observer)
    # Automatic gen-0 collections may run meanwhile, so at least; gen 2 ran exactly when asked.
    assert after[0] - before[0] >= 1 and after[2] - before[2] == 2
    assert observer not in gc.callbacks
    gc.collect(2)  # not observed any more
    assert _count(registry, "2") == after[2]


def test_freeze_moves_live_objects_out_of_collections():
    kept = [[i] for i in range(10_000)]  # live objects a full collection would otherwise walk
    try:
        frozen = heap.freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= len(kept)
        assert not any(gc.is_tracked(x) and x in gc.get_objects(generation=2) for x in kept[:3])
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
