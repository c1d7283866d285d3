"""Preprocessing equals the checkpoint's HF PIL image processor bit for bit; bad input is INVALID_ARGUMENT.

The HF side gets what `transformers.image_utils.load_image` would hand it minus its
RGB conversion: the decoded PIL image with EXIF orientation applied. Conversion
to RGB (alpha onto white) is then the processor's own.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from modalmesh import pb
from modalmesh.errors import InvalidArgument
from modalmesh.rpc.codec import to_proto
from modalmesh.testing import tiny
from services.vision_encoder import preprocess as pp
from services.vision_encoder.model import build_encoder_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_pre")
    return {name: build_encoder_model(tiny.ensure(name, root), device="cpu", dtype=torch.float32)
            for name in ("qwen2_vl", "siglip")}


def _hf(model, images, **kw):
    from transformers import Qwen2VLImageProcessorPil, SiglipImageProcessorPil

    cls = Qwen2VLImageProcessorPil if model.native else SiglipImageProcessorPil
    return cls.from_pretrained(model.model_dir)(images=images, return_tensors="pt", **kw)


def _rng_image(mode: str, h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    if mode == "P_transparent":
        image = Image.fromarray(rng.integers(0, 16, (h, w), dtype=np.uint8), "P")
        image.putpalette(rng.integers(0, 256, 48, dtype=np.uint8).tolist())
        image.info["transparency"] = 3
        return image
    if mode == "P":
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert("P")
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2, "CMYK": 4}[mode]
    array = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    if mode == "RGBA":
        array[..., 3] = np.where(rng.random((h, w)) < 0.3, 0, array[..., 3])  # some fully transparent
    return Image.fromarray(array[..., 0] if channels == 1 else array, mode)


def _encode(image: Image.Image, fmt: str, **save) -> bytes:
    buf = io.BytesIO()
    if fmt == "PNG" and "transparency" in image.info:
        save["transparency"] = image.info["transparency"]
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


CASES = [  # (mode, format, h, w)
    ("RGB", "PNG", 56, 56), ("RGB", "PNG", 123, 77), ("RGBA", "PNG", 90, 200), ("L", "PNG", 64, 100),
    ("LA", "PNG", 71, 71), ("P", "PNG", 100, 30), ("P_transparent", "PNG", 50, 80),
    ("RGB", "JPEG", 300, 260), ("L", "JPEG", 33, 150), ("CMYK", "JPEG", 80, 60), ("RGB", "WEBP", 45, 95),
    ("RGBA", "WEBP", 60, 60), ("P", "GIF", 40, 70), ("P_transparent", "GIF", 50, 50), ("RGB", "BMP", 37, 61),
    ("RGB", "TIFF", 52, 48), ("RGBA", "TIFF", 30, 90), ("L", "TIFF", 60, 60), ("RGB", "PPM", 29, 29),
    ("RGBA", "TGA", 33, 44),
]


@pytest.mark.parametrize("name", ["qwen2_vl", "siglip"])
@pytest.mark.parametrize("mode, fmt, h, w", CASES)
def test_pixel_values_equal_hf_processor(models, name, mode, fmt, h, w):
    model = models[name]
    data = _encode(_rng_image(mode, h, w, seed=h * w), fmt)
    got = model.prepare(pb.EncodeItem(data=data), 0)
    want = _hf(model, [ImageOps.exif_transpose(Image.open(io.BytesIO(data)))])
    if model.native:
        assert torch.equal(got.inputs["pixel_values"], want["pixel_values"])
        assert list(got.meta["grid_thw"]) == want["image_grid_thw"][0].tolist()
        assert got.cost == int(want["image_grid_thw"][0].prod())
    else:
        assert torch.equal(got.inputs["pixel_values"], want["pixel_values"][0])


@pytest.mark.parametrize("name", ["qwen2_vl", "siglip"])
def test_an_animated_gif_is_its_first_frame_as_hf_sees_it(models, name):
    """PIL opens a GIF on its first frame, and so does HF's processor given that image: the two frames differ, and
    the pixel values are the first one's."""
    model = models[name]
    frames = [_rng_image("RGB", 48, 64, seed=s).convert("P") for s in (1, 2)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    data = buf.getvalue()
    assert Image.open(io.BytesIO(data)).n_frames == 2
    got = model.prepare(pb.EncodeItem(data=data), 0).inputs["pixel_values"]
    first = _hf(model, [Image.open(io.BytesIO(data))])["pixel_values"]
    second_image = Image.open(io.BytesIO(data))
    second_image.seek(1)
    second = _hf(model, [second_image.convert("RGB")])["pixel_values"]
    if not model.native:
        first, second = first[0], second[0]
    assert torch.equal(got, first) and not torch.equal(got, second)


def test_exif_orientation_is_applied(models):
    model = models["qwen2_vl"]
    image = _rng_image("RGB", 60, 140, seed=5)  # landscape pixels, EXIF says rotate 90 (portrait)
    exif = Image.Exif()
    exif[0x0112] = 6
    data = _encode(image, "JPEG", exif=exif.tobytes())
    got = model.prepare(pb.EncodeItem(data=data), 0)
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert upright.size == (60, 140)
    want = _hf(model, [upright])
    assert list(got.meta["grid_thw"]) == want["image_grid_thw"][0].tolist()
    assert got.meta["grid_thw"][1] > got.meta["grid_thw"][2]  # taller than wide
    assert torch.equal(got.inputs["pixel_values"], want["pixel_values"])


@pytest.mark.parametrize("shape", [(70, 90, 3), (64, 48)])
def test_raw_pixel_tensors_equal_hf_processor(models, shape):
    array = np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)
    item = pb.EncodeItem(pixels=to_proto(torch.from_numpy(array)))
    for model in models.values():
        got = model.prepare(item, 0)
        want = _hf(model, [Image.fromarray(array).convert("RGB")])
        key = "pixel_values"
        assert torch.equal(got.inputs[key], want[key] if model.native else want[key][0])


@pytest.mark.parametrize("lo, hi", [(0, 28 * 28 * 4), (28 * 28 * 30, 0), (28 * 28 * 8, 28 * 28 * 8)])
def test_per_item_pixel_budgets(models, lo, hi):
    model = models["qwen2_vl"]
    image = _rng_image("RGB", 150, 190, seed=9)
    got = model.prepare(pb.EncodeItem(data=_encode(image, "PNG"), min_pixels=lo, max_pixels=hi), 0)
    size = {"shortest_edge": lo or model.processor.min_pixels, "longest_edge": hi or model.processor.max_pixels}
    want = _hf(model, [image], size=size)
    assert list(got.meta["grid_thw"]) == want["image_grid_thw"][0].tolist()
    assert torch.equal(got.inputs["pixel_values"], want["pixel_values"])


def test_smart_resize_matches_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    rng = np.random.default_rng(0)
    for h, w in rng.integers(1, 4000, (300, 2)).tolist():
        if max(h, w) / min(h, w) > 200:
            continue
        assert pp.smart_resize(h, w, 28, 3136, 1003520) == smart_resize(h, w, 28, 3136, 1003520)


def test_cache_key_depends_on_content_and_budget(models):
    model = models["qwen2_vl"]
    a = _encode(_rng_image("RGB", 60, 60, 1), "PNG")
    b = _encode(_rng_image("RGB", 60, 60, 2), "PNG")
    key = lambda data, **kw: model.prepare(pb.EncodeItem(data=data, **kw), 0).cache_key  # noqa: E731
    assert key(a) == key(a) and key(a) != key(b)
    assert key(a) != key(a, max_pixels=28 * 28 * 4)
    assert key(a) == key(a, max_pixels=model.processor.max_pixels)  # the default, spelled out


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height (valid CRC) with a tiny, bogus IDAT."""
    def chunk(kind, payload):
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(
        b"IEND", b"")


def _pixels(array) -> pb.EncodeItem:
    return pb.EncodeItem(pixels=to_proto(torch.as_tensor(array)))


BAD = [
    ("garbage", pb.EncodeItem(data=b"not an image at all"), "not a decodable"),
    ("empty", pb.EncodeItem(data=b""), "empty image data"),
    ("nothing", pb.EncodeItem(), "no image"),
    ("truncated", None, "corrupt or truncated"),
    # PIL would run Ghostscript on it: refused as though PIL did not know the format.
    ("eps", pb.EncodeItem(data=b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"), "not a decodable"),
    ("bomb", pb.EncodeItem(data=_png_header_only(100_000, 100_000)), "too large"),
    ("big", pb.EncodeItem(data=_png_header_only(9000, 9000)), "too large: the server's limit is"),
    ("zero", _pixels(np.zeros((0, 10, 3), np.uint8)), "zero size"),
    ("rgba tensor", _pixels(np.zeros((10, 10, 4), np.uint8)), "is not (H, W, 3)"),
    ("1-d tensor", _pixels(np.zeros((30,), np.uint8)), "is not (H, W, 3)"),
    ("float tensor", _pixels(np.zeros((10, 10, 3), np.float32)), "not uint8"),
    ("short data", pb.EncodeItem(pixels=pb.Tensor(dtype=pb.UINT8, shape=[10, 10, 3], data=b"\0" * 7)), "bytes"),
    ("aspect", _pixels(np.zeros((1, 300, 3), np.uint8)), "aspect ratio"),
    ("audio", pb.EncodeItem(pcm=to_proto(torch.zeros(16))), "not an image input"),
    ("budget", pb.EncodeItem(data=_encode(_rng_image("RGB", 30, 30, 0), "PNG"), max_pixels=10 ** 9),
     "exceeds the server's limit"),
    ("min>max", pb.EncodeItem(data=_encode(_rng_image("RGB", 30, 30, 0), "PNG"), min_pixels=10 ** 5,
                              max_pixels=28 * 28 * 4), "larger than max_pixels"),
    ("negative", pb.EncodeItem(data=_encode(_rng_image("RGB", 30, 30, 0), "PNG"), min_pixels=-1), ">= 0"),
]


@pytest.mark.parametrize("case, item, message", BAD, ids=[c[0] for c in BAD])
def test_bad_items_raise_invalid_argument_naming_the_index(models, case, item, message):
    if case == "truncated":
        item = pb.EncodeItem(data=_encode(_rng_image("RGB", 80, 80, 0), "PNG")[:300])
    with pytest.raises(InvalidArgument, match=r"^items\[7\]") as info:
        models["qwen2_vl"].prepare(item, 7)
    assert message in str(info.value)


def test_configured_max_image_pixels(tmp_path):
    model = build_encoder_model(tiny.ensure("siglip", tmp_path), device="cpu", dtype=torch.float32,
                                options={"max_image_pixels": 1000})
    model.prepare(_pixels(np.zeros((20, 50, 3), np.uint8)), 0)
    with pytest.raises(InvalidArgument, match=r"items\[2\]: image is 40x30 = 1200 pixels, too large"):
        model.prepare(pb.EncodeItem(data=_encode(_rng_image("RGB", 30, 40, 0), "JPEG")), 2)
