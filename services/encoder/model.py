"""The contract between an encoder model (vision or audio) and the shared service layer.

A model prepares items on the CPU (decode, resize, resample, features) and
encodes whole batches on its device. The service layer does the rest: thread
pool for `prepare`, cache lookups, batching across requests, splitting results
back, protos and metrics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from modalmesh import pb


@dataclass
class PreparedItem:
    """CPU-side result of preprocessing one EncodeItem."""

    inputs: dict[str, torch.Tensor]  # what encode() needs for this item
    cost: int  # its size for the batch budget (patches, mel frames)
    cache_key: bytes  # hash of the content and of every parameter that changes the output
    meta: dict = field(default_factory=dict)  # e.g. {"grid_thw": (t, h, w)} or {"valid_length": n}


@dataclass
class EncodedItem:
    embedding: torch.Tensor | None  # (rows, output_hidden_size); rows == placeholder tokens the LLM reserves
    grid_thw: tuple[int, ...] = ()
    valid_length: int = 0
    second_per_grid_t: float = 0.0  # a video: seconds one temporal grid step spans (Qwen2.5-VL's positions)
    error: Exception | None = None  # this item alone failed in encode (e.g. its image did not decode there)

    @classmethod
    def failed(cls, error: Exception) -> EncodedItem:
        return cls(embedding=None, error=error)


class EncoderModel(ABC):
    modality: int = pb.MODALITY_UNSPECIFIED
    hidden_size: int = 0  # the tower's width
    output_hidden_size: int = 0  # width of the returned rows (the LLM's hidden size after merger/projector)
    architecture: str = ""

    def cache_key(self, item: pb.EncodeItem, index: int) -> bytes | None:
        """The item's cache key before any preprocessing (content hash + parameters), so a hit skips
        decoding; must equal the key prepare() returns. None: look the cache up after prepare()."""
        return None

    @abstractmethod
    def prepare(self, item: pb.EncodeItem, index: int, key: bytes | None = None) -> PreparedItem:
        """CPU preprocessing; bad input raises InvalidArgument("items[index]: ..."). Thread-safe.
        `key`: cache_key(item, index) when the caller has it already (hashing the content twice cost a
        seventh of a preparing thread's time)."""

    @abstractmethod
    def encode(self, batch: list[PreparedItem]) -> list[EncodedItem]:
        """One forward over the batch (packed, no per-item loops over layers); results in input order. An
        item found bad only here gets `EncodedItem.failed(error)`: its caller alone sees the error."""
