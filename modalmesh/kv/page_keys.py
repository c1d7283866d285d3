"""Cache keys of KV pages: what a page's K/V depend on, hashed and chained.

A full page's K/V are a function of every token before it and of its own
tokens, so its key is a hash of its parent's key and its tokens (vLLM's block
hash). Placeholder tokens do not say what they stand for: the rows of an image
or a clip are spliced in place of one repeated id. For those tokens the key
takes the item's content digest and the row's offset in the item instead, so
two different images behind the same placeholders never share a page, and the
same image at the same place always does.

BLAKE2b (16 bytes): keys are compared, never trusted as content, and a
collision would hand one request another's K/V, so a cryptographic hash, not
Python's `hash` (which a client could collide on purpose).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ROOT = b"modalmesh-kv-page-v1"  # the parent of a sequence's first page


@dataclass(frozen=True)
class ItemRows:
    """Tokens [start, end) of a prompt are one item's rows; `digest` names its content (and every parameter
    that changes its rows)."""

    start: int
    end: int
    digest: bytes


def chain(parent: bytes, tokens: Sequence[int], items: Sequence[ItemRows] = (), page_start: int = 0) -> bytes:
    """The key of one page holding `tokens` (its first at position `page_start`) after the page keyed `parent`."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    page_end = page_start + len(tokens)
    for item in items:
        if item.start < page_end and page_start < item.end:
            first = max(page_start, item.start)  # the page's first row of this item
            h.update(struct.pack("<qq", first - page_start, first - item.start))
            h.update(item.digest)
    return h.digest()


def extend_keys(keys: list[bytes], token_ids: Callable[[int, int], Sequence[int]], page_size: int, upto: int,
                items: Sequence[ItemRows] = (), unknown: int | None = None) -> list[bytes]:
    """Append to `keys` (those of a sequence's first len(keys) pages) the keys of its further full pages within
    its first `upto` tokens (`token_ids(start, end)` reads them), stopping at a page holding the value
    `unknown` (a token not sampled yet). Returns `keys`, extended in place."""
    parent = keys[-1] if keys else ROOT
    for page in range(len(keys), upto // page_size):
        start = page * page_size
        chunk = token_ids(start, start + page_size)
        if unknown is not None and unknown in chunk:
            break
        parent = chain(parent, chunk, items, start)
        keys.append(parent)
    return keys
