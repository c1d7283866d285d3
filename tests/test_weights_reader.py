"""CheckpointReader: layouts, lazy key-filtered shard opening, and clear errors for broken files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

from modalmesh.weights import CheckpointError, CheckpointReader


@pytest.fixture(scope="module")
def qwen2_vl_sharded(tmp_path_factory):
    """A tiny real Qwen2-VL saved in small shards: vision tower and LM in different files."""
    path = tmp_path_factory.mktemp("qwen2vl")
    torch.manual_seed(0)
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2),
        image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63,
    )
    model = Qwen2VLForConditionalGeneration(cfg)
    model.save_pretrained(path, max_shard_size="20KB")
    return path


def _index(path):
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def test_prefix_filter_opens_only_the_shards_holding_wanted_tensors(qwen2_vl_sharded):
    weight_map = _index(qwen2_vl_sharded)
    visual_shards = {qwen2_vl_sharded / f for k, f in weight_map.items() if k.startswith("visual.")}
    all_shards = {qwen2_vl_sharded / f for f in weight_map.values()}
    assert visual_shards != all_shards  # the test means something only if some shards are LM-only

    reader = CheckpointReader(qwen2_vl_sharded, prefixes=("visual.",))
    assert reader.opened_files == []  # the index answers which keys exist
    names = sorted(reader.keys())
    assert names == sorted(k for k in weight_map if k.startswith("visual."))
    tensors = dict(reader.iter_tensors())
    assert sorted(tensors) == names
    assert set(reader.opened_files) == visual_shards

    lm = CheckpointReader(qwen2_vl_sharded, prefixes=("model.", "lm_head."))
    lm_names = [name for name, _ in lm]
    assert not any(n.startswith("visual.") for n in lm_names) and "lm_head.weight" in lm_names
    lm_shards = {qwen2_vl_sharded / f for k, f in weight_map.items() if not k.startswith("visual.")}
    assert set(lm.opened_files) == lm_shards


def test_tensors_equal_the_saved_model(qwen2_vl_sharded):
    reference = Qwen2VLForConditionalGeneration.from_pretrained(qwen2_vl_sharded)
    expected = {"visual.blocks.0.attn.qkv.weight": reference.model.visual.blocks[0].attn.qkv.weight,
                "model.layers.1.mlp.up_proj.weight": reference.model.language_model.layers[1].mlp.up_proj.weight}
    reader = CheckpointReader(qwen2_vl_sharded)
    for name, tensor in expected.items():
        torch.testing.assert_close(reader.get_tensor(name), tensor.detach(), atol=0, rtol=0)
    infos = reader.infos()
    assert reader.total_bytes() == sum(i.nbytes for i in infos.values())
    assert infos["visual.blocks.0.attn.qkv.weight"].shape == (96, 32)


def test_missing_shard_file_is_named(qwen2_vl_sharded, tmp_path):
    for f in qwen2_vl_sharded.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    shard = _index(tmp_path)["lm_head.weight"]
    (tmp_path / shard).unlink()
    reader = CheckpointReader(tmp_path, prefixes=("lm_head.",))
    with pytest.raises(CheckpointError, match=f"{shard}, which does not exist"):
        list(reader)


def test_index_entry_pointing_at_the_wrong_shard(tmp_path):
    save_file({"a.weight": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": torch.ones(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                            "b.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"maps 'b.weight' to shard model-00001-of-00002.safetensors.*no such tensor"):
        dict(CheckpointReader(tmp_path))


def test_unknown_name_suggests_the_nearest(tmp_path):
    save_file({"model.norm.weight": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.nrom.weight'.*nearest: model.norm.weight"):
        CheckpointReader(tmp_path).get_tensor("model.nrom.weight")


def test_truncated_file_is_reported_as_truncated(tmp_path):
    save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        list(CheckpointReader(tmp_path))


def _raw_safetensors(path, header: dict, payload: bytes):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + payload)


def test_unreadable_dtype_is_named(tmp_path):
    _raw_safetensors(tmp_path / "model.safetensors",
                     {"w": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, b"\0\0")
    with pytest.raises(CheckpointError, match=r"tensor 'w' has dtype 'F4', which this build cannot read"):
        CheckpointReader(tmp_path).keys()


def test_corrupt_header_is_reported(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"{not json!")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        CheckpointReader(tmp_path).keys()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        CheckpointReader(tmp_path).keys()
    _raw_safetensors(tmp_path / "model.safetensors",
                     {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(CheckpointError, match="needs 16 bytes but its offsets span 8"):
        CheckpointReader(tmp_path).keys()


def test_no_weights_in_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no weights found"):
        CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        CheckpointReader(tmp_path / "absent")


def test_bin_is_a_last_resort_loaded_without_code(tmp_path):
    state = {"a.weight": torch.randn(3, 2), "b.bias": torch.randn(3)}
    torch.save(state, tmp_path / "pytorch_model.bin")
    torch.save({"not": "weights"}, tmp_path / "training_args.bin")  # trainers leave these around
    reader = CheckpointReader(tmp_path)
    assert reader.format == "pickle"
    got = dict(reader.iter_tensors())
    assert sorted(got) == sorted(state)
    for k in state:
        torch.testing.assert_close(got[k], state[k], atol=0, rtol=0)
    # safetensors wins when both exist
    save_file({"c": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    assert CheckpointReader(tmp_path).keys() == ["c"]


class NotAllowed:  # pickled by reference: weights_only loading must refuse it
    pass


def test_bin_with_arbitrary_objects_is_refused(tmp_path):
    torch.save({"w": torch.ones(1), "evil": NotAllowed()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="cannot load as a PyTorch checkpoint"):
        list(CheckpointReader(tmp_path))


def test_sharded_bin_index(tmp_path):
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": torch.zeros(2)}, tmp_path / "pytorch_model-00002-of-00002.bin")
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {
        "a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}}))
    reader = CheckpointReader(tmp_path, prefixes=("b",))
    assert [n for n, _ in reader] == ["b"]
    assert [p.name for p in reader.opened_files] == ["pytorch_model-00002-of-00002.bin"]


def test_diffusers_subfolder_layout(tmp_path):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=4,
                        layers_per_block=1)
    vae.save_pretrained(tmp_path / "vae")
    (tmp_path / "model_index.json").write_text("{}")
    reader = CheckpointReader(tmp_path, subfolder="vae", prefixes=("decoder.",))
    assert [p.name for p in reader.files()] == ["diffusion_pytorch_model.safetensors"]
    got = dict(reader.iter_tensors())
    expected = {k: v for k, v in vae.state_dict().items() if k.startswith("decoder.")}
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, atol=0, rtol=0)


def test_variant_files(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    save_file({"w": torch.ones(2, dtype=torch.float16)}, str(tmp_path / "diffusion_pytorch_model.fp16.safetensors"))
    assert CheckpointReader(tmp_path).get_tensor("w").dtype == torch.float32
    assert CheckpointReader(tmp_path, variant="fp16").get_tensor("w").dtype == torch.float16
