"""The decoding engine behind VAEService (and bench/vae.py): load, plan, decode, post-process.

    engine = VAEEngine.load(vae_dir, device=torch.device("cuda"), dtype=torch.float32)
    z = engine.cfg.unscale(latents)                       # unless the client sent unscaled latents
    result = engine.decode(z, TilingRequest())            # pixels in [-1, 1], tiles per image
    to_uint8(result.pixels)                               # (B, H, W, 3) as diffusers' image processor

Everything here runs in one worker thread at a time (the service's batcher);
nothing touches the asyncio loop.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from modalmesh.attention import registry
from modalmesh.batch_graphs import BatchGraphs
from modalmesh.errors import DeadlineExceeded, ResourceExhausted
from services.vae.config import VAEConfig
from services.vae.models.autoencoder_kl import ResnetBlock
from services.vae.tiling import TileGrid, tiled_decode
from services.vae.weights import build_decoder, load_decoder

log = logging.getLogger(__name__)

AUTO, ON, OFF = "auto", "on", "off"


@dataclass(frozen=True)
class TilingRequest:
    mode: str = AUTO
    tile: int = 0  # latent pixels per tile side; 0 = engine default
    overlap: int = -1  # latent pixels of overlap; -1 = engine default


@dataclass(frozen=True)
class TilingDefaults:
    tile: int = 64
    overlap: int = 16
    threshold: int = 64  # AUTO tiles when a latent side exceeds this
    batch: int = 4  # (tile, image) crops per decoder call

    @classmethod
    def for_config(cls, cfg: VAEConfig, tile: int = 0, overlap: int = -1, threshold: int = 0, batch: int = 4):
        tile = tile or max(cfg.default_tile_latent, 8)
        overlap = overlap if overlap >= 0 else tile // 4
        return cls(tile=tile, overlap=overlap, threshold=threshold or tile, batch=max(1, batch))


@dataclass
class DecodeResult:
    pixels: torch.Tensor  # (B, 3, H, W) on the engine's device, about [-1, 1]
    tiles: int  # tiles per image (1 when untiled)
    notes: list[str] = field(default_factory=list)


WORKSPACE_POOL = "vae_workspace"


class VAEEngine:
    def __init__(self, cfg: VAEConfig, model: torch.nn.Module, *, device: torch.device, dtype: torch.dtype,
                 tiling: TilingDefaults | None = None, max_batch: int = 8, channels_last: bool = False,
                 untiled_budget_bytes: int = 0, cuda_graphs: bool = False, metrics=None):
        self.cfg = cfg
        self.metrics = metrics  # None: no workspace gauges (tests, benches)
        self.model = model
        self.device = device
        self.dtype = dtype
        self.tiling = tiling or TilingDefaults.for_config(cfg)
        self.max_batch = max(1, max_batch)
        self.channels_last = channels_last
        self.untiled_budget_bytes = untiled_budget_bytes  # 0: free device memory (CUDA) / unbounded (CPU)
        # Decodes of the tile's shape (every tile, and an image of the tile's size) replayed from CUDA graphs, a
        # graph per batch of 1..tiling.batch, captured by warm_up (`capture_graphs`)
        self.cuda_graphs = cuda_graphs
        self.graphs: BatchGraphs | None = None
        self.graph_pool_bytes = 0  # the graphs' private memory pool, idle between replays but not free to eager
        self._before_replay: Callable[[], None] | None = None  # decode()'s stop check, where no hook can run
        if channels_last:
            self.model.to(memory_format=torch.channels_last)
        attn = self.attention_layer()
        self.attention_backend = attn.backend_name if attn is not None else "none"
        # A backend that materialises the (S, S) score matrix: memory grows with the square of h*w.
        self.attention_score_matrix = attn is not None and registry.spec(attn.backend_name).score_matrix

    @classmethod
    def load(cls, vae_dir: str | Path, *, device: torch.device, dtype: torch.dtype, dummy: bool = False,
             metrics=None, tile: int = 0, overlap: int = -1, threshold: int = 0, tile_batch: int = 4,
             fused_kernels: bool = True, **kwargs) -> VAEEngine:
        cfg = VAEConfig.from_dir(vae_dir)
        tiling = TilingDefaults.for_config(cfg, tile, overlap, threshold, tile_batch)
        # The attention kernel is chosen for the typical call: one tile-sized latent.
        model = build_decoder(cfg, dtype=dtype, seqlen_hint=tiling.threshold ** 2, fused_kernels=fused_kernels)
        engine_report = load_decoder(model, vae_dir, device=device, dtype=dtype, dummy=dummy, metrics=metrics)
        log.info("%s", engine_report.summary())
        return cls(cfg, model, device=device, dtype=dtype, tiling=tiling, **kwargs)

    def attention_layer(self):
        attns = self.model.decoder.mid_block.attentions
        return attns[0].attn if len(attns) else None

    # ---- planning ---------------------------------------------------------------------------
    def grid(self, h: int, w: int, req: TilingRequest) -> TileGrid:
        tile = req.tile or self.tiling.tile
        if req.overlap >= 0:
            overlap = req.overlap
        else:
            overlap = self.tiling.overlap if not req.tile else tile // 4
        overlap = min(overlap, tile - 1)
        return TileGrid.plan(h, w, tile=tile, overlap=overlap)

    def untiled_bytes(self, batch: int, h: int, w: int) -> int:
        """Rough peak activation bytes of an untiled decode (for the AUTO memory check)."""
        elt = torch.empty((), dtype=self.dtype).element_size()
        channels = list(reversed(self.cfg.block_out_channels))
        peak = 0
        for level, c in enumerate(channels):  # block input and (upsampled) output per level
            side = 2 ** (level + (1 if level < len(channels) - 1 else 0))
            peak = max(peak, c * h * w * side * side)
        need = 3 * peak * elt * batch  # input, output and a norm/activation temporary
        if self.attention_score_matrix:
            heads = self.cfg.block_out_channels[-1] // self.cfg.attention_head_dim
            need += 2 * batch * heads * (h * w) ** 2 * 4
        return need

    def budget_bytes(self) -> int | None:
        if self.untiled_budget_bytes:
            return self.untiled_budget_bytes
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            return int(0.9 * (free + max(0, cached - self.graph_pool_bytes)))
        try:  # CPU: half of the memory available now
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
        except (ValueError, OSError, AttributeError):
            return None

    def fits(self, batch: int, h: int, w: int) -> bool:
        budget = self.budget_bytes()
        return budget is None or self.untiled_bytes(batch, h, w) <= budget

    def should_tile(self, batch: int, h: int, w: int, req: TilingRequest) -> bool:
        if req.mode == ON:
            return True
        if req.mode == OFF:
            return False
        return max(h, w) > self.tiling.threshold or not self.fits(min(batch, self.max_batch), h, w)

    # ---- decoding ---------------------------------------------------------------------------
    def _run(self, z: torch.Tensor) -> torch.Tensor:
        z = z.to(self.device, self.dtype)
        graphs = self.graphs
        if graphs is None or z.shape[1:] != graphs.inputs.shape[1:]:
            return self._forward(z)
        largest = graphs.sizes[-1]  # a larger batch replays the largest graph in turn
        parts = []
        for first in range(0, z.shape[0], largest):
            if self._before_replay is not None:  # a replay is one launch: stop between replays, not blocks
                self._before_replay()
            parts.append(graphs(z[first:first + largest]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _forward(self, z: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            z = z.contiguous(memory_format=torch.channels_last)
        return self.model(z)

    @torch.inference_mode()
    def decode(self, z: torch.Tensor, req: TilingRequest = TilingRequest(), *,
               should_stop: Callable[[], bool] | None = None, budget_s: float = 0.0) -> DecodeResult:
        """z: (B, C, h, w) as AutoencoderKL.decode takes it (already unscaled), any device/float dtype.

        `should_stop` is asked before every resnet block of an eager decode, and before every graph replay
        (a tile batch) of a graphed one: once it says yes the decode stops with DecodeAbandoned, so a
        request nobody waits for no longer holds the worker.
        Past `budget_s` seconds (0: none) it stops the same way with DeadlineExceeded."""
        if should_stop is None and not budget_s:
            return self._decode_or_tile(z, req)
        deadline = time.monotonic() + budget_s if budget_s else None
        check = _stop_point(should_stop, deadline, budget_s)
        hooks = [m.register_forward_pre_hook(check) for m in self.model.modules() if isinstance(m, ResnetBlock)]
        self._before_replay = lambda: check(None, ())
        try:
            return self._decode_or_tile(z, req)
        except (DecodeAbandoned, DeadlineExceeded):
            self._release()
            raise
        finally:
            self._before_replay = None
            for hook in hooks:
                hook.remove()

    def _decode_or_tile(self, z: torch.Tensor, req: TilingRequest) -> DecodeResult:
        b, _, h, w = z.shape
        tiled = self.should_tile(b, h, w, req)
        try:
            return self._decode(z, tiled, req)
        except torch.OutOfMemoryError:
            self._release()
            if tiled or req.mode != AUTO:
                raise ResourceExhausted(
                    f"decoding {b} latent(s) of {h}x{w} ran out of device memory"
                    f"{' (tiled)' if tiled else '; request tiling or fewer images'}") from None
            log.warning("untiled decode of %dx%dx%d ran out of memory; retrying tiled", b, h, w)
            try:
                result = self._decode(z, True, req)
            except torch.OutOfMemoryError:
                self._release()
                raise ResourceExhausted(f"decoding {b} latent(s) of {h}x{w} ran out of device memory, "
                                        "even tiled") from None
            result.notes.append("out of memory untiled: tiled")
            return result

    def _decode(self, z: torch.Tensor, tiled: bool, req: TilingRequest) -> DecodeResult:
        b, _, h, w = z.shape
        try:
            if tiled:
                grid = self.grid(h, w, req)
                self.publish_workspace(self.untiled_bytes(min(b * grid.count, self.tiling.batch), grid.tile_h,
                                                          grid.tile_w))
                z = z.to(self.device, torch.float32)
                pixels = tiled_decode(self._run, z, grid, scale=self.cfg.scale_factor, tile_batch=self.tiling.batch)
                return DecodeResult(pixels, grid.count)
            step = self.max_batch
            while step > 1 and not self.fits(step, h, w):
                step //= 2
            self.publish_workspace(self.untiled_bytes(min(step, b), h, w))
            parts = [self._run(z[i:i + step]) for i in range(0, b, step)]
            return DecodeResult(parts[0] if len(parts) == 1 else torch.cat(parts), 1)
        finally:
            self.publish_workspace(0)

    def publish_workspace(self, used_bytes: int) -> None:
        """The workspace as a pool (pool="vae_workspace", in bytes): the estimated activations of the decode
        running now (0 when idle) against the budget an untiled decode must fit in, so the VAE shows a pool
        in the same gauges as the LLM's KV pool and the encoders' caches."""
        if self.metrics is None:
            return
        budget = self.budget_bytes() or 0
        self.metrics.set_pool(WORKSPACE_POOL, capacity_tokens=budget, used_tokens=used_bytes, nbytes=used_bytes,
                              page_size=0)

    def _release(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def warm_up(self) -> None:
        side = self.warm_up_side()
        z = torch.zeros(1, self.cfg.latent_channels, side, side)
        self.decode(z, TilingRequest(mode=OFF))  # its end publishes the idle workspace: a pool from the start
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if self.cuda_graphs and side == self.tiling.tile:
                self.capture_graphs()
            self.publish_workspace(0)  # the budget less the graphs' pool

    def graph_batch(self) -> int:
        """The largest batch with a graph: a tile batch (what a tiled decode sends, whatever --max-batch), where
        that many tiles fit the budget, else fewer."""
        tile, batch = self.tiling.tile, self.tiling.batch
        while batch > 1 and not self.fits(batch, tile, tile):
            batch -= 1
        return batch

    def capture_graphs(self) -> None:
        """A CUDA graph per batch of 1..graph_batch() tiles (modalmesh/batch_graphs.py). An eager decode of the
        tile's size at batch 1 runs 200-odd kernels, and at the low-resolution end of the decoder each takes
        less device time than Python takes to launch it: on an H200 the 1024² bf16 decode's stream sat idle
        1.1 of 21.3 ms (2026-12-07, `bench/vae.py --profile`). A replay launches them all at once."""
        tile = self.tiling.tile
        self.graphs, self.graph_pool_bytes = None, 0  # a capture again: the old pool freed before measuring
        torch.cuda.empty_cache()  # what the graphs' pool adds, measured as idle memory before and after
        idle = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        self.graphs = BatchGraphs.capture(self._forward, item_shape=(self.cfg.latent_channels, tile, tile),
                                          dtype=self.dtype, device=self.device, max_batch=self.graph_batch())
        torch.cuda.empty_cache()
        after = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        self.graph_pool_bytes = max(0, after - idle) if self.graphs is not None else 0

    def warm_up_side(self) -> int:
        """The latent side of the decode before SERVING. On CUDA, the tile's, where it fits: Triton specialises
        kernels on their sizes, and after an 8x8 warm-up a cold start's first 1024² decode still compiled for
        2.4 s (SDXL shape, H200, 2026-12-07: `bench/startup.py`). Elsewhere, and where it does not fit, 8x8."""
        tile = self.tiling.tile
        if self.device.type == "cuda" and self.fits(1, tile, tile):
            return tile
        return 8


class DecodeAbandoned(Exception):
    """Every request of the decode went away (cancelled, deadline passed): it stopped between blocks (or
    between graph replays)."""


def _stop_point(should_stop: Callable[[], bool] | None, deadline: float | None, budget_s: float):
    def check(module, args):
        if should_stop is not None and should_stop():
            raise DecodeAbandoned("every request of this decode went away")
        if deadline is not None and time.monotonic() > deadline:
            raise DeadlineExceeded(f"the decode took longer than {budget_s:g} s (--max-decode-seconds); "
                                   "send smaller latents or fewer images")

    return check


# ---- pixels as clients receive them -------------------------------------------------------------
def to_unit(pixels: torch.Tensor) -> torch.Tensor:
    """[-1, 1] -> [0, 1] float32, (B, 3, H, W): diffusers' VaeImageProcessor.denormalize."""
    return (pixels.float() * 0.5 + 0.5).clamp_(0, 1)


def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> (B, H, W, 3) uint8, rounded as diffusers' numpy_to_pil does."""
    return to_unit(pixels).mul_(255).round_().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def encode_png(image: torch.Tensor, compress_level: int = 1) -> bytes:
    """One (H, W, 3) uint8 CPU image -> PNG bytes (lossless)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image.numpy()).save(buf, format="PNG", compress_level=compress_level)
    return buf.getvalue()
