"""Chat templates: --chat-template FILE, chat_template_kwargs (Qwen3's enable_thinking), continue_final_message
and add_generation_prompt, through gRPC and through the gateway with the official openai client. The reference is
transformers: the prompt its tokenizer's apply_chat_template renders with the same template and arguments, and the
tokens and logprobs its generate makes from that prompt (tiny random Qwen3, fp32 on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import openai
import pytest
import torch

from modalmesh import pb
from modalmesh.ops.launcher import ServiceProcess
from modalmesh.testing import tiny
from services.gateway.launch import GatewayProcess

COMMON = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--device", "cpu", "--grace-period", "10",
          "--kv-cache-tokens", "2048"]
GATEWAY = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--grace-period", "10"]

# Qwen3's thinking switch, cut down to what the tiny tokenizer can say: enable_thinking=false pre-fills an empty
# think block. The checkpoint's own template knows nothing of it, so only --chat-template can make it appear.
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ raise_exception('this template takes no tool messages') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe a fox."}]
CONTINUE = [{"role": "user", "content": "Describe a fox."}, {"role": "assistant", "content": "The quick brown"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    model = tiny.ensure("qwen3", root)
    template = root / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    llm = ServiceProcess("llm", [*COMMON, "--model", str(model), "--chat-template", str(template)]).start()
    procs = [llm]
    try:
        llm.wait_listening(timeout=180)
        gw = GatewayProcess([*GATEWAY, "--llm", llm.target]).start()
        procs.append(gw)
        llm.wait_serving(timeout=180)
        gw.wait_serving(timeout=180)
        yield dict(model=model, llm=llm, gw=gw)
        assert gw.terminate(timeout=30) == 0, gw.log_tail()
        assert llm.terminate(timeout=30) == 0, llm.log_tail()
    finally:
        for p in reversed(procs):
            p.terminate(timeout=30)


def reference(model_dir, messages, n, **template_args):
    """transformers: the prompt ids apply_chat_template makes with THINKING_TEMPLATE, then greedy generate's
    tokens and each token's logprob."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(messages, chat_template=THINKING_TEMPLATE, tokenize=False, **template_args)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    new = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, new)]
    return text, ids, new, logprobs


def client(gw):
    return openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def grpc_generate(target, chat, n):
    ids, lps, last = [], [], None
    with grpc.insecure_channel(target) as channel:
        stub = pb.llm_pb2_grpc.LLMServiceStub(channel)
        request = pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(temperature=0.0, max_tokens=n, logprobs=1))
        for r in stub.Generate(request, timeout=120):
            ids += r.token_ids
            lps += r.logprobs
            last = r
    return ids, lps, last


def grpc_chat(messages, **fields):
    return pb.Chat(messages=[pb.ChatMessage(role=m["role"], content=[pb.ContentPart(text=m["content"])])
                             for m in messages], **fields)


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}, {"enable_thinking": True}])
def test_chat_template_file_and_kwargs_equal_hf_through_the_openai_client(served, kwargs):
    n = 8
    text, prompt_ids, ref, ref_lps = reference(served["model"], MESSAGES, n, add_generation_prompt=True,
                                               **(kwargs or {}))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")  # the file's template, not the checkpoint's
    assert ("<think>" in text) == (kwargs == {"enable_thinking": False})
    extra = {"chat_template_kwargs": kwargs} if kwargs is not None else {}
    r = client(served["gw"]).chat.completions.create(model=served["model"].name, messages=MESSAGES, max_tokens=n,
                                                     temperature=0.0, logprobs=True, extra_body=extra)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len(ref)
    got_lps = [t.logprob for t in r.choices[0].logprobs.content]
    torch.testing.assert_close(torch.tensor(got_lps), torch.tensor(ref_lps), atol=1e-4, rtol=0)
    # The same through gRPC, token ids compared.
    fields = {"chat_template_kwargs_json": json.dumps(kwargs)} if kwargs else {}
    ids, lps, last = grpc_generate(served["llm"].target, grpc_chat(MESSAGES, **fields), n)
    assert ids == ref and last.usage.prompt_tokens == len(prompt_ids)
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-4, rtol=0)


def test_thinking_off_changes_the_prompt_and_the_reply(served):
    """enable_thinking reaches the template: the two prompts differ by the pre-filled think block."""
    _, with_think, _, _ = reference(served["model"], MESSAGES, 1, add_generation_prompt=True, enable_thinking=False)
    _, plain, _, _ = reference(served["model"], MESSAGES, 1, add_generation_prompt=True)
    c = client(served["gw"])
    usage = [c.chat.completions.create(model=served["model"].name, messages=MESSAGES, max_tokens=1, temperature=0.0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": on}}).usage.prompt_tokens
             for on in (False, True)]
    assert usage == [len(with_think), len(plain)] and len(with_think) > len(plain)


def test_continue_final_message_equals_hf(served):
    n = 6
    text, prompt_ids, ref, ref_lps = reference(served["model"], CONTINUE, n, add_generation_prompt=False,
                                               continue_final_message=True)
    assert text.endswith("The quick brown")  # open-ended: no <|im_end|> after the assistant's words
    c = client(served["gw"])
    # add_generation_prompt unset means false with continue_final_message; vLLM's explicit false works too.
    for extra in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False}):
        r = c.chat.completions.create(model=served["model"].name, messages=CONTINUE, max_tokens=n, temperature=0.0,
                                      logprobs=True, extra_body=extra)
        assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len(ref)
        got_lps = [t.logprob for t in r.choices[0].logprobs.content]
        torch.testing.assert_close(torch.tensor(got_lps), torch.tensor(ref_lps), atol=1e-4, rtol=0)
    ids, _, _ = grpc_generate(served["llm"].target, grpc_chat(CONTINUE, continue_final_message=True), n)
    assert ids == ref
    # add_generation_prompt false alone: the assistant turn is closed, the prompt is HF's without a generation prompt.
    _, closed_ids, closed_ref, _ = reference(served["model"], CONTINUE, n, add_generation_prompt=False)
    ids, _, last = grpc_generate(served["llm"].target, grpc_chat(CONTINUE, add_generation_prompt=False), n)
    assert ids == closed_ref and last.usage.prompt_tokens == len(closed_ids) != len(prompt_ids)


@pytest.mark.parametrize("extra,param,words", [
    ({"chat_template_kwargs": {"tokenize": True}}, None, "tokenize cannot be set"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, None, "add_generation_prompt cannot be set"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "must be an object"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message", "cannot both"),
    ({"continue_final_message": "yes"}, "continue_final_message", "true or false"),
])
def test_bad_template_fields_are_400_naming_them(served, extra, param, words):
    c = client(served["gw"])
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=served["model"].name, messages=MESSAGES, max_tokens=1, extra_body=extra)
    assert words in err.value.message
    if param is not None:
        assert err.value.body["param"] == param
    # The service carries on.
    assert c.chat.completions.create(model=served["model"].name, messages=MESSAGES, max_tokens=2).usage


def test_a_template_refusal_and_bad_kwargs_json_are_invalid_argument(served):
    """The template's own raise_exception is the request's fault, named, not INTERNAL."""
    with pytest.raises(grpc.RpcError) as err:
        grpc_generate(served["llm"].target, grpc_chat([{"role": "tool", "content": "42"}]), 1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "this template takes no tool messages" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        grpc_generate(served["llm"].target, grpc_chat(MESSAGES, chat_template_kwargs_json="{not json"), 1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not JSON" in err.value.details()


@pytest.mark.parametrize("content,words", [("{% for x in %}", "line 1"), ("", "empty")])
def test_an_unusable_chat_template_file_fails_start_up_in_one_line(tmp_path, content, words):
    template = tmp_path / "bad.jinja"
    template.write_text(content)
    model = tiny.ensure("qwen3", tmp_path)
    out = subprocess.run([sys.executable, "-m", "services.llm", *COMMON, "--model", str(model), "--chat-template",
                          str(template)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--chat-template" in out.stderr and words in out.stderr and "Traceback" not in out.stderr
