"""Fixed-shape towers (SigLIP, Whisper) replayed from CUDA graphs, one per batch bucket.

    graphs = BatchGraphs.capture(tower, item_shape=(3, 384, 384), dtype=torch.bfloat16, device=cuda, max_batch=64)
    out = graphs(pixels)        # (B, ...) in, the tower's (B, ...) out: a replay when B fits a bucket

Why: an eager tower forward is ~27-32 layers of Python module calls and kernel launches,
about 12 ms of host time per batch whatever its size. In an encoder service that time holds
the GIL, so the event loop and the preprocessing threads barely run while a batch launches;
on an H200 the SigLIP service settled at 3.7 images a batch and 215 img/s against the
tower's 625 (py-spy: the batch thread in Python 71 % of the time). A replay is one launch.

Only towers whose every input has the same shape but the batch size qualify: Qwen2-VL packs
images of any resolution, so it stays eager. Every batch size up to the largest the batcher
can form has a graph of its own: no padding rows. With buckets of 1, 2, 4, 6, 8, 12, 16, ...
(the first version) a batch of 13-15 ran 16 rows; under load on an H200 SigLIP's batches
averaged 14-16 images, and an image's share of its batch's span on the stream fell from
2.71 to 2.45 ms with a graph per size (SigLIP through the service 330.6 -> 367.1 img/s in
one run). Whisper's batches were mostly full (16), and it did not change. The cost is at
start-up: every size is warmed up, captured and replayed once (SigLIP 44 sizes, Whisper 20;
about 6 s more a service on the H200, read off the bench steps' durations). Each graph
writes its output into one buffer of the largest size, so the graphs' memory does not grow
with their number (their intermediates share one pool, captured largest first); the real
rows are copied out of it, or read before the next replay overwrites it. A batch larger than
the largest graph runs eagerly. When capture fails (an attention kernel that cannot be
captured, say), the tower runs eagerly and the reason is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)


def buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: every one up to `max_batch` (a padded row costs a whole row's work)."""
    return list(range(1, max(1, max_batch) + 1))


def capture(sizes: list[int], forward: Callable[[int], torch.Tensor], device: torch.device,
            mempool) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
    """One graph of `forward(n)` per size, largest first so smaller graphs reuse its memory; a warm-up of
    every size runs first (kernels chosen and compiled, workspaces allocated). Shared by the towers here
    and the LLM's step graphs (services/llm/graphs.py)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for n in sizes:
            forward(n)
    torch.cuda.current_stream(device).wait_stream(stream)
    graphs, outputs = {}, {}
    for n in reversed(sizes):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool):
            outputs[n] = forward(n)
        graphs[n] = graph
    torch.cuda.synchronize(device)
    return graphs, outputs


class BatchGraphs:
    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor,
                 graphs: dict[int, object], outputs: dict[int, torch.Tensor]):
        self.forward = forward
        self.inputs = inputs  # (max bucket, *item_shape): the graphs read from here
        self.graphs = graphs  # bucket -> something with .replay() (torch.cuda.CUDAGraph on CUDA)
        self.outputs = outputs  # bucket -> the graph's output: a view of one buffer that every replay writes
        self.sizes = sorted(graphs)
        self.replays = 0

    @classmethod
    def capture(cls, forward: Callable[[torch.Tensor], torch.Tensor], *, item_shape: Sequence[int],
                dtype: torch.dtype, device: torch.device, max_batch: int) -> BatchGraphs | None:
        """One graph per bucket up to `max_batch`; None, logged, when the forward cannot be captured."""
        sizes = buckets(max_batch)
        inputs = torch.zeros((sizes[-1], *item_shape), dtype=dtype, device=device)
        shared: list[torch.Tensor] = []  # the one output buffer, made by the first (warm-up) forward

        def into_shared(n: int) -> torch.Tensor:
            out = forward(inputs[:n])
            if not shared:
                shared.append(torch.empty((sizes[-1], *out.shape[1:]), dtype=out.dtype, device=out.device))
            return shared[0][:n].copy_(out)

        try:
            with torch.inference_mode():
                graphs, outputs = capture(sizes, into_shared, device, torch.cuda.graph_pool_handle())
                # Each graph's first replay uploads it to the device, which takes longer than a replay: pay it
                # here rather than in the first batch of each size under load.
                for n in sizes:
                    graphs[n].replay()
                torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - eager still works; say why the graphs do not
            log.warning("tower runs eagerly: CUDA graph capture failed (%s: %s)", type(exc).__name__, exc)
            return None
        log.info("captured tower CUDA graphs for batch sizes %s", sizes)
        return cls(forward, inputs, graphs, outputs)

    def bucket(self, n: int) -> int:
        """The captured batch size a batch of `n` replays (0: larger than any: eager); `n` itself once
        captured."""
        return next((b for b in self.sizes if b >= n), 0)

    def __call__(self, x: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """The tower's output for `x`: its own tensor, or (`copy=False`) a view of the graphs' buffer that
        the next replay (of any size) overwrites, for a caller whose next work on the stream copies it."""
        n = x.shape[0]
        bucket = self.bucket(n)
        if not bucket:
            return self.forward(x)
        self.inputs[:n].copy_(x)
        self.graphs[bucket].replay()
        self.replays += 1
        out = self.outputs[bucket][:n]
        return out.clone() if copy else out
