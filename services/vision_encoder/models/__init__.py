"""Vision towers, one file per architecture, and how a checkpoint picks one.

Each tower class declares, as data: the ``architectures`` / ``model_types`` it serves,
its ``processor_kind`` (see preprocess.py), the ``checkpoint_prefixes`` that hold its
tensors in a full multimodal checkpoint (the reader opens nothing else), and its
weight-name ``mapper`` / ``stacked`` rules.
"""

from __future__ import annotations

from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError
from services.vision_encoder.models.qwen2_5_vl import Qwen2_5VisionTransformer
from services.vision_encoder.models.qwen2_vl import Qwen2VisionTransformer
from services.vision_encoder.models.siglip import SiglipVisionTower

TOWERS = (Qwen2VisionTransformer, Qwen2_5VisionTransformer, SiglipVisionTower)


def tower_class(cfg: ModelConfig) -> type:
    """The tower for a checkpoint: by architecture name first, then by model_type."""
    for arch in cfg.architectures:
        for tower in TOWERS:
            if arch in tower.architectures:
                return tower
    for tower in TOWERS:
        if cfg.model_type in tower.model_types:
            return tower
    known = sorted({a for t in TOWERS for a in t.architectures})
    raise ConfigError(f"no vision tower for architectures {list(cfg.architectures)} / model_type "
                      f"{cfg.model_type!r}; supported: {', '.join(known)}")


__all__ = ["TOWERS", "Qwen2VisionTransformer", "Qwen2_5VisionTransformer", "SiglipVisionTower", "tower_class"]
