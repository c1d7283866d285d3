"""The gateway's tool calling without processes: tools / tool_choice checks, the Hermes parser (whole and
streamed), and what reaches the LLM (the chat's tools, a tool-call grammar for required / named)."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from modalmesh import pb
from services.gateway import protocol, tools
from services.gateway.errors import APIError

LIMITS = protocol.Limits(max_image_bytes=1000, max_audio_bytes=1000)
F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}
G = {"type": "function", "function": {"name": "g"}}


def chat(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize("extra, param", [
    ({"tools": {"f": 1}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [F, F]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [F], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": "h"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [F], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
])
def test_bad_tools_name_the_field(extra, param):
    with pytest.raises(APIError) as err:
        protocol.chat_request(chat(**extra), LIMITS, "r")
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_tools_reach_the_llm_and_required_or_named_become_a_tool_call_grammar():
    auto = protocol.chat_request(chat(tools=[F, G]), LIMITS, "r")
    assert json.loads(auto.grpc.chat.tools) == [F, G] and not auto.grpc.sampling.HasField("structured")
    assert auto.tools.choice == "auto"
    required = protocol.chat_request(chat(tools=[F, G], tool_choice="required"), LIMITS, "r")
    schema = json.loads(required.grpc.sampling.structured.tool_call)
    assert [o["properties"]["name"] for o in schema["anyOf"]] == [{"const": "f"}, {"const": "g"}]
    assert schema["anyOf"][0]["properties"]["arguments"] == F["function"]["parameters"]
    assert schema["anyOf"][1]["properties"]["arguments"] == {"type": "object"}  # no parameters: any object
    named = protocol.chat_request(chat(tools=[F, G], tool_choice={"type": "function", "function": {"name": "g"}}),
                                  LIMITS, "r")
    assert json.loads(named.grpc.sampling.structured.tool_call)["properties"]["name"] == {"const": "g"}
    none = protocol.chat_request(chat(tools=[F], tool_choice="none"), LIMITS, "r")
    assert none.grpc.chat.tools and none.tools is None  # shown to the model, nothing parsed


def test_tool_messages_and_assistant_calls_reach_the_llm():
    body = {"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2", "name": "f"}], "tools": [F]}
    msgs = protocol.chat_request(body, LIMITS, "r").grpc.chat.messages
    assert msgs[1].tool_calls[0] == pb.ToolCall(id="c1", name="f", arguments='{"x": 1}')
    assert (msgs[2].role, msgs[2].tool_call_id, msgs[2].name, msgs[2].content[0].text) == ("tool", "c1", "f", "2")
    for bad, param in [({"role": "tool", "content": "2"}, "messages[0].tool_call_id"),
                       ({"role": "user", "content": "x", "tool_calls": [{}]}, "messages[0].tool_calls"),
                       ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
                        "messages[0].tool_calls[0].function.arguments")]:
        with pytest.raises(APIError) as err:
            protocol.chat_request({"model": "m", "messages": [bad]}, LIMITS, "r")
        assert err.value.param == param


CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


@pytest.mark.parametrize("text, content, calls", [
    ("plain answer", "plain answer", []),
    ("Sure." + CALL, "Sure.", [("f", {"x": 1})]),
    (CALL + CALL.replace('"x": 1', '"x": 2'), None, [("f", {"x": 1}), ("f", {"x": 2})]),
    ('<tool_call>\n{"name": "f", "arguments": {"s": "a\x01b"}}\n</tool_call>', None, [("f", {"s": "a\x01b"})]),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("<tool_call>\n{\"name\": \"f\"", '<tool_call>\n{"name": "f"', []),  # unfinished: content, as vLLM
])
def test_the_hermes_parser(text, content, calls):
    got_content, got_calls = tools.parse(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls


@pytest.mark.parametrize("text", ["Sure." + CALL, "no call <tool", "a<tool_call>b" + CALL, CALL + " ", "x" + CALL + CALL])
def test_streamed_parsing_equals_the_whole_answers(text):
    for step in (1, 3, 7, len(text)):
        parser = tools.StreamParser()
        content, deltas = "", []
        for i in range(0, len(text), step):
            c, d = parser.feed(text[i:i + step])
            content += c
            deltas += d
        content += parser.finish()
        want_content, want_calls = tools.parse(text)
        assert content == (want_content or "")
        names = [d["function"]["name"] for d in deltas if "id" in d]
        args = [d["function"]["arguments"] for d in deltas if "id" not in d]
        assert names == [c["function"]["name"] for c in want_calls]
        assert args == [c["function"]["arguments"] for c in want_calls]


def test_tool_call_responses_parse_as_openai_types():
    parsed = protocol.chat_request(chat(tools=[F]), LIMITS, "r")
    acc = protocol.Choices("chat", parsed)
    acc[0].add(pb.GenerateResponse(token_ids=[1], text="Sure." + CALL, finish_reason=pb.STOP,
                                   usage=pb.Usage(prompt_tokens=3, completion_tokens=1)))
    r = ChatCompletion.model_validate(json.loads(json.dumps(protocol.completion_body("chat", "i", "m", acc, None))))
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "Sure."
    assert r.choices[0].message.tool_calls[0].function.name == "f"
    maker = protocol.ChunkMaker("chat", "i", "m", include_usage=False, fingerprint=None)
    _, deltas = tools.StreamParser().feed(CALL)
    chunk = ChatCompletionChunk.model_validate(maker.tool_calls(deltas))
    assert chunk.choices[0].delta.tool_calls[0].function.name == "f"


def test_parallel_tool_calls_false_keeps_the_first_call():
    two = CALL + CALL.replace('"x": 1', '"x": 2')
    assert len(tools.parse(two)[1]) == 2 and len(tools.parse(two, parallel=False)[1]) == 1
    parser = tools.StreamParser(parallel=False)
    _, deltas = parser.feed(two)
    assert [d["function"]["arguments"] for d in deltas if "id" not in d] == ['{"x": 1}']
    parsed = protocol.chat_request(chat(tools=[F], parallel_tool_calls=False), LIMITS, "r")
    assert parsed.tools.parallel is False
    with pytest.raises(APIError):
        protocol.chat_request(chat(tools=[F], parallel_tool_calls="no"), LIMITS, "r")
