"""The LLM service end to end over gRPC: greedy parity with HF generate under continuous batching,
multimodal embeddings, sampling, cancellation, queue limits and bad input."""

import concurrent.futures as cf
import json
import time
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from modalmesh import pb
from modalmesh.ops.launcher import ServiceProcess
from modalmesh.rpc.codec import to_proto
from modalmesh.testing import tiny

COMMON = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--device", "cpu", "--grace-period", "10",
          "--kv-cache-tokens", "2048"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tmp_path_factory.mktemp("llm-ckpts")


class LLM:
    """A running `python -m services.llm` and a stub to it."""

    def __init__(self, model_dir, *flags):
        self.dir = model_dir
        self.proc = ServiceProcess("llm", [*COMMON, "--model", str(model_dir), *flags]).start()
        self.proc.wait_serving(timeout=180)
        self.channel = grpc.insecure_channel(self.proc.target)
        self.stub = pb.llm_pb2_grpc.LLMServiceStub(self.channel)

    def generate(self, timeout=120, **kw):
        """All deltas of one call, merged: (token ids, text, last response)."""
        ids, text, last = [], "", None
        for r in self.stub.Generate(pb.GenerateRequest(**kw), timeout=timeout):
            ids += r.token_ids
            text += r.text
            last = r
        return ids, text, last

    def kv_used(self):
        return self.stub.Info(pb.InfoRequest(), timeout=10).pools[0].used_tokens

    def close(self):
        self.channel.close()
        assert self.proc.terminate(timeout=30) == 0


def greedy(max_tokens, **kw):
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def _hf_generate(model_dir, prompt_ids, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. A picture is", "Ü", "def forward(self, x):"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt_neox"])
def test_greedy_tokens_equal_hf_generate_with_concurrent_requests(ckpts, family):
    from transformers import AutoTokenizer

    model_dir = tiny.ensure(family, ckpts)
    tok = AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(model_dir, "--max-batch-tokens", "16", "--max-num-seqs", "16")  # small budget: prompts are chunked, batches mix
    try:
        lengths = [24, 9, 17, 30]
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(llm.generate, text=p, sampling=greedy(n)) for p, n in zip(PROMPTS, lengths)]
            results = [f.result() for f in futures]
        for prompt, n, (ids, text, last) in zip(PROMPTS, lengths, results):
            prompt_ids = tok(prompt)["input_ids"]
            ref = _hf_generate(model_dir, prompt_ids, n)
            assert ids == ref, f"{family} {prompt!r}"
            assert len(set(ids)) > 3  # a real continuation, not one token repeated
            assert text == tok.decode(ids, skip_special_tokens=True)
            assert last.usage.prompt_tokens == len(prompt_ids) and last.usage.completion_tokens == len(ids)
            assert last.finish_reason == (pb.LENGTH if len(ids) == n else pb.STOP)
        assert llm.kv_used() == 0
    finally:
        llm.close()


@pytest.fixture(scope="module")
def qwen2(ckpts):
    llm = LLM(tiny.ensure("qwen2", ckpts), "--max-queue", "2", "--max-num-seqs", "2")
    yield llm
    llm.close()


def test_token_ids_and_chat_prompts(qwen2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2.dir)
    ids = tok("Describe this image.")["input_ids"]
    by_ids, _, _ = qwen2.generate(token_ids=pb.TokenIds(ids=ids), sampling=greedy(8))
    by_text, _, _ = qwen2.generate(text="Describe this image.", sampling=greedy(8))
    assert by_ids == by_text == _hf_generate(qwen2.dir, ids, 8)
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=[pb.ContentPart(text="hi there")])])
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "hi there"}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"]
    got, _, last = qwen2.generate(chat=chat, sampling=greedy(6))
    assert got == _hf_generate(qwen2.dir, list(chat_ids), 6)
    assert last.usage.prompt_tokens == len(chat_ids)


def test_seeded_sampling_is_reproducible_and_stop_rules_apply(qwen2):
    sampling = pb.SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16)
    a, _, _ = qwen2.generate(text="Hello", sampling=sampling)
    b, _, _ = qwen2.generate(text="Hello", sampling=sampling)
    sampling.seed = 99
    c, _, _ = qwen2.generate(text="Hello", sampling=sampling)
    assert a == b and a != c

    full, full_text, _ = qwen2.generate(text="Hello", sampling=greedy(12))
    # A stop token id ends the stream right there.
    cut, _, last = qwen2.generate(text="Hello", sampling=greedy(12, stop_token_ids=[full[4]]))
    assert cut == full[:full.index(full[4]) + 1] and last.finish_reason == pb.STOP
    # A stop string never reaches the client, and what precedes it is exact.
    stop = full_text[len(full_text) // 2:len(full_text) // 2 + 3]
    _, text, last = qwen2.generate(text="Hello", sampling=greedy(12, stop=[stop]))
    assert text == full_text[:full_text.index(stop)] and last.finish_reason == pb.STOP
    # max_tokens
    ids, _, last = qwen2.generate(text="Hello", sampling=greedy(3))
    assert ids == full[:3] and last.finish_reason == pb.LENGTH and last.usage.completion_tokens == 3
    # logprobs of the chosen tokens
    resp = list(qwen2.stub.Generate(pb.GenerateRequest(text="Hello", sampling=greedy(3, logprobs=1)), timeout=60))
    assert all(len(r.logprobs) == len(r.token_ids) and all(lp <= 0 for lp in r.logprobs) for r in resp)


def test_cancellation_frees_every_page(qwen2):
    # The service writes the stream ahead of the client, so on a loaded machine a 400-token generation could end
    # before the client looked (CI saw the pool empty after the first token): a try counts only where the pool
    # held its pages when looked at and the cancel found the call still running (bounded tries).
    for _ in range(5):
        call = qwen2.stub.Generate(pb.GenerateRequest(text="Hello " * 20, sampling=greedy(400)), timeout=60)
        first = next(call)
        assert first.token_ids
        held = qwen2.kv_used()
        call.cancel()
        if held > 0 and call.code() == grpc.StatusCode.CANCELLED:
            break
    else:
        pytest.fail("every generation ended before its cancel reached it")
    ids, _, _ = qwen2.generate(text="x", sampling=greedy(2))  # the service carries on
    assert len(ids) == 2
    # The abort reaches the engine between steps, asynchronously: watch the pool drain (bounded).
    deadline = time.monotonic() + 30
    while qwen2.kv_used() and time.monotonic() < deadline:
        pass
    assert qwen2.kv_used() == 0


@pytest.mark.parametrize("request_kw, message", [
    (dict(text=""), "prompt is empty"),
    (dict(), "prompt: give text, token_ids or chat"),
    (dict(text="hi " * 600), "this model's limit is 512"),
    (dict(text="hi", sampling=greedy(600)), "exceeds this model's limit of 512"),
    (dict(text="hi", sampling=pb.SamplingParams(top_p=2.0)), "sampling.top_p"),
    (dict(token_ids=pb.TokenIds(ids=[1, 99999])), "outside the vocabulary"),
    (dict(text="hi", items=[pb.MultimodalItem(modality=pb.IMAGE)]), "takes no IMAGE input"),
])
def test_bad_input_is_invalid_argument_and_the_service_carries_on(qwen2, request_kw, message):
    with pytest.raises(grpc.RpcError) as err:
        qwen2.generate(**request_kw)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert message in err.value.details()
    ids, _, _ = qwen2.generate(text="still fine", sampling=greedy(2))
    assert len(ids) == 2


def test_queue_overflow_is_resource_exhausted(qwen2):
    # --max-num-seqs 2 --max-queue 2: at most 2 running and 2 waiting; the rest are refused.
    calls = [qwen2.stub.Generate(pb.GenerateRequest(text=f"req {i}", sampling=greedy(200)), timeout=120)
             for i in range(8)]
    codes = []
    for call in calls:
        try:
            for _ in call:
                pass
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
    assert codes.count(grpc.StatusCode.OK) >= 2
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert qwen2.kv_used() == 0


def test_metrics_count_tokens_and_latency(qwen2):
    qwen2.generate(text="count me", sampling=greedy(5))
    body = urllib.request.urlopen(f"http://127.0.0.1:{qwen2.proc.metrics_port}/metrics", timeout=10).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(body) for s in f.samples}

    def get(name, **labels):
        return samples.get((name, tuple(sorted({"service": "llm", **labels}.items()))))

    assert get("modalmesh_generation_tokens_total") >= 5
    assert get("modalmesh_prompt_tokens_total") >= 2
    assert get("modalmesh_time_to_first_token_seconds_count") >= 1
    # request series carry the served model (--model-id, here the checkpoint directory's name)
    model = {"model_name": qwen2.dir.name}
    assert get("modalmesh_requests_finished_total", finished_reason="length", **model) >= 1
    assert get("modalmesh_e2e_request_latency_seconds_count", **model) >= 1
    assert get("modalmesh_request_generation_tokens_sum", **model) >= 5
    assert get("modalmesh_num_requests_running", **model) == 0
    assert get("modalmesh_kv_pool_capacity_tokens", pool="kv") == 2048
    assert get("modalmesh_kv_pool_used_tokens", pool="kv") == 0
    assert any(k[0] == "modalmesh_attention_backend_info" for k in samples)
    # The process's collections are timed (the start-up one at least), and its start-up heap was frozen.
    assert get("modalmesh_gc_pause_seconds_count", generation="2") >= 1
    assert any("start-up objects out of the garbage collector" in line for line in qwen2.proc.lines)


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen2_vl_with_precomputed_image_embeddings_equals_hf_generate(ckpts, tp):
    from PIL import Image
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    model_dir = tiny.ensure("qwen2_vl", ckpts)
    ref = Qwen2VLForConditionalGeneration.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    images = [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
              for h, w in [(56, 84), (112, 56)]]
    inputs = processor(images=images, return_tensors="pt")
    grids = inputs["image_grid_thw"]
    counts = [int(t * h * w) // 4 for t, h, w in grids]
    with torch.no_grad():
        embeds = ref.model.visual(inputs["pixel_values"], grid_thw=grids)
        embeds = getattr(embeds, "pooler_output", embeds)
    rows = torch.split(embeds, counts)
    text = ("Look: <|vision_start|><|image_pad|><|vision_end|> and "
            "<|vision_start|><|image_pad|><|vision_end|> what differs?")
    expanded = text.replace("<|image_pad|>", "<IMG>", 2)
    for n in counts:
        expanded = expanded.replace("<IMG>", "<|image_pad|>" * n, 1)
    input_ids = tok(expanded, return_tensors="pt")["input_ids"]
    # What the Qwen2-VL processor returns beside input_ids; transformers needs it for M-RoPE.
    mm_token_type_ids = (input_ids == ref.config.image_token_id).int()
    with torch.no_grad():
        want = ref.generate(input_ids=input_ids, pixel_values=inputs["pixel_values"], image_grid_thw=grids,
                            mm_token_type_ids=mm_token_type_ids, max_new_tokens=12,
                            do_sample=False)[0, input_ids.shape[1]:].tolist()
    llm = LLM(model_dir, "--tensor-parallel-size", str(tp))
    try:
        items = [pb.MultimodalItem(modality=pb.IMAGE, embedding=pb.Embedding(
            embedding=to_proto(r), grid_thw=[int(x) for x in grid], num_placeholder_tokens=r.shape[0]))
            for r, grid in zip(rows, grids)]
        got, _, _ = llm.generate(text=text, items=items, sampling=greedy(12))
        assert got == want
        assert len(set(got)) > 3
        # Logprobs too (every rank's shard meets in the LM head's all-gather): HF teacher-forced on our tokens.
        lps = [lp for r in llm.stub.Generate(pb.GenerateRequest(text=text, items=items, sampling=greedy(
            12, logprobs=1)), timeout=120) for lp in r.logprobs]
        full = torch.cat([input_ids, torch.tensor([got])], dim=1)
        with torch.no_grad():
            logits = ref(input_ids=full, pixel_values=inputs["pixel_values"], image_grid_thw=grids,
                         mm_token_type_ids=(full == ref.config.image_token_id).int()).logits[0].float()
        ref_lps = logits[input_ids.shape[1] - 1:-1].log_softmax(-1).gather(1, torch.tensor(got)[:, None])[:, 0]
        assert len(lps) == len(got) and max(abs(a - b) for a, b in zip(lps, ref_lps.tolist())) < 1e-4
        # Already-expanded placeholders are accepted too; a wrong count is refused with both numbers.
        got2, _, _ = llm.generate(text=expanded, items=items, sampling=greedy(12))
        assert got2 == want
        wrong = text.replace("<|image_pad|>", "<|image_pad|><|image_pad|>", 1)
        with pytest.raises(grpc.RpcError) as err:
            llm.generate(text=wrong, items=items, sampling=greedy(2))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"2 placeholder tokens for it but its embedding has {counts[0]} rows" in err.value.details()
        bad = pb.MultimodalItem(modality=pb.IMAGE, embedding=pb.Embedding(embedding=to_proto(torch.zeros(4, 7)),
                                                                           grid_thw=[1, 4, 4]))
        with pytest.raises(grpc.RpcError) as err:
            llm.generate(text="<|image_pad|>", items=[bad], sampling=greedy(2))
        assert "this model needs (rows, 64)" in err.value.details()
        raw = pb.MultimodalItem(modality=pb.IMAGE, input=pb.EncodeItem(data=b"png"))
        with pytest.raises(grpc.RpcError) as err:
            llm.generate(text="<|image_pad|>", items=[raw], sampling=greedy(2))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--vision-encoder" in err.value.details()
        assert llm.kv_used() == 0
    finally:
        llm.close()


def test_tensor_parallel_service_equals_hf_generate(ckpts):
    # Two ranks (gloo on the CPU): rank 0 serves, rank 1 follows each step with its shard.
    from transformers import AutoTokenizer

    model_dir = tiny.ensure("qwen2", ckpts)
    tok = AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(model_dir, "--tensor-parallel-size", "2", "--max-batch-tokens", "16", "--max-num-seqs", "16")
    try:
        with cf.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(llm.generate, text=p, sampling=greedy(10)) for p in PROMPTS[:3]]
            results = [f.result() for f in futures]
        for prompt, (ids, _, _) in zip(PROMPTS, results):
            assert ids == _hf_generate(model_dir, tok(prompt)["input_ids"], 10)
        info = llm.stub.Info(pb.InfoRequest(), timeout=10)
        assert info.pools[0].used_tokens == 0
    finally:
        llm.close()
