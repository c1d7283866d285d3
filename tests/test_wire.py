"""modalmesh.rpc.wire against the protobuf runtime: same messages, same bytes, fewer copies."""

import random

import pytest
import torch

from modalmesh import pb
from modalmesh.rpc import wire
from modalmesh.rpc.codec import to_payload

PATH = wire.ENCODE_RESPONSE_BYTES  # EncodeResponse.embeddings[i].embedding.data == (1, 1, 3)


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
    assert got == full.SerializeToString()  # byte for byte what the runtime writes


@pytest.mark.parametrize("sizes", [[4], [0], [3, 0, 200], [50000], []])
def test_strip_gives_the_rest_and_views_of_each_payload(sizes):
    full, bare, payloads = response(7 + len(sizes), sizes)
    wire_bytes = full.SerializeToString()
    rest, views = wire.strip(wire_bytes, PATH)
    assert rest == bare.SerializeToString()
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


@pytest.mark.parametrize("nbytes", [1, 127, 128, 16383 - 20, 16383, 16384, (1 << 21) - 1, 1 << 21])
def test_lengths_across_varint_widths(nbytes):
    # Payload and enclosing messages cross the 1/2/3/4-byte length-prefix boundaries.
    data = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
    full = pb.EncodeResponse(model_id="m")
    e = full.embeddings.add(num_placeholder_tokens=1)
    e.embedding.CopyFrom(pb.Tensor(dtype=pb.UINT8, shape=[nbytes], data=data))
    bare = pb.EncodeResponse()
    bare.CopyFrom(full)
    bare.embeddings[0].embedding.data = b""
    assert wire.inject(bare.SerializeToString(), PATH, [data]) == full.SerializeToString()
    rest, views = wire.strip(full.SerializeToString(), PATH)
    assert rest == bare.SerializeToString() and bytes(views[0]) == data


def test_inject_refuses_payloads_it_cannot_place_exactly_once():
    two = pb.EncodeResponse()
    for _ in range(2):
        two.embeddings.add().embedding.dtype = pb.FLOAT32
    with pytest.raises(ValueError, match="fewer payloads"):
        wire.inject(two.SerializeToString(), PATH, [b"ab"])
    no_tensor = pb.EncodeResponse()
    no_tensor.embeddings.add(num_placeholder_tokens=3)  # no embedding sub-message to put the bytes in
    with pytest.raises(ValueError, match="lacks or repeats"):
        wire.inject(no_tensor.SerializeToString(), PATH, [b"ab"])
    tensor = pb.Tensor(dtype=pb.FLOAT32).SerializeToString()
    twice = bytes([1 << 3 | 2, len(tensor)]) + tensor
    twice = twice + twice  # the same sub-message twice: protobuf would merge them
    doubled = bytes([1 << 3 | 2, len(twice)]) + twice
    with pytest.raises(ValueError, match="lacks or repeats"):
        wire.inject(doubled, PATH, [b"ab"])
    assert wire.inject(two.SerializeToString(), PATH, [None, b"xy"]) == (
        lambda m: (m.embeddings[1].embedding.__setattr__("data", b"xy"), m.SerializeToString())[1])(two)


def test_the_llm_parses_what_strip_cannot_and_names_garbage():
    from services.llm.encoders import _parse_encode_response, _Unparseable

    full, _, payloads = response(3, [5])
    group = bytes([9 << 3 | 3, 8, 1, 9 << 3 | 4])  # a group field (wire types 3/4): protobuf keeps it as unknown
    reply, views = _parse_encode_response(full.SerializeToString() + group)
    assert views == [None] and reply.embeddings[0].embedding.data == payloads[0]  # protobuf parsed it all
    bad = _parse_encode_response(b"\x0a\x05ab")
    assert isinstance(bad, _Unparseable) and "DecodeError" in bad.why


@pytest.mark.parametrize("answer, message", [
    (b"\x0a\x05ab", "sent an unparseable answer: DecodeError"),
    (None, "sent an embedding of dtype INT64, not a float one"),
])
def test_the_encoder_pool_names_the_encoder_of_a_bad_answer(answer, message):
    import asyncio

    import grpc

    from modalmesh.errors import ModalmeshError
    from services.llm.encoders import EncoderPool

    if answer is None:
        reply = pb.EncodeResponse()
        reply.embeddings.add(num_placeholder_tokens=2).embedding.CopyFrom(
            pb.Tensor(dtype=pb.INT64, shape=[2, 1], data=bytes(16)))
        answer = reply.SerializeToString()

    async def body():
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(lambda request, context: answer,
                                                      request_deserializer=lambda b: b, response_serializer=lambda b: b)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(pb.ENCODER_SERVICE,
                                                                              {"Encode": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pool = EncoderPool(pb.IMAGE, f"127.0.0.1:{port}")
        try:
            with pytest.raises(ModalmeshError, match=f"items\\[2\\]: encoder 127.0.0.1:{port} {message}"):
                await pool.encode_one(pb.EncodeItem(data=b"png"), 2, timeout=30)
        finally:
            await pool.close()
            await server.stop(0)

    asyncio.run(asyncio.wait_for(body(), timeout=60))
