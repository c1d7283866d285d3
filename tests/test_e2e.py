"""The stack end to end on local processes: encoders -> LLM over gRPC, checked against the reference.

Greedy tokens of Generate(image/audio bytes + text), with the LLM fanning items out to
encoder processes, equal Hugging Face `generate` on the processor's inputs. Also: concurrent
multimodal and text-only requests, a replica killed mid-burst, SIGTERM during streaming,
and an encoder of another checkpoint refused.
"""

import concurrent.futures as cf
import io
import math
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from modalmesh import pb
from modalmesh.ops.launcher import ServiceProcess
from modalmesh.rpc.shm import shm_available
from modalmesh.testing import tiny

COMMON = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--device", "cpu", "--grace-period", "30"]
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"


def png(h, w, seed):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def wav(seconds, seed, rate=16000):
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    signal = 0.4 * np.sin(2 * math.pi * (220 + 90 * seed) * t) + 0.05 * rng.standard_normal(t.shape)
    buf = io.BytesIO()
    sf.write(buf, signal.astype(np.float32), rate, format="WAV", subtype="FLOAT")
    return buf.getvalue(), signal.astype(np.float32)


def start(service, model, *flags):
    return ServiceProcess(service, [*COMMON, "--model", str(model), *flags]).start()


def generate(target, timeout=120, **kw):
    ids, text = [], ""
    with grpc.insecure_channel(target) as channel:
        for r in pb.llm_pb2_grpc.LLMServiceStub(channel).Generate(pb.GenerateRequest(**kw), timeout=timeout):
            ids += r.token_ids
            text += r.text
    return ids


def greedy(n):
    return pb.SamplingParams(temperature=0.0, max_tokens=n)


def image_items(images):
    return [pb.MultimodalItem(modality=pb.IMAGE, input=pb.EncodeItem(data=data)) for data in images]


def metric(proc, name, **labels):
    """The sum of `name`'s samples on the process's /metrics whose labels include `labels`."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def counter(proc, rpc="Encode"):
    return metric(proc, "modalmesh_requests_total", rpc=rpc, code="OK")


def stop_all(*procs):
    for p in procs:
        p.send_sigterm()
    return [p.terminate(timeout=60) for p in procs]


# ---- Qwen2-VL: vision_encoder + llm --------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def vl(ckpts):
    model = tiny.ensure("qwen2_vl", ckpts)
    vision = start("vision_encoder", model)
    vision.wait_listening()
    llm = start("llm", model, "--kv-cache-tokens", "4096", "--vision-encoder", f"ipv4:127.0.0.1:{vision.grpc_port}")
    for p in (vision, llm):
        p.wait_serving(timeout=180)
    yield model, vision, llm
    stop_all(llm, vision)


class VLReference:
    def __init__(self, model_dir):
        from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

        self.model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir).eval()
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)

    def generate(self, text, images, n):
        ids, kwargs = self._inputs(text, images)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, max_new_tokens=n, do_sample=False, **kwargs)
        return out[0, ids.shape[1]:].tolist()

    def greedy_logprobs(self, text, images, n):
        """Greedy tokens and each one's logprob, from generate's own logits (teacher forcing would put the
        image token back into input_ids when a tiny model samples it, which HF refuses)."""
        ids, kwargs = self._inputs(text, images)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, max_new_tokens=n, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True, **kwargs)
        tokens = out.sequences[0, ids.shape[1]:]
        logits = torch.stack(out.logits)[:, 0].float()
        return tokens.tolist(), logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0]

    def _inputs(self, text, images):
        kwargs = {}
        if images:
            pil = [Image.open(io.BytesIO(data)) for data in images]
            inputs = self.processor(images=pil, return_tensors="pt")
            counts = [int(g.prod()) // 4 for g in inputs["image_grid_thw"]]
            for c in counts:  # what the Qwen2-VL processor does to the prompt
                text = text.replace("<|image_pad|>", "<|placeholder|>" * c, 1)
            text = text.replace("<|placeholder|>", "<|image_pad|>")
            kwargs = dict(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
        ids = self.tok(text, return_tensors="pt")["input_ids"]
        kwargs["mm_token_type_ids"] = (ids == self.model.config.image_token_id).int()
        return ids, kwargs


@pytest.fixture(scope="module")
def vl_ref(vl):
    return VLReference(vl[0])


@pytest.mark.parametrize("sizes", [[(56, 84)], [(112, 56), (56, 56), (84, 140)]], ids=["one", "three-sizes"])
def test_image_bytes_through_the_encoder_pool_equal_hf_generate(vl, vl_ref, sizes):
    _, vision, llm = vl
    images = [png(h, w, seed=i + len(sizes)) for i, (h, w) in enumerate(sizes)]
    text = "Compare: " + " and ".join(VISION for _ in images) + " — what do you see?"
    got = generate(llm.target, text=text, items=image_items(images), sampling=greedy(12))
    want = vl_ref.generate(text, images, 12)
    assert got == want
    assert len(set(got)) > 3


def test_concurrent_multimodal_and_text_requests_are_all_correct(vl, vl_ref):
    _, vision, llm = vl
    cases = []
    for i in range(6):
        if i % 2:
            cases.append((f"Just text number {i}, please continue", []))
        else:
            images = [png(56 + 28 * (i % 3), 84, seed=100 + i), png(56, 56, seed=200 + i)]
            cases.append((f"{VISION} then {VISION} case {i}", images))
    with cf.ThreadPoolExecutor(len(cases)) as pool:
        futures = [pool.submit(generate, llm.target, text=t, items=image_items(imgs), sampling=greedy(10))
                   for t, imgs in cases]
        got = [f.result() for f in futures]
    for (text, images), ids in zip(cases, got):
        assert ids == vl_ref.generate(text, images, 10), text


def test_chat_request_with_image_parts(vl, vl_ref):
    _, _, llm = vl
    image = png(84, 56, seed=7)
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=[
        pb.ContentPart(item=pb.MultimodalItem(modality=pb.IMAGE, input=pb.EncodeItem(data=image))),
        pb.ContentPart(text="Describe it.")])])
    got = generate(llm.target, chat=chat, sampling=greedy(8))
    text = vl_ref.tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}],
                                          tokenize=False, add_generation_prompt=True)
    assert got == vl_ref.generate(text, [image], 8)


def transfer_bytes(proc, direction):
    return {path: metric(proc, "modalmesh_transfer_bytes_total", direction=direction, path=path)
            for path in ("grpc", "shared_memory")}


def slabs_handed_back(proc):
    """For every shared-memory slab the process has mapped: was its content handed back?"""
    names = {line.split()[-1] for line in Path(f"/proc/{proc.proc.pid}/maps").read_text().splitlines()
             if "/dev/shm/modalmesh-emb-" in line and not line.endswith("(deleted)")}
    words = {n: Path(n).read_bytes()[:16] for n in names}
    return {Path(n).name: w[:8] == w[8:] for n, w in words.items()}


@pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm on this host")
def test_co_located_embeddings_travel_through_shared_memory_and_bytes_when_off(vl, vl_ref):
    model, vision, llm = vl
    images = [png(84, 112, seed=31), png(56, 56, seed=32)]
    text = f"{VISION} beside {VISION}: what changed?"
    want = vl_ref.generate(text, images, 10)
    before, sent_before = transfer_bytes(llm, "received"), transfer_bytes(vision, "sent")
    assert generate(llm.target, text=text, items=image_items(images), sampling=greedy(10)) == want
    after, sent_after = transfer_bytes(llm, "received"), transfer_bytes(vision, "sent")
    # Both images came through /dev/shm (same host): no embedding bytes in messages, every slab handed back.
    assert after["shared_memory"] > before["shared_memory"] and after["grpc"] == before["grpc"]
    assert sent_after["shared_memory"] - sent_before["shared_memory"] == after["shared_memory"] - before["shared_memory"]
    handed_back = slabs_handed_back(vision)
    assert handed_back and all(handed_back.values()), handed_back
    # An LLM told not to offer the path gets the same embeddings as message bytes.
    plain = start("llm", model, "--kv-cache-tokens", "4096", "--vision-encoder", vision.target,
                  "--encoder-shared-memory", "off")
    try:
        plain.wait_serving(timeout=180)
        assert generate(plain.target, text=text, items=image_items(images), sampling=greedy(10)) == want
        got = transfer_bytes(plain, "received")
        assert got["grpc"] == after["shared_memory"] - before["shared_memory"] and got["shared_memory"] == 0
    finally:
        assert stop_all(plain) == [0]


def _setup_counts(llm):
    stages = ("link", "validate", "prefix", "encode", "admit")
    counts = {s: metric(llm, "modalmesh_generate_setup_seconds_count", stage=s) for s in stages}
    sums = {s: metric(llm, "modalmesh_generate_setup_seconds_sum", stage=s) for s in stages}
    calls = {s: metric(llm, "modalmesh_encode_call_seconds_count", modality="image", stage=s) for s in ("rpc", "take")}
    return counts, sums, calls


def test_a_calls_setup_before_the_engine_is_timed_by_stage(vl):
    """Where a request waits before the engine has it: every stage it went through observed once, within the
    client's own time for the call (the link's clock is the edge's, read in another process)."""
    _, _, llm = vl
    counts0, sums0, calls0 = _setup_counts(llm)
    start_ = time.perf_counter()
    generate(llm.target, text=f"{VISION} and some text", items=image_items([png(56, 84, seed=91)]), sampling=greedy(2))
    generate(llm.target, text="text alone", sampling=greedy(2))
    wall = time.perf_counter() - start_
    counts, sums, calls = _setup_counts(llm)
    added = {s: counts[s] - counts0[s] for s in counts}
    # The text-only call has no items: no digests, no Encode; the image was new, so it was encoded.
    assert added == {"link": 2, "validate": 2, "prefix": 1, "encode": 1, "admit": 2}, added
    assert {s: calls[s] - calls0[s] for s in calls} == {"rpc": 1, "take": 1}
    spent = sum(sums[s] - sums0[s] for s in sums)
    assert 0 < spent < wall, (spent, wall)
    assert sums["encode"] - sums0["encode"] > 0 and sums["link"] - sums0["link"] > 0


def _until(predicate, timeout=10.0):
    """Poll `predicate` until it holds (bounded): the encoder counts a call after it has sent the answer."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_the_same_image_asked_about_again_is_neither_encoded_nor_prefilled(vl, vl_ref):
    _, vision, llm = vl
    image, other = png(112, 140, seed=71), png(56, 84, seed=72)  # 20 rows
    # The two prompts share the image and a page or more of text after it: pages are cached whole.
    lead = f"Here is a picture: {VISION} Look at it closely, then answer my question. "
    questions = [lead + "Which colours can you see in it?", lead + "What shapes are there?"]
    before = counter(vision)
    results = []
    for i, text in enumerate(questions):
        responses = list(pb.llm_pb2_grpc.LLMServiceStub(grpc.insecure_channel(llm.target)).Generate(
            pb.GenerateRequest(text=text, items=image_items([image]), sampling=pb.SamplingParams(
                temperature=0.0, max_tokens=10, logprobs=1)), timeout=120))
        results.append(([t for r in responses for t in r.token_ids], [lp for r in responses for lp in r.logprobs],
                        responses[-1].usage))
        assert _until(lambda: counter(vision) >= before + 1)
    # A third request with another image is encoded: had the second one called Encode, this would count 3.
    generate(llm.target, text=f"{VISION} new", items=image_items([other]), sampling=greedy(2))
    assert _until(lambda: counter(vision) >= before + 2)
    time.sleep(0.2)
    assert counter(vision) == before + 2
    (_, _, first), (_, _, second) = results
    rows_end = len(vl_ref.tok(lead.split(VISION)[0])["input_ids"]) + 1 + 20  # text, vision_start, rows
    assert first.cached_tokens == 0 and second.cached_tokens >= rows_end, (first, second)
    for text, (ids, lps, _) in zip(questions, results):
        want, want_lps = vl_ref.greedy_logprobs(text, [image], 10)
        assert ids == want
        torch.testing.assert_close(torch.tensor(lps), want_lps, atol=1e-4, rtol=0)
    assert metric(llm, "modalmesh_prefix_cache_hits_total") >= second.cached_tokens


def test_bad_image_fails_cleanly_and_names_the_item(vl):
    _, _, llm = vl
    with pytest.raises(grpc.RpcError) as err:
        generate(llm.target, text=f"{VISION}{VISION}", items=image_items([png(56, 56, 1), b"not an image"]),
                 sampling=greedy(2))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "items[1]" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        generate(llm.target, text=AUDIO, items=[pb.MultimodalItem(modality=pb.AUDIO, input=pb.EncodeItem(data=b"x"))],
                 sampling=greedy(2))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "takes no AUDIO input" in err.value.details()
    # A caller may not point the LLM at files under /dev/shm: only encoder answers it asked for may.
    sneaky = pb.Embedding(embedding=pb.Tensor(dtype=pb.FLOAT32, shape=[1, 8], shared_memory=pb.SharedMemoryRef(
        name="modalmesh-emb-" + "0" * 32, nbytes=32)), num_placeholder_tokens=1)
    with pytest.raises(grpc.RpcError) as err:
        generate(llm.target, text=VISION, items=[pb.MultimodalItem(modality=pb.IMAGE, embedding=sneaky)],
                 sampling=greedy(2))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0].embedding: a shared-memory reference is not accepted" in err.value.details()
    # Nor at another process's GPU memory: a CUDA IPC handle comes only in encoder answers it asked for.
    handle = pb.Embedding(embedding=pb.Tensor(dtype=pb.FLOAT32, shape=[1, 8], cuda_ipc=pb.CudaIpcRef(
        handle=b"\x01" * 64, nbytes=32, storage_size_bytes=32)), num_placeholder_tokens=1)
    with pytest.raises(grpc.RpcError) as err:
        generate(llm.target, text=VISION, items=[pb.MultimodalItem(modality=pb.IMAGE, embedding=handle)],
                 sampling=greedy(2))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0].embedding: a CUDA IPC handle (cuda_ipc) is not accepted" in err.value.details()
    assert len(generate(llm.target, text="still serving", sampling=greedy(2))) == 2


def test_sigterm_on_the_llm_lets_streams_finish_and_refuses_new_calls(vl):
    # Last test of the VL module fixture: it stops the LLM.
    _, _, llm = vl
    channel = grpc.insecure_channel(llm.target)
    stub = pb.llm_pb2_grpc.LLMServiceStub(channel)
    stream = stub.Generate(pb.GenerateRequest(text="A long story:", sampling=greedy(150)), timeout=120)
    first = next(stream)
    llm.send_sigterm()
    rest = list(stream)  # in-flight streams finish during the drain
    assert sum(len(r.token_ids) for r in [first, *rest]) == 150 and rest[-1].finish_reason == pb.LENGTH
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(text="new", sampling=greedy(2)), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()
    assert llm.proc.wait(timeout=60) == 0


# ---- Qwen2-Audio: audio_encoder + llm ------------------------------------------------------------
def test_audio_bytes_through_the_encoder_pool_equal_hf_generate(ckpts):
    from transformers import AutoTokenizer, Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor

    model_dir = tiny.ensure("qwen2_audio", ckpts)
    audio = start("audio_encoder", model_dir)
    audio.wait_listening()
    llm = start("llm", model_dir, "--kv-cache-tokens", "4096", "--audio-encoder", f"ipv4:127.0.0.1:{audio.grpc_port}")
    try:
        for p in (audio, llm):
            p.wait_serving(timeout=180)
        ref = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir).eval()
        tok = AutoTokenizer.from_pretrained(model_dir)
        fe = WhisperFeatureExtractor.from_pretrained(model_dir)
        for seconds, seed in [(2.5, 0), (0.7, 1)]:
            data, signal = wav(seconds, seed)
            text = f"Listen: {AUDIO} and tell me, in words, what is this sound? Answer:"
            got = generate(llm.target, text=text,
                           items=[pb.MultimodalItem(modality=pb.AUDIO, input=pb.EncodeItem(data=data))],
                           sampling=greedy(12))
            feats = fe(signal, sampling_rate=16000, return_attention_mask=True, padding="max_length",
                       return_tensors="pt")
            length = int(feats["attention_mask"].sum())
            n = (((length - 1) // 2 + 1) - 2) // 2 + 1  # the Qwen2-Audio processor's count
            ids = tok(text.replace("<|AUDIO|>", "<|AUDIO|>" * n), return_tensors="pt")["input_ids"]
            with torch.no_grad():
                want = ref.generate(input_ids=ids, input_features=feats["input_features"],
                                    feature_attention_mask=feats["attention_mask"], max_new_tokens=12,
                                    do_sample=False)[0, ids.shape[1]:].tolist()
            assert got == want, seconds
            assert len(set(got)) > 3
    finally:
        assert stop_all(llm, audio) == [0, 0]


# ---- resilience ---------------------------------------------------------------------------------
def test_a_replica_killed_mid_burst_costs_no_request(ckpts):
    model = tiny.ensure("qwen2_vl", ckpts)
    a, b = start("vision_encoder", model), start("vision_encoder", model)
    a.wait_listening()
    b.wait_listening()
    llm = start("llm", model, "--kv-cache-tokens", "8192",
                "--vision-encoder", f"ipv4:127.0.0.1:{a.grpc_port},127.0.0.1:{b.grpc_port}")
    try:
        for p in (a, b, llm):
            p.wait_serving(timeout=180)
        for i in range(6):  # round_robin: both replicas take traffic
            assert len(generate(llm.target, text=VISION, items=image_items([png(56, 56, 300 + i)]),
                                sampling=greedy(1))) == 1
        assert counter(a) > 0 and counter(b) > 0
        with cf.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(generate, llm.target, text=VISION, items=image_items([png(56, 84, 400 + i)]),
                                   sampling=greedy(2)) for i in range(16)]
            a.kill()  # SIGKILL during the burst
            results = [f.result() for f in futures]
        assert all(len(r) == 2 for r in results)
        assert counter(b) > 0
    finally:
        a.kill()
        stop_all(llm, b)


def test_an_encoder_of_another_checkpoint_is_refused(ckpts):
    vl_model, other = tiny.ensure("qwen2_vl", ckpts), tiny.ensure("qwen2_5_vl", ckpts)
    vision = start("vision_encoder", other)  # same width (64), different weights
    vision.wait_listening()
    llm = start("llm", vl_model, "--kv-cache-tokens", "2048", "--vision-encoder", f"ipv4:127.0.0.1:{vision.grpc_port}")
    try:
        for p in (vision, llm):
            p.wait_serving(timeout=180)
        with pytest.raises(grpc.RpcError) as err:
            generate(llm.target, text=VISION, items=image_items([png(56, 56, 1)]), sampling=greedy(2))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not this LLM's" in err.value.details() and "--allow-foreign-encoders" in err.value.details()
    finally:
        assert stop_all(llm, vision) == [0, 0]


def test_raw_items_without_an_encoder_flag_say_which_flag_is_missing(ckpts):
    llm = start("llm", tiny.ensure("qwen2_vl", ckpts), "--kv-cache-tokens", "2048")
    try:
        llm.wait_serving(timeout=180)
        with pytest.raises(grpc.RpcError) as err:
            generate(llm.target, text=VISION, items=image_items([png(56, 56, 1)]), sampling=greedy(2))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--vision-encoder" in err.value.details()
    finally:
        assert stop_all(llm) == [0]
