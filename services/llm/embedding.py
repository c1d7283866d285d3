"""`Embedding`: one item's embedding as the LLM splices it, whatever brought it here.

A client's precomputed embedding (`MultimodalItem.embedding`, decoded here with the codec,
which refuses same-host refs) and an encoder's answer (read by
modalmesh.rpc.transfer.EmbeddingReceiver, by whichever path it took) both become this one
value at the boundary, so the splicer never sees a proto, a path or a side table.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import torch

from modalmesh import pb
from modalmesh.errors import InvalidArgument
from modalmesh.rpc.codec import dtype_name, from_proto, transfer_stream

FLOAT_WIRE = (pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16)


@dataclass(frozen=True)
class Embedding:
    # (rows, hidden), on the LLM's device (a CPU one may alias a client's message). None: the item's rows are
    # in the prefix cache, so it was not encoded; `num_placeholder_tokens` then says how many rows it has.
    tensor: torch.Tensor | None
    modality: int
    grid_thw: tuple[int, ...] = ()
    valid_length: int = 0
    num_placeholder_tokens: int = 0  # 0: not stated; otherwise it must equal the rows
    second_per_grid_t: float = 0.0  # a video: seconds one temporal grid step spans (Qwen2.5-VL's positions)
    digest: bytes = b""  # names the item's content for the prefix cache (services/llm/item_digest.py)
    finite: bool | None = None  # whether every value is finite, once `known_finite` has looked; None: `check` looks

    @property
    def rows(self) -> int:
        return self.num_placeholder_tokens if self.tensor is None else int(self.tensor.shape[0])

    @classmethod
    def of(cls, message: pb.Embedding, tensor: torch.Tensor, modality: int) -> "Embedding":
        """`tensor` with the rest of `message` (an encoder's or a client's pb.Embedding)."""
        return cls(tensor, modality, tuple(int(d) for d in message.grid_thw), int(message.valid_length),
                   int(message.num_placeholder_tokens), float(message.second_per_grid_t))

    def check(self, index: int, hidden_size: int) -> None:
        """What the splicer needs: float rows of the model's width, finite, as many as stated."""
        if self.tensor is None:  # cached rows: checked when they were encoded
            return
        tensor = self.tensor  # a float one: both ways in (`from_client`, the encoder pools) refuse others
        if tensor.dim() != 2 or tensor.shape[1] != hidden_size:
            raise InvalidArgument(f"items[{index}].embedding: shape {list(tensor.shape)}; this model needs "
                                  f"(rows, {hidden_size})")
        if tensor.shape[0] == 0:
            raise InvalidArgument(f"items[{index}].embedding has no rows")
        # They would reach every logit of the request: NaN logprobs.
        if not (self.finite if self.finite is not None else _all_finite(tensor)):
            raise InvalidArgument(f"items[{index}].embedding contains NaN or infinite values")
        rows = self.num_placeholder_tokens
        if rows and rows != tensor.shape[0]:
            raise InvalidArgument(f"items[{index}]: num_placeholder_tokens {rows} != embedding rows {tensor.shape[0]}")


def _all_finite(tensor: torch.Tensor) -> bool:
    """On a GPU, checked on the transfer stream that brought the rows (already done with them): on the
    engine's stream the check, on the event loop, would wait for the step running there."""
    if not tensor.is_cuda:
        return bool(torch.isfinite(tensor).all())
    with torch.cuda.stream(transfer_stream(tensor.device)):
        return bool(torch.isfinite(tensor).all())


async def known_finite(embeddings: list[Embedding | None]) -> list[Embedding | None]:
    """`embeddings` with `finite` filled in, reduced on their device and waited for in a worker thread. On the
    engine process's event loop the wait (on a GPU busy with the encoder's batches and the engine's steps) was
    6.5 % of the loop's samples under image + text load, about 2 ms a request that every other call waited
    behind (py-spy, H100, issue 18)."""
    todo = [i for i, e in enumerate(embeddings) if e is not None and e.tensor is not None and e.finite is None]
    if not todo:
        return embeddings
    flags = await asyncio.to_thread(lambda: [_all_finite(embeddings[i].tensor) for i in todo])
    out = list(embeddings)
    for i, flag in zip(todo, flags):
        out[i] = dataclasses.replace(out[i], finite=flag)
    return out


def from_client(item: pb.MultimodalItem, index: int, device: torch.device | None = None) -> Embedding:
    """A client's precomputed embedding, decoded onto `device` (a shared-memory ref is refused)."""
    if item.WhichOneof("source") != "embedding":
        raise InvalidArgument(f"items[{index}]: no embedding")
    message = item.embedding.embedding
    if message.dtype not in FLOAT_WIRE:
        raise InvalidArgument(f"items[{index}].embedding: dtype {dtype_name(message.dtype)} is not a float type "
                              "(FLOAT32, FLOAT16, BFLOAT16)")
    tensor = from_proto(message, name=f"items[{index}].embedding", device=device)
    return Embedding.of(item.embedding, tensor, item.modality)
