"""nvJPEG (through nvImageCodec) against PIL on a GPU: the tolerance docs/architecture.md states.

Needs CUDA and nvImageCodec (the optional extra). Without CUDA the tests skip. Without
nvImageCodec they skip too, unless MODALMESH_REQUIRE_NVIMGCODEC=1 (scripts/device.sh sets
it), which turns a missing library into a failure: on the device machine it must run.
The CPU side (routing, orientation, fallbacks, errors) is tests/test_device_decode.py.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

from modalmesh import pb
from modalmesh.testing import tiny
from services.vision_encoder import device_decode as dd
from services.vision_encoder.model import build_encoder_model
from tests.test_device_decode import _bogus_huffman, jpeg, photo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# nvJPEG's decode against PIL's (libjpeg-turbo), uint8 levels. Measured on an H200 (Pillow 12.3, nvImageCodec
# 0.9.0, 2026-12-01): max 3, worst mean 0.049 (the hybrid backend; the hardware decoder alone: 1 and 0.000).
MAX_DECODE_LEVELS = 4
MAX_DECODE_MEAN = 0.1
# After resize and normalise, against the exact CPU path: the device path's own bounds
# (tests/test_vision_device_preprocess.py); measured 1 level SigLIP, 2 Qwen2-VL, worst mean 6.2e-4.
MAX_PIXEL_LEVELS = 4
MAX_PIXEL_MEAN = 2.5e-3
MAX_EMBEDDING_REL = 0.05  # measured 1.2e-2 SigLIP, 4.0e-3 Qwen2-VL (tiny random towers, fp32)


@pytest.fixture(scope="module")
def nvimgcodec():
    try:
        from nvidia import nvimgcodec
    except ImportError:
        if os.environ.get("MODALMESH_REQUIRE_NVIMGCODEC") == "1":
            raise
        pytest.skip("nvImageCodec is not installed (pip install 'modalmesh[nvimgcodec]')")
    return nvimgcodec


def cases() -> dict[str, bytes]:
    """JPEGs as cameras and encoders write them: subsamplings, qualities, progressive, grey, odd sizes."""
    out = {}
    for i, (h, w) in enumerate([(384, 512), (448, 448), (77, 123), (700, 1000)]):
        for sub in (0, 1, 2):  # 4:4:4, 4:2:2, 4:2:0
            out[f"{w}x{h} sub{sub} q90"] = jpeg(photo(h, w, i), subsampling=sub)
    out["512x384 q75"] = _save(photo(384, 512, 9), quality=75)
    out["512x384 q98"] = _save(photo(384, 512, 9), quality=98)
    out["512x384 progressive"] = _save(photo(384, 512, 10), progressive=True)
    out["512x384 grey"] = _save(photo(384, 512, 11).convert("L"))
    out["noise 256"] = _save(Image.fromarray(np.random.default_rng(0).integers(0, 256, (256, 256, 3), np.uint8)))
    return out


def _save(image: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", **{"quality": 90, **kw})
    return buf.getvalue()


def _pil(data: bytes) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as image:
        return torch.from_numpy(np.array(image.convert("RGB")))


def test_nvjpeg_decodes_within_the_stated_tolerance_of_pil(nvimgcodec):
    jpegs = cases()
    print(f"\nnvJPEG vs PIL (Pillow {Image.__version__}) on {torch.cuda.get_device_name()}, uint8 levels:")
    worst = {}
    for backends in (dd.BACKENDS, *((b,) for b in dd.BACKENDS)):
        try:
            decoder = dd.NvJpegDecoder("cuda", backends=backends)
        except RuntimeError as e:
            print(f"  {'+'.join(backends)}: cannot decode here ({e})")
            continue
        got = decoder.decode(list(jpegs.values()))
        torch.cuda.synchronize()
        rows, refused = [], []
        for (label, data), image in zip(jpegs.items(), got):
            if image is None:  # a backend alone may refuse some (the hardware decoder: progressive JPEGs)
                assert backends != dd.BACKENDS, label
                refused.append(label)
                continue
            want = _pil(data)
            assert image.shape == want.shape and image.dtype == torch.uint8 and image.is_cuda, (backends, label)
            diff = (image.cpu().int() - want.int()).abs()
            rows.append((label, diff.max().item(), diff.float().mean().item()))
        worst[backends] = (max(r[1] for r in rows), max(r[2] for r in rows))
        print(f"  {'+'.join(backends)}: max |Δ| {worst[backends][0]}, worst mean |Δ| {worst[backends][1]:.3f}; "
              + ", ".join(f"{label} {m}/{a:.2f}" for label, m, a in rows)
              + (f"; refused: {', '.join(refused)}" if refused else ""))
    assert dd.BACKENDS in worst
    assert worst[dd.BACKENDS][0] <= MAX_DECODE_LEVELS and worst[dd.BACKENDS][1] <= MAX_DECODE_MEAN


@pytest.mark.parametrize("name", ["siglip", "qwen2_vl"])
def test_the_model_with_nvjpeg_against_the_exact_cpu_path(nvimgcodec, tmp_path, name):
    path = tiny.ensure(name, tmp_path)
    exact = build_encoder_model(path, device="cpu", dtype=torch.float32, options={"preprocess_device": "cpu"})
    ours = build_encoder_model(path, device="cuda", dtype=torch.float32,
                               options={"preprocess_device": "device", "image_decode": "nvimgcodec"})
    ours.tower.load_state_dict(exact.tower.state_dict())
    assert ours.describe()["image_decode"] == "nvimgcodec"
    data = [jpeg(photo(384, 512, 0)), jpeg(photo(300, 200, 1), orientation=6), jpeg(photo(120, 90, 2), orientation=3),
            _save(photo(100, 160, 3).convert("L")), _save(photo(448, 448, 4), progressive=True)]
    items = [pb.EncodeItem(data=d) for d in data]
    want = [exact.prepare(it, i) for i, it in enumerate(items)]
    got = [ours.prepare(it, i) for i, it in enumerate(items)]
    assert all("jpeg" in g.meta for g in got)  # none decoded in prepare
    level = 1 / 255 / min(exact.processor.image_std)
    images, errors = ours._device_pixels(got)
    assert not errors
    worst, means = 0.0, []
    for w, g, pixels in zip(want, got, images):
        assert (g.cost, g.meta.get("grid_thw")) == (w.cost, w.meta.get("grid_thw"))
        pixels = ours.device_preprocessor.rows([pixels]) if exact.native else pixels
        diff = (pixels.cpu() - w.inputs["pixel_values"]).abs()
        worst = max(worst, diff.max().item())
        means.append(diff.mean().item())
    rel = max(((g.embedding.cpu() - w.embedding).abs().max() / w.embedding.abs().max()).item()
              for g, w in zip(ours.encode(got), exact.encode(want)))
    print(f"\n{name}, nvJPEG + device preprocessing vs the exact CPU path: max |Δ| {worst / level:.2f} levels, "
          f"worst mean |Δ| {max(means):.2e}; embeddings max |Δ| / max |e| {rel:.2e}")
    assert worst <= MAX_PIXEL_LEVELS * level + 1e-6 and max(means) <= MAX_PIXEL_MEAN
    assert rel <= MAX_EMBEDDING_REL


def test_buffers_are_reused_a_bad_jpeg_fails_alone_and_no_cuda_error_stays(nvimgcodec, tmp_path):
    path = tiny.ensure("siglip", tmp_path)
    model = build_encoder_model(path, device="cuda", dtype=torch.float32,
                                options={"preprocess_device": "device", "image_decode": "nvimgcodec"})
    decoder = model.jpeg_decoder
    good = [jpeg(photo(120 + 8 * i, 160, i)) for i in range(6)]
    for _ in range(3):
        decoder.decode(good)
    assert len(decoder._buffers) == 6
    first = [image.cpu() for image in decoder.decode(good[:2])]  # fewer images than buffers: a part reused
    bigger = decoder.decode([jpeg(photo(500, 400, 9))] + good[1:2])  # a buffer grows
    assert len(decoder._buffers) == 6 and bigger[0].shape == (500, 400, 3)
    assert torch.equal(bigger[1].cpu(), first[1])  # the same JPEG decodes the same through a reused buffer
    garbled = bytearray(good[3])
    start = garbled.index(b"\xff\xda") + 40
    garbled[start:start + 200] = bytes(200)
    items = [pb.EncodeItem(data=d) for d in (good[0], _bogus_huffman(good[1]), bytes(garbled), good[2])]
    out = model.encode([model.prepare(it, i) for i, it in enumerate(items)])
    assert out[1].error is not None and str(out[1].error).startswith("items[1]: corrupt or truncated")
    # A stream corrupt inside its scan: PIL decodes such streams with grey patches; nvJPEG may or may not.
    # Either way the batch's other items are unharmed.
    alone = model.encode([model.prepare(pb.EncodeItem(data=d), 0) for d in (good[0], good[2])])
    torch.testing.assert_close(out[0].embedding, alone[0].embedding)
    torch.testing.assert_close(out[3].embedding, alone[1].embedding)
    print(f"\na JPEG corrupt inside its scan: {'error ' + str(out[2].error) if out[2].error else 'decoded'}")
    torch.cuda.synchronize()
    assert torch.ones(4, device="cuda").sum().item() == 4  # no CUDA error left behind
