"""modalmesh.rpc.wire against the protobuf runtime: same messages, same bytes, fewer copies."""

import random

import pytest
import torch

from modalmesh import pb
from modalmesh.rpc import wire
from modalmesh.rpc.codec import to_payload

PATH = (1, 1, 3)  # EncodeResponse.embeddings[i].embedding.data


def response(seed: int, sizes: list[int]):
    """A full EncodeResponse (the reference) and its parts: without data, and the payloads."""
    rng = random.Random(seed)
    full = pb.EncodeResponse(model_id=f"m{seed}", weights_fingerprint="f" * rng.randrange(0, 300), modality=pb.IMAGE)
    bare = pb.EncodeResponse()
    bare.CopyFrom(full)
    payloads = []
    for n in sizes:
        meta, data = to_payload(torch.randn(n, 3, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))))
        kw = dict(grid_thw=[1, rng.randrange(1, 40), 2], num_placeholder_tokens=n, valid_length=rng.randrange(3),
                  cache_hit=bool(rng.randrange(2)))
        e = full.embeddings.add(**kw)
        e.embedding.CopyFrom(meta)
        e.embedding.data = data
        b = bare.embeddings.add(**kw)
        b.embedding.CopyFrom(meta)
        payloads.append(data or None)
    return full, bare, payloads


@pytest.mark.parametrize("sizes", [[4], [0], [3, 0, 200], [50000], []])
def test_inject_gives_what_protobuf_would_parse(sizes):
    full, bare, payloads = response(len(sizes), sizes)
    got = wire.inject(bare.SerializeToString(), PATH, payloads)
    assert pb.EncodeResponse.FromString(got) == full
    assert len(got) == full.ByteSize()


@pytest.mark.parametrize("sizes", [[4], [0], [3, 0, 200], [50000], []])
def test_strip_gives_the_rest_and_views_of_each_payload(sizes):
    full, bare, payloads = response(7 + len(sizes), sizes)
    wire_bytes = full.SerializeToString()
    rest, views = wire.strip(wire_bytes, PATH)
    assert pb.EncodeResponse.FromString(rest) == bare
    assert [bytes(v) if v is not None else None for v in views] == payloads
    for v in views:  # views into the received buffer, not copies
        if v is not None:
            assert v.obj is wire_bytes


def test_fields_in_any_order_and_unknown_fields_survive():
    e = pb.Embedding(num_placeholder_tokens=2)
    e.embedding.CopyFrom(pb.Tensor(dtype=pb.FLOAT32, shape=[2]))
    tensor = e.embedding.SerializeToString()
    # data first, then an unknown field 15 (varint 7), then the known ones
    odd_tensor = bytes([3 << 3 | 2, 8]) + bytes(range(8)) + bytes([15 << 3, 7]) + tensor
    odd = bytes([1 << 3 | 2, len(odd_tensor)]) + odd_tensor + bytes([3 << 3, 2])
    top = bytes([1 << 3 | 2, len(odd)]) + odd
    rest, views = wire.strip(top, PATH)
    assert bytes(views[0]) == bytes(range(8))
    parsed = pb.EncodeResponse.FromString(rest)
    assert parsed.embeddings[0].num_placeholder_tokens == 2 and not parsed.embeddings[0].embedding.data
    assert pb.EncodeResponse.FromString(wire.inject(rest, PATH, [bytes(range(8))])) == pb.EncodeResponse.FromString(top)


def test_malformed_wire_is_a_clear_error():
    with pytest.raises(ValueError, match="runs past the end"):
        wire.strip(bytes([1 << 3 | 2, 50, 1, 2]), PATH)
    with pytest.raises(ValueError, match="truncated varint"):
        wire.strip(bytes([0x80]), PATH)
    with pytest.raises(ValueError, match="more payloads"):
        wire.inject(b"", PATH, [b"x"])
