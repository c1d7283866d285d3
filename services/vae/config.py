"""The VAE service's configuration: the checkpoint's (VAEConfig) and the service's own (VAEServiceConfig).

    vae_dir = find_vae_dir(model_dir)          # DIR/vae/ (pipeline layout) or DIR (standalone VAE)
    cfg = VAEConfig.from_dir(vae_dir)
    cfg.latent_channels, cfg.scale_factor, cfg.unscale(latents)
    settings = VAEServiceConfig.from_args(args)  # the flags, once: nothing below the service reads args

Both are frozen and checked once. Only this module reads the raw config.json. Families: SD 1.x / 2.x (4 latent channels,
quant convs, scaling 0.18215), SDXL (scaling 0.13025, optional latents_mean/std),
SD3 / FLUX (16 channels, shift_factor, no quant convs).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from modalmesh.errors import ConfigError

SUPPORTED_CLASS = "AutoencoderKL"
_ACTIVATIONS = {"silu": "silu", "swish": "silu"}


def find_vae_dir(model_dir: str | Path) -> Path:
    """DIR/vae when DIR is a pipeline (vae/config.json), else DIR if its config.json is a VAE's."""
    root = Path(model_dir)
    for candidate in (root / "vae", root):
        config = candidate / "config.json"
        if config.is_file() and _is_autoencoder_kl(_read(config)):
            return candidate
    what = None
    if (root / "config.json").is_file():
        raw = _read(root / "config.json")
        what = raw.get("_class_name") or raw.get("architectures") or raw.get("model_type")
    raise ConfigError(
        f"--model {model_dir}: no diffusers AutoencoderKL config (looked for vae/config.json and config.json "
        f"with \"_class_name\": \"AutoencoderKL\"){f'; config.json describes {what}' if what else ''}"
    )


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return data


def _is_autoencoder_kl(raw: dict) -> bool:
    name = raw.get("_class_name")
    if name is not None:
        return name == SUPPORTED_CLASS
    # Hand-written configs without the diffusers class tag: recognise the decoder's keys.
    return "latent_channels" in raw and "block_out_channels" in raw and "architectures" not in raw


@dataclass(frozen=True)
class VAEConfig:
    latent_channels: int = 4
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    norm_num_groups: int = 32
    act_fn: str = "silu"
    mid_block_add_attention: bool = True
    use_post_quant_conv: bool = True
    sample_size: int = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True
    norm_eps: float = 1e-6  # diffusers' decoder hard-codes 1e-6
    class_name: str = SUPPORTED_CLASS  # diffusers' ``_class_name`` (hand-written configs omit it)

    @property
    def architectures(self) -> tuple[str, ...]:
        """What a decoder class is picked by (modalmesh.models.pick), as HF configs spell it."""
        return (self.class_name,)

    @property
    def scale_factor(self) -> int:
        """Pixels per latent pixel along each side (8 for SD/SDXL/SD3/FLUX)."""
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def attention_head_dim(self) -> int:
        return self.block_out_channels[-1]  # one head over all mid-block channels

    @property
    def default_tile_latent(self) -> int:
        """diffusers' tile_latent_min_size: sample_size / scale factor."""
        return max(1, self.sample_size // self.scale_factor)

    @classmethod
    def from_dir(cls, vae_dir: str | Path) -> VAEConfig:
        return cls.from_dict(_read(Path(vae_dir) / "config.json"), source=str(Path(vae_dir) / "config.json"))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> VAEConfig:
        if not _is_autoencoder_kl(raw):
            raise ConfigError(f"{source}: {raw.get('_class_name')!r} is not supported (only {SUPPORTED_CLASS})")
        up = tuple(raw.get("up_block_types") or ("UpDecoderBlock2D",))
        blocks = tuple(int(c) for c in raw.get("block_out_channels") or (64,))
        if any(t != "UpDecoderBlock2D" for t in up):
            raise ConfigError(f"{source}: up_block_types {list(up)}: only UpDecoderBlock2D is supported")
        if len(up) != len(blocks):
            raise ConfigError(f"{source}: {len(up)} up blocks but {len(blocks)} block_out_channels")
        act = str(raw.get("act_fn", "silu"))
        if act not in _ACTIVATIONS:
            raise ConfigError(f"{source}: act_fn {act!r} is not supported (silu)")
        if raw.get("norm_type", "group") != "group":
            raise ConfigError(f"{source}: norm_type {raw.get('norm_type')!r} is not supported (group)")
        groups = int(raw.get("norm_num_groups", 32))
        if any(c % groups for c in blocks):
            raise ConfigError(f"{source}: block_out_channels {list(blocks)} not divisible by {groups} groups")
        sample = raw.get("sample_size", 32)
        sample = int(sample[0] if isinstance(sample, (list, tuple)) else sample)
        latent = int(raw.get("latent_channels", 4))
        mean, std = raw.get("latents_mean"), raw.get("latents_std")
        for name, value in (("latents_mean", mean), ("latents_std", std)):
            if value is not None and len(value) != latent:
                raise ConfigError(f"{source}: {name} has {len(value)} entries for {latent} latent channels")
        shift = raw.get("shift_factor")
        cfg = cls(
            latent_channels=latent,
            out_channels=int(raw.get("out_channels", 3)),
            block_out_channels=blocks,
            layers_per_block=int(raw.get("layers_per_block", 1)),
            norm_num_groups=groups,
            act_fn=_ACTIVATIONS[act],
            mid_block_add_attention=bool(raw.get("mid_block_add_attention", True)),
            use_post_quant_conv=bool(raw.get("use_post_quant_conv", True)),
            sample_size=sample,
            scaling_factor=float(raw.get("scaling_factor", 0.18215)),
            shift_factor=float(shift) if shift is not None else None,
            latents_mean=tuple(float(x) for x in mean) if mean is not None else None,
            latents_std=tuple(float(x) for x in std) if std is not None else None,
            force_upcast=bool(raw.get("force_upcast", True)),
            class_name=str(raw.get("_class_name") or SUPPORTED_CLASS),
        )
        if cfg.out_channels != 3:
            raise ConfigError(f"{source}: out_channels={cfg.out_channels}; only RGB (3) decoders are served")
        if cfg.scaling_factor == 0:
            raise ConfigError(f"{source}: scaling_factor is 0")
        return cfg

    def unscale(self, latents: torch.Tensor) -> torch.Tensor:
        """What a diffusion model emits -> what AutoencoderKL.decode takes, as the diffusers pipelines do:
        SD/SDXL ``z / scaling_factor``; SD3/FLUX ``z / scaling_factor + shift_factor``; SDXL-style configs
        with latents_mean/std ``z * std / scaling_factor + mean``."""
        if self.latents_mean is not None and self.latents_std is not None:
            shape = (1, self.latent_channels, 1, 1)
            mean = torch.tensor(self.latents_mean, dtype=latents.dtype, device=latents.device).view(shape)
            std = torch.tensor(self.latents_std, dtype=latents.dtype, device=latents.device).view(shape)
            return latents * std / self.scaling_factor + mean
        latents = latents / self.scaling_factor
        if self.shift_factor is not None:
            latents = latents + self.shift_factor
        return latents


@dataclass(frozen=True)
class DecodeLimits:
    """What one Decode request may ask for (services/vae/inputs.py checks it)."""

    max_images: int = 16  # --max-images
    max_latent_side: int = 1024  # --max-latent-side
    max_reply_bytes: int = 256 << 20  # --max-message-mb: the reply must fit in one message


@dataclass(frozen=True)
class VAEServiceConfig:
    """The VAE service's flags as one frozen value, built once (the ModelRunner pattern)."""

    max_batch: int = 8  # images per decoder call (equal latent shapes)
    max_queue: int = 64  # requests waiting; beyond: RESOURCE_EXHAUSTED
    limits: DecodeLimits = field(default_factory=DecodeLimits)
    # Tiling flags; the tile plan itself (engine.TilingDefaults) also needs the checkpoint's config.
    tile_size: int = 0
    tile_overlap: int = -1
    tile_threshold: int = 0
    tile_batch: int = 4
    max_decode_seconds: float = 300.0  # 0: no budget
    untiled_budget_bytes: int = 0  # 0: free device memory on CUDA
    channels_last: bool | None = None  # None: on CUDA with the fused kernels (`use_channels_last`)
    cudnn_benchmark: bool = False
    cuda_graphs: bool = True  # on CUDA: tile-shaped decodes replayed from graphs (VAEEngine.capture_graphs)
    fused_kernels: bool = True  # GroupNorm(+SiLU) as Triton kernels on CUDA (modalmesh.kernels.group_norm)
    png_compress_level: int = 1
    dummy_weights: bool = False

    def __post_init__(self):
        for flag, value in (("max_batch", self.max_batch), ("max_queue", self.max_queue),
                            ("max_images", self.limits.max_images),
                            ("max_latent_side", self.limits.max_latent_side), ("tile_batch", self.tile_batch)):
            if value < 1:
                raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1")

    def use_channels_last(self, device: torch.device) -> bool:
        """NHWC unless told: on CUDA with the fused kernels it measured fastest (PyTorch's own GroupNorm copies
        NHWC to NCHW and back; without it cuDNN converts NCHW around every convolution)."""
        if self.channels_last is not None:
            return self.channels_last
        return device.type == "cuda" and self.fused_kernels

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> VAEServiceConfig:
        return cls(
            max_batch=args.max_batch, max_queue=args.max_queue,
            limits=DecodeLimits(max_images=args.max_images, max_latent_side=args.max_latent_side,
                                max_reply_bytes=args.max_message_mb << 20),
            tile_size=args.tile_size, tile_overlap=args.tile_overlap, tile_threshold=args.tile_threshold,
            tile_batch=args.tile_batch, max_decode_seconds=args.max_decode_seconds,
            untiled_budget_bytes=args.max_untiled_mb << 20, channels_last=args.channels_last,
            cudnn_benchmark=args.cudnn_benchmark, cuda_graphs=args.cuda_graphs, fused_kernels=not args.no_fused_kernels,
            png_compress_level=args.png_compress_level,
            dummy_weights=args.dummy_weights,
        )
