"""M-RoPE positions equal Qwen2-VL's get_rope_index, for one and several images of different sizes."""

import pytest
import torch
from transformers import Qwen2VLConfig, Qwen2VLModel

from services.llm.mrope import mrope_positions

IMG = 5


@pytest.fixture(scope="module")
def hf_model():
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=8, hidden_size=16, num_heads=2), image_token_id=IMG,
    )
    return Qwen2VLModel(config)


@pytest.mark.parametrize("layout", [
    [("text", 3), ((1, 4, 6),), ("text", 2)],
    [((1, 2, 2),), ("text", 4)],
    [("text", 1), ((1, 4, 4),), ("text", 3), ((1, 6, 2),), ("text", 5), ((1, 2, 8),), ("text", 1)],
])
def test_positions_equal_hf_get_rope_index(hf_model, layout):
    ids, spans, types, grids = [], [], [], []
    for part in layout:
        if part[0] == "text":
            ids += [7] * part[1]
            types += [0] * part[1]
        else:
            grid = part[0]
            n = grid[0] * grid[1] // 2 * grid[2] // 2
            spans.append((len(ids), grid))
            grids.append(grid)
            ids += [IMG] * n
            types += [1] * n
    ref, ref_delta = hf_model.get_rope_index(
        torch.tensor([ids]), mm_token_type_ids=torch.tensor([types]), image_grid_thw=torch.tensor(grids))
    ours, delta = mrope_positions(len(ids), spans, spatial_merge=2)
    assert torch.equal(ours, ref[:, 0])
    assert delta == ref_delta.item()


def test_text_only_is_plain_positions():
    pos, delta = mrope_positions(5, [], 2)
    assert torch.equal(pos, torch.arange(5).expand(3, -1)) and delta == 0
