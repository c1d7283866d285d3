"""Vision towers against their transformers references (CPU, FP32, tiny random checkpoints).

Both checkpoint layouts load: the hub layout ``visual.*`` that save_pretrained writes and
the transformers-5 layout ``model.visual.*`` (the reference's state_dict, sharded so the
vision tensors sit in their own file: only that file may be opened).
"""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from modalmesh import pb
from modalmesh.testing import tiny
from modalmesh.weights import CheckpointReader, MissingWeightsError
from services.vision_encoder.model import build_encoder_model
from services.vision_encoder.models import Qwen2VisionTransformer

TOL = 1e-4
SIZES = [(56, 56), (100, 150), (224, 180), (40, 300)]  # (h, w): grids 4x4 .. 16x12, odd merged grids


def _ref_class(name):
    import transformers

    return {"qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
            "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
            "siglip": transformers.SiglipVisionModel}[name]


def _write_sharded(state: dict, out, vision_prefix: str) -> None:
    """Two shards + index: vision tensors in one file, everything else in the other."""
    shards = {"model-vision.safetensors": {}, "model-rest.safetensors": {}}
    for k, v in state.items():
        shards["model-vision.safetensors" if k.startswith(vision_prefix) else "model-rest.safetensors"][k] = (
            v.detach().contiguous().clone())
    weight_map = {}
    for file, tensors in shards.items():
        if tensors:
            save_file(tensors, str(out / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _split_qkv(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if ".attn.qkv." in k:
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), v.chunk(3, dim=0)):
                out[k.replace(".attn.qkv.", f".attn.{part}.")] = chunk
        else:
            out[k.replace(".attn.proj.", ".attn.out_proj.")] = v
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> {layout: dir} and the FP32 reference models."""
    root = tmp_path_factory.mktemp("vision")
    dirs, refs = {}, {}
    for name, alt_prefix in (("qwen2_vl", ""), ("qwen2_5_vl", ""), ("siglip", "vision_model.")):
        hub = tiny.ensure(name, root)
        ref = _ref_class(name).from_pretrained(hub, dtype=torch.float32).eval()
        alt = root / f"{name}_alt"
        alt.mkdir()
        for f in ("config.json", "preprocessor_config.json"):
            shutil.copy(hub / f, alt / f)
        state = {alt_prefix + k: v for k, v in ref.state_dict().items()}
        _write_sharded(state, alt, "model.visual." if name != "siglip" else alt_prefix)
        dirs[name] = {"hub": hub, "alt": alt}
        refs[name] = ref
        if name == "qwen2_5_vl":  # converted checkpoints spell attention q/k/v_proj + out_proj
            split = root / f"{name}_split"
            split.mkdir()
            for f in ("config.json", "preprocessor_config.json"):
                shutil.copy(hub / f, split / f)
            _write_sharded(_split_qkv(ref.state_dict()), split, "model.visual.")
            dirs[name]["split"] = split
    return dirs, refs


def _images(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def _item(image: Image.Image) -> pb.EncodeItem:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return pb.EncodeItem(data=buf.getvalue())


def _hf_qwen(ref, path, images):
    from transformers import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil.from_pretrained(path)
    batch = proc(images=images, return_tensors="pt")
    with torch.no_grad():
        out = ref.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"]).pooler_output
    sizes = (batch["image_grid_thw"].prod(-1) // 4).tolist()
    return list(out.split(sizes)), [tuple(g) for g in batch["image_grid_thw"].tolist()]


@pytest.mark.parametrize("name, layout", [("qwen2_vl", "hub"), ("qwen2_vl", "alt"), ("qwen2_5_vl", "hub"),
                                          ("qwen2_5_vl", "alt"), ("qwen2_5_vl", "split")])
def test_qwen_tower_matches_reference_single_and_mixed_batch(checkpoints, name, layout):
    dirs, refs = checkpoints
    model = build_encoder_model(dirs[name][layout], device="cpu", dtype=torch.float32)
    images = _images(SIZES, seed=1)
    want, grids = _hf_qwen(refs[name], dirs[name]["hub"], images)
    prepared = [model.prepare(_item(im), i) for i, im in enumerate(images)]
    # One image per forward, then all four resolutions in one packed forward.
    singles = [model.encode([p])[0] for p in prepared]
    mixed = model.encode(prepared)
    for got_list in (singles, mixed):
        for got, ref_rows, grid in zip(got_list, want, grids):
            assert got.grid_thw == grid
            assert got.embedding.shape == (grid[0] * grid[1] * grid[2] // 4, 64)
            assert got.embedding.dtype == torch.float32
            assert (got.embedding - ref_rows).abs().max().item() <= TOL
    # Reference on the mixed batch equals the reference on single images (sanity of the oracle).
    one, _ = _hf_qwen(refs[name], dirs[name]["hub"], images[1:2])
    assert (one[0] - want[1]).abs().max().item() <= TOL


def test_qwen2_5_window_attention_is_exercised(checkpoints):
    dirs, _ = checkpoints
    model = build_encoder_model(dirs["qwen2_5_vl"]["hub"], device="cpu", dtype=torch.float32)
    assert model.tower.window == 2 and model.tower.full_attention_layers == {1, 3}
    from services.vision_encoder.models.qwen2_5_vl import batch_windows

    order, lengths = batch_windows([(1, 6, 10), (1, 4, 4)], merge=2, window=2)
    # 3x5 merged grid -> windows of 2x2, 2x2, 2x1, 1x2, 1x2, 1x1; then the 2x2 grid is one window.
    assert [n // 4 for n in lengths] == [4, 4, 2, 2, 2, 1, 4]
    assert sorted(order.tolist()) == list(range(19))


@pytest.mark.parametrize("layout", ["hub", "alt"])
def test_only_vision_tensors_are_opened(checkpoints, layout):
    dirs, _ = checkpoints
    path = dirs["qwen2_vl"][layout]
    reader = CheckpointReader(path, prefixes=Qwen2VisionTransformer.checkpoint_prefixes)
    names = list(reader.keys())
    assert names and all(n.startswith(("visual.", "model.visual.")) for n in names)
    for _ in reader:
        pass
    if layout == "alt":
        assert [p.name for p in reader.opened_files] == ["model-vision.safetensors"]
    model = build_encoder_model(path, device="cpu", dtype=torch.float32)
    assert all(n.startswith(("visual.", "model.visual.")) for n in model.load_report.loaded)
    assert not model.load_report.skipped


@pytest.mark.parametrize("layout", ["hub", "alt"])
def test_siglip_patch_and_pooled_match_reference(checkpoints, layout):
    from transformers import SiglipImageProcessorPil

    dirs, refs = checkpoints
    images = _images([(32, 32), (50, 70), (20, 90)], seed=2)
    batch = SiglipImageProcessorPil.from_pretrained(dirs["siglip"]["hub"])(images=images, return_tensors="pt")
    with torch.no_grad():
        ref = refs["siglip"](pixel_values=batch["pixel_values"])
    for output, want in (("patch", ref.last_hidden_state), ("pooled", ref.pooler_output[:, None]),
                         ("both", torch.cat((ref.last_hidden_state, ref.pooler_output[:, None]), 1))):
        model = build_encoder_model(dirs["siglip"][layout], device="cpu", dtype=torch.float32,
                                    options={"siglip_output": output})
        prepared = [model.prepare(_item(im), i) for i, im in enumerate(images)]
        got = model.encode(prepared)
        assert [g.embedding.shape for g in got] == [want.shape[1:]] * 3
        assert model.rows_for() == want.shape[1]
        for g, w in zip(got, want):
            assert (g.embedding - w).abs().max().item() <= TOL
        if output == "patch":  # the pooling head is not built, its tensors are skipped by rule
            assert not hasattr(model.tower, "head") and model.load_report.skipped


def test_siglip_image_size_not_a_multiple_of_the_patch(tmp_path):
    """so400m-384 has 384 / 14 = 27.4 patches a side: the last 6 pixels fall off, as in a valid conv."""
    from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    config = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                image_size=38, patch_size=8, initializer_range=0.2)
    ref = SiglipVisionModel(config).eval()
    ref.save_pretrained(tmp_path)
    SiglipImageProcessorPil(size={"height": 38, "width": 38}).save_pretrained(tmp_path)
    images = _images([(38, 38), (64, 30)], seed=4)
    pv = SiglipImageProcessorPil.from_pretrained(tmp_path)(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = ref(pixel_values=pv)
    want = torch.cat((out.last_hidden_state, out.pooler_output[:, None]), 1)
    # the encoder MLPs' 64 wide as the checkpoint has them, and padded to 128 with zero weights (the default)
    for pad_to, width in ((1, 64), (None, 128)):
        model = build_encoder_model(tmp_path, device="cpu", dtype=torch.float32,
                                    options={"siglip_output": "both", "siglip_mlp_pad_to": pad_to})
        assert model.tower.encoder.layers[0].mlp.fc1.weight.shape == (width, 32)
        got = model.encode([model.prepare(_item(im), i) for i, im in enumerate(images)])
        assert got[0].embedding.shape == (17, 32)
        for g, w in zip(got, want):
            assert (g.embedding - w).abs().max().item() <= TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "siglip"])
def test_bf16_cuda_parity(checkpoints, name):
    dirs, refs = checkpoints
    ref = _ref_class(name).from_pretrained(dirs[name]["hub"], dtype=torch.bfloat16).cuda().eval()
    model = build_encoder_model(dirs[name]["hub"], device="cuda", dtype=torch.bfloat16)
    images = _images(SIZES if name != "siglip" else [(32, 32), (64, 48)], seed=3)
    got = model.encode([model.prepare(_item(im), i) for i, im in enumerate(images)])
    if name == "siglip":
        from transformers import SiglipImageProcessorPil

        pv = SiglipImageProcessorPil.from_pretrained(dirs[name]["hub"])(images=images, return_tensors="pt")
        with torch.no_grad():
            want = ref(pixel_values=pv["pixel_values"].cuda().bfloat16()).last_hidden_state.cpu()
    else:
        from transformers import Qwen2VLImageProcessorPil

        batch = Qwen2VLImageProcessorPil.from_pretrained(dirs[name]["hub"])(images=images, return_tensors="pt")
        with torch.no_grad():
            out = ref.model.visual(batch["pixel_values"].cuda().bfloat16(),
                                   grid_thw=batch["image_grid_thw"].cuda()).pooler_output.cpu()
        want = out.split((batch["image_grid_thw"].prod(-1) // 4).tolist())
    for g, w in zip(got, want):
        assert g.embedding.dtype == torch.bfloat16
        scale = w.float().abs().max().item()
        assert (g.embedding.float().cpu() - w.float()).abs().max().item() <= 0.05 * max(scale, 1.0)


def test_full_siglip_model_checkpoint_loads_only_the_vision_tower(tmp_path):
    """A SiglipModel (text + vision) checkpoint: vision_config, vision_model.* tensors; text_model.* unopened."""
    from transformers import SiglipConfig, SiglipImageProcessorPil, SiglipModel

    torch.manual_seed(1)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=32,
                  patch_size=8)
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    ref = SiglipModel(SiglipConfig(text_config=text, vision_config=vision)).eval()
    ref.save_pretrained(tmp_path)
    SiglipImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(tmp_path)
    model = build_encoder_model(tmp_path, device="cpu", dtype=torch.float32)
    assert model.architecture == "SiglipModel"
    assert all(n.startswith("vision_model.") for n in model.load_report.loaded)
    image = _images([(40, 40)], seed=5)[0]
    pv = SiglipImageProcessorPil.from_pretrained(tmp_path)(images=[image], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = ref.vision_model(pixel_values=pv).last_hidden_state[0]
    got = model.encode([model.prepare(_item(image), 0)])[0].embedding
    assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize("name, gone, param", [
    ("qwen2_vl", "visual.blocks.1.norm2.weight", r"blocks\.1\.norm2\.weight"),
    ("siglip", "post_layernorm.bias", r"post_layernorm\.bias"),
])
def test_a_missing_tower_tensor_is_named(checkpoints, tmp_path, name, gone, param):
    dirs, _ = checkpoints
    dst = tiny.without_tensors(dirs[name]["hub"], tmp_path / name, gone)
    with pytest.raises(MissingWeightsError, match=param):
        build_encoder_model(dst, device="cpu", dtype=torch.float32)
