"""Batch prepared items from many requests up to a token budget, within a short window.

Requests submit their cache misses; one worker takes items in arrival order
until the budget (sum of `cost`) or the item cap is reached — an item larger
than the budget still runs, alone — waiting at most `window_s` for a batch to
fill, then runs the batch in a thread so the event loop keeps serving.
Cancelled requests' items are dropped before they are encoded.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from modalmesh.errors import ResourceExhausted
from modalmesh.metrics import Metrics
from services.encoder.model import PreparedItem

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    item: PreparedItem
    future: asyncio.Future


class Batcher:
    def __init__(self, run_batch: Callable[[list[PreparedItem]], list], *, max_batch_tokens: int,
                 max_batch_items: int = 64, window_s: float = 0.002, max_queue: int = 1024,
                 max_queue_tokens: int | None = None, metrics: Metrics | None = None):
        self.run_batch = run_batch
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_items = max_batch_items
        self.window_s = window_s
        self.max_queue = max_queue
        # Items differ wildly in size (one audio item may hold 20 windows of features): cap the cost too.
        self.max_queue_tokens = max_queue_tokens or 64 * max_batch_tokens
        self.metrics = metrics
        self._queue: deque[_Pending] = deque()
        self._wakeup = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self.batches_run = 0

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="encoder-batcher")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None

    @property
    def depth(self) -> int:
        return len(self._queue)

    async def submit(self, items: list[PreparedItem]) -> list:
        """Encode `items` (in batches shared with other requests); results in order."""
        if not items:
            return []
        if len(self._queue) + len(items) > self.max_queue:
            raise ResourceExhausted(f"encoder queue is full ({len(self._queue)} items waiting, limit {self.max_queue})")
        queued = self._queued_tokens()
        if queued and queued + sum(it.cost for it in items) > self.max_queue_tokens:
            raise ResourceExhausted(f"encoder queue is full ({queued} tokens of work waiting, limit "
                                    f"{self.max_queue_tokens})")
        loop = asyncio.get_running_loop()
        pending = [_Pending(item, loop.create_future()) for item in items]
        self._queue.extend(pending)
        self._publish_depth()
        self._wakeup.set()
        try:
            return list(await asyncio.gather(*(p.future for p in pending)))
        except BaseException:
            for p in pending:
                p.future.cancel()  # the worker skips them
            raise

    def _take_batch(self) -> list[_Pending]:
        batch, tokens = [], 0
        while self._queue and len(batch) < self.max_batch_items:
            head = self._queue[0]
            if head.future.done():  # cancelled by its request
                self._queue.popleft()
                continue
            if batch and tokens + head.item.cost > self.max_batch_tokens:
                break
            batch.append(self._queue.popleft())
            tokens += head.item.cost
        return batch

    def _queued_tokens(self) -> int:
        return sum(p.item.cost for p in self._queue if not p.future.done())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            # Give concurrent requests a moment to join, unless the batch is already full.
            deadline = loop.time() + self.window_s
            while self._queued_tokens() < self.max_batch_tokens and len(self._queue) < self.max_batch_items:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            batch = self._take_batch()
            self._publish_depth()
            if not batch:
                continue
            if self.metrics is not None:
                self.metrics.batch_size.observe(len(batch))
                self.metrics.batch_tokens.observe(sum(p.item.cost for p in batch))
            try:
                results = await asyncio.to_thread(self.run_batch, [p.item for p in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"encoder returned {len(results)} results for {len(batch)} items")
            except Exception as exc:  # noqa: BLE001 - delivered to every waiting request of the batch
                log.exception("encoder batch of %d items failed", len(batch))
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            self.batches_run += 1
            for p, result in zip(batch, results):
                if not p.future.done():
                    p.future.set_result(result)

    def _publish_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._queue))
