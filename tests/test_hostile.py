"""Hostile input and faults, one test per defect of the hardening issue: each fails on the code before its fix.

Every service runs on 127.0.0.1 with ephemeral ports and is stopped by its test.
"""

import time
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from modalmesh import pb, tiny
from modalmesh.rpc.codec import to_proto
from tests.test_llm_service import LLM, greedy


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile-ckpts")


# ---- the LLM -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(ckpts):
    server = LLM(tiny.ensure("qwen2", ckpts), "--max-stop-strings", "4", "--max-stop-string-chars", "16",
                 "--max-stop-token-ids", "3", "--max-items-per-request", "2")
    yield server
    server.close()


def _refused(llm, **kw):
    with pytest.raises(grpc.RpcError) as err:
        llm.generate(**kw)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details()


@pytest.mark.parametrize("sampling, flag", [
    (greedy(4, stop=[f"s{i}" for i in range(100_000)]), "--max-stop-strings"),
    (greedy(4, stop=["x" * 17]), "--max-stop-string-chars"),
    (greedy(4, stop_token_ids=[1, 2, 3, 4]), "--max-stop-token-ids"),
])
def test_stop_lists_past_the_limits_are_refused_naming_the_flag(llm, sampling, flag):
    # 100,000 stop strings once took every other client from 0.1 s to 26-54 s (checked per token).
    assert flag in _refused(llm, text="hi", sampling=sampling)
    ids, _, _ = llm.generate(text="still fine", sampling=greedy(3, stop=["zz", "yy", "xx", "ww"]))
    assert len(ids) == 3


def test_too_many_items_are_refused_before_any_encoder_is_asked(llm):
    item = pb.MultimodalItem(modality=pb.IMAGE, input=pb.EncodeItem(data=b"png"))
    # No --vision-encoder: past the limit the count is the error, not the missing encoder.
    assert "--max-items-per-request" in _refused(llm, text="a", items=[item] * 3)
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=[pb.ContentPart(item=item)] * 3)])
    assert "--max-items-per-request" in _refused(llm, chat=chat)


def test_nan_or_infinite_embeddings_are_refused(ckpts):
    model_dir = tiny.ensure("qwen2_vl", ckpts)
    server = LLM(model_dir)
    try:
        hidden = server.stub.Info(pb.InfoRequest(), timeout=10).hidden_size
        for bad in (float("nan"), float("inf")):
            rows = torch.zeros(4, hidden)
            rows[1, 3] = bad
            item = pb.MultimodalItem(modality=pb.IMAGE, embedding=pb.Embedding(embedding=to_proto(rows),
                                                                              grid_thw=[1, 4, 4]))
            details = _refused(server, text="<|vision_start|><|image_pad|><|vision_end|>", items=[item],
                               sampling=greedy(2))
            assert "items[0].embedding contains NaN or infinite values" in details
    finally:
        server.close()


def _kv_used_metric(llm):
    body = urllib.request.urlopen(f"http://127.0.0.1:{llm.proc.metrics_port}/metrics", timeout=10).read().decode()
    return next(s.value for f in text_string_to_metric_families(body) for s in f.samples
                if s.name == "modalmesh_kv_pool_used_tokens")


def test_the_kv_pool_gauge_drops_when_a_request_is_cancelled(llm):
    call = llm.stub.Generate(pb.GenerateRequest(text="Hello " * 20, sampling=greedy(400)), timeout=60)
    assert next(call).token_ids
    call.cancel()
    deadline = time.monotonic() + 10  # no other request follows: the abort itself must publish
    while _kv_used_metric(llm) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _kv_used_metric(llm) == 0
