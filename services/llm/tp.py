"""Tensor-parallel ranks 1..N-1 of the LLM service, as child processes of rank 0.

    runner = ModelRunner.launch(config)  # RankWorkers(config).start(), then rank 0 in this process
    ...
    runner.shutdown()                    # stops the ranks' loops, tears the group down, joins them

Each child runs `ModelRunner(dataclasses.replace(config, rank=r)).loop()`: the
same runner, handed the whole config (nano-vllm, mini-sglang). Children never
outlive rank 0: each asks the kernel for SIGKILL when its parent dies, and rank
0 watches them: a rank that dies while the group is up takes the service down
(its shard of the weights is gone, every later step would hang in a collective).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from modalmesh import distributed, heap
from modalmesh.logs import configure_logging
from modalmesh.process import set_parent_death_signal
from services.llm.config import LLMConfig

log = logging.getLogger(__name__)


def _rank_main(config: LLMConfig, parent: int) -> None:
    _die_with(parent)
    configure_logging(f"llm-rank{config.rank}", level=config.log_level, fmt=config.log_format)
    from services.llm.runner import ModelRunner

    code = 1
    try:
        runner = ModelRunner(config)
        if config.gc_freeze:
            heap.freeze_startup_heap()  # its step loop allocates too: full collections skip the model
        log.info("rank %d of %d ready", config.rank, config.world_size)
        runner.loop()
        code = 0
    except BaseException:  # noqa: BLE001 - say why, then leave without finalisers (see exit_rank)
        log.exception("rank %d failed", config.rank)
    distributed.exit_rank(code)


def _die_with(parent: int) -> None:
    """SIGKILL this process when its parent (rank 0) dies; leave at once if it already has."""
    set_parent_death_signal(signal.SIGKILL)  # best effort: rank 0's watch still ends the group
    if os.getppid() != parent:
        os._exit(1)


class RankWorkers:
    """Ranks 1..N-1 of `config`'s group; `config` (with the group's port) is what rank 0 runs."""

    def __init__(self, config: LLMConfig):
        self.config = dataclasses.replace(config, rank=0, dist_port=config.dist_port or distributed.free_port())
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        self.procs = [ctx.Process(target=_rank_main, args=(dataclasses.replace(self.config, rank=r), os.getpid()),
                                  name=f"llm-rank{r}", daemon=True) for r in range(1, config.world_size)]
        self._closing = threading.Event()
        self._watch: threading.Thread | None = None

    def start(self) -> None:
        for p in self.procs:
            p.start()
        self._watch = threading.Thread(target=self._watch_ranks, name="llm-rank-watch", daemon=True)
        self._watch.start()

    def _watch_ranks(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        while sentinels and not self._closing.is_set():
            for ready in wait(list(sentinels), timeout=0.5):
                p = sentinels.pop(ready)
                p.join(0)
                if not self._closing.is_set():
                    log.critical("%s exited with %s while the group was up: the service cannot go on without its "
                                 "shard; exiting", p.name, p.exitcode)
                    self.kill()
                    distributed.exit_rank(1)

    def stopping(self) -> None:
        """From now on a rank that exits is leaving as told, not failing."""
        self._closing.set()

    def join(self, timeout: float = 30.0) -> list[int | None]:
        """Wait for the ranks to leave after `ModelRunner.shutdown`; kill any that do not. Their exit codes."""
        self._closing.set()
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                log.warning("%s did not stop within %.0f s: killed", p.name, timeout)
                p.kill()
                p.join(5)
        return [p.exitcode for p in self.procs]

    def kill(self) -> None:
        self._closing.set()
        for p in self.procs:
            if p.is_alive():
                p.kill()
