"""Stand-in for the shared encoder contract (``services/encoder/model.py``) until it lands on main.

Same names and fields as the lead's contract; model.py imports the real one when present.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class PreparedItem:
    inputs: dict[str, torch.Tensor]
    cost: int
    cache_key: bytes
    meta: dict = field(default_factory=dict)


@dataclass
class EncodedItem:
    embedding: torch.Tensor
    grid_thw: tuple[int, ...] = ()
    valid_length: int = 0


class EncoderModel(ABC):
    modality: int
    hidden_size: int
    output_hidden_size: int
    architecture: str

    @abstractmethod
    def prepare(self, item, index: int) -> PreparedItem: ...

    @abstractmethod
    def encode(self, batch: list[PreparedItem]) -> list[EncodedItem]: ...
