"""The sampling surface and structured output through the local stack, driven by the official openai client.

One tiny random Qwen2 LLM (FP32, CPU) behind one gateway, on 127.0.0.1 ephemeral ports. References:
greedy tokens from a loop over the Hugging Face model with the penalties written out on its logits
(OpenAI's formula), HF's logprobs for top_logprobs, `jsonschema` for JSON-schema output, `re` for regexes.
"""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest
import torch

from modalmesh import pb
from modalmesh.ops.launcher import ServiceProcess
from modalmesh.testing import tiny
from services.gateway.launch import GatewayProcess

COMMON = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--device", "cpu"]
GATEWAY = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--grace-period", "10"]
MODEL = "qwen2"
PROMPT = "The quick brown fox"
# A Hermes / Qwen2.5-style template (the tiny checkpoint's own knows no tools): tools in a system block,
# calls as <tool_call> JSON, tool results as <tool_response>.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n{{ tool.function.name }}: {{ tool.function.parameters | tojson }}{% endfor %}"
    "\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for call in message.tool_calls %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    model_dir = tiny.ensure(MODEL, root)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(model_dir)
    llm = ServiceProcess("llm", [*COMMON, "--model", str(model_dir), "--kv-cache-tokens", "4096"]).start()
    procs = [llm]
    try:
        llm.wait_listening()
        gw = GatewayProcess([*GATEWAY, "--llm", llm.target, "--served-model-name", MODEL]).start()
        procs.append(gw)
        for p in procs:
            p.wait_serving(timeout=180)
        yield dict(dir=model_dir, llm=llm, gw=gw)
        assert gw.terminate(timeout=30) == 0, gw.log_tail()
    finally:
        for p in reversed(procs):
            p.send_sigterm()
        for p in reversed(procs):
            p.terminate(timeout=60)


def client(stack):
    return openai.OpenAI(base_url=f"{stack['gw'].base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def generate(stack, **request) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(stack["llm"].target) as channel:
        return list(pb.llm_pb2_grpc.LLMServiceStub(channel).Generate(pb.GenerateRequest(**request), timeout=120))


@pytest.fixture(scope="module")
def hf(stack):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(stack["dir"], dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(stack["dir"])


def _reference_greedy(model, prompt_ids, steps, *, presence=0.0, frequency=0.0, bias=None):
    """Greedy decoding with logit_bias and OpenAI's penalties applied to the HF model's logits by hand."""
    ids, out = list(prompt_ids), []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float().clone()
        for t, b in (bias or {}).items():
            logits[t] += b
        for t in set(out):
            logits[t] -= out.count(t) * frequency + presence
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
    return out


# ---- penalties, logit_bias: tokens against the reference --------------------------------------------------
@pytest.mark.parametrize("presence, frequency, bias", [(2.0, 0.0, {}), (-2.0, 0.0, {}), (0.0, -1.0, {}),
                                                     (0.5, 1.0, {5: 3.0, 60: -100.0})])
def test_penalties_and_logit_bias_equal_a_reference_on_the_hf_logits(stack, hf, presence, frequency, bias):
    model, tok = hf
    prompt_ids = tok(PROMPT)["input_ids"]
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, presence_penalty=presence,
                                 frequency_penalty=frequency)
    for t, b in bias.items():
        sampling.logit_bias[t] = b
    got = [t for m in generate(stack, token_ids=pb.TokenIds(ids=prompt_ids), sampling=sampling) for t in m.token_ids]
    want = _reference_greedy(model, prompt_ids, 20, presence=presence, frequency=frequency, bias=bias)
    assert got == want
    plain = _reference_greedy(model, prompt_ids, 20)
    assert want != plain  # the penalties changed the answer, so the comparison means something


def test_logit_bias_through_the_openai_client(stack, hf):
    _, tok = hf
    target = tok("fox")["input_ids"][0]
    r = client(stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0,
                                         logit_bias={str(target): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tok.decode([target] * 4)


# ---- n, seed ----------------------------------------------------------------------------------------------
def test_n3_with_a_seed_is_reproducible_and_choice_i_is_seed_plus_i(stack):
    c = client(stack)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me"}], n=3, seed=42, temperature=1.0,
                  max_tokens=10)
    a, b = c.chat.completions.create(**kwargs), c.chat.completions.create(**kwargs)
    texts = [ch.message.content for ch in a.choices]
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert texts == [ch.message.content for ch in b.choices]
    assert len(set(texts)) > 1  # three draws, not one answer thrice
    singles = [c.chat.completions.create(**{**kwargs, "n": 1, "seed": 42 + i}).choices[0].message.content
               for i in range(3)]
    assert singles == texts
    assert a.usage.completion_tokens == sum(c.usage.completion_tokens for c in [a]) and a.usage.completion_tokens > 3
    # Streamed, each choice's chunks add up to the same text, and usage counts every choice.
    stream = c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    parts, finished, usage = {0: "", 1: "", 2: ""}, set(), None
    for chunk in stream:
        for ch in chunk.choices:
            parts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
        usage = chunk.usage or usage
    assert [parts[i] for i in range(3)] == texts and finished == {0, 1, 2}
    assert usage.completion_tokens == a.usage.completion_tokens


# ---- logprobs ---------------------------------------------------------------------------------------------
def test_top_logprobs_equal_hf_on_chat_and_completions(stack, hf):
    model, tok = hf
    prompt_ids = tok(PROMPT)["input_ids"]
    r = client(stack).completions.create(model=MODEL, prompt=prompt_ids, max_tokens=5, temperature=0.0, logprobs=3,
                                         extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    messages = generate(stack, token_ids=pb.TokenIds(ids=prompt_ids),
                        sampling=pb.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1,
                                                   top_logprobs=3))
    out = [t for m in messages for t in m.token_ids]
    with torch.no_grad():
        ref = model(torch.tensor([prompt_ids + out])).logits[0].float().log_softmax(-1)[len(prompt_ids) - 1:-1]
    grpc_top = [top for m in messages for top in m.top_logprobs]
    for i, token in enumerate(out):
        want = ref[i].topk(3)
        assert list(grpc_top[i].token_ids) == want.indices.tolist()
        torch.testing.assert_close(torch.tensor(list(grpc_top[i].logprobs)), want.values, atol=1e-4, rtol=0)
        assert lp.token_logprobs[i] == pytest.approx(ref[i, token].item(), abs=1e-4)
        # OpenAI's completions shape is {token text: logprob}: two ids of one text share a key, as they do here.
        ref_top = dict(zip((tok.decode([t]) for t in want.indices.tolist()), want.values.tolist()))
        assert lp.top_logprobs[i] == pytest.approx(ref_top, abs=1e-4)
        assert lp.tokens[i] == tok.decode([token])
    chat = client(stack).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=20)
    for entry in chat.choices[0].logprobs.content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 20 and values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.logprob == pytest.approx(values[0])


def test_completions_echo_prepends_the_prompt(stack):
    c = client(stack)
    plain = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.0)
    echoed = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.0, echo=True, stream=True) if ch.choices)
    assert streamed == echoed.choices[0].text


def _hf_prompt_logprobs(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)  # row p scores token p + 1


def test_completions_echo_with_logprobs_scores_the_prompt_as_hf_does(stack, hf):
    model, tok = hf
    ids = tok(PROMPT)["input_ids"]
    ref = _hf_prompt_logprobs(model, ids)
    c = client(stack)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0.0, logprobs=2, echo=True)
    r = c.completions.create(**kwargs)
    plain = c.completions.create(**{**kwargs, "echo": False})
    lp, n = r.choices[0].logprobs, len(ids)
    assert r.choices[0].text == PROMPT + plain.choices[0].text
    assert lp.tokens[:n] == [tok.decode([t]) for t in ids] and lp.tokens[n:] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has nothing before it
    want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:n]), want, atol=1e-4, rtol=0)
    for p in range(1, n):
        top = ref[p - 1].topk(2)  # OpenAI's shape: the token's own entry, and the top 2
        expected = {tok.decode([ids[p]]): ref[p - 1, ids[p]].item(),
                    **dict(zip((tok.decode([t]) for t in top.indices.tolist()), top.values.tolist()))}
        assert lp.top_logprobs[p] == pytest.approx(expected, abs=1e-4)
    assert lp.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-6)
    assert lp.text_offset[n] == len(PROMPT)
    # Streamed: the echo and its scores come in the first chunk; the chunks add up to the same answer.
    chunks = [ch.choices[0] for ch in c.completions.create(**kwargs, stream=True) if ch.choices]
    assert "".join(ch.text for ch in chunks) == r.choices[0].text
    streamed = [v for ch in chunks if ch.logprobs for v in ch.logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6) and chunks[0].text.startswith(PROMPT)


def test_vllm_prompt_logprobs_on_chat_and_completions(stack, hf):
    model, tok = hf
    messages = [{"role": "user", "content": "Hello there"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ref = _hf_prompt_logprobs(model, ids)
    c = client(stack)
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0.0,
                                     extra_body={"prompt_logprobs": 1})
    scores = chat.model_extra["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    for p, entry in enumerate(scores[1:]):
        mine = entry[str(ids[p + 1])]
        assert mine["logprob"] == pytest.approx(ref[p, ids[p + 1]].item(), abs=1e-4)
        value = ref[p, ids[p + 1]]  # rank: how many are at least as likely (float noise may reorder near-ties)
        assert int((ref[p] > value + 1e-4).sum()) < mine["rank"] <= int((ref[p] >= value - 1e-4).sum())
        best = int(ref[p].argmax())
        assert entry[str(best)]["logprob"] == pytest.approx(ref[p, best].item(), abs=1e-4)
        assert entry[str(best)]["rank"] == 1 and len(entry) <= 2
    done = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0.0,
                                extra_body={"prompt_logprobs": 0})
    prompt_ids = tok(PROMPT)["input_ids"]
    got = done.choices[0].model_extra["prompt_logprobs"]
    assert [None if e is None else list(e) for e in got] == [None] + [[str(t)] for t in prompt_ids[1:]]
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1})
    assert "prompt_logprobs" in err.value.message


# ---- min_tokens, min_p, include_stop_str_in_output ---------------------------------------------------------
def test_min_tokens_holds_eos_back(stack, hf):
    _, tok = hf
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    c = client(stack)
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.0, logit_bias={str(eos): 100})
    assert c.completions.create(**body).usage.completion_tokens == 1  # EOS at once
    r = c.completions.create(**body, extra_body={"min_tokens": 4})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"  # 4 tokens, then EOS


def test_min_p_one_is_greedy(stack):
    c = client(stack)
    greedy = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.0).choices[0].text
    sampled = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.5, seed=3,
                                   extra_body={"min_p": 1.0}).choices[0].text
    free = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.5, seed=3).choices[0].text
    assert sampled == greedy != free


def test_include_stop_str_in_output(stack):
    c = client(stack)
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True})
    full = c.completions.create(**body).choices[0].text
    stop = full[5:7]
    assert stop and full.index(stop) == 5
    cut = c.completions.create(**body, stop=[stop]).choices[0].text
    kept = c.completions.create(**{**body, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}},
                                stop=[stop]).choices[0].text
    assert cut == full[:5] and kept == full[:7]


# ---- structured output ------------------------------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}},
    "required": ["name", "age", "ok", "tag"], "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_parses_and_validates_on_a_random_model(stack, seed):
    r = client(stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A person, please"}], max_tokens=120, temperature=1.0,
        seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_vllm_guided_extras_constrain_the_output(stack):
    c = client(stack)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Answer"}], max_tokens=40, temperature=1.0, seed=5)
    choice = c.chat.completions.create(**ask, extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
    assert choice.choices[0].message.content in ("alpha", "beta", "gamma")
    regex = c.chat.completions.create(**ask, extra_body={"guided_regex": "[a-c]{3}-[0-9]{2}"})
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", regex.choices[0].message.content)
    schema = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
              "additionalProperties": False}
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        r = c.chat.completions.create(**ask, extra_body=extra)
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    completion = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=1,
                                      extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert completion.choices[0].text in ("yes", "no")
    # n choices each follow the grammar, with their own matcher.
    many = c.chat.completions.create(**{**ask, "n": 3}, extra_body={"guided_regex": "[0-9]{4}"})
    assert all(re.fullmatch("[0-9]{4}", ch.message.content) for ch in many.choices)


def test_json_object_output_is_an_object_when_it_finishes(stack):
    r = client(stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON"}], max_tokens=200, temperature=0.0,
        response_format={"type": "json_object"}, logit_bias={"0": -100})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("extra, name", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strange"}}}},
     "json_schema"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "regex"),
    ({"extra_body": {"guided_grammar": "root ::= missing_rule"}}, "grammar"),
])
def test_a_spec_xgrammar_cannot_compile_is_a_400_naming_it_and_the_stack_stays_up(stack, extra, name):
    c = client(stack)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3, **extra)
    assert f"sampling.structured.{name}" in err.value.message and "cannot compile" in err.value.message
    assert c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                     max_tokens=3).choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra", [{"guided_decoding_backend": "outlines"}, {"chat_template": "{{ x }}"},
                                   {"prompt_logprobs": 21}, {"use_beam_search": True}])
def test_unsupported_fields_are_400_through_the_client(stack, extra):
    with pytest.raises(openai.BadRequestError) as err:
        client(stack).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                              max_tokens=3, extra_body=extra)
    assert next(iter(extra)) in err.value.message


# ---- tools ------------------------------------------------------------------------------------------------
# Small: the tiny tokenizer spends about a token per character, and the tiny model takes 512.
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": 0, "maximum": 12}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
CONVERSATION = [
    {"role": "user", "content": "Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18"},
    {"role": "user", "content": "Time?"},
]
SHORT = [{"role": "user", "content": "Time?"}]  # leaves the tiny model room for a call


def _check_call(call, tools=TOOLS):
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_tools_and_tool_messages_go_through_the_chat_template(stack, hf):
    _, tok = hf
    c = client(stack)
    chat = c.chat.completions.create(model=MODEL, messages=CONVERSATION, tools=TOOLS, tool_choice="none",
                                     max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    # The reference: HF's own rendering of the same messages and tools (arguments as objects, HF's convention).
    messages = json.loads(json.dumps(CONVERSATION))
    messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "unit": "c"}
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "get_time" in text and "<tool_response>\n18" in text
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ref = c.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == ref.choices[0].text
    assert chat.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("seed", [0, 1])
def test_tool_choice_required_makes_a_valid_call_streamed_as_openai_does(stack, seed):
    c = client(stack)
    kwargs = dict(model=MODEL, messages=SHORT, tools=TOOLS, tool_choice="required", max_tokens=200,
                  temperature=1.0, seed=seed)
    r = c.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0])
    calls, finish = {}, None
    for chunk in c.chat.completions.create(**kwargs, stream=True):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = ch.finish_reason or finish
    want = choice.message.tool_calls[0].function
    assert finish == "tool_calls" and [(e["name"], e["arguments"]) for e in calls.values()] == [
        (want.name, want.arguments)]
    assert calls[0]["id"].startswith("call_")


def test_a_named_tool_choice_calls_that_tool(stack):
    r = client(stack).chat.completions.create(
        model=MODEL, messages=SHORT, tools=TOOLS, max_tokens=200, temperature=1.0, seed=4,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = r.choices[0].message.tool_calls
    assert [call.function.name for call in calls] == ["get_time"]
    _check_call(calls[0])


def test_tool_choice_auto_parses_what_the_model_writes(stack):
    # A random model never calls on its own: a guided choice makes it write content then a Hermes call.
    written = 'Hm.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}\n</tool_call>'
    c = client(stack)
    kwargs = dict(model=MODEL, messages=SHORT, tools=TOOLS, max_tokens=200, temperature=0.0,
                  extra_body={"guided_choice": [written]})
    r = c.chat.completions.create(**kwargs)
    message = r.choices[0].message
    assert message.content == "Hm." and r.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "f"})]
    content, args = "", ""
    for chunk in c.chat.completions.create(**kwargs, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                args += d.function.arguments or ""
    assert content == "Hm." and json.loads(args) == {"city": "Oslo", "unit": "f"}
    # tool_choice none: the same text is content, not a call.
    none = c.chat.completions.create(**kwargs, tool_choice="none")
    assert none.choices[0].message.content == written and not none.choices[0].message.tool_calls


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400(stack, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client(stack).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                              **body)
    assert err.value.body["param"] == param


# ---- the gRPC surface -------------------------------------------------------------------------------------
def test_grpc_n_tags_each_message_with_its_choice_and_bad_fields_are_invalid_argument(stack):
    messages = generate(stack, text=PROMPT, sampling=pb.SamplingParams(n=2, seed=7, max_tokens=4, ignore_eos=True,
                                                                       logprobs=1, top_logprobs=2))
    for index in (0, 1):
        mine = [m for m in messages if m.index == index]
        assert sum(len(m.token_ids) for m in mine) == 4 and mine[-1].finish_reason == pb.LENGTH
        assert all(len(m.top_logprobs) == len(m.token_ids) == len(m.tokens) for m in mine)
    for bad, name in [(pb.SamplingParams(min_p=2.0), "min_p"), (pb.SamplingParams(n=99), "n must be"),
                      (pb.SamplingParams(presence_penalty=3.0), "presence_penalty"),
                      (pb.SamplingParams(structured=pb.StructuredOutput(regex="(")), "structured.regex"),
                      (pb.SamplingParams(structured=pb.StructuredOutput(tool_call="[]")), "structured.tool_call")]:
        with pytest.raises(grpc.RpcError) as err:
            generate(stack, text=PROMPT, sampling=bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.value.details()
    # The service is unharmed: the same request as before answers the same.
    again = generate(stack, text=PROMPT, sampling=pb.SamplingParams(n=2, seed=7, max_tokens=4, ignore_eos=True,
                                                                    logprobs=1, top_logprobs=2))
    def by_choice(ms):  # how tokens group into messages depends on timing; each choice's tokens do not
        return [[t for m in ms if m.index == i for t in m.token_ids] for i in (0, 1)]

    assert by_choice(again) == by_choice(messages) and by_choice(messages)[0] != by_choice(messages)[1]


def test_n_choices_share_the_prompts_pages(stack, hf):
    """n = 3 over a prompt of several full pages: one choice prefills it, the siblings take its pages from the
    prefix cache (each reports them cached), and every choice still equals its n = 1 run."""
    _, tok = hf
    prompt = " ".join(f"w{i}" for i in range(40))
    n_prompt = len(tok(prompt)["input_ids"])
    full = (n_prompt - 1) // 16 * 16  # the pages of 16 wholly before its last token (always computed)
    assert full >= 48
    sampling = dict(seed=11, max_tokens=4, ignore_eos=True, temperature=1.0)
    messages = generate(stack, text=prompt, sampling=pb.SamplingParams(n=3, **sampling))
    finals = sorted((m.index, m.usage.cached_tokens) for m in messages if m.finish_reason)
    assert [i for i, _ in finals] == [0, 1, 2]
    assert sorted(cached for _, cached in finals) == [0, full, full]  # the first prefilled what its siblings took
    for index in range(3):
        alone = generate(stack, text=prompt, sampling=pb.SamplingParams(**{**sampling, "seed": 11 + index}))
        assert [t for m in messages if m.index == index for t in m.token_ids] == [t for m in alone
                                                                                   for t in m.token_ids]


def test_each_choice_of_n_gets_the_prompts_scores_on_its_first_message(stack, hf):
    model, tok = hf
    ids = tok(PROMPT)["input_ids"]
    messages = generate(stack, token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        n=2, seed=3, max_tokens=3, ignore_eos=True, prompt_logprobs=2))
    firsts = {}
    for m in messages:
        if m.index not in firsts:
            firsts[m.index] = m
        else:
            assert not m.HasField("prompt_logprobs")  # the first message only
    assert sorted(firsts) == [0, 1]
    want = _hf_prompt_logprobs(model, ids).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    for first in firsts.values():
        p = first.prompt_logprobs
        assert list(p.token_ids) == ids and len(p.top) == len(ids) - 1 and all(len(t.token_ids) == 2 for t in p.top)
        torch.testing.assert_close(torch.tensor(list(p.logprobs)), want, atol=1e-4, rtol=0)
