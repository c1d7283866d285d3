"""Tensor codec: exact round trips and clean rejection of malformed tensors."""

import pytest
import torch

from modalmesh import pb
from modalmesh.errors import InvalidArgument
from modalmesh.rpc.codec import TORCH_DTYPES, from_proto, to_proto

ALL_DTYPES = list(TORCH_DTYPES.values())


def _sample(dtype: torch.dtype, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g, dtype=torch.float32) * 1e3
        return t.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (5, 7), (2, 3, 4)], ids=str)
def test_round_trip_is_bit_exact(dtype, shape):
    t = _sample(dtype, shape)
    msg = to_proto(t)
    assert list(msg.shape) == list(shape)
    assert len(msg.data) == t.numel() * t.element_size()
    back = from_proto(pb.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == dtype and back.shape == t.shape
    # Compare bits, so NaN payloads and -0.0 count too.
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_bfloat16_bits_and_special_values():
    t = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 3.140625], dtype=torch.bfloat16)
    msg = to_proto(t)
    assert msg.dtype == pb.BFLOAT16
    assert msg.data == t.view(torch.int16).numpy().tobytes()
    back = from_proto(msg)
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))


def test_non_contiguous_inputs_encode_their_logical_values():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for view in (base.t(), base[:, ::2], base[1:3, 2:5], base.expand(2, 4, 6), base.unsqueeze(0).transpose(0, 2)):
        assert not view.is_contiguous() or view.data_ptr() != base.data_ptr()
        back = from_proto(to_proto(view))
        assert torch.equal(back, view.contiguous())


def test_wire_layout_is_little_endian_c_order():
    t = torch.tensor([[1, 2], [3, 256]], dtype=torch.int16)
    assert to_proto(t).data == bytes([1, 0, 2, 0, 3, 0, 0, 1])


def test_decode_copy_is_writable_and_independent():
    msg = to_proto(torch.ones(4))
    out = from_proto(msg, copy=True)
    out.add_(1)
    assert torch.equal(from_proto(msg), torch.ones(4))


def test_unsupported_torch_dtype_is_rejected():
    with pytest.raises(InvalidArgument, match="no wire encoding"):
        to_proto(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.parametrize(
    "msg, match",
    [
        (pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], data=b"\0" * 4), "unknown or unspecified dtype"),
        (pb.Tensor(dtype=42, shape=[1], data=b"\0" * 4), "unknown or unspecified dtype 42"),
        (pb.Tensor(dtype=pb.FLOAT32, shape=[2, -1], data=b""), "negative dimension"),
        (pb.Tensor(dtype=pb.FLOAT32, shape=[3], data=b"\0" * 11), "holds 11 bytes but shape \\[3\\] of FLOAT32 needs 12"),
        (pb.Tensor(dtype=pb.BFLOAT16, shape=[], data=b""), "needs 2"),
        (pb.Tensor(dtype=pb.INT64, shape=[0], data=b"\0"), "needs 0"),
    ],
)
def test_malformed_tensors_raise_invalid_argument(msg, match):
    with pytest.raises(InvalidArgument, match=match) as info:
        from_proto(msg, name="items[0].pcm")
    assert str(info.value).startswith("items[0].pcm:")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_copy_out_owns_its_memory_and_equals_the_source(dtype):
    from modalmesh.rpc.codec import copy_out

    message = to_proto((torch.arange(24) - 7).to(dtype).reshape(2, 3, 4))
    view = from_proto(message)  # aliases the message's read-only bytes
    out = copy_out(view)
    assert torch.equal(out, view) and out.dtype == dtype and out.shape == (2, 3, 4)
    assert out.data_ptr() != view.data_ptr()
    out.add_(1)  # writable: the message's bytes are untouched
    assert torch.equal(from_proto(message), view) and not torch.equal(out, view)
    assert copy_out(torch.empty(0, 5, dtype=dtype)).shape == (0, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copy_out_to_cuda_equals_the_cpu_copy():
    from modalmesh.rpc.codec import copy_out

    view = from_proto(to_proto(torch.randn(256, 3584).to(torch.bfloat16)))
    out = copy_out(view, "cuda")
    assert out.device.type == "cuda" and torch.equal(out.cpu(), copy_out(view))
    # Through one reused pinned bounce buffer: the next copies (of any content) take it again.
    from modalmesh.rpc import codec

    buffers = {b.data_ptr() for b in codec.PINNED._free}
    for i in range(3):
        again = from_proto(to_proto(torch.full((256, 3584), float(i)).to(torch.bfloat16)))
        assert torch.equal(copy_out(again, "cuda").cpu(), again)
    assert {b.data_ptr() for b in codec.PINNED._free} == buffers and buffers


def test_pinned_buffers_lend_the_smallest_fitting_and_keep_a_few():
    """Buffers of several sizes free at once (the H200 run: list.remove compared tensors elementwise and
    raised); the smallest one that fits is lent, and at most `keep` stay."""
    from modalmesh.rpc.codec import PinnedBuffers

    pool = PinnedBuffers(keep=2)
    small, large = pool.take(1 << 20), pool.take(3 << 20)
    pool.give_back(large)
    pool.give_back(small)
    assert pool.take(100).data_ptr() == small.data_ptr()  # the smallest that fits
    assert pool.take(2 << 20).data_ptr() == large.data_ptr()
    for b in (pool.take(1 << 20), pool.take(2 << 20), pool.take(5 << 20)):
        pool.give_back(b)
    assert sorted(b.numel() for b in pool._free) == [2 << 20, 5 << 20]  # the smallest went
