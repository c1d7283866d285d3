"""The audio encoder model behind EncoderService: Whisper encoder or Qwen2-Audio tower + projector.

    model = build_encoder_model(dir, device="cuda", dtype=torch.bfloat16, options={"max_audio_seconds": 600})
    prepared = model.prepare(pb.EncodeItem(data=wav_bytes), 0)       # CPU: decode, downmix, checks, rows
    [encoded] = model.encode([prepared])                             # one forward for the whole batch
    encoded.embedding                                                # on the model's device (a view)

Where resampling and log-mel run (`preprocess_device`, the `--preprocess-device` flag):
"cpu" in `prepare` (the thread pool; exact to HF's WhisperFeatureExtractor), "device" in
`encode` (device_features.py: one upload of the batch's mono waves at their own rates),
"auto" = the device on CUDA. Either way `prepare` checks every limit and counts the rows,
so errors name their item and batching knows each cost before the device sees anything.

Rows returned per item (= the LLM's placeholder tokens):

* The clip is cut into 30 s windows (the last one padded); a window with `L`
  valid mel frames (``ceil(samples / 160)``) has ``P = (L - 1) // 2 + 1``
  positions after the stride-2 stem. `valid_length` is the sum of `L`.
* Qwen2-Audio: ``(P - 2) // 2 + 1`` rows per window — exactly what
  `Qwen2AudioProcessor` expands ``<|AUDIO|>`` to and what
  `Qwen2AudioForConditionalGeneration` splices (for clips up to 30 s, which is
  all the reference takes; longer clips concatenate the windows' rows).
* Whisper: by default the ``P`` rows covering the valid audio of each window.
  Whisper attends over the whole padded window, so the model still runs all
  1500 positions; these rows equal the reference's ``last_hidden_state[:, :P]``.
  ``whisper_rows="full"`` returns all 1500 per window instead (what a Whisper
  decoder cross-attends to).

Batch cost (`--max-batch-tokens`, in mel frames): 3000 per window for Whisper
(every window runs in full), ``2 * P`` per window for Qwen2-Audio (only valid
positions run).
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import torch

from modalmesh import pb
from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError, InvalidArgument
from modalmesh.models import build_and_load, pick
from modalmesh.rpc.codec import from_proto
from modalmesh.weights import LoadReport
from modalmesh.batch_graphs import BatchGraphs
from modalmesh.staging import HostStaging
from services.audio_encoder.audio import (
    DEFAULT_RESAMPLER,
    Resampler,
    ResampleTooCostly,
    decode_audio,
    downmix,
    pcm_audio,
)
from services.audio_encoder.device_features import DeviceFeatures
from services.audio_encoder.features import FeatureConfig, LogMel
from services.audio_encoder.models import (
    ARCHITECTURES,
    AudioEncoderDims,
    AudioTowerConfig,
    Qwen2AudioTower,
    WhisperAudioEncoder,
)
from services.audio_encoder.models.qwen2_audio import output_rows
from services.audio_encoder.models.whisper import PackedIndex, conv_output_lengths
from services.encoder.model import EncodedItem, EncoderModel, PreparedItem

log = logging.getLogger(__name__)

from services.audio_encoder.flags import (  # noqa: E402 - flag defaults
    DEFAULT_MAX_AUDIO_SECONDS,
    MAX_BATCH_TOKENS,
    PREPROCESS_DEVICES,
    WHISPER_ROWS,
)


@dataclass(frozen=True)
class AudioOptions:
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS
    whisper_rows: str = "valid"
    preprocess_device: str = "auto"  # where resampling + log-mel run: "cpu", "device", or auto (device on CUDA)
    warmup: bool = True
    cuda_graphs: bool = True  # Whisper on CUDA: the tower replayed per batch bucket (modalmesh/batch_graphs.py)
    max_batch_tokens: int = MAX_BATCH_TOKENS  # the batcher's budget: graphs for the batches it can form
    fused_kernels: bool = True  # on CUDA: residual add + LayerNorm as one Triton kernel (modalmesh.kernels)

    def preprocess_on_device(self, device: torch.device) -> bool:
        if self.preprocess_device == "auto":
            return device.type == "cuda"
        return self.preprocess_device == "device"

    @classmethod
    def from_dict(cls, options: dict | None) -> AudioOptions:
        options = dict(options or {})
        unknown = set(options) - {"max_audio_seconds", "whisper_rows", "preprocess_device", "warmup", "cuda_graphs",
                            "max_batch_tokens", "fused_kernels"}
        if unknown:
            raise ConfigError(f"unknown audio encoder options: {', '.join(sorted(unknown))}")
        out = cls(**{k: v for k, v in options.items() if v is not None})
        if not out.max_audio_seconds > 0:
            raise ConfigError(f"max_audio_seconds must be > 0, got {out.max_audio_seconds}")
        if out.whisper_rows not in WHISPER_ROWS:
            raise ConfigError(f"whisper_rows {out.whisper_rows!r}: expected one of {', '.join(WHISPER_ROWS)}")
        if out.preprocess_device not in PREPROCESS_DEVICES:
            raise ConfigError(f"preprocess_device {out.preprocess_device!r}: expected one of "
                              f"{', '.join(PREPROCESS_DEVICES)}")
        return out


class AudioEncoderModel(EncoderModel):
    modality = pb.AUDIO

    def __init__(self, module: WhisperAudioEncoder | Qwen2AudioTower, features: FeatureConfig, *,
                 device: torch.device | str, dtype: torch.dtype, options: AudioOptions | None = None,
                 resampler: Resampler = DEFAULT_RESAMPLER, load_report: LoadReport | None = None):
        self.module = module.eval()
        self.dims: AudioEncoderDims = module.dims
        self.packed = isinstance(module, Qwen2AudioTower)
        self.architecture = "Qwen2AudioEncoder" if self.packed else "WhisperEncoder"
        self.hidden_size = self.dims.d_model
        self.output_hidden_size = module.output_hidden_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.options = options or AudioOptions()
        self.features = features
        self.logmel = LogMel(features)  # the CPU path's, and the row arithmetic of both paths
        self.resampler = resampler
        self.on_device = self.options.preprocess_on_device(self.device)
        # Built once: its filters, window and resampling tables stay on the device.
        self.device_features = DeviceFeatures(features, resampler, self.device) if self.on_device else None
        self.staging = HostStaging(self.device)
        self.load_report = load_report
        self.opened_files: list[Path] = load_report.opened_files if load_report is not None else []
        if features.nb_max_frames != self.dims.window_frames:
            raise ConfigError(f"the feature extractor makes {features.nb_max_frames} frames per window; "
                              f"the encoder takes {self.dims.window_frames}")
        rows = "qwen2-audio" if self.packed else f"whisper-{self.options.whisper_rows}"
        # Everything besides the input that changes the output rows: the device path's features differ
        # from the CPU path's by float rounding on CUDA, so which path made them is part of it.
        self.preprocess = f"device:{self.device.type}" if self.on_device else "cpu"
        self.signature = f"{features.signature()}|{resampler.signature()}|{rows}|pre={self.preprocess}".encode()
        self.graphs = None  # Whisper's windows all have one shape: its tower replays a graph per batch bucket
        if self.device.type == "cuda" and not self.packed and self.options.cuda_graphs:
            self.graphs = BatchGraphs.capture(self.module, item_shape=(self.dims.n_mels, self.dims.window_frames),
                                              dtype=dtype, device=self.device, max_batch=self._largest_batch())

    def _largest_batch(self) -> int:
        """The most windows the batcher can put in one batch: its budget's worth, or the longest clip
        allowed, which runs alone when it is larger than the budget."""
        longest = math.ceil(self.options.max_audio_seconds / self.features.chunk_length)
        return max(1, self.options.max_batch_tokens // self.dims.window_frames, longest)

    # ---- per item, CPU ----------------------------------------------------------------------
    def cache_key(self, item: pb.EncodeItem, index: int) -> bytes | None:
        """The clip's bytes (or samples, dtype, shape and rate) + the model signature, before decoding."""
        digest = hashlib.sha256(self.signature)
        source = item.WhichOneof("source")
        if source == "data":
            # The declared rate too: one that contradicts the file is refused by prepare(), never answered
            # from an entry cached for the file without it.
            digest.update(struct.pack("<4sq", b"data", item.sample_rate) + item.data)
        elif source == "pcm":
            digest.update(struct.pack("<4sqq", b"pcm\0", item.pcm.dtype, item.sample_rate))
            digest.update(repr(list(item.pcm.shape)).encode() + b"\0" + item.pcm.data)
        else:
            return None  # prepare() says what is wrong with it
        return digest.digest()

    def prepare(self, item: pb.EncodeItem, index: int, key: bytes | None = None) -> PreparedItem:
        """Decode, downmix and check everything (limits, resampling cost, rows) on the CPU; then either
        resample + log-mel here (CPU path) or keep the mono wave at its own rate for `encode` (device path)."""
        what = f"items[{index}]"
        wave, rate = self._decode(item, what)
        mono = downmix(wave)
        target = self.features.sampling_rate
        try:
            self.resampler.check(mono.shape[-1], rate, target)
        except ResampleTooCostly as exc:
            raise InvalidArgument(f"{what}: {exc}") from None
        samples = self.resampler.output_length(mono.shape[-1], rate, target)
        frames = torch.tensor(self.logmel.valid_frames(samples), dtype=torch.int64)
        positions = conv_output_lengths(frames)
        rows = self._rows(frames, positions)
        if int(rows.sum()) == 0:
            raise InvalidArgument(f"{what}: audio of {samples} samples at {target} Hz "
                                  "is too short to give any embedding row")
        windows = len(frames)
        # Qwen2-Audio: positions < P read mel frames < 2P + 1 only; what lies past them (other frames,
        # or the zeros a batch pads with) never reaches a valid position, so only `width` frames run.
        width = min(self.dims.window_frames, int(2 * positions.max() + 1)) if self.packed else self.dims.window_frames
        inputs = {"frames": frames, "positions": positions, "rows": rows}
        if self.on_device:
            inputs["wave"] = mono.contiguous()
        else:
            mel = self.logmel(self.resampler(mono, rate, target)).mel
            inputs["mel"] = mel[..., :width].contiguous() if self.packed else mel
        if not self.packed:
            # This clip's rows of its windows' (windows * 1500) outputs; encode shifts them by the windows before it.
            S = self.dims.max_source_positions
            inputs["keep"] = torch.cat([w * S + torch.arange(n) for w, n in enumerate(rows.tolist())])
        cost = int(2 * positions.sum()) if self.packed else windows * self.dims.window_frames
        return PreparedItem(inputs=inputs, cost=cost, cache_key=key if key is not None else self.cache_key(item, index),
                            meta={"valid_length": int(frames.sum()), "windows": windows, "rate": rate,
                                  "width": width, "rows": int(rows.sum())})

    def _decode(self, item: pb.EncodeItem, what: str) -> tuple[torch.Tensor, int]:
        max_s = self.options.max_audio_seconds
        source = item.WhichOneof("source")
        if source == "data":
            wave, rate = decode_audio(item.data, what=what, max_seconds=max_s)
            if item.sample_rate and item.sample_rate != rate:
                raise InvalidArgument(f"{what}: sample_rate {item.sample_rate} contradicts the file's {rate} Hz "
                                      "(leave it 0 for encoded files)")
            return wave, rate
        if source == "pcm":
            pcm = from_proto(item.pcm, name=f"{what}.pcm")
            return pcm_audio(pcm, item.sample_rate, what=what, max_seconds=max_s)
        if source == "pixels":
            raise InvalidArgument(f"{what}: pixels are an image; the audio encoder takes data (WAV, FLAC, OGG) "
                                  "or pcm samples")
        raise InvalidArgument(f"{what}: no audio: set data (WAV, FLAC, OGG bytes) or pcm with sample_rate")

    def _rows(self, frames: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return output_rows(frames)
        if self.options.whisper_rows == "full":
            return torch.full_like(positions, self.dims.max_source_positions)
        return positions

    # ---- per batch, on the device -----------------------------------------------------------
    def encode(self, batch: list[PreparedItem]) -> list[EncodedItem]:
        """One upload (HostStaging) of the batch's waves or mel plus its row index, features on the
        device when `on_device`, one forward; the answers are views of one output on the device."""
        with torch.inference_mode():
            width = max(p.meta["width"] for p in batch)
            if self.packed:
                index = PackedIndex.build(torch.cat([p.inputs["positions"] for p in batch]).tolist(),
                                          conv_output_lengths(width), self.module.pool)
                extra = index.tensors()
            else:
                starts = [0, *accumulate(p.meta["windows"] for p in batch)][:-1]
                S = self.dims.max_source_positions
                keep = torch.cat([p.inputs["keep"] + w * S for p, w in zip(batch, starts)])
                extra = [keep]
            key = "wave" if self.on_device else "mel"
            uploaded = self.staging.upload([*(p.inputs[key] for p in batch), *extra])
            inputs, extra = uploaded[:len(batch)], uploaded[len(batch):]
            if self.on_device:
                mel = self.device_features(inputs, [p.meta["rate"] for p in batch])[..., :width]
            else:
                mel = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[-1])) for m in inputs])
            mel = mel.to(self.dtype)
            if self.packed:
                out = self.module(mel, index=index.with_tensors(extra))
            else:
                # (windows, 1500, d); a replay's own buffer is fine: index_select copies before the next
                hidden = self.graphs(mel, copy=False) if self.graphs is not None else self.module(mel)
                out = hidden.flatten(0, 1).index_select(0, extra[0])
        # Views of one tensor on the device: the transport takes them from there (no per-item copies).
        return [EncodedItem(embedding=e, valid_length=p.meta["valid_length"])
                for e, p in zip(out.split([p.meta["rows"] for p in batch]), batch)]

    def describe(self) -> dict[str, str]:
        """Service-specific facts for Info.extra."""
        f = self.features
        rows = "qwen2_audio" if self.packed else f"whisper_{self.options.whisper_rows}"
        return {"tower": type(self.module).__name__, "rows": rows, "n_mels": str(f.n_mels),
                "sampling_rate": str(f.sampling_rate), "window_seconds": str(f.chunk_length),
                "max_audio_seconds": f"{self.options.max_audio_seconds:g}", "resampler": self.resampler.signature(),
                "preprocess": self.preprocess, "cuda_graphs": "on" if self.graphs is not None else "off",
                "fused_kernels": "on" if self.module.fused_kernels else "off"}

    def warmup(self) -> None:
        """Silent 1 s clips through prepare and encode (kernels, backend smoke tests, allocator); on the
        device path also at the common file rates, so their resampling tables are on the device already."""
        rates = [self.features.sampling_rate, *((44100, 48000) if self.on_device else ())]
        silence = [pb.EncodeItem(pcm=pb.Tensor(dtype=pb.FLOAT32, shape=[r], data=bytes(4 * r)), sample_rate=r)
                   for r in rates]
        self.encode([self.prepare(item, i) for i, item in enumerate(silence)])


# ---- building ---------------------------------------------------------------------------------


def audio_config(model_dir, checkpoint: ModelConfig) -> AudioTowerConfig:
    """The encoder's part: Qwen2-Audio's ``audio_config``, or the top level, where Whisper keeps its keys."""
    try:
        audio = ModelConfig.from_hf(model_dir, part="audio")
    except ConfigError:
        audio = checkpoint
    try:
        dims = AudioEncoderDims.from_config(audio)
    except ValueError as e:
        raise ConfigError(f"{model_dir}: {e}") from None
    return AudioTowerConfig(checkpoint.architectures, checkpoint.model_type, dims, checkpoint.hidden_size)


def build_encoder_model(model_dir, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                        dummy: bool = False, options: dict | None = None, metrics=None) -> AudioEncoderModel:
    """Build the audio tower of the checkpoint in `model_dir`, load its weights (or dummy ones), warm up.

    `metrics`: where the weight-load gauges go (None: the process's installed Metrics).
    """
    opts = AudioOptions.from_dict(options)
    checkpoint = ModelConfig.from_hf(model_dir)
    cls = pick(checkpoint, ARCHITECTURES, what="audio tower")
    cfg = audio_config(model_dir, checkpoint)
    dims = cfg.dims
    module, report = build_and_load(cls, cfg, model_dir, device=device, dtype=dtype, dummy=dummy, metrics=metrics,
                                    fused_kernels=opts.fused_kernels)
    features = FeatureConfig.from_dir(model_dir, dims.n_mels)
    model = AudioEncoderModel(module, features, device=device, dtype=dtype, options=opts, load_report=report)
    if opts.warmup:
        model.warmup()
    log.info("%s from %s: %d layers, d_model %d, %d mel bins -> rows of %d; %s", model.architecture, model_dir,
             dims.layers, dims.d_model, dims.n_mels, model.output_hidden_size, report.summary())
    return model
