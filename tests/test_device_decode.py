"""JPEGs decoded in the worker instead of `prepare` (device_decode.py), on the CPU with PIL standing in for nvImageCodec.

What is checked here is everything but nvJPEG itself: which images go to the device decoder,
EXIF orientation applied as exif_transpose does, sizes / grids / costs before decoding, the
batch decoded in one call (in parts past CHUNK_BYTES), PIL taking over where the device
decoder fails, a bad item failing its own caller alone, the flag's choices and errors. With
a decoder that decodes exactly like PIL, the embeddings must equal the PIL path's bit for bit.
nvJPEG against PIL is measured on a GPU: tests/test_device_decode_cuda.py.
"""

from __future__ import annotations

import asyncio
import io

import grpc
import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from modalmesh import pb
from modalmesh.errors import ConfigError, InvalidArgument, ResourceExhausted
from modalmesh.rpc.codec import from_proto
from modalmesh.testing import tiny
from services.vision_encoder import device_decode as dd
from services.vision_encoder import preprocess as pp
from services.vision_encoder.model import build_encoder_model
from tests.test_vision_service import _serve


class PilJpegDecoder:
    """Stands in for nvImageCodec: decodes with PIL without applying EXIF (NvJpegDecoder asks for the same),
    so `orient` does the turning; None for what it cannot decode or is told to fail on."""

    name = "pil-as-device"

    def __init__(self, fail: tuple[bytes, ...] = ()):
        self.fail = set(fail)
        self.calls: list[int] = []

    def decode(self, jpegs):
        self.calls.append(len(jpegs))
        out = []
        for data in jpegs:
            try:
                if data in self.fail:
                    raise OSError("told to fail")
                with Image.open(io.BytesIO(data)) as image:
                    out.append(torch.from_numpy(np.array(image.convert("RGB"))))
            except OSError:
                out.append(None)
        return out


def photo(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (h // 8 + 2, w // 8 + 2, 3), dtype=np.uint8))
    array = np.array(coarse.resize((w, h), Image.Resampling.BILINEAR))
    array[h // 3:h // 2, w // 4:w // 2] = (250, 12, 30)
    return Image.fromarray(array)


def jpeg(image: Image.Image, orientation: int = 1, **kw) -> bytes:
    buf = io.BytesIO()
    exif = Image.Exif()
    if orientation != 1:
        exif[pp.ORIENTATION_TAG] = orientation
    image.save(buf, format="JPEG", quality=90, exif=exif.tobytes(), **kw)
    return buf.getvalue()


def _bogus_huffman(data: bytes) -> bytes:
    """A JPEG whose first Huffman table claims 16 x 255 codes: the header reads (Pillow 12 and 13) and it ends
    in EOI, but libjpeg refuses the table when decoding ("broken data stream")."""
    table = data.index(b"\xff\xc4")
    return data[:table + 5] + b"\xff" * 16 + data[table + 21:]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("device_decode")
    return {name: tiny.ensure(name, root) for name in ("qwen2_vl", "siglip")}


def _models(path, decoder=None, **options):
    """The device preprocessing path with PIL decoding in `prepare`, and the same with `decoder` in the worker."""
    pil = build_encoder_model(path, device="cpu", dtype=torch.float32,
                              options={"preprocess_device": "device", "image_decode": "pil", **options})
    ours = build_encoder_model(path, device="cpu", dtype=torch.float32, options={"preprocess_device": "device",
                                                                                 **options},
                               jpeg_decoder=decoder or PilJpegDecoder())
    ours.tower.load_state_dict(pil.tower.state_dict())
    return pil, ours


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_turns_an_image_exactly_as_exif_transpose(orientation):
    data = jpeg(photo(30, 52, orientation), orientation)
    with Image.open(io.BytesIO(data)) as raw:
        stored = torch.from_numpy(np.array(raw.convert("RGB")))
        upright = np.array(ImageOps.exif_transpose(raw).convert("RGB"))
    header = pp.image_header(pb.EncodeItem(data=data), 0)
    assert header.orientation == orientation and header.format == "JPEG"
    turned = dd.orient(stored, orientation)
    assert torch.equal(turned, torch.from_numpy(upright))
    assert dd.upright_size(header.width, header.height, orientation) == (upright.shape[1], upright.shape[0])


@pytest.mark.parametrize("name", ["qwen2_vl", "siglip"])
def test_jpegs_decoded_in_the_worker_give_the_pil_paths_embeddings_bit_for_bit(checkpoints, name):
    pil, ours = _models(checkpoints[name])
    images = [jpeg(photo(60, 90, 0)), jpeg(photo(90, 60, 1), orientation=6), jpeg(photo(70, 70, 2), orientation=3),
              jpeg(photo(56, 84, 3).convert("L")), jpeg(photo(100, 40, 4), orientation=8, subsampling=0)]
    png = io.BytesIO()
    photo(50, 50, 5).save(png, format="PNG")
    items = [pb.EncodeItem(data=d) for d in images] + [pb.EncodeItem(data=png.getvalue())]
    want = [pil.prepare(it, i) for i, it in enumerate(items)]
    got = [ours.prepare(it, i) for i, it in enumerate(items)]
    for i, (w, g) in enumerate(zip(want, got)):
        assert (g.cost, g.meta.get("grid_thw"), g.meta["size"]) == (w.cost, w.meta.get("grid_thw"), w.meta["size"])
        if i < len(images):  # nothing decoded in prepare: the bytes wait for the worker
            assert g.inputs == {} and g.meta["jpeg"] == images[i]
        else:  # PNG: PIL in prepare, as before
            assert torch.equal(g.inputs["image"], w.inputs["image"])
    want_e, got_e = pil.encode(want), ours.encode(got)
    assert ours.jpeg_decoder.calls == [len(images)]  # the batch's JPEGs in one decode call
    for w, g in zip(want_e, got_e):
        assert g.error is None and g.grid_thw == w.grid_thw
        assert torch.equal(g.embedding, w.embedding)


def test_what_the_device_decoder_takes(checkpoints, monkeypatch):
    _, ours = _models(checkpoints["siglip"])
    good = jpeg(photo(64, 48, 0))
    cases = {
        "png": (io.BytesIO(), "PNG"),
        "cmyk": (io.BytesIO(), "JPEG"),  # Adobe-marked, CMYK
    }
    photo(40, 40, 1).save(cases["png"][0], format="PNG")
    Image.new("CMYK", (40, 40), (10, 200, 30, 0)).save(cases["cmyk"][0], format="JPEG")
    assert "jpeg" in ours.prepare(pb.EncodeItem(data=good), 0).meta
    assert "jpeg" in ours.prepare(pb.EncodeItem(data=good + b"\0\0"), 0).meta  # zero padding after EOI
    for label, (buf, _) in cases.items():
        prepared = ours.prepare(pb.EncodeItem(data=buf.getvalue()), 0)
        assert "jpeg" not in prepared.meta and prepared.inputs["image"].dtype == torch.uint8, label
    # Truncated: PIL refuses it in prepare, with the PIL path's error, instead of a half-grey picture.
    with pytest.raises(InvalidArgument, match=r"^items\[3\]: corrupt or truncated"):
        ours.prepare(pb.EncodeItem(data=good[:-40]), 3)
    header = pp.image_header(pb.EncodeItem(data=good), 0)
    assert dd.takes(header, good)
    assert not dd.takes(header._replace(adobe=True), good)  # RGB- or CMYK-coded streams stay with PIL
    assert not dd.takes(header._replace(orientation=0), good)  # an unreadable EXIF block
    assert not dd.takes(header._replace(reduce=2), good)  # draft-decoded by PIL, smaller
    assert not dd.takes(header._replace(width=65), good)  # PIL's header and the frame header disagree
    sof = good.index(b"\xff\xc0")
    for label, changed in {
        "arithmetic": good[:sof + 1] + b"\xc9" + good[sof + 2:],  # nvJPEG refuses it; PIL would decode it
        "12-bit": good[:sof + 4] + b"\x0c" + good[sof + 5:],
        "two frames": good[:sof] + good[sof:sof + 2 + int.from_bytes(good[sof + 2:sof + 4], "big")] + good[sof:],
    }.items():
        assert dd.frame(changed) is None and not dd.takes(header, changed), label
    assert dd.frame(good) == (48, 64) and dd.frame(jpeg(photo(64, 48, 0), progressive=True)) == (48, 64)
    monkeypatch.setattr(dd, "MAX_PIXELS", 64 * 48 - 1)
    assert not dd.takes(header, good)
    # A large JPEG decoded at 1/2 by PIL's draft stays on the PIL path and keeps its reduced size.
    big = build_encoder_model(checkpoints["siglip"], device="cpu", dtype=torch.float32,
                              options={"preprocess_device": "device", "max_image_decoded_bytes": 32 * 24 * 3},
                              jpeg_decoder=PilJpegDecoder())
    monkeypatch.setattr(dd, "MAX_PIXELS", 4096 * 4096)
    assert big.prepare(pb.EncodeItem(data=good), 0).inputs["image"].shape == (32, 24, 3)


def test_pil_takes_over_where_the_device_decoder_fails_and_a_bad_item_fails_alone(checkpoints):
    good = [jpeg(photo(60, 80, i)) for i in range(3)]
    broken = _bogus_huffman(good[0])
    pil, ours = _models(checkpoints["siglip"], PilJpegDecoder(fail=(good[1],)))
    items = [pb.EncodeItem(data=d) for d in (good[0], good[1], broken, good[2])]
    got = ours.encode([ours.prepare(it, i) for i, it in enumerate(items)])
    want = pil.encode([pil.prepare(pb.EncodeItem(data=d), i) for i, d in enumerate(good)])
    assert torch.equal(got[0].embedding, want[0].embedding)
    assert torch.equal(got[1].embedding, want[1].embedding)  # the device failed it, PIL decoded it in the worker
    assert isinstance(got[2].error, InvalidArgument) and got[2].embedding is None
    assert str(got[2].error).startswith("items[2]: corrupt or truncated")
    assert torch.equal(got[3].embedding, want[2].embedding)
    alone = ours.encode([ours.prepare(pb.EncodeItem(data=broken), 5)])  # a batch of nothing but a bad item
    assert str(alone[0].error).startswith("items[5]:")


def test_a_fallback_finding_no_decode_memory_fails_its_item_alone_at_once(checkpoints):
    # PIL's fallback decode in the worker takes decode memory without waiting: with none free that item is
    # RESOURCE_EXHAUSTED and the batch goes on (it waited 30 s and then failed the whole batch).
    good = [jpeg(photo(60, 80, i)) for i in range(2)]
    pil, ours = _models(checkpoints["siglip"], PilJpegDecoder(fail=(good[1],)))
    ours.decode_budget.held = ours.decode_budget.capacity  # other large images hold all of it
    got = ours.encode([ours.prepare(pb.EncodeItem(data=d), i) for i, d in enumerate(good)])
    assert isinstance(got[1].error, ResourceExhausted) and str(got[1].error).startswith("items[1]: the server is busy")
    assert torch.equal(got[0].embedding, pil.encode([pil.prepare(pb.EncodeItem(data=good[0]), 0)])[0].embedding)


def test_a_device_decoder_that_raises_leaves_the_batch_to_pil(checkpoints):
    class Broken(PilJpegDecoder):
        def decode(self, jpegs):
            raise RuntimeError("out of memory")

    pil, ours = _models(checkpoints["siglip"], Broken())
    data = [jpeg(photo(60, 80, i)) for i in range(2)]
    got = ours.encode([ours.prepare(pb.EncodeItem(data=d), i) for i, d in enumerate(data)])
    want = pil.encode([pil.prepare(pb.EncodeItem(data=d), i) for i, d in enumerate(data)])
    assert all(torch.equal(g.embedding, w.embedding) for g, w in zip(got, want))


def test_a_batch_past_chunk_bytes_is_decoded_in_parts(checkpoints, monkeypatch):
    pil, ours = _models(checkpoints["siglip"])
    data = [jpeg(photo(60, 80, i)) for i in range(5)]
    monkeypatch.setattr(dd, "CHUNK_BYTES", 2 * 60 * 80 * 3)
    got = ours.encode([ours.prepare(pb.EncodeItem(data=d), i) for i, d in enumerate(data)])
    want = pil.encode([pil.prepare(pb.EncodeItem(data=d), i) for i, d in enumerate(data)])
    assert ours.jpeg_decoder.calls == [2, 2, 1]
    assert all(torch.equal(g.embedding, w.embedding) for g, w in zip(got, want))


def test_the_decoder_is_in_the_cache_key_and_info(checkpoints):
    pil, ours = _models(checkpoints["siglip"])
    item = pb.EncodeItem(data=jpeg(photo(40, 40, 0)))
    assert pil.cache_key(item, 0) != ours.cache_key(item, 0)
    assert ours.prepare(item, 0).cache_key == ours.cache_key(item, 0)
    assert (pil.describe()["image_decode"], ours.describe()["image_decode"]) == ("pil", "pil-as-device")


def test_the_flag_choices_and_their_errors(checkpoints, monkeypatch):
    assert dd.jpeg_decoder("auto", "cpu", "device") is None  # on the CPU: PIL
    assert dd.jpeg_decoder("pil", "cuda", "device") is None
    with pytest.raises(ConfigError, match="--image-decode nvimgcodec: .*preprocessed on the CPU"):
        dd.jpeg_decoder("nvimgcodec", "cuda", "cpu")
    with pytest.raises(ConfigError, match="image_decode must be one of auto, pil, nvimgcodec"):
        dd.jpeg_decoder("nvjpeg", "cuda", "device")

    def missing(device):
        raise ImportError("No module named 'nvidia.nvimgcodec'")

    monkeypatch.setattr(dd, "NvJpegDecoder", missing)
    assert dd.jpeg_decoder("auto", "cuda", "device") is None  # not installed: PIL, said in the log
    with pytest.raises(ConfigError, match=r"not installed \(pip install 'modalmesh\[nvimgcodec\]'\)"):
        dd.jpeg_decoder("nvimgcodec", "cuda", "device")
    with pytest.raises(ConfigError, match="--image-decode nvimgcodec: nvJPEG runs on CUDA and the encoder runs on cpu"):
        build_encoder_model(checkpoints["siglip"], device="cpu", dtype=torch.float32,
                            options={"image_decode": "nvimgcodec"})


def test_through_the_service_a_bad_jpeg_fails_its_request_alone(checkpoints, monkeypatch):
    """Two concurrent requests share a batch; the one whose JPEG no decoder can read gets INVALID_ARGUMENT
    naming its item, the other its rows (the PIL path's)."""
    path = checkpoints["siglip"]
    good = jpeg(photo(60, 80, 0))
    broken = _bogus_huffman(good)
    monkeypatch.setattr(dd, "jpeg_decoder", lambda choice, device, preprocess: PilJpegDecoder())
    other = jpeg(photo(60, 80, 1))
    pil, _ = _models(path)
    want = pil.encode([pil.prepare(pb.EncodeItem(data=other), 0)])[0].embedding

    async def body():
        service, server, port, _metrics, calls = await _serve(path, "--preprocess-device", "device",
                                                               "--batch-window-ms", "300")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                results = await asyncio.gather(
                    stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(data=good), pb.EncodeItem(data=broken)])),
                    stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(data=other)])),
                    return_exceptions=True)
                return results, [len(c) for c in calls], service.model.describe()
        finally:
            await server.stop(0)
            await service.close()

    (bad, ok), sizes, facts = asyncio.run(asyncio.wait_for(body(), 120))
    assert facts["image_decode"] == "pil-as-device"
    assert sizes == [3]  # one batch: both requests' items
    assert isinstance(bad, grpc.aio.AioRpcError) and bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad.details().startswith("items[1]: corrupt or truncated")
    # Close, not equal: the service's batch and the reference's differ in size, and so may the CPU's kernels.
    torch.testing.assert_close(from_proto(ok.embeddings[0].embedding), want, rtol=1e-5, atol=1e-5)
