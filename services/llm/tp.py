"""Tensor parallelism inside the LLM service: rank 0 serves, ranks 1..N-1 follow.

Rank 0 is the service process: it owns the gRPC server, the scheduler and the
sampler. Every other rank is a worker process holding its shard of the weights
and of the KV pool (the same pages: one block table serves all ranks). For
each step rank 0 broadcasts the step's inputs — token ids, positions, lengths,
block table, rows to sample, and spliced embeddings when there are any — as
plain tensors (no pickling); then every rank runs the same forward, whose
layers meet in their all-reduces / all-gathers. Only rank 0 samples.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from modalmesh import distributed

log = logging.getLogger(__name__)

_HEADER = 8  # kind, tokens, sequences, block-table width, has_embeds, mrope, sampled rows, spare
STOP, STEP = 0, 1


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) or (3, T) int64
    query_lens: list[int]
    context_lens: list[int]
    block_table: torch.Tensor  # (B, W) int32
    rows: torch.Tensor  # (n,) int64: rows of the hidden states to sample from
    has_embeds: bool


class StepChannel:
    """Broadcasts of one step's inputs from rank 0 (`send`) to the workers (`recv`)."""

    def __init__(self, device: torch.device, hidden_size: int, dtype: torch.dtype):
        # gloo moves CPU tensors, nccl CUDA ones: the device the model runs on.
        self.device = device
        self.hidden_size = hidden_size
        self.dtype = dtype

    def _header(self, values: list[int]) -> torch.Tensor:
        return distributed.broadcast(torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64,
                                                  device=self.device))

    def send(self, s: StepInputs) -> None:
        mrope = s.positions.dim() == 2
        self._header([STEP, s.input_ids.shape[0], len(s.query_lens), s.block_table.shape[1], int(s.has_embeds),
                      int(mrope), s.rows.shape[0]])
        lens = torch.tensor(s.query_lens + s.context_lens, dtype=torch.int64, device=self.device)
        for t in (s.input_ids, s.positions, lens, s.block_table, s.rows):
            distributed.broadcast(t.contiguous())

    def send_stop(self) -> None:
        self._header([STOP])

    def recv(self) -> StepInputs | None:
        header = self._header([]).tolist()
        if header[0] == STOP:
            return None
        _, tokens, batch, width, has_embeds, mrope, rows = header[:7]
        empty = lambda *shape, dtype=torch.int64: torch.empty(shape, dtype=dtype, device=self.device)  # noqa: E731
        input_ids = distributed.broadcast(empty(tokens))
        positions = distributed.broadcast(empty(3, tokens) if mrope else empty(tokens))
        lens = distributed.broadcast(empty(2 * batch)).tolist()
        block_table = distributed.broadcast(empty(batch, width, dtype=torch.int32))
        sample_rows = distributed.broadcast(empty(rows))
        return StepInputs(input_ids, positions, lens[:batch], lens[batch:], block_table, sample_rows,
                          bool(has_embeds))

    def embeds(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's spliced input embeddings, on every rank."""
        return distributed.broadcast(x.contiguous())


def _worker(rank: int, world_size: int, port: int, model_dir: str, device_type: str, dtype: str,
            options: dict) -> None:
    from modalmesh.attention import PagedMetadata
    from modalmesh.kv.pool import build_kv_pool
    from modalmesh.metrics import Metrics
    from services.llm.loader import load_llm

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    logging.basicConfig(level=options.get("log_level", "INFO"),
                        format=f"%(asctime)s %(levelname)s llm-rank{rank} %(name)s: %(message)s")
    distributed.init_tp(rank, world_size, backend=distributed.default_backend(device_type))
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    torch.set_grad_enabled(False)
    model, cfg, _ = load_llm(model_dir, device=device, dtype=getattr(torch, dtype),
                             page_size=options["page_size"], dummy=options["dummy"])
    pool = build_kv_pool(cfg, device, max_model_len=options["max_model_len"], tp_size=world_size,
                         dtype=getattr(torch, dtype), page_size=options["page_size"],
                         kv_cache_tokens=options["kv_cache_tokens"], mem_fraction=options["mem_fraction"],
                         metrics=Metrics(f"llm-rank{rank}", process_metrics=False))
    kv_caches = [pool.layer(i) for i in range(cfg.num_layers)]
    channel = StepChannel(device, cfg.hidden_size, getattr(torch, dtype))
    log.info("rank %d of %d ready", rank, world_size)
    try:
        with torch.inference_mode():
            while (step := channel.recv()) is not None:
                meta = PagedMetadata.build(step.query_lens, step.context_lens, step.block_table, pool.page_size)
                embeds = None
                if step.has_embeds:
                    embeds = channel.embeds(model.embed(step.input_ids))
                hidden = model(step.positions, meta, kv_caches, input_ids=None if embeds is not None else
                               step.input_ids, inputs_embeds=embeds)
                if step.rows.numel():
                    model.compute_logits(hidden[step.rows])  # its all-gather needs every rank
    finally:
        distributed.destroy_tp()
    distributed.exit_rank()


class TPWorkers:
    """Ranks 1..N-1 as child processes of the service (rank 0 joins with `init_rank0`)."""

    def __init__(self, world_size: int, model_dir: str, device_type: str, dtype: torch.dtype, options: dict):
        self.world_size = world_size
        self.port = distributed.free_port()
        ctx = mp.get_context("spawn")
        name = str(dtype).removeprefix("torch.")
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, self.port, str(model_dir), device_type, name,
                                                        options), name=f"llm-rank{r}", daemon=True)
                      for r in range(1, world_size)]

    def start(self) -> None:
        for p in self.procs:
            p.start()

    def init_rank0(self, device_type: str) -> None:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(self.port)
        distributed.init_tp(0, self.world_size, backend=distributed.default_backend(device_type))

    def join(self, timeout: float = 60.0) -> None:
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
        distributed.destroy_tp()
