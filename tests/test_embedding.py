"""The LLM's `Embedding` value: finiteness known off the event loop, and `check` keeping to it."""

import asyncio
import threading

import pytest
import torch

from modalmesh import pb
from modalmesh.errors import InvalidArgument
from services.llm import embedding as embedding_module
from services.llm.embedding import Embedding, known_finite


def test_known_finite_reduces_in_a_worker_thread_and_check_keeps_to_it(monkeypatch):
    threads = []

    def all_finite(tensor):  # the device reduction the event loop must not wait for
        threads.append(threading.current_thread())
        return bool(torch.isfinite(tensor).all())

    monkeypatch.setattr(embedding_module, "_all_finite", all_finite)
    good, bad = torch.zeros(3, 8), torch.zeros(3, 8)
    bad[1, 2] = float("inf")
    items = [Embedding(good, pb.IMAGE), None, Embedding(bad, pb.IMAGE),
             Embedding(None, pb.IMAGE, num_placeholder_tokens=4)]  # None: not encoded; no tensor: cached rows

    async def main():
        return await known_finite(items), threading.current_thread()

    out, loop_thread = asyncio.run(main())
    assert [e if e is None else e.finite for e in out] == [True, None, False, None]
    assert len(threads) == 2 and loop_thread not in threads
    out[0].check(0, 8)
    with pytest.raises(InvalidArgument, match=r"items\[2\].embedding contains NaN or infinite values"):
        out[2].check(2, 8)
    threads.clear()
    again = asyncio.run(known_finite(out))  # already known: nothing reduced again
    assert again[0] is out[0] and not threads
    # `check` looks for itself where `known_finite` has not: a NaN is refused either way.
    with pytest.raises(InvalidArgument, match="NaN or infinite"):
        Embedding(bad, pb.IMAGE).check(0, 8)
