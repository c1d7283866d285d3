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


def _chunk(prompt_ids, outputs, start, length, prompt):
    import types

    from services.llm.scheduler import Sequence

    seq = Sequence("s", list(prompt_ids), 64, state=types.SimpleNamespace(prompt=prompt))
    seq.output_ids = list(outputs)
    return types.SimpleNamespace(seq=seq, start=start, length=length)


def test_a_packed_steps_positions_are_each_chunks_own_in_order():
    """`PackedPositions` against the positions token by token: a prompt chunk's M-RoPE columns, a
    generated token's 1-D position shifted by its prompt's delta on all three axes, a text-only prompt's
    plain positions, and a chunk that crosses from prompt into output; padding is 0."""
    from services.llm.inputs import PreparedPrompt
    from services.llm.runner import PackedPositions

    image = mrope_positions(20, [(2, (1, 8, 8))], 2)  # 16 image tokens from index 2
    image_prompt = PreparedPrompt(list(range(20)), mrope=image[0], mrope_delta=image[1])
    text_prompt = PreparedPrompt(list(range(7)))
    chunks = [
        _chunk(range(20), [], 0, 12, image_prompt),       # a prompt chunk inside the image
        _chunk(range(20), [5] * 3, 22, 1, image_prompt),  # a decode row
        _chunk(range(7), [], 3, 4, text_prompt),          # text only
        _chunk(range(20), [5], 17, 4, image_prompt),      # prompt tail + the first output
    ]

    def expected(chunk):
        prompt, n = chunk.seq.state.prompt, len(chunk.seq.prompt_ids)
        cols = []
        for i in range(chunk.start, chunk.start + chunk.length):
            if prompt.mrope is None:
                cols.append([i] * 3)
            elif i < n:
                cols.append(prompt.mrope[:, i].tolist())
            else:
                cols.append([i + prompt.mrope_delta] * 3)
        return cols

    packed = PackedPositions(mrope=True)
    for c in chunks:
        packed.add(c)
    packed.pad(3)
    want = [col for c in chunks for col in expected(c)] + [[0, 0, 0]] * 3
    got = packed.tensor()
    assert got.dtype == torch.int64 and got.shape == (3, len(want))
    assert got.t().tolist() == want
    assert image[1] != 0  # the delta is exercised
    # An M-RoPE model whose step holds text-only prompts: nothing to patch in, the three axes equal.
    text = PackedPositions(mrope=True)
    text.add(chunks[2])
    text.pad(1)
    assert text.tensor().t().tolist() == expected(chunks[2]) + [[0, 0, 0]]
    # A model without M-RoPE: plain 1-D positions, whatever the prompt holds.
    flat = PackedPositions(mrope=False)
    for c in chunks:
        flat.add(c)
    assert flat.tensor().tolist() == [i for c in chunks for i in range(c.start, c.start + c.length)]
