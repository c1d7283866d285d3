"""The device preprocessing path (device_preprocess.py) against the exact PIL path (preprocess.py).

The torch code runs on the CPU here (``preprocess_device="device"`` on a CPU model), so CI
checks it; the CUDA test runs the same comparisons on a GPU. Tolerances, in grey levels of
the resized uint8 image (one level is 1/255/std after normalising: 0.0078 for SigLIP's
std 0.5, 0.0150 for Qwen2-VL's smallest std 0.2613), measured on these images (Pillow 13):
  max |Δ| of normalised pixel values <= 4 levels (measured: Qwen2-VL 1.95, SigLIP 4.0 on an image
  with a noisy alpha shrinking on both axes), mean |Δ| per image <= 2.5e-3 (measured: 1.9e-3 worst,
  1.7e-4 on average); grid, row count and cost identical; an image needing no resize is bit-equal;
  embeddings (tiny random towers, fp32): max |Δ| <= 5 % of max |embedding| (measured: 0.14 % Qwen2-VL,
  0.94 % SigLIP).
The difference is PIL's 22-bit fixed-point resize against torch's float32 one, plus the
pass order Pillow 13 picks for some images shrinking on both axes (see horizontal_first).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from modalmesh import pb
from modalmesh.errors import InvalidArgument
from modalmesh.rpc.codec import to_proto
from modalmesh.testing import tiny
from services.vision_encoder.device_preprocess import patchify_rows
from services.vision_encoder.model import build_encoder_model
from services.vision_encoder.preprocess import patchify

MAX_LEVELS = 4  # max |Δ| in grey levels
MAX_MEAN = 2.5e-3  # mean |Δ| of normalised values
MAX_EMBEDDING_REL = 0.05


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_device_pre")
    return {name: tiny.ensure(name, root) for name in ("qwen2_vl", "siglip")}


def _pair(path, device="cpu"):
    exact = build_encoder_model(path, device="cpu", dtype=torch.float32, options={"preprocess_device": "cpu"})
    ours = build_encoder_model(path, device=device, dtype=torch.float32, options={"preprocess_device": "device"})
    ours.tower.load_state_dict(exact.tower.state_dict())
    return exact, ours


@pytest.fixture(scope="module")
def pairs(checkpoints):
    return {name: _pair(path) for name, path in checkpoints.items()}


def photo(h: int, w: int, seed: int, mode: str = "RGB") -> Image.Image:
    """Smooth colour fields with a hard-edged block: what photographs and screenshots have."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (h // 8 + 2, w // 8 + 2, 3), dtype=np.uint8))
    array = np.array(coarse.resize((w, h), Image.Resampling.BILINEAR))
    array[h // 3:h // 2 + 1, w // 4:w // 2 + 1] = (250, 12, 30)
    image = Image.fromarray(array)
    if mode == "RGBA":
        alpha = Image.fromarray(np.where(rng.random((h, w)) < 0.3, 0, 255).astype(np.uint8))
        image.putalpha(alpha)
    elif mode == "L":
        image = image.convert("L")
    return image


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


SIZES = [(56, 56), (123, 77), (300, 260), (33, 150), (640, 480), (20, 30), (448, 448), (200, 700)]
MODES = ["RGB", "RGBA", "L"]


def _device_pixels(model, prepared):
    images, errors = model._device_pixels(prepared)
    assert not errors
    pre = model.device_preprocessor
    return (pre.rows(images) if model.native else torch.stack(images)).float().cpu()


def _levels(model) -> float:
    """One grey level in normalised units (the largest of the three channels)."""
    return 1 / 255 / min(model.processor.image_std)


@pytest.mark.parametrize("name", ["qwen2_vl", "siglip"])
def test_device_path_matches_pil_path_within_tolerance(pairs, name):
    exact, ours = pairs[name]
    assert (exact.preprocess, ours.preprocess) == ("cpu", "device")
    worst, means = 0.0, []
    for seed, (h, w) in enumerate(SIZES):
        for mode in MODES:
            item = pb.EncodeItem(data=_png(photo(h, w, seed, mode)))
            want, got = exact.prepare(item, 0), ours.prepare(item, 0)
            assert got.cost == want.cost
            assert got.meta.get("grid_thw") == want.meta.get("grid_thw")
            assert got.inputs["image"].dtype == torch.uint8 and got.inputs["image"].shape == (h, w, 3)
            ref = want.inputs["pixel_values"]
            pixels = _device_pixels(ours, [got])
            pixels = pixels if exact.native else pixels[0]
            assert pixels.shape == ref.shape  # rows x (C * T * P * P) for Qwen2-VL, (3, H, W) for SigLIP
            diff = (pixels - ref).abs()
            worst = max(worst, diff.max().item())
            means.append(diff.mean().item())
            assert diff.max().item() <= MAX_LEVELS * _levels(exact) + 1e-6, (h, w, mode)
            assert diff.mean().item() <= MAX_MEAN, (h, w, mode)
    print(f"\n{name}: device vs PIL path, max |Δ| {worst:.4f} ({worst / _levels(exact):.2f} levels), "
          f"mean |Δ| {np.mean(means):.2e} (worst image {max(means):.2e})")


@pytest.mark.parametrize("name", ["qwen2_vl", "siglip"])
def test_an_image_at_the_target_size_is_bit_equal(pairs, name):
    exact, ours = pairs[name]
    side = 56 if exact.native else exact.processor.height  # 56 = 2 merged patches: no resize
    array = np.random.default_rng(3).integers(0, 256, (side, side, 3), dtype=np.uint8)
    item = pb.EncodeItem(pixels=to_proto(torch.from_numpy(array)))  # raw pixels take the same path
    want, got = exact.prepare(item, 0), ours.prepare(item, 0)
    pixels = _device_pixels(ours, [got])
    assert torch.equal(pixels if exact.native else pixels[0], want.inputs["pixel_values"])


def test_patchify_rows_equal_numpy_patchify():
    array = np.random.default_rng(0).standard_normal((56, 84, 3)).astype(np.float32)
    want = patchify(array, 14, 2, 2)
    got = patchify_rows(torch.from_numpy(array).permute(2, 0, 1), 14, 2, 2)
    assert torch.equal(got, torch.from_numpy(want))


@pytest.mark.parametrize("name", ["qwen2_vl", "siglip"])
def test_embeddings_agree_through_the_tower_in_a_mixed_batch(pairs, name):
    exact, ours = pairs[name]
    items = [pb.EncodeItem(data=_png(photo(h, w, i, MODES[i % 3]))) for i, (h, w) in enumerate(SIZES[:5])]
    items.append(pb.EncodeItem(data=items[0].data))  # same shape and size twice: resized together
    want = exact.encode([exact.prepare(it, i) for i, it in enumerate(items)])
    got = ours.encode([ours.prepare(it, i) for i, it in enumerate(items)])
    worst = 0.0
    for w, g in zip(want, got):
        assert g.grid_thw == w.grid_thw and g.embedding.shape == w.embedding.shape
        rel = ((g.embedding - w.embedding).abs().max() / w.embedding.abs().max()).item()
        worst = max(worst, rel)
    assert worst <= MAX_EMBEDDING_REL
    torch.testing.assert_close(got[0].embedding, got[-1].embedding, rtol=1e-4, atol=1e-4)  # same pixels
    print(f"\n{name}: embeddings, device vs PIL path, max |Δ| / max |e| = {worst:.2e}")


def test_cache_key_and_info_name_the_path(pairs):
    exact, ours = pairs["qwen2_vl"]
    item = pb.EncodeItem(data=_png(photo(40, 40, 0)))
    assert exact.cache_key(item, 0) != ours.cache_key(item, 0)
    assert ours.prepare(item, 0).cache_key == ours.cache_key(item, 0)
    given = ours.prepare(item, 0, ours.cache_key(item, 0))  # the service hands over the key it made
    assert given.cache_key == ours.cache_key(item, 0) and all(
        torch.equal(v, ours.prepare(item, 0).inputs[k]) for k, v in given.inputs.items())
    assert (exact.describe()["preprocess"], ours.describe()["preprocess"]) == ("cpu", "device")


def test_auto_is_the_exact_path_on_cpu(checkpoints):
    model = build_encoder_model(checkpoints["siglip"], device="cpu", dtype=torch.float32)
    assert model.preprocess == "cpu" and model.device_preprocessor is None


def test_answers_are_views_of_one_batch_output(pairs):
    _, ours = pairs["qwen2_vl"]
    items = [pb.EncodeItem(data=_png(photo(h, w, 1))) for h, w in ((56, 56), (60, 90))]
    out = ours.encode([ours.prepare(it, i) for i, it in enumerate(items)])
    assert out[0].embedding.untyped_storage().data_ptr() == out[1].embedding.untyped_storage().data_ptr()


def test_bad_items_stay_invalid_argument_on_the_device_path(pairs):
    _, ours = pairs["qwen2_vl"]
    with pytest.raises(InvalidArgument, match=r"^items\[4\]: data is not a decodable"):
        ours.prepare(pb.EncodeItem(data=b"not an image"), 4)
    with pytest.raises(InvalidArgument, match=r"^items\[2\].*aspect ratio"):
        ours.prepare(pb.EncodeItem(pixels=to_proto(torch.zeros((1, 300, 3), dtype=torch.uint8))), 2)


def test_jpeg_draft_reduce_on_the_device_path(checkpoints):
    exact, ours = (build_encoder_model(checkpoints["qwen2_vl"], device="cpu", dtype=torch.float32,
                                       options={"preprocess_device": p, "max_image_decoded_bytes": 240 * 200 * 3})
                   for p in ("cpu", "device"))
    buf = io.BytesIO()
    photo(480, 400, 2).save(buf, format="JPEG", quality=90)
    item = pb.EncodeItem(data=buf.getvalue())
    want, got = exact.prepare(item, 0), ours.prepare(item, 0)
    assert got.inputs["image"].shape == (240, 200, 3)  # decoded at 1/2
    assert got.meta["grid_thw"] == want.meta["grid_thw"]
    pixels = _device_pixels(ours, [got])
    assert (pixels - want.inputs["pixel_values"]).abs().max().item() <= MAX_LEVELS * _levels(exact) + 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["qwen2_vl", "siglip"])
def test_cuda_device_path_matches_the_cpu_paths(checkpoints, pairs, name):
    exact, on_cpu = pairs[name]
    _, on_cuda = _pair(checkpoints[name], device="cuda")
    assert on_cuda.preprocess == "device"
    items = [pb.EncodeItem(data=_png(photo(h, w, i, MODES[i % 3]))) for i, (h, w) in enumerate(SIZES)]
    want = [exact.prepare(it, i) for i, it in enumerate(items)]
    cpu_items = [on_cpu.prepare(it, i) for i, it in enumerate(items)]
    cuda_items = [on_cuda.prepare(it, i) for i, it in enumerate(items)]
    worst_pil, worst_cpu, means = 0.0, 0.0, []
    for w, c, g in zip(want, cpu_items, cuda_items):
        assert g.cost == w.cost and g.meta.get("grid_thw") == w.meta.get("grid_thw")
        pixels = _device_pixels(on_cuda, [g])
        pixels = pixels if exact.native else pixels[0]
        ref_cpu = _device_pixels(on_cpu, [c])
        ref_cpu = ref_cpu if exact.native else ref_cpu[0]
        d_pil = (pixels - w.inputs["pixel_values"]).abs()
        d_cpu = (pixels - ref_cpu).abs()
        worst_pil, worst_cpu = max(worst_pil, d_pil.max().item()), max(worst_cpu, d_cpu.max().item())
        means.append(d_pil.mean().item())
        assert d_pil.max().item() <= MAX_LEVELS * _levels(exact) + 1e-6 and d_pil.mean().item() <= MAX_MEAN
        assert d_cpu.max().item() <= 1 * _levels(exact) + 1e-6 and d_cpu.mean().item() <= 1e-4
    want_e = exact.encode(want)
    got_e = on_cuda.encode(cuda_items)
    assert all(e.embedding.device.type == "cuda" for e in got_e)  # answers stay on the device
    rel = max(((g.embedding.cpu() - w.embedding).abs().max() / w.embedding.abs().max()).item()
              for g, w in zip(got_e, want_e))
    assert rel <= MAX_EMBEDDING_REL
    for _ in range(2):  # once through each of HostStaging's two buffers at this batch's size
        on_cuda.encode(cuda_items)
    grown = on_cuda.staging.grown
    for _ in range(3):
        on_cuda.encode(cuda_items)
    torch.cuda.synchronize()
    assert on_cuda.staging.grown == grown  # warm: the pinned buffers are reused, not grown
    print(f"\n{name} on {torch.cuda.get_device_name()}: CUDA device path vs PIL path max |Δ| {worst_pil:.4f} "
          f"({worst_pil / _levels(exact):.2f} levels), mean |Δ| {np.mean(means):.2e}; vs the device path on "
          f"CPU max |Δ| {worst_cpu:.4f}; embeddings max |Δ| / max |e| {rel:.2e}")
