"""Checkpoint reading and weight loading.

    reader.py       CheckpointReader: HF / diffusers layouts, lazy, key-filtered
    mapper.py       WeightsMapper (name rules as data), StackedMapping (fused params)
    param.py        the per-parameter weight_loader protocol, checked copies
    materialize.py  meta -> device/dtype, dummy weights
    loader.py       load_weights / load_dummy_weights -> LoadReport
    fingerprint.py  checkpoint_fingerprint (cheap identity of a checkpoint)
"""

from modalmesh.weights.errors import (
    CheckpointError,
    MissingWeightsError,
    UnexpectedWeightsError,
    WeightMismatchError,
)
from modalmesh.weights.loader import LoadReport, load_checkpoint, load_dummy_weights, load_weights
from modalmesh.weights.mapper import (
    IDENTITY,
    LEGACY_BUFFERS,
    NO_STACKING,
    QKV_GATE_UP,
    StackedMapping,
    WeightsMapper,
)
from modalmesh.weights.materialize import init_dummy_weights, materialize
from modalmesh.weights.param import copy_into, default_weight_loader
from modalmesh.weights.reader import CheckpointReader, TensorInfo

__all__ = [
    "CheckpointError", "CheckpointReader", "IDENTITY", "LEGACY_BUFFERS", "LoadReport", "MissingWeightsError",
    "NO_STACKING", "QKV_GATE_UP", "StackedMapping", "TensorInfo", "UnexpectedWeightsError", "WeightMismatchError",
    "WeightsMapper", "copy_into", "default_weight_loader", "init_dummy_weights", "load_checkpoint", "load_dummy_weights",
    "load_weights", "materialize",
]
