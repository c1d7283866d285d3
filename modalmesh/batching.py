"""The batching skeleton the encoders and the VAE share: a bounded queue, one worker, work run in a thread.

    class MyBatcher(BatchQueue[Item, Result]):
        def _take(self) -> list[Waiting[Item]]: ...     # the policy: which waiting items run together

    batcher = MyBatcher(run, name="vae", max_queue=64, metrics=metrics)
    batcher.start()                                      # on the service's event loop
    results = await batcher.wait_for([item, ...])        # one result per item, in order
    await batcher.stop()                                 # waiting callers get FAILED_PRECONDITION

Callers queue items; one asyncio worker wakes, lets a batch fill for up to `window_s`
(unless `_batch_full()` already says it is full), takes a batch with the subclass's
`_take()` and calls ``run(items, abandoned)`` in a thread so the event loop keeps
serving. `abandoned()` turns true once every caller of the batch has gone (its RPC was
cancelled): long work may check it and stop. Results go back to each caller; a result
that is an exception goes to that item's caller alone, and an exception `run` raises
goes to every caller of the batch; the worker carries on. A caller that
goes away cancels its items: the worker drops them before running them. More than
`max_queue` items waiting is RESOURCE_EXHAUSTED.

What differs between services is only the policy: the encoders fill a token budget in
arrival order (services/encoder/batcher.py), the VAE groups equal latent shapes up to a
number of images (services/vae/batcher.py). The LLM's continuous batching is another
thing (services/llm/scheduler.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from modalmesh.errors import FailedPrecondition, ModalmeshError, ResourceExhausted
from modalmesh.metrics import Metrics

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass(eq=False)
class Waiting(Generic[Item]):
    """One queued item and the future its caller awaits."""

    item: Item
    future: asyncio.Future

    @property
    def gone(self) -> bool:
        """Its caller has its answer or has gone away."""
        return self.future.done()


class BatchQueue(Generic[Item, Result]):
    """Bounded FIFO of items; one worker runs batches chosen by `_take` with ``run(items, abandoned)``."""

    unit = "items"  # what the queue holds, in messages

    def __init__(self, run: Callable[[list[Item], Callable[[], bool]], Sequence[Result]], *, name: str,
                 max_queue: int, window_s: float = 0.0, metrics: Metrics | None = None):
        self.run = run
        self.name = name
        self.max_queue = max(1, max_queue)
        self.window_s = window_s
        self.metrics = metrics
        self._queue: deque[Waiting[Item]] = deque()
        self._wakeup = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self.batches_run = 0

    # -- the policy: subclasses ---------------------------------------------------------------
    def _take(self) -> list[Waiting[Item]]:
        """Remove the next batch from `self._queue` (only live items are there) and return it."""
        raise NotImplementedError

    def _batch_full(self) -> bool:
        """True when the waiting items already make a full batch: the worker stops waiting for more."""
        return False

    def _check_room(self, items: Sequence[Item]) -> None:
        """Raise ResourceExhausted when `items` do not fit in the queue."""
        if len(self._queue) + len(items) > self.max_queue:
            raise ResourceExhausted(f"{self.name} queue is full ({len(self._queue)} {self.unit} waiting, "
                                    f"limit {self.max_queue}); retry later")

    def _observe(self, batch: list[Waiting[Item]]) -> None:
        """Metrics of a batch about to run."""

    # -- life cycle ---------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._worker is not None and not self._worker.done()

    @property
    def depth(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._loop(), name=f"{self.name}-batcher")

    async def stop(self) -> None:
        """Stop the worker; callers still waiting get FAILED_PRECONDITION rather than waiting forever."""
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None
        while self._queue:
            waiting = self._queue.popleft()
            if not waiting.future.done():
                waiting.future.set_exception(FailedPrecondition("the service is shutting down"))
        self._publish_depth()

    async def wait_for(self, items: Sequence[Item]) -> list[Result]:
        """Queue `items` (batched with other callers'); their results in order."""
        if not items:
            return []
        self._check_room(items)
        loop = asyncio.get_running_loop()
        waiting = [Waiting(item, loop.create_future()) for item in items]
        self._queue.extend(waiting)
        self._publish_depth()
        self._wakeup.set()
        try:
            return list(await asyncio.gather(*(w.future for w in waiting)))
        except BaseException:
            for w in waiting:
                w.future.cancel()  # the worker drops them, or `abandoned()` turns true for their batch
            raise

    # -- the worker ---------------------------------------------------------------------------
    def _drop_gone(self) -> None:
        if any(w.gone for w in self._queue):
            self._queue = deque(w for w in self._queue if not w.gone)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._drop_gone()
            while not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                self._drop_gone()
            # Give concurrent callers a moment to join, unless the batch is already full.
            deadline = loop.time() + self.window_s
            while not self._batch_full():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            self._drop_gone()
            batch = self._take()
            self._publish_depth()
            if not batch:
                continue
            self._observe(batch)
            try:
                results = await asyncio.to_thread(self.run, [w.item for w in batch],
                                                  lambda: all(w.future.cancelled() for w in batch))
                if len(results) != len(batch):
                    raise RuntimeError(f"{self.name}: {len(results)} results for {len(batch)} items")
            except Exception as exc:  # noqa: BLE001 - delivered to every caller of the batch
                if isinstance(exc, ModalmeshError):  # a status for the callers (e.g. a time budget), not a bug
                    log.warning("%s batch of %d items: %s", self.name, len(batch), exc)
                else:
                    log.exception("%s batch of %d items failed", self.name, len(batch))
                for w in batch:
                    if not w.future.done():
                        w.future.set_exception(exc)
                continue
            self.batches_run += 1
            for w, result in zip(batch, results):
                if w.future.done():
                    continue
                if isinstance(result, Exception):  # that item alone failed: its caller gets the error
                    w.future.set_exception(result)
                else:
                    w.future.set_result(result)

    def _publish_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._queue))
