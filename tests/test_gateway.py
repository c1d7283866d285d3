"""The OpenAI-compatible gateway in front of the local stack (tiny checkpoints), driven by the official client.

Services: vision_encoder + llm (tiny Qwen2-VL) + vae behind one gateway; audio_encoder + llm (tiny
Qwen2-Audio) behind another; a scripted fake LLM (in this process) behind a third for the error paths
the real stack cannot be pushed into on demand (queue full, mid-stream failure, not ready).
Greedy gateway output is checked against the LLM's own gRPC Generate for the same input.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import math
import subprocess
import sys
import time
import urllib.request
from concurrent import futures

import grpc
import numpy as np
import openai
import pytest
import soundfile as sf
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save as save_safetensors

from modalmesh import pb
from modalmesh.ops.launcher import ServiceProcess
from modalmesh.rpc.codec import to_proto
from modalmesh.testing import tiny
from services.gateway.launch import GatewayProcess

COMMON = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--device", "cpu"]
GATEWAY = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--grace-period", "10"]
ERROR_KEYS = {"message", "type", "param", "code"}


# ---- inputs --------------------------------------------------------------------------------------
def png(h, w, seed):
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def audio(seconds, seed, fmt="WAV", subtype="FLOAT"):
    t = np.arange(int(seconds * 16000)) / 16000
    noise = np.random.default_rng(seed).standard_normal(t.shape)
    signal = 0.4 * np.sin(2 * math.pi * (220 + 90 * seed) * t) + 0.05 * noise
    buf = io.BytesIO()
    sf.write(buf, signal.astype(np.float32), 16000, format=fmt, subtype=subtype)
    return buf.getvalue()


def data_url(data, mime="image/png"):
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(data):
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def audio_part(data, fmt="wav"):
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def grpc_chat(parts):
    """The gRPC chat message equivalent to one OpenAI user message with these content parts."""
    content = []
    for part in parts:
        if part["type"] == "text":
            content.append(pb.ContentPart(text=part["text"]))
        elif part["type"] == "image_url":
            raw = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
            content.append(pb.ContentPart(item=pb.MultimodalItem(modality=pb.IMAGE, input=pb.EncodeItem(data=raw))))
        else:
            raw = base64.b64decode(part["input_audio"]["data"])
            content.append(pb.ContentPart(item=pb.MultimodalItem(modality=pb.AUDIO, input=pb.EncodeItem(data=raw))))
    return pb.Chat(messages=[pb.ChatMessage(role="user", content=content)])


def grpc_generate(target, **request):
    text, ids, logprobs, last = "", [], [], None
    with grpc.insecure_channel(target) as channel:
        for r in pb.llm_pb2_grpc.LLMServiceStub(channel).Generate(pb.GenerateRequest(**request), timeout=120):
            text += r.text
            ids += r.token_ids
            logprobs += r.logprobs
            last = r
    return text, ids, logprobs, last


def llm_info(target):
    with grpc.insecure_channel(target) as channel:
        return pb.llm_pb2_grpc.LLMServiceStub(channel).Info(pb.InfoRequest(), timeout=10)


def scrape(port):
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return [s for f in text_string_to_metric_families(body) for s in f.samples]


def metric(port, name, **labels):
    return sum(s.value for s in scrape(port) if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def post(gw, path, body, headers=None, raw=False):
    """(status, headers, parsed JSON or bytes) of a POST with any body, through a plain HTTP client."""
    conn = http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=120)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        payload = r.read()
        return r.status, dict(r.getheaders()), payload if raw else json.loads(payload)
    finally:
        conn.close()


def assert_openai_error(status, body, want_status, code=None, param=None):
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert "Traceback" not in body["error"]["message"] and "\n" not in body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body


def client(gw, key="unused"):
    return openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key=key, max_retries=0, timeout=120)


# ---- the stack -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    vl, aud, vae_dir = tiny.ensure("qwen2_vl", root), tiny.ensure("qwen2_audio", root), tiny.ensure("vae", root)
    media = root / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(png(56, 56, 11))
    vision = ServiceProcess("vision_encoder", [*COMMON, "--model", str(vl)]).start()
    audio_enc = ServiceProcess("audio_encoder", [*COMMON, "--model", str(aud)]).start()
    vae = ServiceProcess("vae", [*COMMON, "--model", str(vae_dir)]).start()
    procs = [vision, audio_enc, vae]
    try:
        for p in procs:
            p.wait_listening()
        llm = ServiceProcess("llm", [*COMMON, "--model", str(vl), "--kv-cache-tokens", "4096",
                                     "--vision-encoder", f"ipv4:{vision.target}"]).start()
        audio_llm = ServiceProcess("llm", [*COMMON, "--model", str(aud), "--kv-cache-tokens", "4096",
                                           "--audio-encoder", f"ipv4:{audio_enc.target}"]).start()
        procs += [llm, audio_llm]
        for p in (llm, audio_llm):
            p.wait_listening()
        gw = GatewayProcess([*GATEWAY, "--llm", llm.target, "--vae", vae.target, "--max-image-mb", "0.25",
                             "--max-request-mb", "1", "--allowed-local-media-path", str(media)]).start()
        audio_gw = GatewayProcess([*GATEWAY, "--llm", audio_llm.target]).start()
        procs += [gw, audio_gw]
        for p in procs:
            p.wait_serving(timeout=180)
        yield dict(vl=vl, media=media, vision=vision, audio_enc=audio_enc, vae=vae, llm=llm, audio_llm=audio_llm,
                   gw=gw, audio_gw=audio_gw)
        for g in (gw, audio_gw):  # SIGTERM: the gateway drains and exits 0
            assert g.terminate(timeout=30) == 0, g.log_tail()
    finally:
        for p in reversed(procs):
            p.send_sigterm()
        for p in reversed(procs):
            p.terminate(timeout=60)


# ---- /v1/models, /health, /metrics ---------------------------------------------------------------
def test_models_list_the_llm_model_id_from_its_info(stack):
    c = client(stack["gw"])
    model_id = llm_info(stack["llm"].target).model_id
    assert [m.id for m in c.models.list()] == [model_id] == ["qwen2_vl"]
    assert c.models.retrieve(model_id).id == model_id
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")
    assert [m.id for m in client(stack["audio_gw"]).models.list()] == ["qwen2_audio"]


def test_health_reflects_the_grpc_health_of_the_services_behind(stack):
    status, body = stack["gw"].health()
    assert status == 200 and body["status"] == "ok" and body["model"] == "qwen2_vl"
    assert {k: v["status"] for k, v in body["services"].items()} == {"llm": "SERVING", "vae": "SERVING"}


def test_gateway_metrics_use_the_shared_schema(stack):
    gw = stack["gw"]
    client(gw).completions.create(model="qwen2_vl", prompt="count me", max_tokens=2, temperature=0)
    port = gw.metrics_port
    assert metric(port, "modalmesh_requests_total", service="gateway", rpc="/v1/completions", code="200") >= 1
    assert metric(port, "modalmesh_request_duration_seconds_count", service="gateway", rpc="/v1/completions") >= 1
    assert metric(port, "modalmesh_ready", service="gateway") == 1
    assert metric(port, "modalmesh_service_info", service="gateway", model_id="qwen2_vl") == 1
    assert metric(port, "modalmesh_generation_tokens_total", service="gateway") >= 2
    assert metric(port, "modalmesh_gateway_time_to_first_token_seconds_count", service="gateway") >= 1
    # the engine-side TTFT is the LLM's alone: a sum over services no longer adds the two
    assert metric(port, "modalmesh_time_to_first_token_seconds_count", service="gateway") == 0
    assert metric(port, "modalmesh_http_requests_total", service="gateway", route="/v1/completions",
                  status="200") >= 1
    assert all(s.name.startswith(("modalmesh_", "process_", "python_")) for s in scrape(port))


# ---- chat with images ----------------------------------------------------------------------------
def test_chat_with_an_image_equals_grpc_generate(stack):
    parts = [image_part(png(56, 84, 1)), {"type": "text", "text": "Describe the image."}]
    r = client(stack["gw"]).chat.completions.create(
        model="qwen2_vl", messages=[{"role": "user", "content": parts}], max_tokens=12, temperature=0)
    text, ids, _, last = grpc_generate(stack["llm"].target, chat=grpc_chat(parts), sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=12))
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "qwen2_vl"
    assert len(r.choices) == 1 and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (last.usage.prompt_tokens, 12) == (
        last.usage.prompt_tokens, len(ids))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert len(set(ids)) > 3  # not a degenerate output


def test_streamed_chat_with_an_image_equals_grpc_generate_and_reports_usage(stack):
    parts = [{"type": "text", "text": "Compare"}, image_part(png(112, 56, 2)), image_part(png(56, 56, 3)),
             {"type": "text", "text": "what changed?"}]
    stream = client(stack["gw"]).chat.completions.create(
        model="qwen2_vl", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}],
        max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    chat = grpc_chat(parts)
    chat.messages.insert(0, pb.ChatMessage(role="system", content=[pb.ContentPart(text="Be brief.")]))
    text, _, _, last = grpc_generate(stack["llm"].target, chat=chat,
                                     sampling=pb.SamplingParams(temperature=0.0, max_tokens=10))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    body, usage = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].delta.content or "" for c in body) == text
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1]) and all(c.usage is None for c in body)
    assert usage.choices == [] and usage.usage.completion_tokens == 10
    assert usage.usage.prompt_tokens == last.usage.prompt_tokens


def test_sse_framing_is_what_openai_clients_parse(stack):
    status, headers, payload = post(stack["gw"], "/v1/chat/completions", {
        "model": "qwen2_vl", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
        "stream": True}, raw=True)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = payload.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        chunk = json.loads(event[len("data: "):])
        assert set(chunk) >= {"id", "object", "created", "model", "choices"} and "usage" not in chunk
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "length"


def test_file_urls_only_under_the_allowed_media_path(stack):
    c = client(stack["gw"])
    url = (stack["media"] / "cat.png").as_uri()
    r = c.chat.completions.create(model="qwen2_vl", max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    cat = image_part((stack["media"] / "cat.png").read_bytes())
    want, *_ = grpc_generate(stack["llm"].target, chat=grpc_chat([cat]),
                             sampling=pb.SamplingParams(temperature=0.0, max_tokens=4))
    assert r.choices[0].message.content == want
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="qwen2_vl", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": (stack["vl"] / "config.json").as_uri()}}]}])
    assert err.value.body["param"] == "messages[0].content[0].image_url.url"


def test_sampling_fields_reach_the_llm(stack):
    body = dict(temperature=0.9, top_p=0.8, seed=1234, stop=["e"], max_completion_tokens=9)
    r = client(stack["gw"]).chat.completions.create(
        model="qwen2_vl", messages=[{"role": "user", "content": "Sample something"}], logprobs=True,
        extra_body={"top_k": 50, "repetition_penalty": 1.1}, **body)
    text, ids, logprobs, last = grpc_generate(
        stack["llm"].target, chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=[
            pb.ContentPart(text="Sample something")])]),
        sampling=pb.SamplingParams(temperature=0.9, top_p=0.8, seed=1234, stop=["e"], max_tokens=9, top_k=50,
                                   repetition_penalty=1.1, logprobs=1))
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == {pb.STOP: "stop", pb.LENGTH: "length"}[last.finish_reason]
    got = [t.logprob for t in r.choices[0].logprobs.content]
    assert len(got) == len(ids) == r.usage.completion_tokens
    assert np.allclose(got, logprobs, atol=1e-5) and all(v <= 0 for v in got)


def test_completions_plain_prompt_equals_grpc_generate(stack):
    c = client(stack["gw"])
    text, ids, logprobs, _ = grpc_generate(stack["llm"].target, text="Once upon a time",
                                           sampling=pb.SamplingParams(temperature=0.0, max_tokens=8, logprobs=1))
    r = c.completions.create(model="qwen2_vl", prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=0)
    assert r.object == "text_completion" and r.choices[0].text == text and r.usage.completion_tokens == 8
    assert np.allclose(r.choices[0].logprobs.token_logprobs, logprobs, atol=1e-5)
    chunks = list(c.completions.create(model="qwen2_vl", prompt="Once upon a time", max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == 8
    r = c.completions.create(model="qwen2_vl", prompt=[40, 41, 42, 43], max_tokens=4, temperature=0)
    want, *_ = grpc_generate(stack["llm"].target, token_ids=pb.TokenIds(ids=[40, 41, 42, 43]),
                             sampling=pb.SamplingParams(temperature=0.0, max_tokens=4))
    assert r.choices[0].text == want  # token-id prompts go through as token ids


def test_concurrent_requests_through_the_gateway_each_equal_grpc_generate(stack):
    c = client(stack["gw"])
    cases = [[image_part(png(56, 56 + 28 * (i % 2), 20 + i)), {"type": "text", "text": f"case {i}"}] if i % 2 == 0
             else [{"type": "text", "text": f"just text {i}"}] for i in range(6)]

    def run(i):
        kw = dict(model="qwen2_vl", messages=[{"role": "user", "content": cases[i]}], max_tokens=8, temperature=0)
        if i % 3 == 0:
            return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw))
        return c.chat.completions.create(**kw).choices[0].message.content

    with futures.ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(run, range(len(cases))))
    for parts, text in zip(cases, got):
        want, *_ = grpc_generate(stack["llm"].target, chat=grpc_chat(parts),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=8))
        assert text == want


# ---- audio ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3"])
def test_chat_with_audio_equals_grpc_generate(stack, fmt):
    clip = {"wav": lambda: audio(1.5, 0), "flac": lambda: audio(1.0, 1, "FLAC", "PCM_16"),
            "mp3": lambda: audio(1.0, 2, "MP3", "MPEG_LAYER_III")}[fmt]()
    parts = [audio_part(clip, fmt), {"type": "text", "text": "What is this sound?"}]
    r = client(stack["audio_gw"]).chat.completions.create(
        model="qwen2_audio", messages=[{"role": "user", "content": parts}], max_tokens=10, temperature=0)
    text, ids, _, last = grpc_generate(stack["audio_llm"].target, chat=grpc_chat(parts),
                                       sampling=pb.SamplingParams(temperature=0.0, max_tokens=10))
    assert r.choices[0].message.content == text and r.usage.completion_tokens == len(ids) > 3
    assert r.choices[0].finish_reason == {pb.STOP: "stop", pb.LENGTH: "length"}[last.finish_reason]


def test_streamed_chat_with_audio_equals_grpc_generate(stack):
    parts = [{"type": "text", "text": "Listen:"}, audio_part(audio(2.0, 3))]
    chunks = list(client(stack["audio_gw"]).chat.completions.create(
        model="qwen2_audio", messages=[{"role": "user", "content": parts}], max_tokens=10, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text, ids, _, _ = grpc_generate(stack["audio_llm"].target, chat=grpc_chat(parts),
                                    sampling=pb.SamplingParams(temperature=0.0, max_tokens=10))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == len(ids) > 3


# ---- bad input: OpenAI-shaped 4xx, the services stay up --------------------------------------------
def _user(*parts):
    return {"model": "qwen2_vl", "max_tokens": 2, "messages": [{"role": "user", "content": list(parts)}]}


BAD_REQUESTS = {
    "malformed-json": (b'{"model": "qwen2_vl", "messages": [', 400, "invalid_json", None),
    "not-an-object": (b"[1, 2]", 400, "invalid_json", None),
    "unknown-model": ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404,
                      "model_not_found", "model"),
    "no-messages": ({"model": "qwen2_vl", "messages": []}, 400, None, "messages"),
    "bad-base64": (_user({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@not-base64"}}), 400,
                   "invalid_image", "messages[0].content[0].image_url.url"),
    "not-a-data-url": (_user({"type": "image_url", "image_url": {"url": "data:image/png;base64"}}), 400,
                       "invalid_image_url", "messages[0].content[0].image_url.url"),
    "wrong-media-type": (_user({"type": "image_url", "image_url": {"url": data_url(b"abc", "text/plain")}}), 400,
                         "invalid_image_url", "messages[0].content[0].image_url.url"),
    "http-url": (_user({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}), 400,
                 "unsupported_image_url", "messages[0].content[0].image_url.url"),
    "file-url-outside": (_user({"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}), 400,
                         "invalid_image_url", "messages[0].content[0].image_url.url"),
    "not-an-image": (_user({"type": "text", "text": "see"}, image_part(b"definitely not a PNG")), 400,
                     "invalid_argument", "messages[0].content[1]"),
    "oversized-image": (_user(image_part(png(300, 300, 5))), 400, "image_too_large",
                        "messages[0].content[0].image_url.url"),
    "unsupported-part": (_user({"type": "file", "file": {"file_data": "data:application/pdf;base64,AAAA"}}), 400,
                         "unsupported_content_type", "messages[0].content[0].type"),
    "not-a-video": (_user({"type": "video_url", "video_url": {"url": data_url(b"definitely not an MP4", "video/mp4")}}),
                    400, "invalid_argument", "messages[0].content[0]"),
    "video-wrong-media-type": (_user({"type": "video_url", "video_url": {"url": data_url(b"abc", "image/png")}}), 400,
                               "invalid_video_url", "messages[0].content[0].video_url.url"),
    "audio-to-a-vision-llm": (_user(audio_part(audio(0.5, 4))), 400, "invalid_argument", "messages[0].content[0]"),
    "bad-audio-format": (_user({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aac"}}), 400,
                         "invalid_audio_format", "messages[0].content[0].input_audio.format"),
    "n-17": ({**_user({"type": "text", "text": "hi"}), "n": 17}, 400, None, "n"),
    "bad-tool": ({**_user({"type": "text", "text": "hi"}), "tools": [{"type": "function"}]}, 400, None, "tools[0]"),
    "bad-temperature": ({**_user({"type": "text", "text": "hi"}), "temperature": "hot"}, 400, None, "temperature"),
    "negative-top-p": ({**_user({"type": "text", "text": "hi"}), "top_p": -1}, 400, None, "top_p"),
    "bad-role": ({"model": "qwen2_vl", "messages": [{"role": "robot", "content": "x"}]}, 400, None,
                 "messages[0].role"),
    "tool-without-call-id": ({"model": "qwen2_vl", "messages": [{"role": "tool", "content": "x"}]}, 400, None,
                             "messages[0].tool_call_id"),
    "stream-options-without-stream": ({**_user({"type": "text", "text": "hi"}), "stream_options": {}}, 400, None,
                                      "stream_options"),
    "too-long-for-the-model": ({**_user({"type": "text", "text": "hi"}), "max_tokens": 100000}, 400,
                               "invalid_argument", None),
    "body-over-the-limit": (json.dumps(_user({"type": "text", "text": "x" * (1 << 20)})).encode(), 413, None, None),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_openai_shaped_errors(stack, case):
    body, status, code, param = BAD_REQUESTS[case]
    got_status, _, got = post(stack["gw"], "/v1/chat/completions", body)
    assert_openai_error(got_status, got, status, code, param)


def test_the_openai_client_raises_its_typed_errors_and_the_stack_stays_up(stack):
    c = client(stack["gw"])
    with pytest.raises(openai.NotFoundError) as err:
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 404 and err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="qwen2_vl", messages=[{"role": "user", "content": [image_part(b"junk")]}],
                                  stream=True)  # refused before the stream starts: a status, not an event
    assert err.value.status_code == 400 and "messages[0].content[0]" in err.value.message
    for name in ("vision", "audio_enc", "vae", "llm", "audio_llm", "gw", "audio_gw"):
        assert stack[name].proc.poll() is None, name
    r = c.chat.completions.create(model="qwen2_vl",
                                  messages=[{"role": "user", "content": [image_part(png(56, 56, 9))]}],
                                  max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    status, body = stack["gw"].health()
    assert status == 200, body


def test_unknown_routes_and_methods_are_openai_shaped(stack):
    status, _, body = post(stack["gw"], "/v1/embeddings", {"input": "x"})
    assert_openai_error(status, body, 404)
    with urllib.request.urlopen(urllib.request.Request(f"{stack['gw'].base_url}/v1/models", method="GET")) as r:
        assert r.status == 200
    status, headers, body = post(stack["gw"], "/v1/models", {})
    assert_openai_error(status, body, 405)


# ---- client disconnect frees the KV pages -----------------------------------------------------------
def test_client_disconnect_mid_stream_cancels_generation_and_frees_kv_pages(stack):
    llm, gw = stack["llm"], stack["gw"]
    cancelled = metric(llm.metrics_port, "modalmesh_requests_total", rpc="Generate", code="CANCELLED")
    conn = http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": "qwen2_vl", "messages": [{"role": "user", "content": "Tell a very long story."}],
        "max_tokens": 450, "ignore_eos": True, "temperature": 0, "stream": True}), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    events = 0
    while events < 4:  # the role chunk and a few tokens
        line = r.readline()
        assert line, "stream ended early"
        events += line.startswith(b"data: ")
    assert llm_info(llm.target).pools[0].used_tokens > 0  # the request holds KV pages now
    r.close()
    conn.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    used = None
    while time.monotonic() < deadline:
        used = llm_info(llm.target).pools[0].used_tokens
        if used == 0:
            break
        time.sleep(0.05)
    assert used == 0
    # It was cancelled (not run to its 450 tokens): the LLM counts a CANCELLED Generate, the gateway a 499.
    deadline = time.monotonic() + 10
    while metric(llm.metrics_port, "modalmesh_requests_total", rpc="Generate", code="CANCELLED") <= cancelled:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert metric(gw.metrics_port, "modalmesh_requests_total", rpc="/v1/chat/completions", code="499") >= 1
    assert metric(gw.metrics_port, "modalmesh_http_requests_total", route="/v1/chat/completions", status="499") >= 1
    assert metric(llm.metrics_port, "modalmesh_generation_tokens_total") < 450 * 50


# ---- /v1/images/decode ---------------------------------------------------------------------------
def _grpc_decode(target, latents):
    with grpc.insecure_channel(target) as channel:
        return pb.vae_pb2_grpc.VAEServiceStub(channel).Decode(
            pb.DecodeRequest(latents=to_proto(latents), output=pb.PNG), timeout=60).png


def _multipart(fields, files):
    boundary = "modalmeshboundary"
    out = b""
    for name, value in fields.items():
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
    for name, (filename, data) in files.items():
        out += (f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n").encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def test_images_decode_turns_latents_into_the_vaes_png(stack):
    gw = stack["gw"]
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    want = _grpc_decode(stack["vae"].target, latents)[0]
    npy = io.BytesIO()
    np.save(npy, latents.numpy())
    body, ctype = _multipart({"tiling": "off"}, {"file": ("z.npy", npy.getvalue())})
    status, _, got = post(gw, "/v1/images/decode", body, {"Content-Type": ctype})
    assert status == 200 and base64.b64decode(got["data"][0]["b64_json"]) == want and got["tiles"] == 1
    st = save_safetensors({"latents": latents[0]})  # (C, h, w): a batch of one
    status, headers, got = post(gw, "/v1/images/decode?response_format=png", st,
                                {"Content-Type": "application/octet-stream"}, raw=True)
    assert status == 200 and headers["Content-Type"] == "image/png" and got == want
    status, _, got = post(gw, "/v1/images/decode", {"latents": base64.b64encode(npy.getvalue()).decode()})
    assert status == 200 and base64.b64decode(got["data"][0]["b64_json"]) == want
    raw = {"latents": base64.b64encode(latents.numpy().tobytes()).decode(), "dtype": "float32", "shape": [1, 4, 8, 8]}
    status, _, got = post(gw, "/v1/images/decode", raw)
    assert status == 200 and base64.b64decode(got["data"][0]["b64_json"]) == want
    two = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    status, _, got = post(gw, "/v1/images/decode", save_safetensors({"latents": two}),
                          {"Content-Type": "application/octet-stream"})
    assert status == 200 and [base64.b64decode(d["b64_json"]) for d in got["data"]] == _grpc_decode(
        stack["vae"].target, two)


@pytest.mark.parametrize("body,ctype,param", [
    (b"not latents at all", "application/octet-stream", "latents"),
    ({"latents": "%%%"}, "application/json", "latents"),
    ({"latents": base64.b64encode(b"\0" * 12).decode(), "dtype": "float32", "shape": [1, 4, 8, 8]},
     "application/json", "latents"),
    (save_safetensors({"latents": torch.zeros(1, 3, 8, 8)}), "application/octet-stream", None),  # the VAE: 4 channels
    (save_safetensors({"latents": torch.zeros(1, 4, 8, 8)}), "application/x-www-form-urlencoded", None),
])
def test_bad_latents_are_400(stack, body, ctype, param):
    if ctype == "application/x-www-form-urlencoded":  # response_format png with a file of 2 images
        body, ctype = save_safetensors({"latents": torch.zeros(2, 4, 8, 8)}), "application/octet-stream"
        status, _, got = post(stack["gw"], "/v1/images/decode?response_format=png", body, {"Content-Type": ctype})
        assert_openai_error(status, got, 400, param="response_format")
        return
    status, _, got = post(stack["gw"], "/v1/images/decode", body, {"Content-Type": ctype})
    assert_openai_error(status, got, 400, param=param)


def test_images_decode_without_a_vae_is_501(stack):
    status, _, got = post(stack["audio_gw"], "/v1/images/decode", b"x", {"Content-Type": "application/octet-stream"})
    assert_openai_error(status, got, 501, code="not_configured")


def test_an_unreachable_llm_is_503_and_health_says_why():
    gw = GatewayProcess([*GATEWAY, "--llm", "ipv4:127.0.0.1:1"]).start()  # nothing listens on port 1
    try:
        gw.wait_listening()
        deadline = time.monotonic() + 30
        status, body = gw.health()
        while body.get("services", {}).get("llm", {}).get("status") != "UNREACHABLE":
            assert time.monotonic() < deadline, body
            time.sleep(0.05)
            status, body = gw.health()
        assert status == 503 and body["status"] == "unavailable" and "UNAVAILABLE" in body["services"]["llm"]["detail"]
        got_status, _, got = post(gw, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert_openai_error(got_status, got, 503, code="not_ready")
        with pytest.raises(openai.InternalServerError):
            client(gw).models.list()
    finally:
        assert gw.terminate(timeout=30) == 0


# ---- error paths of a scripted LLM: 429, 503, mid-stream failure, auth ---------------------------------
class ScriptedLLM(pb.llm_pb2_grpc.LLMServiceServicer):
    """Answers by the prompt text: 'full' -> RESOURCE_EXHAUSTED, 'gone' -> UNAVAILABLE,
    'precondition' -> FAILED_PRECONDITION, 'crash' -> INTERNAL after two tokens, else 'ok' x3."""

    def Info(self, request, context):
        return pb.ServiceInfo(service="llm", model_id="scripted", ready=True, max_model_len=64)

    def Generate(self, request, context):
        prompt = request.text
        codes = {"full": grpc.StatusCode.RESOURCE_EXHAUSTED, "gone": grpc.StatusCode.UNAVAILABLE,
                 "precondition": grpc.StatusCode.FAILED_PRECONDITION}
        if prompt in codes:
            context.abort(codes[prompt], f"scripted {prompt}")
        for i in range(3):
            if prompt == "crash" and i == 2:
                context.abort(grpc.StatusCode.INTERNAL, "scripted crash")
            last = i == 2
            yield pb.GenerateResponse(token_ids=[i], text="ok", logprobs=[-0.5] if request.sampling.logprobs else [],
                                      finish_reason=pb.STOP if last else pb.FINISH_REASON_UNSPECIFIED,
                                      usage=pb.Usage(prompt_tokens=4, completion_tokens=3) if last else None)


@pytest.fixture(scope="module")
def scripted():
    server = grpc.server(futures.ThreadPoolExecutor(8))
    pb.llm_pb2_grpc.add_LLMServiceServicer_to_server(ScriptedLLM(), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    gw = GatewayProcess([*GATEWAY, "--llm", f"127.0.0.1:{port}", "--api-key", "sesame",
                         "--metrics-buckets", "0.5,30,7200"]).start()
    try:
        gw.wait_listening()
        yield gw, health_servicer
    finally:
        assert gw.terminate(timeout=30) == 0
        server.stop(None)


def test_not_ready_is_503_until_the_llm_serves(scripted):
    gw, health_servicer = scripted
    status, body = gw.health()
    assert status == 503 and body["services"]["llm"]["status"] in ("NOT_SERVING", "UNKNOWN")
    with pytest.raises(openai.InternalServerError) as err:
        client(gw, "sesame").completions.create(model="scripted", prompt="x")
    assert err.value.status_code == 503 and err.value.body["code"] == "not_ready"
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    gw.wait_serving(timeout=30)
    assert client(gw, "sesame").completions.create(model="scripted", prompt="x").choices[0].text == "okokok"


@pytest.mark.parametrize("prompt,status,cls", [
    ("full", 429, openai.RateLimitError), ("gone", 503, openai.InternalServerError),
    ("precondition", 503, openai.InternalServerError)])
def test_grpc_codes_map_to_http_statuses(scripted, prompt, status, cls):
    gw, health_servicer = scripted
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    gw.wait_serving(timeout=30)
    for stream in (False, True):
        with pytest.raises(cls) as err:
            r = client(gw, "sesame").completions.create(model="scripted", prompt=prompt, stream=stream)
            list(r) if stream else r
        assert err.value.status_code == status and f"scripted {prompt}" in err.value.message


def test_a_failure_mid_stream_is_an_error_event_then_done(scripted):
    gw, health_servicer = scripted
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    gw.wait_serving(timeout=30)
    status, _, payload = post(gw, "/v1/completions", {"prompt": "crash", "stream": True},
                              {"Authorization": "Bearer sesame"}, raw=True)
    events = [e for e in payload.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])
    assert error["error"]["code"] == "internal" and "scripted crash" in error["error"]["message"]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]] == ["ok", "ok"]
    with pytest.raises(openai.APIError):
        list(client(gw, "sesame").completions.create(model="scripted", prompt="crash", stream=True))


def test_api_key_is_required_when_set(scripted):
    gw, _ = scripted
    with pytest.raises(openai.AuthenticationError):
        client(gw, "wrong").models.list()
    status, _, body = post(gw, "/v1/completions", {"prompt": "x"})
    assert_openai_error(status, body, 401, code="invalid_api_key")
    assert gw.health()[0] in (200, 503)  # /health needs no key


# ---- drain ---------------------------------------------------------------------------------------
def test_sigterm_lets_in_flight_streams_finish_then_exits_0(stack):
    gw = GatewayProcess([*GATEWAY, "--llm", stack["llm"].target]).start()
    try:
        gw.wait_serving(timeout=60)
        conn = http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({
            "prompt": "A long story:", "max_tokens": 120, "ignore_eos": True, "temperature": 0, "stream": True}),
            {"Content-Type": "application/json"})
        r = conn.getresponse()
        first = r.readline()
        assert first.startswith(b"data: ")
        gw.send_sigterm()
        rest = r.read().decode().split("\n\n")
        conn.close()
        assert rest[-2:] == ["data: [DONE]", ""]
        finish = json.loads(rest[-3][6:])["choices"][0]
        assert finish["finish_reason"] == "length"
        assert gw.proc.wait(timeout=30) == 0
        with pytest.raises(OSError):  # nothing listens any more
            http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=5).request("GET", "/health")
    finally:
        gw.terminate(timeout=30)


def test_http_metrics_have_their_own_status_label_and_are_on_the_http_port(scripted):
    gw, health_servicer = scripted
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    gw.wait_serving(timeout=30)
    before = metric(gw.metrics_port, "modalmesh_http_requests_total", route="/v1/completions", status="429")
    with pytest.raises(openai.RateLimitError):
        client(gw, "sesame").completions.create(model="scripted", prompt="full")
    assert list(client(gw, "sesame").completions.create(model="scripted", prompt="x", stream=True))
    # /metrics on the HTTP port, without the API key, is the same registry as --metrics-port's
    http_samples = scrape(gw.http_port)
    assert metric(gw.http_port, "modalmesh_http_requests_total", route="/v1/completions", status="429") == before + 1
    assert metric(gw.metrics_port, "modalmesh_http_requests_total", route="/v1/completions", status="429") == before + 1
    assert any(s.name == "modalmesh_ready" and s.labels["service"] == "gateway" for s in http_samples)
    assert all("code" not in s.labels for s in http_samples if s.name.startswith("modalmesh_http_"))
    # the gateway's TTFT and token gaps under their own names; the LLM's stay the LLM's
    assert metric(gw.metrics_port, "modalmesh_gateway_time_to_first_token_seconds_count") >= 1
    assert metric(gw.metrics_port, "modalmesh_gateway_inter_token_latency_seconds_count") >= 2
    assert metric(gw.metrics_port, "modalmesh_time_to_first_token_seconds_count") == 0
    assert metric(gw.metrics_port, "modalmesh_inter_token_latency_seconds_count") == 0
    # --metrics-buckets 0.5,30,7200 made the request-duration buckets
    bounds = {s.labels["le"] for s in scrape(gw.metrics_port)
              if s.name == "modalmesh_http_request_duration_seconds_bucket"}
    assert bounds == {"0.5", "30.0", "7200.0", "+Inf"}


@pytest.mark.parametrize("value,why", [("1,1,5", "strictly increasing"), ("5,1", "strictly increasing"),
                                       ("0,1", "positive"), ("1,fast", "comma-separated")])
def test_bad_metrics_buckets_exit_2_naming_the_flag(value, why):
    proc = subprocess.run([sys.executable, "-m", "services.gateway", *GATEWAY, "--llm", "127.0.0.1:1",
                           "--metrics-buckets", value], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--metrics-buckets" in proc.stderr and why in proc.stderr, proc.stderr
