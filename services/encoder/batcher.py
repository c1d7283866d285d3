"""The encoders' batching policy: prepared items from many requests, in arrival order, up to a token budget.

The worker takes items in arrival order until the budget (sum of `cost`) or the item cap
is reached — an item larger than the budget still runs, alone — waiting at most
`window_s` for a batch to fill. Queue, worker, thread hand-off, cancellation and errors
are the shared skeleton's (modalmesh/batching.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from modalmesh.batching import BatchQueue, Waiting
from modalmesh.errors import ResourceExhausted
from modalmesh.metrics import Metrics
from services.encoder.model import PreparedItem


class Batcher(BatchQueue[PreparedItem, object]):
    def __init__(self, run_batch: Callable[[list[PreparedItem], Callable[[], bool]], list], *,
                 max_batch_tokens: int, max_batch_items: int = 64, window_s: float = 0.002, max_queue: int = 1024,
                 max_queue_tokens: int | None = None, metrics: Metrics | None = None):
        super().__init__(run_batch, name="encoder", max_queue=max_queue, window_s=window_s, metrics=metrics)
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_items = max_batch_items
        # Items differ wildly in size (one audio item may hold 20 windows of features): cap the cost too.
        self.max_queue_tokens = max_queue_tokens or 64 * max_batch_tokens

    async def submit(self, items: list[PreparedItem]) -> list:
        """Encode `items` (in batches shared with other requests); results in order."""
        return await self.wait_for(items)

    def _check_room(self, items: Sequence[PreparedItem]) -> None:
        super()._check_room(items)
        queued = self._queued_tokens()
        if queued and queued + sum(it.cost for it in items) > self.max_queue_tokens:
            raise ResourceExhausted(f"encoder queue is full ({queued} tokens of work waiting, limit "
                                    f"{self.max_queue_tokens})")

    def _batch_full(self) -> bool:
        return self._queued_tokens() >= self.max_batch_tokens or len(self._queue) >= self.max_batch_items

    def _take(self) -> list[Waiting[PreparedItem]]:
        batch, tokens = [], 0
        while self._queue and len(batch) < self.max_batch_items:
            head = self._queue[0]
            if batch and tokens + head.item.cost > self.max_batch_tokens:
                break
            batch.append(self._queue.popleft())
            tokens += head.item.cost
        return batch

    def _observe(self, batch: list[Waiting[PreparedItem]]) -> None:
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(batch))
            self.metrics.batch_tokens.observe(sum(w.item.cost for w in batch))

    def _queued_tokens(self) -> int:
        return sum(w.item.cost for w in self._queue if not w.gone)
