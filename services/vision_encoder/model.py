"""The vision encoder's model side: checkpoint -> tower, EncodeItem -> PreparedItem -> rows.

    model = build_encoder_model("/models/Qwen2-VL-7B-Instruct", device="cuda", dtype=torch.bfloat16)
    prepared = [model.prepare(item, i) for i, item in enumerate(request.items)]   # CPU, thread pool
    encoded = model.encode(prepared)                                              # one forward

`prepare` decodes and computes the cache key; on the CPU path (``preprocess_device``
"cpu", the default without CUDA) it also preprocesses exactly like the checkpoint's HF
image processor (preprocess.py); on the device path ("device", the default on CUDA) it
keeps the decoded uint8 pixels and the target size, and `encode` resizes, normalises
and patchifies them on the device (device_preprocess.py: close to, not equal to, the
PIL path; the cache key says which path made the pixels). On that path a plain JPEG is
not decoded in `prepare` at all when nvImageCodec is there (``image_decode``): `encode`
decodes the batch's JPEGs on the device (device_decode.py). `encode` uploads the batch
in one copy through reused pinned buffers, runs one forward over it - Qwen2-VL rows
concatenated (never stacked, resolutions mix freely), SigLIP images stacked (fixed
resolution) - and returns one `EncodedItem` per input whose rows stay on the model's
device in the serving dtype (views of the batch output; the transport copies them off).

A video item (`EncodeItem.video`, Qwen2-VL / Qwen2.5-VL towers only) is decoded and its frames
sampled in `prepare` (video.py: PyAV, HF's sampling rules) and preprocessed there on the CPU, on either
path, exactly as the PIL path does images, frame by frame (preprocess.video_patches): its grid has
t = frames / temporal_patch_size, and its answer says the seconds one temporal step spans (Qwen2.5-VL's
positions). On the device path a batch holding videos runs its images and its videos as two forwards.

Rows per item: Qwen2-VL / Qwen2.5-VL, the merged patches ``t*h*w / merge^2`` in the LLM's
width (= the placeholder tokens the LLM reserves); SigLIP, by ``siglip_output``, the
patch embeddings (last hidden state after post_layernorm, default), the pooled
embedding (1 row), or both (patch rows, then the pooled row).
"""

from __future__ import annotations

import hashlib
import logging
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from modalmesh import pb
from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError, InvalidArgument, ModalmeshError
from modalmesh.models import build_and_load, pick
from modalmesh.batch_graphs import BatchGraphs
from modalmesh.staging import HostStaging
from services.encoder import flags as encoder_flags
from services.vision_encoder import device_decode as dd
from services.vision_encoder import device_preprocess as dp
from services.vision_encoder import flags as vision_flags
from services.vision_encoder import preprocess as pp
from services.vision_encoder import video as vd
from services.vision_encoder.decode_memory import (
    DEFAULT_DECODE_MEMORY,
    DEFAULT_MAX_DECODED_BYTES,
    DecodeBudget,
    peak_bytes,
)
from services.vision_encoder.models import ARCHITECTURES, SiglipVisionTower, siglip

from services.encoder.model import EncodedItem, EncoderModel, PreparedItem

log = logging.getLogger(__name__)

DEFAULT_OPTIONS = {
    "max_image_pixels": pp.DEFAULT_MAX_IMAGE_PIXELS,  # decoded image size limit (decompression bombs)
    "max_image_decoded_bytes": DEFAULT_MAX_DECODED_BYTES,  # ... and in bytes (RGBA, 16-bit)
    "decode_memory_bytes": DEFAULT_DECODE_MEMORY,  # estimated peaks of the decodes in flight, together
    "max_request_pixels": 0,  # per-item max_pixels may not exceed this (0: the checkpoint's max_pixels)
    "siglip_output": "patch",  # "patch" | "pooled" | "both"
    "preprocess_device": "auto",  # "auto" (device on CUDA) | "cpu" (exact PIL path) | "device"
    "image_decode": "auto",  # "auto" (nvImageCodec when it loads, on the device path) | "pil" | "nvimgcodec"
    "cuda_graphs": True,  # SigLIP on CUDA: the tower replayed per batch bucket (modalmesh/batch_graphs.py)
    "fused_kernels": True,  # on CUDA: add + LayerNorm / RMSNorm, rotary, SiLU*up, quick GELU as Triton kernels,
    # SigLIP's tanh GELU in its GEMM's epilogue
    "siglip_mlp_pad_to": siglip.MLP_PAD_TO,  # SigLIP's MLP width rounded up with zero weights (1: as the checkpoint)
    # The batcher's limits: graphs are captured for the batch sizes it can form, no larger.
    "max_batch_items": encoder_flags.MAX_BATCH_ITEMS,
    "max_batch_tokens": vision_flags.MAX_BATCH_TOKENS,
    # Video (Qwen2-VL / Qwen2.5-VL): frames sampled a second, at most this many, from at most this long a video.
    "video_fps": vd.DEFAULT_VIDEO_FPS,
    "max_video_frames": vd.DEFAULT_MAX_VIDEO_FRAMES,
    "max_video_seconds": vd.DEFAULT_MAX_VIDEO_SECONDS,
}


def vision_config(model_dir) -> ModelConfig:
    """The vision part of a multimodal checkpoint, or the whole config of a standalone vision model."""
    try:
        return ModelConfig.from_hf(model_dir, part="vision")
    except ConfigError:
        cfg = ModelConfig.from_hf(model_dir, part="text")  # the root section when nothing is nested
        if cfg.model_type.endswith("vision_model") or any(a.endswith("VisionModel") for a in cfg.architectures):
            return cfg
        raise


class VisionEncoderModel(EncoderModel):
    modality = pb.IMAGE

    def __init__(self, model_dir, *, device, dtype: torch.dtype, dummy: bool = False, options: dict | None = None,
                 metrics=None, jpeg_decoder=None):
        unknown = set(options or {}) - set(DEFAULT_OPTIONS)
        if unknown:
            raise ConfigError(f"unknown vision encoder options {sorted(unknown)} (known: {sorted(DEFAULT_OPTIONS)})")
        self.options = {**DEFAULT_OPTIONS, **{k: v for k, v in (options or {}).items() if v is not None}}
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        cfg = vision_config(model_dir)
        cls = pick(cfg, ARCHITECTURES, what="vision tower")
        self.architecture = cfg.architectures[0] if cfg.architectures else cfg.model_type
        kwargs = {"fused_kernels": bool(self.options["fused_kernels"])}
        if cls is SiglipVisionTower:
            kwargs.update(output=self.options["siglip_output"], mlp_pad_to=int(self.options["siglip_mlp_pad_to"]))
        self.tower, self.load_report = build_and_load(cls, cfg, model_dir, device=self.device, dtype=dtype,
                                                      dummy=dummy, metrics=metrics, **kwargs)
        self.native = cls.processor_kind == "qwen2_vl"
        self.hidden_size = self.tower.dim if self.native else self.tower.hidden_size
        self.output_hidden_size = self.tower.out_hidden_size
        self.processor = self._processor(cls)
        # Video: the video processor's parameters (its own config file, else the image processor's) and sampling.
        self.video_processor, self.video_sampling = self._video_processor() if self.native else (None, None)
        limit = int(self.options["max_request_pixels"]) or (self.processor.max_pixels if self.native else 0)
        self.max_request_pixels = limit
        self.decode_budget = DecodeBudget(int(self.options["decode_memory_bytes"]))
        self.preprocess = dp.preprocess_path(str(self.options["preprocess_device"]), self.device, self.processor)
        self.staging = HostStaging(self.device)  # encode's uploads (one worker thread)
        self.device_preprocessor = (dp.DevicePreprocessor(self.processor, self.device, self.staging)
                                    if self.preprocess == "device" else None)
        # JPEGs decoded on the device (device_decode.py); `jpeg_decoder` stands in for nvImageCodec in tests.
        self.jpeg_decoder = jpeg_decoder or dd.jpeg_decoder(str(self.options["image_decode"]), self.device,
                                                            self.preprocess)
        if self.jpeg_decoder is not None and self.device_preprocessor is None:
            raise ConfigError("a device JPEG decoder needs the device preprocessing path (--preprocess-device)")
        self.image_decode = self.jpeg_decoder.name if self.jpeg_decoder is not None else "pil"
        self.graphs = None  # SigLIP's images all have one shape: its tower replays a graph per batch bucket
        if self.device.type == "cuda" and not self.native and self.options["cuda_graphs"]:
            self.graphs = BatchGraphs.capture(self.tower, item_shape=(3, self.processor.height, self.processor.width),
                                              dtype=dtype, device=self.device, max_batch=self._largest_batch())
        if int(self.options["max_image_pixels"]) > (Image.MAX_IMAGE_PIXELS or 0):
            Image.MAX_IMAGE_PIXELS = int(self.options["max_image_pixels"])  # ours is checked before decoding
        self._key_base = hashlib.sha256(b"\0".join([
            self.architecture.encode(), self.processor.digest(), str(self.options["siglip_output"]).encode(),
            str(dtype).encode(), self.preprocess.encode(),  # the two paths' pixels differ slightly
            self.image_decode.encode(),  # and so do the decoders'
        ])).digest()

    def _largest_batch(self) -> int:
        """The most images the batcher can put in one batch (`cost` is num_patches an image)."""
        return min(int(self.options["max_batch_items"]),
                   max(1, int(self.options["max_batch_tokens"]) // self.tower.num_patches))

    def _video_processor(self) -> tuple[pp.ImageProcessorConfig, vd.VideoSampling]:
        tower = self.tower
        proc = pp.video_processor_config(self.model_dir, patch_size=tower.patch_size,
                                         temporal_patch_size=tower.temporal_patch_size, merge_size=tower.merge)
        got = (proc.patch_size, proc.temporal_patch_size, proc.merge_size)
        want = (tower.patch_size, tower.temporal_patch_size, tower.merge)
        if got != want:
            raise ConfigError(f"{self.model_dir}: the video processor's config gives {got} but the tower's says {want}")
        # The processor's own min_frames / max_frames where its config names them (the flag caps max_frames too).
        raw = pp.video_processor_dict(self.model_dir)
        cap = int(self.options["max_video_frames"])
        sampling = vd.VideoSampling(fps=float(self.options["video_fps"]),
                                    min_frames=int(raw.get("min_frames") or vd.DEFAULT_MIN_FRAMES),
                                    max_frames=min(cap, int(raw.get("max_frames") or cap)),
                                    max_seconds=float(self.options["max_video_seconds"]))
        sampling.check(proc.temporal_patch_size)
        return proc, sampling

    def _processor(self, cls) -> pp.ImageProcessorConfig:
        tower = self.tower
        if self.native:
            proc = pp.ImageProcessorConfig.from_dir(
                self.model_dir, "qwen2_vl", patch_size=tower.patch_size,
                temporal_patch_size=tower.temporal_patch_size, merge_size=tower.merge)
            got = (proc.patch_size, proc.temporal_patch_size, proc.merge_size)
            want = (tower.patch_size, tower.temporal_patch_size, tower.merge)
        else:
            proc = pp.ImageProcessorConfig.from_dir(
                self.model_dir, "fixed", height=tower.image_size, width=tower.image_size,
                image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
            got, want = (proc.height, proc.width), (tower.image_size, tower.image_size)
        if got != want:
            raise ConfigError(f"{self.model_dir}/preprocessor_config.json gives {got} but the {cls.__name__} "
                              f"config says {want}")
        return proc

    # ---- the contract ---------------------------------------------------------------------
    def cache_key(self, item: pb.EncodeItem, index: int) -> bytes:
        """Content + pixel budget + everything fixed at load time: known before decoding."""
        params = b""
        if item.WhichOneof("source") == "video":
            self._check_takes_video(index)
            params = b"video:" + self.video_processor.digest() + self.video_sampling.key()
        elif self.native:
            lo, hi = pp.pixel_budget(self.processor, item, index, self.max_request_pixels)
            params = f"{lo}:{hi}".encode()
        return hashlib.sha256(self._key_base + params + pp.content_digest(item)).digest()

    def _check_takes_video(self, index: int) -> None:
        if not self.native:
            raise InvalidArgument(f"items[{index}]: video input is for Qwen2-VL / Qwen2.5-VL vision towers; this "
                                  f"encoder serves {self.architecture} ({type(self.tower).__name__}), which takes "
                                  "images only")

    def prepare(self, item: pb.EncodeItem, index: int, key: bytes | None = None) -> PreparedItem:
        where = f"items[{index}]"
        key = key if key is not None else self.cache_key(item, index)
        if item.WhichOneof("source") == "video":
            return self._prepare_video(item, index, key)
        if self.native:
            lo, hi = pp.pixel_budget(self.processor, item, index, self.max_request_pixels)
        max_pixels = int(self.options["max_image_pixels"])
        header = pp.image_header(item, index, max_image_pixels=max_pixels,
                                 max_decoded_bytes=int(self.options["max_image_decoded_bytes"]))
        if self.jpeg_decoder is not None:
            data = item.data  # one copy of the bytes (upb copies on every read)
            if dd.takes(header, data):
                # The worker decodes it on the device (encode): nothing is decoded here.
                width, height = dd.upright_size(header.width, header.height, header.orientation)
                return self._device_item(height, width, key, where, *((lo, hi) if self.native else ()), inputs={},
                                         jpeg=data, header=header, index=index)
        with self._decoding(item, index, header) as image:
            if self.device_preprocessor is not None:
                return self._prepare_for_device(image, key, where, *((lo, hi) if self.native else ()))
            if self.native:
                rows, grid = pp.qwen2_vl_pixels(image, self.processor, lo, hi, where)
                del image
                t, h, w = grid
                return PreparedItem(inputs={"pixel_values": torch.from_numpy(rows)}, cost=t * h * w,
                                    cache_key=key, meta={"grid_thw": grid})
            pixels = pp.fixed_pixels(image, self.processor, where)
            del image
        return PreparedItem(inputs={"pixel_values": torch.from_numpy(pixels)}, cost=self.tower.num_patches,
                            cache_key=key, meta={})

    def _prepare_video(self, item: pb.EncodeItem, index: int, key: bytes) -> PreparedItem:
        """A video's sampled frames, preprocessed on the CPU (on either path) into pixel_values_videos rows."""
        where = f"items[{index}]"
        self._check_takes_video(index)
        cfg = self.video_processor
        target: list[tuple[int, int]] = []  # the frames' size once resized: known before decoding

        def hold(frames: int, height: int, width: int):
            size = pp.video_size(height, width, cfg, where)
            target.append(size)
            # The processed frames (float32) and their patches, and one decoded frame with its PIL copy.
            peak = frames * size[0] * size[1] * 3 * 4 * 2 + height * width * 3 * 2
            return self.decode_budget.hold(peak, where, what="video")

        video = vd.read_video(item.video, where, self.video_sampling, temporal_patch_size=cfg.temporal_patch_size,
                              max_frame_pixels=int(self.options["max_image_pixels"]),
                              frame=lambda rgb: pp.video_frame(rgb, target[0], cfg), before_decoding=hold)
        rows, grid = pp.video_patches(video.frames, cfg)
        seconds = video.second_per_grid_t
        del video
        t, h, w = grid
        return PreparedItem(inputs={"pixel_values": torch.from_numpy(rows)}, cost=t * h * w, cache_key=key,
                            meta={"grid_thw": grid, "second_per_grid_t": seconds})

    @contextmanager
    def _decoding(self, item: pb.EncodeItem, index: int, header: pp.ImageHeader, wait_s: float | None = None):
        """PIL's decode of `item`, in RGB, while its estimated peak is held from the decode budget. Decoding
        and the conversion to RGB are where one small file becomes a lot of memory: each takes its peak
        from the budget shared by every decoding thread first (`wait_s`: DecodeBudget.hold's)."""
        with self.decode_budget.hold(peak_bytes(*header.decoded_size, header.mode), f"items[{index}]", wait_s):
            yield pp.to_rgb(pp.decode_image(item, index, max_image_pixels=int(self.options["max_image_pixels"]),
                                            reduce=header.reduce))

    def _prepare_for_device(self, image: Image.Image, key: bytes, where: str, *budget: int) -> PreparedItem:
        """The device path's item: the RGB pixels as uint8 and the size `encode` resizes them to."""
        width, height = image.size
        return self._device_item(height, width, key, where, *budget, inputs={"image": dp.rgb_tensor(image)})

    def _device_item(self, height: int, width: int, key: bytes, where: str, *budget: int, inputs: dict,
                     **meta) -> PreparedItem:
        """A device-path item of an upright `height` x `width` image: its cost, grid and target size."""
        if self.native:
            size = dp.qwen2_vl_size(height, width, self.processor, *budget, where)
            grid = (1, size[0] // self.processor.patch_size, size[1] // self.processor.patch_size)
            cost, grid_meta = grid[0] * grid[1] * grid[2], {"grid_thw": grid}
        else:
            size = dp.fixed_size(height, width, self.processor, where)
            cost, grid_meta = self.tower.num_patches, {}
        return PreparedItem(inputs=inputs, cost=cost, cache_key=key, meta={**meta, **grid_meta, "size": size,
                                                                           "where": where})

    @torch.inference_mode()
    def encode(self, batch: list[PreparedItem]) -> list[EncodedItem]:
        """One forward over the batch. An item whose JPEG neither the device nor PIL could decode gets its
        error (EncodedItem.error) and stays out of the forward; the others are encoded."""
        if not batch:
            return []
        if self.device_preprocessor is None:
            uploaded = self.staging.upload([it.inputs["pixel_values"] for it in batch])
            pixels = torch.cat(uploaded) if self.native else torch.stack(uploaded)
            return self._forward(pixels.to(self.dtype), batch)
        videos = [i for i, it in enumerate(batch) if "pixel_values" in it.inputs]
        if videos:  # preprocessed on the CPU (prepare): a forward of their own, the images' another
            return self._encode_with_videos(batch, videos)
        images, errors = self._device_pixels(batch)
        ready = [it for i, it in enumerate(batch) if i not in errors]
        if not ready:
            return [EncodedItem.failed(errors[i]) for i in range(len(batch))]
        pre = self.device_preprocessor
        encoded = iter(self._forward((pre.rows(images) if self.native else torch.stack(images)).to(self.dtype),
                                     ready))
        return [EncodedItem.failed(errors[i]) if i in errors else next(encoded) for i in range(len(batch))]

    def _encode_with_videos(self, batch: list[PreparedItem], videos: list[int]) -> list[EncodedItem]:
        """The device path's batch holding videos: the images through `encode`, the videos' CPU rows in a
        forward of their own; the answers in the batch's order."""
        chosen = set(videos)
        images = [it for i, it in enumerate(batch) if i not in chosen]
        from_images = iter(self.encode(images) if images else [])
        clips = [batch[i] for i in videos]
        rows = torch.cat(self.staging.upload([it.inputs["pixel_values"] for it in clips]))
        from_videos = iter(self._forward(rows.to(self.dtype), clips))
        return [next(from_videos) if i in chosen else next(from_images) for i in range(len(batch))]

    def _forward(self, pixels: torch.Tensor, batch: list[PreparedItem]) -> list[EncodedItem]:
        if self.native:
            grids = [tuple(it.meta["grid_thw"]) for it in batch]
            rows = self.tower(pixels, grids).to(self.dtype)
            sizes = [self.tower.merged_rows(g) for g in grids]
            seconds = [float(it.meta.get("second_per_grid_t", 0.0)) for it in batch]  # a video's; images: 0
            return [EncodedItem(embedding=r, grid_thw=g, second_per_grid_t=s)
                    for r, g, s in zip(rows.split(sizes), grids, seconds)]
        rows = (self.graphs or self.tower)(pixels).to(self.dtype)
        return [EncodedItem(embedding=r) for r in rows.unbind(0)]

    def _device_pixels(self, batch: list[PreparedItem]) -> tuple[list[torch.Tensor], dict[int, Exception]]:
        """The device path: each item's image resized, rescaled and normalised on the device ((3, h, w) float32,
        in order, failed items left out), and the errors of the items that could not be decoded by index.
        JPEGs are decoded here, a part of the batch at a time (`dd.CHUNK_BYTES` decoded), each part
        preprocessed before the next is decoded; the images PIL decoded in `prepare` go up in one copy
        per part."""
        pre = self.device_preprocessor
        out: list[torch.Tensor] = []
        errors: dict[int, Exception] = {}
        for part in self._parts(batch):
            images, sizes = [], []
            for i, image in zip(part, self._decoded([batch[i] for i in part])):
                if isinstance(image, Exception):
                    errors[i] = image
                else:
                    images.append(image)
                    sizes.append(batch[i].meta["size"])
            out += pre.pixels(images, sizes) if images else []
        return out, errors

    @staticmethod
    def _parts(batch: list[PreparedItem]) -> list[list[int]]:
        """The batch's indices in order, cut where the JPEGs to decode would pass dd.CHUNK_BYTES."""
        parts, held = [[]], 0
        for i, item in enumerate(batch):
            header = item.meta.get("header")  # only on JPEGs left for the device to decode
            size = 0 if header is None else header.width * header.height * 3  # decoded, RGB
            if parts[-1] and held + size > dd.CHUNK_BYTES:
                parts.append([])
                held = 0
            parts[-1].append(i)
            held += size
        return parts

    def _decoded(self, items: list[PreparedItem]) -> list[torch.Tensor | Exception]:
        """Each item's upright uint8 (H, W, 3) image: as PIL decoded it in `prepare` (on the host), or decoded
        here from its JPEG on the device; where nvImageCodec fails, PIL decodes it here (an InvalidArgument
        in its place if PIL cannot either)."""
        images: list = [it.inputs.get("image") for it in items]
        todo = [i for i, it in enumerate(items) if "jpeg" in it.meta]
        if not todo:
            return images
        try:
            decoded = self.jpeg_decoder.decode([items[i].meta["jpeg"] for i in todo])
        except Exception:  # noqa: BLE001 - e.g. out of device memory: PIL decodes them, the batch goes on
            log.exception("the device decoder failed on %d JPEGs; PIL decodes them", len(todo))
            decoded = [None] * len(todo)
        for i, image in zip(todo, decoded):
            meta = items[i].meta
            if image is None:
                log.info("%s: the device could not decode this JPEG; decoding it with PIL", meta["where"])
                images[i] = self._decode_with_pil(items[i])
            else:
                images[i] = dd.orient(image, meta["header"].orientation)
        return images

    def _decode_with_pil(self, item: PreparedItem) -> torch.Tensor | Exception:
        """PIL's decode in the worker, for a JPEG the device refused: the item's error in its place if it
        fails, and no waiting for decode memory (the whole batch would wait): none free is that item's
        RESOURCE_EXHAUSTED."""
        meta = item.meta
        try:
            with self._decoding(pb.EncodeItem(data=meta["jpeg"]), meta["index"], meta["header"], wait_s=0) as image:
                return dp.rgb_tensor(image)
        except ModalmeshError as e:
            return e

    # ---- service helpers ------------------------------------------------------------------
    def warmup(self) -> None:
        """One small forward, so the first request does not pay for kernel set-up."""
        side = self.processor.factor if self.native else self.processor.height
        item = pb.EncodeItem(pixels=pb.Tensor(dtype=pb.UINT8, shape=[side, side, 3],
                                              data=np.zeros((side, side, 3), np.uint8).tobytes()))
        self.encode([self.prepare(item, 0)])

    def rows_for(self, grid: tuple[int, int, int] | None = None) -> int:
        """Placeholder tokens an image of `grid` becomes (SigLIP: fixed)."""
        return self.tower.merged_rows(grid) if self.native else self.tower.rows_per_image

    def describe(self) -> dict[str, str]:
        """Service-specific facts for Info.extra."""
        p = self.processor
        facts = {"tower": type(self.tower).__name__, "max_image_pixels": str(self.options["max_image_pixels"]),
                 "preprocess": self.preprocess, "image_decode": self.image_decode,
                 "cuda_graphs": "on" if self.graphs is not None else "off",
                 "fused_kernels": "on" if self.tower.fused_kernels else "off"}
        if self.native:
            facts.update(patch_size=str(p.patch_size), merge_size=str(p.merge_size), min_pixels=str(p.min_pixels),
                         max_pixels=str(p.max_pixels), max_request_pixels=str(self.max_request_pixels))
            v, sampling = self.video_processor, self.video_sampling
            facts.update(video="on" if vd.available() else f"off: PyAV is not installed ({vd.EXTRA})",
                         video_fps=f"{sampling.fps:g}", max_video_frames=str(sampling.max_frames),
                         max_video_seconds=f"{sampling.max_seconds:g}", video_min_pixels=str(v.min_pixels),
                         video_max_pixels=str(v.max_pixels))
        else:
            facts.update(image_size=f"{p.height}x{p.width}", siglip_output=str(self.options["siglip_output"]),
                         rows_per_image=str(self.tower.rows_per_image))
        return facts


def build_encoder_model(model_dir, *, device, dtype, dummy: bool = False, options: dict | None = None,
                        **kw) -> VisionEncoderModel:
    return VisionEncoderModel(model_dir, device=device, dtype=dtype, dummy=dummy, options=options, **kw)
