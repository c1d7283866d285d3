"""The VAE's batching: jobs of one latent shape and tiling share a decoder call, up to `max_batch` images.

    batcher = DecodeBatcher(run, max_queue=64, max_batch=8, metrics=metrics)
    result = await batcher.submit(job)          # a JobResult; RESOURCE_EXHAUSTED when 64 jobs wait

The oldest job heads each batch; later jobs with its key join while the images fit
(a later 1-image job may take room a 2-image one does not fit in); other jobs keep
their place in line. A single job larger than `max_batch` runs alone (the engine
splits it). Queue, worker, thread hand-off, cancellation and errors are the shared
skeleton's (modalmesh/batching.py). `decode_jobs` is what the worker thread does
with one batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from modalmesh.batching import BatchQueue, Waiting
from modalmesh.errors import FailedPrecondition
from modalmesh.metrics import Metrics
from services.vae.engine import VAEEngine, to_uint8, to_unit
from services.vae.inputs import DecodeJob, OutputFormat


@dataclass
class JobResult:
    pixels: torch.Tensor  # CPU: (B, H, W, 3) uint8 for PNG / UINT8, (B, 3, H, W) float32 for FLOAT
    tiles: int


class DecodeBatcher(BatchQueue[DecodeJob, JobResult]):
    unit = "requests"

    def __init__(self, run: Callable[[list[DecodeJob], Callable[[], bool]], list[JobResult]], *, max_queue: int,
                 max_batch: int, metrics: Metrics | None = None):
        super().__init__(run, name="decode", max_queue=max_queue, metrics=metrics)
        self.max_batch = max(1, max_batch)

    async def submit(self, job: DecodeJob) -> JobResult:
        if not self.running:
            raise FailedPrecondition("the decode worker is not running (service starting or stopping)")
        return (await self.wait_for([job]))[0]

    def _take(self) -> list[Waiting[DecodeJob]]:
        head = self._queue.popleft()
        batch, images, kept = [head], head.item.images, deque()
        while self._queue:
            waiting = self._queue.popleft()
            if waiting.item.key == head.item.key and images + waiting.item.images <= self.max_batch:
                batch.append(waiting)
                images += waiting.item.images
            else:
                kept.append(waiting)
        self._queue = kept
        return batch


def decode_jobs(engine: VAEEngine, jobs: list[DecodeJob], abandoned: Callable[[], bool], *, budget_s: float,
                metrics: Metrics) -> list[JobResult]:
    """Worker thread: one decoder call (or one tiled decode) for jobs of one key, pixels split per job."""
    z = jobs[0].z if len(jobs) == 1 else torch.cat([j.z for j in jobs])
    # A cancelled RPC cancels its job: once every job of the batch is gone, the engine stops decoding.
    result = engine.decode(z, jobs[0].tiling, should_stop=abandoned, budget_s=budget_s)
    images = z.shape[0]
    height, width = result.pixels.shape[-2:]
    metrics.batch_size.observe(images)
    metrics.decoded_images_total.inc(images)
    metrics.decoded_pixels_total.inc(images * height * width)
    if result.tiles > 1:
        metrics.vae_tiles_total.inc(result.tiles * images)
    out, start = [], 0
    for job in jobs:
        part = result.pixels[start:start + job.images]
        start += job.images
        pixels = to_unit(part) if job.output == OutputFormat.FLOAT else to_uint8(part)
        out.append(JobResult(pixels.cpu(), result.tiles))
    return out
