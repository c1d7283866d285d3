"""Which of a request's items the prefix cache already holds, so the LLM does not encode them again.

The pages of an item's rows are keyed by the item's digest (modalmesh.kv.page_keys),
so the same image asked about again finds its rows' K/V cached. Before any Encode
the service rebuilds the prompt as far as the items' row counts are known — from
`ItemShapes`, what earlier encodes of the same content returned — computes those
pages' keys, and pins the longest cached run of them (`LLMEngine.hold_prefix`). An
item whose rows all lie in the pinned pages is not encoded at all: its rows are
never read, only its cached K/V. The hold stays with the request to its end, so
a preempted request finds those pages again when it is recomputed.

A digest covers the item as sent (content and every field that changes its rows:
pixel budget, sample rate, a video file's bytes, a precomputed embedding's bytes, shape, grid and
seconds per grid step). A video's frames are sampled by the vision encoder's --video-fps and
--max-video-frames, which are not in the item: the encoders behind one LLM share them (a change
of them is a restart of the LLM too, whose cache would otherwise hold rows sampled the old way). The
encoders are checked to serve this LLM's checkpoint, so the same item gives the
same rows.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from modalmesh import pb
from modalmesh.config import ModelConfig
from modalmesh.kv.page_keys import ItemRows, extend_keys
from services.llm.inputs import expand_known_items

# Requests bigger than this are hashed in a worker thread (hashlib lets go of the GIL), not on the engine process's
# event loop: with 1 MiB, a 448^2 image's ~600 KB was serialised and hashed on the loop, 8.8 % of its samples under
# image + text load (py-spy, H100, issue 18), while the calls behind it waited.
_THREAD_BYTES = 64 << 10


def item_digest(item: pb.MultimodalItem) -> bytes:
    h = hashlib.blake2b(digest_size=16, person=b"modalmesh-item")
    h.update(item.SerializeToString(deterministic=True))
    return h.digest()


async def item_digests(items: list[pb.MultimodalItem], request_bytes: int) -> list[bytes]:
    """`request_bytes`: the size of the request the items came in, as received. Not the items' `ByteSize`: that
    serialises each item (upb), 7.8 % of the loop's GIL samples for 1.8 MB embeddings (py-spy, H200, issue 17)."""
    if request_bytes < _THREAD_BYTES:
        return [item_digest(item) for item in items]
    return await asyncio.to_thread(lambda: [item_digest(item) for item in items])


@dataclass(frozen=True)
class ItemShape:
    rows: int
    grid_thw: tuple[int, ...] = ()
    second_per_grid_t: float = 0.0  # a video's (Qwen2.5-VL's positions need it when its rows are cached)


class ItemShapes:
    """digest -> the rows (and grid) its encoding had, for the most recent `capacity` items."""

    def __init__(self, capacity: int = 65536):
        self.capacity = capacity
        self._shapes: OrderedDict[bytes, ItemShape] = OrderedDict()

    def get(self, digest: bytes) -> ItemShape | None:
        shape = self._shapes.get(digest)
        if shape is not None:
            self._shapes.move_to_end(digest)
        return shape

    def put(self, digest: bytes, shape: ItemShape) -> None:
        self._shapes[digest] = shape
        self._shapes.move_to_end(digest)
        while len(self._shapes) > self.capacity:
            self._shapes.popitem(last=False)


@dataclass(frozen=True)
class PrefixPlan:
    keys: list[bytes]  # page keys of the prompt's known prefix, to pin
    item_ends: list[tuple[int, int]]  # (item index, end of its rows in the expanded prompt), for known items


def plan_prefix(ids: list[int], items: list[pb.MultimodalItem], digests: list[bytes], shapes: ItemShapes,
                cfg: ModelConfig, page_size: int) -> PrefixPlan:
    """The page keys to look up before encoding: full pages of the expanded prompt up to its first item of
    unknown rows, or up to its last token (always computed) when every item is known."""
    known = [shapes.get(d) for d in digests]
    tokens, spans, complete = expand_known_items(ids, items, [k.rows if k else None for k in known], cfg)
    rows = [ItemRows(start, end, digests[i]) for i, start, end in spans]
    upto = len(tokens) - 1 if complete else len(tokens)
    keys = extend_keys([], lambda a, b: tokens[a:b], page_size, upto, rows)
    return PrefixPlan(keys, [(i, end) for i, _, end in spans if known[i] is not None])
