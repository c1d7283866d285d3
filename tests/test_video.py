"""Video for Qwen2-VL in the LLM service: a precomputed video embedding (grid_thw with t > 1) spliced at
<|video_pad|> with M-RoPE positions as transformers computes them, against HF's video path (pixel_values_videos,
video_grid_thw) on the same patches: greedy tokens equal, logprobs within 1e-4 (tiny random Qwen2-VL, fp32, CPU).
No encoder takes raw video yet, and Qwen2.5-VL (time-scaled positions) is refused."""

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
        yield dict(vl=vl, llm=procs[0], llm25=procs[1])
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
        # A grid that does not describe the rows, and raw video, are refused by name.
        for bad, words in ((pb.MultimodalItem(modality=pb.VIDEO, embedding=pb.Embedding(
                embedding=to_proto(video), grid_thw=[3, 4, 6])), "grid_thw [3, 4, 6] does not describe its 12 rows"),
                           (pb.MultimodalItem(modality=pb.VIDEO, input=pb.EncodeItem(data=b"x")),
                            "precomputed embedding only")):
            with pytest.raises(grpc.RpcError) as err:
                _generate(stub, text=text, items=[bad], sampling=sampling)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()


def test_qwen2_5_vl_video_is_refused_until_its_time_scaled_positions_are_taken(served):
    item = pb.MultimodalItem(modality=pb.VIDEO, embedding=pb.Embedding(
        embedding=to_proto(torch.zeros(12, 64)), grid_thw=[2, 4, 6]))
    with grpc.insecure_channel(served["llm25"].target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            _generate(pb.llm_pb2_grpc.LLMServiceStub(channel), text="<|video_pad|>", items=[item],
                      sampling=pb.SamplingParams(max_tokens=2))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "takes no VIDEO input" in err.value.details()
