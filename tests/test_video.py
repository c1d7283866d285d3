"""Video in the LLM service: a video embedding (grid_thw with t > 1) spliced at <|video_pad|> with M-RoPE positions
as transformers computes them. Here: a precomputed embedding against HF's video path (pixel_values_videos,
video_grid_thw) on the same patches, greedy tokens equal and logprobs within 1e-4 (tiny random Qwen2-VL, fp32, CPU);
positions against HF's get_rope_index for Qwen2-VL and Qwen2.5-VL (time-scaled by second_per_grid_ts), images,
videos and text mixed. Raw video files through the whole stack: tests/test_video_stack.py."""

from __future__ import annotations

import grpc
import pytest
import torch

from modalmesh import pb
from modalmesh.ops.launcher import ServiceProcess
from modalmesh.rpc.codec import to_proto
from modalmesh.testing import tiny

COMMON = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--device", "cpu", "--grace-period", "10",
          "--kv-cache-tokens", "2048"]
N = 10


def _generate(stub, **request):
    ids, lps = [], []
    for r in stub.Generate(pb.GenerateRequest(**request), timeout=120):
        ids += r.token_ids
        lps += r.logprobs
    return ids, lps


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("video")
    vl, vl25 = tiny.ensure("qwen2_vl", root), tiny.ensure("qwen2_5_vl", root)
    procs = [ServiceProcess("llm", [*COMMON, "--model", str(d)]).start() for d in (vl, vl25)]
    try:
        for p in procs:
            p.wait_serving(timeout=180)
        yield dict(vl=vl, vl25=vl25, llm=procs[0], llm25=procs[1])
    finally:
        for p in procs:
            p.terminate(timeout=30)


def test_qwen2_vl_video_embedding_equals_hf_video_generate(served):
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    ref = Qwen2VLForConditionalGeneration.from_pretrained(served["vl"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(served["vl"])
    vision = ref.config.vision_config
    # Four frames as the processor lays them out: 2 temporal patches of 2 frames, a 4 x 6 patch grid each.
    grid = torch.tensor([[2, 4, 6]])
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixels = torch.randn(int(grid.prod()), width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        video = ref.model.get_video_features(pixels, video_grid_thw=grid)
        video = torch.cat(list(getattr(video, "pooler_output", video)))
    rows = int(grid.prod()) // 4
    assert video.shape[0] == rows == 12
    text = "Watch <|vision_start|><|video_pad|><|vision_end|> then tell me what moved."
    expanded = text.replace("<|video_pad|>", "<|video_pad|>" * rows)
    input_ids = tok(expanded, return_tensors="pt")["input_ids"]
    types = (input_ids == ref.config.video_token_id).int() * 2  # what the processor returns: video = 2
    with torch.no_grad():
        out = ref.generate(input_ids=input_ids, pixel_values_videos=pixels, video_grid_thw=grid,
                           mm_token_type_ids=types, max_new_tokens=N, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)
    want = out.sequences[0, input_ids.shape[1]:].tolist()
    want_lps = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, want)]
    item = pb.MultimodalItem(modality=pb.VIDEO, embedding=pb.Embedding(
        embedding=to_proto(video), grid_thw=[2, 4, 6], num_placeholder_tokens=rows))
    with grpc.insecure_channel(served["llm"].target) as channel:
        stub = pb.llm_pb2_grpc.LLMServiceStub(channel)
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=N, logprobs=1, ignore_eos=True)
        got, lps = _generate(stub, text=text, items=[item], sampling=sampling)
        assert got == want and len(set(got)) > 3
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), atol=1e-4, rtol=0)
        # The temporal axis matters: the same rows read as one 4 x 12 frame (t = 1) answer otherwise.
        flat = pb.MultimodalItem(modality=pb.VIDEO, embedding=pb.Embedding(
            embedding=to_proto(video), grid_thw=[1, 4, 12], num_placeholder_tokens=rows))
        _, flat_lps = _generate(stub, text=text, items=[flat], sampling=sampling)
        assert max(abs(a - b) for a, b in zip(flat_lps, lps)) > 1e-3
        # A grid that does not describe the rows, and a raw video item holding no video file, are refused by name.
        for bad, words in ((pb.MultimodalItem(modality=pb.VIDEO, embedding=pb.Embedding(
                embedding=to_proto(video), grid_thw=[3, 4, 6])), "grid_thw [3, 4, 6] does not describe its 12 rows"),
                           (pb.MultimodalItem(modality=pb.VIDEO, input=pb.EncodeItem(data=b"x")),
                            "a raw VIDEO item takes EncodeItem.video (an encoded video file), not data"),
                           (pb.MultimodalItem(modality=pb.IMAGE, input=pb.EncodeItem(video=b"x")),
                            "a raw IMAGE item takes no video")):
            with pytest.raises(grpc.RpcError) as err:
                _generate(stub, text=text, items=[bad], sampling=sampling)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
        # A raw video needs the vision encoder, which this LLM was started without.
        with pytest.raises(grpc.RpcError) as err:
            _generate(stub, text=text, items=[pb.MultimodalItem(modality=pb.VIDEO, input=pb.EncodeItem(video=b"x"))],
                      sampling=sampling)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--vision-encoder" in err.value.details()


def test_qwen2_5_vl_video_needs_its_seconds_per_grid_step(served):
    """Qwen2.5-VL's video positions are scaled by the seconds a temporal step spans: a precomputed video without
    them (or with a nonsense value) is refused by name, never placed at one temporal position."""
    with grpc.insecure_channel(served["llm25"].target) as channel:
        stub = pb.llm_pb2_grpc.LLMServiceStub(channel)
        for seconds in (0.0, -1.0, float("nan"), 1e9):
            item = pb.MultimodalItem(modality=pb.VIDEO, embedding=pb.Embedding(
                embedding=to_proto(torch.zeros(12, 64)), grid_thw=[2, 4, 6], second_per_grid_t=seconds))
            with pytest.raises(grpc.RpcError) as err:
                _generate(stub, text="<|video_pad|>", items=[item], sampling=pb.SamplingParams(max_tokens=2))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "second_per_grid_t" in err.value.details(), err.value.details()
        item = pb.MultimodalItem(modality=pb.VIDEO, embedding=pb.Embedding(
            embedding=to_proto(torch.zeros(12, 64)), grid_thw=[2, 4, 6], second_per_grid_t=0.5))
        ids, _ = _generate(stub, text="<|video_pad|>", items=[item], sampling=pb.SamplingParams(max_tokens=2))
        assert len(ids) == 2
        # An hour a step: its second step sits at position 14400 (tokens_per_second 4), past the model's length
        # (the rotary tables stop there): refused, not run.
        item.embedding.second_per_grid_t = 3600.0
        with pytest.raises(grpc.RpcError) as err:
            _generate(stub, text="<|video_pad|>", items=[item], sampling=pb.SamplingParams(max_tokens=2))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "video positions run" in err.value.details() and "position 14" in err.value.details()


# ---- positions against transformers' get_rope_index ----------------------------------------------------
IMAGE, VIDEO = 1, 2  # mm_token_type_ids


def _mixed_prompt(cfg, hf_cfg, items):
    """Token ids: text, then each (modality, grid) as its expanded placeholder run between text."""
    from services.llm.embedding import Embedding

    ids, types, embeddings = [7, 8, 9], [0, 0, 0], []
    for n, (modality, grid, seconds) in enumerate(items):
        rows = grid[0] * (grid[1] // 2) * (grid[2] // 2)
        token = cfg.image_token_id if modality == pb.IMAGE else cfg.video_token_id
        ids += [hf_cfg.vision_start_token_id] + [token] * rows + [hf_cfg.vision_end_token_id] + [11 + n] * (n + 2)
        types += [0] + [IMAGE if modality == pb.IMAGE else VIDEO] * rows + [0] * (n + 3)
        embeddings.append(Embedding(torch.zeros(rows, cfg.hidden_size), modality, tuple(grid),
                                    second_per_grid_t=seconds))
    return ids, types, embeddings


# (modality, grid_thw, seconds per temporal step): an image, videos of several lengths and rates; a video whose
# time-scaled positions run past its rows (1 x 2 merged patches, 5 s a step), and 2/3 s (float32 truncation).
MIXED = [(pb.VIDEO, (3, 4, 6), 2 / 3), (pb.IMAGE, (1, 4, 4), 0.0), (pb.VIDEO, (2, 2, 4), 5.0),
         (pb.VIDEO, (4, 6, 4), 0.8125), (pb.IMAGE, (1, 2, 6), 0.0), (pb.VIDEO, (5, 2, 2), 0.5)]


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_video_positions_equal_hf_get_rope_index(served, name, tmp_path):
    """Mixed images, videos and text, in a left-padded batch of two: HF's positions and delta, ours per prompt."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    from modalmesh.config import ModelConfig
    from services.llm.inputs import splice_items

    path = served["vl" if name == "qwen2_vl" else "vl25"]
    cls = Qwen2VLForConditionalGeneration if name == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration
    ref = cls.from_pretrained(path, dtype=torch.float32).eval()
    cfg = ModelConfig.from_hf(path, part="text")
    hf_cfg = AutoConfig.from_pretrained(path)
    tokens_per_second = hf_cfg.vision_config.tokens_per_second if name == "qwen2_5_vl" else None
    prompts = [_mixed_prompt(cfg, hf_cfg, MIXED), _mixed_prompt(cfg, hf_cfg, MIXED[2:3])]
    width = max(len(ids) for ids, _, _ in prompts)
    input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids, _, _ in prompts])
    types = torch.tensor([[0] * (width - len(t)) + t for _, t, _ in prompts])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _, _ in prompts])
    items = MIXED + MIXED[2:3]
    image_grids = torch.tensor([g for m, g, _ in items if m == pb.IMAGE])
    video_grids = torch.tensor([g for m, g, _ in items if m == pb.VIDEO])
    kwargs = {}
    if name == "qwen2_5_vl":  # as the processor hands them over: a float32 tensor
        kwargs["second_per_grid_ts"] = torch.tensor([s for m, _, s in items if m == pb.VIDEO])
    want, want_delta = ref.model.get_rope_index(input_ids, types, image_grids, video_grids, attention_mask=mask,
                                                **kwargs)
    scaled = False
    for b, (ids, _, embeddings) in enumerate(prompts):
        prompt = splice_items(ids, embeddings, cfg, uses_mrope=True, spatial_merge=2,
                              tokens_per_second=tokens_per_second)
        assert prompt.token_ids == ids
        assert torch.equal(prompt.mrope, want[:, b, width - len(ids):]), (name, b)
        assert prompt.mrope_delta == int(want_delta[b])
        scaled |= prompt.mrope_delta > 0
    assert scaled == (name == "qwen2_5_vl")  # 5 s steps outrun their rows: positions ahead of the tokens
