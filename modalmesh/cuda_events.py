"""Awaiting CUDA events from asyncio without a thread per waiter.

    waiter = EventWaiter()
    await waiter.wait(batch_done)   # the event loop stays free; every answer of the batch awaits one wait

One thread synchronizes on the events in the order they were asked for and wakes their awaiters on
their event loops. Events of one stream complete in order, so one thread waiting in turn wakes each
in time (events of several streams would wake no earlier than those asked for before them). Before
it, every answer of a running batch held a sender thread blocked on its event: the service then
answered at most (threads / the batch's time on the GPU) calls a second, with the GPU and the CPU
both half idle (SigLIP: 8 threads, 265 img/s on an H200).
"""

from __future__ import annotations

import asyncio
import queue
import threading


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class EventWaiter:
    """Awaits objects with CUDA-event `query()` / `synchronize()` (one waiting thread, started lazily)."""

    def __init__(self, name: str = "cuda-events"):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # (loop, id(event)) -> its future, while waited for; an awaiter on another loop gets a future of its own
        self._pending: dict[tuple[int, int], asyncio.Future] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    async def wait(self, event) -> bool:
        """Return once `event` has completed (True: it had not yet); one synchronize per event, however many
        await it."""
        if event.query():
            return False
        loop = asyncio.get_running_loop()
        key = (id(loop), id(event))
        with self._lock:
            future = self._pending.get(key)
            if future is None:
                future = self._pending[key] = loop.create_future()
                self._queue.put((event, loop, future))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                    self._thread.start()
        await asyncio.shield(future)  # an awaiter that goes away leaves the others theirs
        return True

    def _run(self) -> None:
        while True:
            event, loop, future = self._queue.get()
            if event is None:
                return
            error = None
            try:
                event.synchronize()
            except BaseException as exc:  # noqa: BLE001 - each awaiter of this event gets it
                error = exc
            with self._lock:
                self._pending.pop((id(loop), id(event)), None)
            try:
                loop.call_soon_threadsafe(_settle, future, error)
            except RuntimeError:  # that loop has closed: nobody awaits any more
                pass

    def close(self) -> None:
        """Stop the thread once the events asked for before have been waited for (blocks: call it off the loop)."""
        if self._thread is not None:
            self._queue.put((None, None, None))
            self._thread.join(timeout=10)
            self._thread = None
