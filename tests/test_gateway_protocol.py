"""The gateway's translation layer without processes: OpenAI bodies -> GenerateRequest, deltas -> OpenAI
shapes (validated with the openai package's own types), data URLs, latents files, gRPC -> HTTP codes."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from safetensors.torch import save as save_safetensors

from modalmesh import pb
from services.gateway import latents, protocol
from services.gateway.errors import APIError, from_grpc
from services.gateway.media import audio_bytes, image_input

LIMITS = protocol.Limits(max_image_bytes=1000, max_audio_bytes=1000)


def image_bytes(part, **kwargs):
    return image_input(part, **kwargs).data


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def chat(content, **extra):
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


def refused(fn, *args, status=400, expect_param=None, **kw) -> APIError:
    with pytest.raises(APIError) as err:
        fn(*args, **kw)
    assert err.value.status == status
    if expect_param is not None:
        assert err.value.param == expect_param, err.value.message
    return err.value


# ---- requests -------------------------------------------------------------------------------------
def test_chat_messages_become_grpc_chat_parts_in_order():
    body = chat([{"type": "text", "text": "a"},
                 {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(b"IMG")}},
                 {"type": "input_audio", "input_audio": {"data": b64(b"WAV"), "format": "wav"}}])
    body["messages"].insert(0, {"role": "developer", "content": "sys"})
    parsed = protocol.chat_request(body, LIMITS, "rid")
    msgs = parsed.grpc.chat.messages
    assert [m.role for m in msgs] == ["system", "user"] and msgs[0].content[0].text == "sys"
    parts = msgs[1].content
    assert parts[0].text == "a"
    assert parts[1].item.modality == pb.IMAGE and parts[1].item.input.data == b"IMG"
    assert parts[2].item.modality == pb.AUDIO and parts[2].item.input.data == b"WAV"
    assert parsed.item_params == ["messages[1].content[1]", "messages[1].content[2]"]
    assert parsed.grpc.request_id == "rid" and not parsed.stream


def test_sampling_fields_as_openai_names_them():
    s = protocol.sampling_params({"temperature": 0, "top_p": 0.5, "max_tokens": 3, "max_completion_tokens": 7,
                                  "stop": "x", "seed": -1, "top_k": 4, "ignore_eos": True}, chat=True)
    assert s.HasField("temperature") and s.temperature == 0 and s.top_p == 0.5 and s.max_tokens == 7
    assert list(s.stop) == ["x"] and s.seed == 2**64 - 1 and s.top_k == 4 and s.ignore_eos and s.logprobs == 0
    s = protocol.sampling_params({}, chat=True)
    assert not s.HasField("temperature") and not s.HasField("seed") and s.max_tokens == 0
    assert protocol.sampling_params({"logprobs": True, "top_logprobs": 0}, chat=True).logprobs == 1
    assert protocol.sampling_params({"logprobs": 0}, chat=False).logprobs == 1
    assert protocol.sampling_params({"logprobs": None}, chat=False).logprobs == 0


def test_openai_and_vllm_sampling_fields_reach_the_llm():
    s = protocol.sampling_params({"n": 3, "presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"7": -100,
                                  "3": 2.5}, "min_p": 0.1, "min_tokens": 2, "include_stop_str_in_output": True,
                                  "logprobs": True, "top_logprobs": 4}, chat=True)
    assert (s.n, s.presence_penalty, s.frequency_penalty, dict(s.logit_bias), s.min_tokens) == (
        3, 0.5, -1.0, {7: -100.0, 3: 2.5}, 2)
    assert s.min_p == pytest.approx(0.1) and s.include_stop_str_in_output and (s.logprobs, s.top_logprobs) == (1, 4)
    s = protocol.sampling_params({"logprobs": 3}, chat=False)
    assert (s.logprobs, s.top_logprobs) == (1, 3)


@pytest.mark.parametrize("body, want", [
    ({"response_format": {"type": "json_object"}}, pb.StructuredOutput(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
     pb.StructuredOutput(json_schema='{"type": "integer"}')),
    ({"guided_json": '{"type": "integer"}'}, pb.StructuredOutput(json_schema='{"type": "integer"}')),
    ({"guided_regex": "a+"}, pb.StructuredOutput(regex="a+")),
    ({"guided_choice": ["yes", "no"]}, pb.StructuredOutput(choice=pb.ChoiceList(choices=["yes", "no"]))),
    ({"guided_grammar": 'root ::= "a"'}, pb.StructuredOutput(grammar='root ::= "a"')),
    ({"structured_outputs": {"json": {"type": "integer"}}}, pb.StructuredOutput(json_schema='{"type": "integer"}')),
    ({"structured_outputs": {"choice": ["a"]}}, pb.StructuredOutput(choice=pb.ChoiceList(choices=["a"]))),
    ({"structured_outputs": {"json_object": True}}, pb.StructuredOutput(json_object=True)),
    ({"response_format": {"type": "text"}}, None),
])
def test_structured_output_fields_become_one_structured_output(body, want):
    s = protocol.sampling_params(body, chat=True)
    assert (s.structured if s.HasField("structured") else None) == want


@pytest.mark.parametrize("body,param", [
    ({"n": 17}, "n"), ({"n": 0}, "n"), ({"temperature": True}, "temperature"), ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"stop": ["", "a"]}, "stop"),
    ({"stop": 5}, "stop"), ({"seed": 1.5}, "seed"), ({"seed": 2**64}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"logit_bias": {"a": 2}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"), ({"min_p": 2}, "min_p"), ({"min_tokens": -1}, "min_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{not json"}}},
     "response_format.json_schema.schema"),
    ({"guided_json": 5}, "guided_json"), ({"guided_choice": []}, "guided_choice"), ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object"),
])
def test_bad_sampling_fields_name_the_field(body, param):
    refused(protocol.sampling_params, body, chat=True, expect_param=param)


def test_completion_prompts():
    assert protocol.completion_request({"prompt": "hi"}, "r").grpc.text == "hi"
    assert protocol.completion_request({"prompt": ["hi"]}, "r").grpc.text == "hi"
    assert list(protocol.completion_request({"prompt": [1, 2]}, "r").grpc.token_ids.ids) == [1, 2]
    assert list(protocol.completion_request({"prompt": [[3, 4]]}, "r").grpc.token_ids.ids) == [3, 4]
    for bad in ({"prompt": ["a", "b"]}, {"prompt": ""}, {}, {"prompt": [1, 2], "echo": True, "logprobs": 1},
                {"prompt": [1, 2], "echo": True}, {"prompt": "a", "logprobs": 21}, {"prompt": "a", "best_of": 2},
                {"prompt": "a", "response_format": {"type": "json_object"}}):
        refused(protocol.completion_request, bad, "r")
    assert protocol.completion_request({"prompt": "ab", "echo": True}, "r").echo == "ab"
    assert not protocol.completion_request({"prompt": "ab", "echo": True}, "r").grpc.sampling.HasField("prompt_logprobs")
    # echo with logprobs k: the LLM scores the prompt with k alternatives (or more, for prompt_logprobs)
    echoed = protocol.completion_request({"prompt": "ab", "echo": True, "logprobs": 3}, "r")
    assert echoed.grpc.sampling.prompt_logprobs == 3 and echoed.prompt_logprobs == 3  # vLLM shows them too
    both = protocol.completion_request({"prompt": "ab", "echo": True, "logprobs": 2, "prompt_logprobs": 5}, "r")
    assert both.grpc.sampling.prompt_logprobs == 5 and both.prompt_logprobs == 5
    parsed = protocol.completion_request({"prompt": "a", "stream": True, "stream_options": {"include_usage": True}},
                                         "r")
    assert parsed.stream and parsed.include_usage


# Every known field this server does not implement is a 400 naming it, on both routes where it applies.
REFUSED = {
    "best_of": 2, "suffix": "x", "audio": {"voice": "alloy"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {}, "store": True,
    "reasoning_effort": "low", "verbosity": "low", "service_tier": "flex", "functions": [{"name": "f"}],
    "function_call": "auto", "use_beam_search": True, "length_penalty": 0.5, "early_stopping": True,
    "allowed_token_ids": [1], "bad_words": ["x"], "truncate_prompt_tokens": 5,
    "spaces_between_special_tokens": False, "logits_processors": ["x"], "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ", "structural_tag": "x", "documents": [{"t": 1}],
    "mm_processor_kwargs": {"max_pixels": 5}, "return_tokens_as_token_ids": True, "return_token_ids": True,
    "priority": 1, "cache_salt": "s", "kv_transfer_params": {}, "vllm_xargs": {}, "add_special_tokens": True,
}
TEMPLATE = {"chat_template": "{{ x }}"}  # chat_template_kwargs / continue_final_message work: test_templates.py


def test_the_refused_lists_are_the_tests_lists():
    # A field added to the server's lists gets a case here (and one taken out, a test of what it does).
    assert set(REFUSED) == set(protocol.UNSUPPORTED) and set(TEMPLATE) == set(protocol.TEMPLATE_FIELDS)


@pytest.mark.parametrize("key", list(REFUSED) + list(TEMPLATE) + ["echo"])
def test_every_unsupported_chat_field_is_a_400_naming_it(key):
    value = {**REFUSED, **TEMPLATE, "echo": True}[key]
    err = refused(protocol.chat_request, chat("hi", **{key: value}), LIMITS, "r", expect_param=key)
    assert err.code == "unsupported_parameter" and key in err.message


@pytest.mark.parametrize("key", list(REFUSED))
def test_every_unsupported_completion_field_is_a_400_naming_it(key):
    err = refused(protocol.completion_request, {"prompt": "hi", key: REFUSED[key]}, "r", expect_param=key)
    assert err.code == "unsupported_parameter"


def test_fields_set_to_what_asks_for_nothing_pass():
    body = chat("hi", n=1, best_of=1, store=False, modalities=["text"], service_tier="auto", tools=[],
                tool_choice="none", use_beam_search=False, length_penalty=1.0, echo=False, chat_template_kwargs={},
                continue_final_message=False, guided_decoding_backend="xgrammar", user="u", metadata={"a": "b"})
    protocol.chat_request(body, LIMITS, "r")


@pytest.mark.parametrize("content,param", [
    ([{"type": "image"}], "messages[0].content[0].type"),
    ([{"text": "no type"}], "messages[0].content[0]"),
    ([{"type": "text", "text": 3}], "messages[0].content[0].text"),
    (5, "messages[0].content"),
    ([{"type": "image_url", "image_url": {}}], "messages[0].content[0].image_url.url"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
     "messages[0].content[0].input_audio.data"),
    ([{"type": "audio_url", "audio_url": {"url": "https://x/a.wav"}}], "messages[0].content[0].audio_url"),
])
def test_bad_content_parts(content, param):
    refused(protocol.chat_request, chat(content), LIMITS, "r", expect_param=param)


def test_data_urls():
    part = lambda url: {"image_url": {"url": url}}  # noqa: E731
    url = "data:image/png;base64," + b64(b"x" * 10)
    assert image_bytes(part(url), param="p", max_bytes=10, local_root=None) == b"x" * 10
    assert image_bytes({"image_url": "data:;base64," + b64(b"y")}, param="p", max_bytes=10, local_root=None) == b"y"
    assert refused(image_bytes, part("data:image/png;base64," + b64(b"x" * 11)), param="p", max_bytes=10,
                   local_root=None).code == "image_too_large"
    for url, code in [("data:image/png," + b64(b"x"), "invalid_image_url"),
                      ("data:image/png;base64,a b", "invalid_image"),
                      ("data:audio/wav;base64,AAAA", "invalid_image_url"), ("ftp://x", "invalid_image_url"),
                      ("file:///etc/hostname", "file_urls_disabled"), ("http://x/y.png", "unsupported_image_url")]:
        assert refused(image_bytes, part(url), param="p", max_bytes=100, local_root=None).code == code, url
    ok = {"input_audio": {"data": b64(b"RIFF"), "format": "WAV"}}
    assert audio_bytes(ok, param="p", max_bytes=10) == b"RIFF"
    as_url = {"input_audio": {"data": "data:audio/wav;base64," + b64(b"RIFF")}}
    assert audio_bytes(as_url, param="p", max_bytes=10) == b"RIFF"
    assert refused(audio_bytes, {"input_audio": {"data": b64(b"RIFF"), "format": "aac"}}, param="p",
                   max_bytes=10).param == "p.input_audio.format"


def test_file_urls_stay_under_the_root(tmp_path):
    (tmp_path / "a.png").write_bytes(b"PNGDATA")
    outside = tmp_path.parent / "outside.png"
    outside.write_bytes(b"x")
    (tmp_path / "link.png").symlink_to(outside)
    part = lambda p: {"image_url": {"url": p.as_uri()}}  # noqa: E731
    assert image_bytes(part(tmp_path / "a.png"), param="p", max_bytes=100, local_root=tmp_path.resolve()) == b"PNGDATA"
    for p in (outside, tmp_path / "link.png", tmp_path / "missing.png", tmp_path):
        refused(image_bytes, part(p), param="p", max_bytes=100, local_root=tmp_path.resolve())


# ---- responses: the openai package's own types parse them ----------------------------------------------
def deltas():
    return [pb.GenerateResponse(token_ids=[5], text="Hel", logprobs=[-0.1]),
            pb.GenerateResponse(token_ids=[6], text="", logprobs=[-0.2]),
            pb.GenerateResponse(token_ids=[7, 8], text="lo", logprobs=[-0.3, -0.4], finish_reason=pb.STOP,
                                usage=pb.Usage(prompt_tokens=4, completion_tokens=4, cached_tokens=2))]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_full_responses_parse_as_openai_types(kind):
    acc = protocol.Accumulator(kind, logprobs=True)
    for d in deltas():
        acc.add(d)
    body = json.loads(json.dumps(protocol.completion_body(kind, "id-1", "m", acc, "fp")))
    if kind == "chat":
        r = ChatCompletion.model_validate(body)
        assert r.choices[0].message.content == "Hello" and r.choices[0].finish_reason == "stop"
        assert [t.token for t in r.choices[0].logprobs.content] == ["Hel", "token_id:6", "token_id:7", "token_id:8"]
        assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    else:
        r = Completion.model_validate(body)
        assert r.choices[0].text == "Hello" and r.choices[0].logprobs.text_offset == [0, 3, 3, 3]
    assert r.usage.total_tokens == 8 and r.usage.prompt_tokens_details.cached_tokens == 2


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_chunks_parse_as_openai_types(kind):
    maker = protocol.ChunkMaker(kind, "id-2", "m", include_usage=True, fingerprint=None)
    acc = protocol.Accumulator(kind, logprobs=False)
    chunks = [maker.role()] if kind == "chat" else []
    for d in deltas():
        text, lp = acc.add(d)
        if text:
            chunks.append(maker.content(text, lp))
    chunks += [maker.finish(acc.finish_reason), maker.usage(acc.usage)]
    if kind == "chat":
        parsed = [ChatCompletionChunk.model_validate(json.loads(json.dumps(c))) for c in chunks]
        assert "".join(p.choices[0].delta.content or "" for p in parsed if p.choices) == "Hello"
        assert parsed[0].choices[0].delta.role == "assistant"
    else:
        for c in chunks:  # the strict type wants a finish_reason; OpenAI's stream itself sends null until the end
            body = json.loads(json.dumps(c))
            for choice in body["choices"]:
                choice["finish_reason"] = choice["finish_reason"] or "length"
            Completion.model_validate(body)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hello"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and all(c["usage"] is None for c in chunks[:-1])


# ---- latents ------------------------------------------------------------------------------------------
def npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def test_latents_files_become_wire_tensors():
    x = np.arange(2 * 4 * 3 * 3, dtype=np.float64).reshape(2, 4, 3, 3) / 7
    t = latents.from_file(npy(x.astype(">f8")))  # big-endian float64 -> little-endian float32
    assert t.dtype == pb.FLOAT32 and list(t.shape) == [2, 4, 3, 3]
    assert np.array_equal(np.frombuffer(t.data, "<f4").reshape(2, 4, 3, 3), x.astype(np.float32))
    t = latents.from_file(npy(x[0].astype(np.float16)))  # (C, h, w) -> a batch of one
    assert t.dtype == pb.FLOAT16 and list(t.shape) == [1, 4, 3, 3]
    bf = torch.randn(1, 4, 2, 2).to(torch.bfloat16)
    t = latents.from_file(save_safetensors({"other": torch.zeros(1), "latents": bf}))
    assert t.dtype == pb.BFLOAT16 and t.data == bf.view(torch.int16).numpy().tobytes()
    t = latents.from_file(save_safetensors({"z": torch.ones(4, 2, 2, dtype=torch.float64)}))
    assert t.dtype == pb.FLOAT32 and np.frombuffer(t.data, "<f4").tolist() == [1.0] * 16
    t = latents.from_raw(np.ones((1, 4, 2, 2), "<f2").tobytes(), "float16", [1, 4, 2, 2])
    assert t.dtype == pb.FLOAT16


@pytest.mark.parametrize("data", [
    b"", b"\x93NUMPY garbage", npy(np.zeros((4, 2, 2), np.int32)), npy(np.zeros((2, 2), np.float32)),
    save_safetensors({"a": torch.zeros(4, 2, 2), "b": torch.zeros(4, 2, 2)}),
    save_safetensors({"latents": torch.zeros(1, 4, 2, 2)})[:-8],  # truncated
    save_safetensors({"latents": torch.zeros(1, 4, 2, 2, dtype=torch.int64)}),
    b"\xff" * 8 + b"{}",
])
def test_bad_latents_files(data):
    refused(latents.from_file, data)


# ---- errors -------------------------------------------------------------------------------------------
class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("code,status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.NOT_FOUND, 404),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.FAILED_PRECONDITION, 503), (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (grpc.StatusCode.INTERNAL, 500), (grpc.StatusCode.UNIMPLEMENTED, 501),
])
def test_grpc_codes_map_to_http(code, status):
    err = from_grpc(FakeRpcError(code, "what\nhappened"), "llm")
    body = err.body()["error"]
    assert err.status == status and set(body) == {"message", "type", "param", "code"}
    assert "\n" not in body["message"] and "what happened" in body["message"] and body["code"] == code.name.lower()


def test_the_gateway_refuses_to_start_without_a_backend():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODALMESH_")}
    result = subprocess.run([sys.executable, "-m", "services.gateway", "--port", "0"], capture_output=True,
                            text=True, timeout=60, env=env)
    assert result.returncode == 2 and "--llm" in result.stderr


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_prompt_logprobs_are_taken_in_range_and_never_streamed(route):
    parse = ((lambda extra: protocol.chat_request(chat("x", **extra), LIMITS, "r")) if route == "chat" else
             (lambda extra: protocol.completion_request({"prompt": "x", **extra}, "r")))
    for k in (0, 20):
        parsed = parse({"prompt_logprobs": k})
        assert parsed.grpc.sampling.prompt_logprobs == k and parsed.prompt_logprobs == k
    assert not parse({}).grpc.sampling.HasField("prompt_logprobs") and parse({}).prompt_logprobs is None
    for bad in ({"prompt_logprobs": -1}, {"prompt_logprobs": 21}, {"prompt_logprobs": "2"},
                {"prompt_logprobs": 1, "stream": True}):
        assert refused(parse, bad).param == "prompt_logprobs"


def _prompt_message(**kw) -> pb.GenerateResponse:
    """A choice's first message carrying the LLM's scores of a three-token prompt."""
    return pb.GenerateResponse(token_ids=[9], text="!", logprobs=[-0.5], tokens=["!"], **kw,
                               prompt_logprobs=pb.PromptLogprobs(
                                   token_ids=[4, 5, 6], tokens=["a", "b", "c"], logprobs=[-1.0, -2.0], ranks=[1, 7],
                                   top=[pb.TopLogprobs(token_ids=[5, 8], logprobs=[-1.0, -1.5], tokens=["b", "x"]),
                                        pb.TopLogprobs(token_ids=[8, 2], logprobs=[-0.125, -0.25], tokens=["x", "y"])]))


def test_echo_with_logprobs_leads_with_the_prompts_scored_tokens():
    acc = protocol.Accumulator("completion", logprobs=True, top_logprobs=1, echo="abc")
    text, lp = acc.add(_prompt_message(top_logprobs=[pb.TopLogprobs(token_ids=[9], logprobs=[-0.5], tokens=["!"])]))
    assert text == "abc!"  # streamed: the echo goes out with the first message's scores
    assert lp["tokens"] == ["a", "b", "c", "!"] and lp["token_logprobs"] == [None, -1.0, -2.0, -0.5]
    # OpenAI's completions shape: the chosen token's own entry and its top k (so up to k + 1)
    assert lp["top_logprobs"] == [None, {"b": -1.0}, {"c": -2.0, "x": -0.125}, {"!": -0.5}]
    assert lp["text_offset"] == [0, 1, 2, 3]
    acc.add(pb.GenerateResponse(token_ids=[7], text="?", logprobs=[-0.25], tokens=["?"], finish_reason=pb.LENGTH,
                                top_logprobs=[pb.TopLogprobs(token_ids=[7], logprobs=[-0.25], tokens=["?"])]))
    full = acc.full_logprobs()
    assert "".join(acc.text) == "abc!?" and full["tokens"] == ["a", "b", "c", "!", "?"]
    assert full["token_logprobs"] == [None, -1.0, -2.0, -0.5, -0.25] and full["text_offset"] == [0, 1, 2, 3, 4]


def test_vllm_prompt_logprobs_hold_each_token_and_its_top_k_by_id():
    acc = protocol.Accumulator("completion", logprobs=False, prompt_logprobs=1)
    text, lp = acc.add(_prompt_message())
    assert text == "!" and lp is None
    assert acc.vllm_prompt_logprobs() == [
        None,
        {"5": {"logprob": -1.0, "rank": 1, "decoded_token": "b"}},  # the token is its own top 1
        {"6": {"logprob": -2.0, "rank": 7, "decoded_token": "c"}, "8": {"logprob": -0.125, "rank": 1,
                                                                        "decoded_token": "x"}},
    ]
    body = protocol.completion_body("chat", "r", "m", protocol.Accumulator("chat", False, prompt_logprobs=0), None)
    assert body["prompt_logprobs"] is None  # asked, but no message came: nothing to show


def test_echoed_offsets_go_on_over_the_prompts_token_texts():
    """A BOS token's text is in the prompt's tokens but not in the echo: the generated tokens' offsets go on
    from the prompt tokens' texts (vLLM's count), never back to len(echo). (Tokens of one message share its
    offset: its text, not the tokens' texts, is what the answer holds.)"""
    acc = protocol.Accumulator("completion", logprobs=True, echo="ab")
    _, lp = acc.add(pb.GenerateResponse(token_ids=[9, 7], text="!?", logprobs=[-0.5, -0.25], tokens=["!", "?"],
                                        prompt_logprobs=pb.PromptLogprobs(token_ids=[1, 4, 5],
                                                                          tokens=["<s>", "a", "b"],
                                                                          logprobs=[-1.0, -2.0], ranks=[1, 2])))
    assert lp["tokens"] == ["<s>", "a", "b", "!", "?"] and lp["text_offset"] == [0, 3, 4, 5, 5]
    assert lp["top_logprobs"] is None
