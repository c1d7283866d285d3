"""Vision towers, one file per architecture; the service picks one from ``ARCHITECTURES``.

Each tower class declares, as data (modalmesh.models.CheckpointModel): the ``architectures`` /
``model_types`` it serves, the ``checkpoint_prefixes`` that hold its tensors in a full
multimodal checkpoint (the reader opens nothing else), its ``weights_mapper`` /
``stacked_params`` rules, and its ``processor_kind`` (see preprocess.py).

    common.py       patch embedding as a linear layer, 2-D rotary, checkpoint name spellings
    qwen2_vl.py     Qwen2-VL: native resolution, packed attention, 2x2 merger
    qwen2_5_vl.py   Qwen2.5-VL: Qwen2-VL with window attention, RMSNorm, gated MLP
    siglip.py       SigLIP: fixed resolution, optional attention-pooling head
"""

from __future__ import annotations

from services.vision_encoder.models.qwen2_5_vl import Qwen2_5VisionTransformer
from services.vision_encoder.models.qwen2_vl import Qwen2VisionTransformer
from services.vision_encoder.models.siglip import SiglipVisionTower

ARCHITECTURES = (Qwen2VisionTransformer, Qwen2_5VisionTransformer, SiglipVisionTower)

__all__ = ["ARCHITECTURES", "Qwen2VisionTransformer", "Qwen2_5VisionTransformer", "SiglipVisionTower"]
