"""The gRPC edge's handle on the LLM's engine process: start it, route its frames to calls, stop it.

    client = EngineClient(config, settings)
    await client.start()                     # spawns core.engine_process_main; returns once it has loaded
    call = client.open_call(request, timeout, metadata)
    row = await call.queue.get()             # delta rows (link.DeltaRow) or a CallFailed, in order
    client.end_call(call, complete=True)
    info = await client.query("info")        # also from another thread: client.query_blocking("metrics")
    await client.stop()                      # Shutdown, then the process joined (killed if it hangs)

The engine process never outlives the edge (SIGKILL on the parent's death), and the edge does not serve
without it: if it exits while serving, the edge logs why and exits 1 too, as rank 0 does when a rank dies.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import time
from dataclasses import dataclass, field

import torch.multiprocessing as mp

from modalmesh import pb
from modalmesh.errors import ConfigError
from services.llm.config import LLMConfig
from services.llm.core import EngineSettings, engine_process_main
from services.llm.link import (Answer, CallFailed, EndCall, FrameReader, FrameWriter, GenerateCall, LoadFailed,
                               Query, Ready, Shutdown, StepDeltas, Stopped, socket_pair)

log = logging.getLogger("modalmesh.llm")


@dataclass
class EdgeCall:
    call_id: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class EngineClient:
    def __init__(self, config: LLMConfig, settings: EngineSettings):
        self.config = config
        self.settings = settings
        self.process = None
        self.ready = False
        self._writer: FrameWriter | None = None
        self._reader: FrameReader | None = None
        self._reading: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: dict[int, EdgeCall] = {}
        self._queries: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._stopped: asyncio.Event | None = None
        self._closing = False
        self._load_failed = False

    async def start(self) -> None:
        """Spawn the engine process and wait until it has loaded (a failed load raises its error here)."""
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        edge_requests, engine_requests = socket_pair()  # edge -> engine
        edge_replies, engine_replies = socket_pair()  # engine -> edge
        # spawn, not fork: the edge's gRPC threads are running, and the engine process uses CUDA. Not a
        # daemon: it has children of its own (the tensor-parallel ranks); the edge always ends it (stop).
        self.process = mp.get_context("spawn").Process(
            target=engine_process_main, name="llm-engine",
            args=(self.config, self.settings, engine_requests, engine_replies, os.getpid()))
        self.process.start()
        engine_requests.close()
        engine_replies.close()
        self._writer = await FrameWriter.open(edge_requests)
        self._reader = await FrameReader.open(edge_replies)
        first = await self._reader.recv()
        if isinstance(first, LoadFailed):
            self._load_failed = True
            if first.error.type_name == "ConfigError":
                raise ConfigError(first.error.message)
            raise RuntimeError(f"the LLM engine failed to load: {first.error.type_name}: {first.error.message}")
        if not isinstance(first, Ready):
            code = await asyncio.to_thread(self._join, 10)
            raise RuntimeError(f"the LLM engine process exited during start-up (exit code {code}); its log says why")
        self.ready = True
        self._reading = asyncio.ensure_future(self._read())

    # -- calls ---------------------------------------------------------------------------------
    def open_call(self, request: pb.GenerateRequest, timeout: float | None,
                  metadata: tuple[tuple[str, str], ...] | None) -> EdgeCall:
        call = EdgeCall(next(self._ids))
        self._calls[call.call_id] = call
        self._writer.send(GenerateCall(call.call_id, request.SerializeToString(), timeout, tuple(metadata or ()),
                                       time.perf_counter()))
        return call

    def end_call(self, call: EdgeCall, complete: bool) -> None:
        if self._calls.pop(call.call_id, None) is not None and not self._closing:
            self._writer.send(EndCall(call.call_id, complete))

    async def query(self, what: str, timeout: float = 10.0):
        if not self.ready or self._closing:
            raise ConnectionError("the LLM engine process is not serving")
        query_id = next(self._ids)
        answer = self._loop.create_future()
        self._queries[query_id] = answer
        self._writer.send(Query(query_id, what))
        try:
            return await asyncio.wait_for(answer, timeout)
        finally:
            self._queries.pop(query_id, None)

    def query_blocking(self, what: str, timeout: float = 5.0):
        """`query` from a thread other than the event loop's (the metrics exporter's)."""
        return asyncio.run_coroutine_threadsafe(self.query(what, timeout), self._loop).result(timeout + 1)

    async def _read(self) -> None:
        calls = self._calls
        while True:
            message = await self._reader.recv()
            if message is None:
                break
            if isinstance(message, StepDeltas):
                for row in message.rows:
                    call = calls.get(row[0])
                    if call is not None:  # else the edge is done with it (cancelled): the row is dropped
                        call.queue.put_nowait(row)
            elif isinstance(message, CallFailed):
                call = calls.get(message.call_id)
                if call is not None:
                    call.queue.put_nowait(message)
            elif isinstance(message, Answer):
                answer = self._queries.get(message.query_id)
                if answer is not None and not answer.done():
                    answer.set_result(message.value)
            elif isinstance(message, Stopped):
                self._stopped.set()
        self._stopped.set()
        if not self._closing:
            code = await asyncio.to_thread(self._join, 5)
            log.critical("the LLM engine process exited (code %s) while serving: the service cannot go on without "
                         "it; exiting", code)
            sys.stderr.flush()
            os._exit(1)

    # -- stopping ------------------------------------------------------------------------------
    async def stop(self, timeout: float = 60.0) -> int | None:
        """End the engine process (after the edge's drain): Shutdown, then join; killed if it hangs. Its exit code."""
        self._closing = True
        if self.process is None:
            return None
        if self.ready and self.process.is_alive():
            self._writer.send(Shutdown())
            await self._writer.drain()
            try:
                await asyncio.wait_for(self._stopped.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("the LLM engine process did not stop within %.0f s", timeout)
        # Still loading (the edge was told to stop): killed at once; a failed load is exiting by itself.
        code = await asyncio.to_thread(self._join, 30 if self.ready else 10 if self._load_failed else 0)
        for future in self._queries.values():
            if not future.done():
                future.set_exception(ConnectionError("the LLM engine process has stopped"))
        if self._reading is not None:
            self._reading.cancel()
        if self._writer is not None:
            self._writer.close()
        return code

    def _join(self, timeout: float) -> int | None:
        self.process.join(timeout)
        if self.process.is_alive():
            if timeout:
                log.warning("the LLM engine process did not exit within %.0f s: killed", timeout)
            self.process.kill()
            self.process.join(10)
        return self.process.exitcode
