"""OpenAI request bodies -> GenerateRequest, and GenerateResponse deltas -> OpenAI responses.

Only what the LLM service can honour is accepted: every OpenAI field and known vLLM
extra it cannot honour (UNSUPPORTED, TEMPLATE_FIELDS below) is a 400 naming the field,
never silently ignored. vLLM's extra sampling fields (``top_k``, ``repetition_penalty``,
``min_p``, ``min_tokens``, ``ignore_eos``, ``skip_special_tokens``, ``stop_token_ids``,
``include_stop_str_in_output``, ``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``, the ``guided_*`` /
``structured_outputs`` fields) pass through, as the openai client's ``extra_body`` sends them.
Fields nobody knows are ignored, as vLLM does.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from modalmesh import pb
from services.gateway import tools as tools_mod
from services.gateway.errors import bad_request
from services.gateway.fetch import FetchPolicy
from services.gateway.media import audio_bytes, image_input, parse_data_url, video_input

FINISH_REASONS = {pb.STOP: "stop", pb.LENGTH: "length"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
UINT64 = 1 << 64


@dataclass(frozen=True)
class Limits:
    max_image_bytes: int
    max_audio_bytes: int
    local_media_root: Path | None = None
    fetch: FetchPolicy = FetchPolicy()  # which http(s) image URLs may be fetched (services/gateway/fetch.py)
    low_detail_max_pixels: int = 512 * 512  # --low-detail-max-pixels: an image's budget at detail "low"
    max_video_bytes: int = 32 << 20  # --max-video-mb


@dataclass(frozen=True)
class MediaFetch:
    """An http(s) image or video the gateway fetches before the call: its bytes go to
    chat.messages[message].content[part]'s item (its data, or its video)."""
    url: str
    param: str
    message: int
    part: int
    kind: str = "image"  # "image" | "video"


@dataclass
class ParsedRequest:
    kind: str  # "chat" | "completion"
    model: str | None
    grpc: pb.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    item_params: list[str] = field(default_factory=list)  # request path of each image / audio, in order
    top_logprobs: int = 0  # alternatives per token in the response
    echo: str = ""  # completions with echo: the prompt text, before each choice's text
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: alternatives per prompt token in the response
    tools: tools_mod.ToolRequest | None = None  # chat with tools: answers are parsed for tool calls
    fetches: list[MediaFetch] = field(default_factory=list)  # http(s) images still to fetch (Gateway._fetch_media)


# ---- fields refused by name -----------------------------------------------------------------------
# Known fields this server does not implement: name -> (values that ask for nothing, why). A field set
# to anything else is a 400 naming it (a client relying on it must not get a 200 that ignored it).
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    # OpenAI
    "best_of": ((1,), "one candidate per choice (use n)"),
    "suffix": (("",), "no insertion"),
    "audio": ((), "text output only"),
    "modalities": ((["text"],), "text output only"),
    "prediction": ((), "no predicted outputs"),
    "web_search_options": ((), "no web search"),
    "store": ((False,), "nothing is stored"),
    "reasoning_effort": ((), "no reasoning controls"),
    "verbosity": ((), "no verbosity control"),
    "service_tier": (("auto", "default"), "one service tier"),
    "functions": (([],), "the deprecated functions field: use tools"),
    "function_call": (("none",), "the deprecated function_call field: use tool_choice"),
    # vLLM extras
    "use_beam_search": ((False,), "no beam search"),
    "length_penalty": ((1, 1.0), "no beam search"),
    "early_stopping": ((False,), "no beam search"),
    "allowed_token_ids": ((), "use logit_bias"),
    "bad_words": (([],), "no bad-words filter"),
    "truncate_prompt_tokens": ((), "prompts are never truncated"),
    "spaces_between_special_tokens": ((True,), "special tokens are decoded as the tokenizer joins them"),
    "logits_processors": (([],), "no custom logits processors"),
    "guided_decoding_backend": (("xgrammar", "auto"), "structured output runs on xgrammar only"),
    "guided_whitespace_pattern": ((), "JSON is generated without free whitespace"),
    "structural_tag": ((), "no structural tags"),
    "documents": (([],), "no document templates"),
    "mm_processor_kwargs": (({},), "no per-request processor options"),
    "return_tokens_as_token_ids": ((False,), "tokens are returned as text"),
    "return_token_ids": ((False,), "token ids are not returned"),
    "priority": ((0,), "one priority: first come, first served"),
    "cache_salt": ((), "no prefix cache to salt"),
    "kv_transfer_params": ((), "no KV transfer"),
    "vllm_xargs": ((), "no extra arguments"),
    "add_special_tokens": ((), "the chat template decides the special tokens"),
}
# The chat-template fields not implemented (chat_template_kwargs and continue_final_message are): a request's
# own template would run client-supplied Jinja on the server, so the service's --chat-template is the way.
TEMPLATE_FIELDS: dict[str, tuple[tuple, str]] = {
    "chat_template": ((), "the server's template is used (the LLM service's --chat-template, or the checkpoint's)"),
}


def refuse_unsupported(body: dict, *, chat: bool) -> None:
    """A 400 for the first known field that asks for something this server does not do."""
    for table in (UNSUPPORTED, TEMPLATE_FIELDS) if chat else (UNSUPPORTED,):
        for key, (no_op, why) in table.items():
            value = body.get(key)
            if value is None or any(value == v and type(value) is type(v) for v in no_op):
                continue
            _unsupported(key, why)


# ---- typed field access -------------------------------------------------------------------------
def _number(body: dict, key: str, *, minimum: float | None = None, maximum: float | None = None,
            exclusive_min: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{key} must be a number", key)
    if minimum is not None and (value <= minimum if exclusive_min else value < minimum):
        raise bad_request(f"{key} must be {'>' if exclusive_min else '>='} {minimum:g}, got {value:g}", key)
    if maximum is not None and value > maximum:
        raise bad_request(f"{key} must be <= {maximum:g}, got {value:g}", key)
    return float(value)


INT32_MAX = (1 << 31) - 1  # the gRPC fields these land in are int32


def _integer(body: dict, key: str, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{key} must be an integer", key)
    if minimum is not None and value < minimum:
        raise bad_request(f"{key} must be >= {minimum}, got {value}", key)
    if maximum is not None and value > maximum:
        raise bad_request(f"{key} must be <= {maximum}, got {value}", key)
    return value


def _boolean(body: dict, key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad_request(f"{key} must be true or false", key)
    return value


def _unsupported(key: str, why: str) -> None:
    raise bad_request(f"{key} is not supported by this server: {why}", key, "unsupported_parameter")


# ---- sampling -------------------------------------------------------------------------------------
MAX_N = 16  # the LLM's limit (services/llm/sampling.py)
MAX_TOP_LOGPROBS = 20
MAX_PROMPT_LOGPROBS = 20  # the LLM's limit; vLLM's -1 (the whole vocabulary) is not taken


def _logit_bias(body: dict) -> dict[int, float]:
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise bad_request("logit_bias must be an object of token id -> bias", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token <= INT32_MAX:
            raise bad_request(f"logit_bias token id {token} is out of range", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"logit_bias values must be numbers in [-100, 100], got {value!r} for {key}",
                              "logit_bias")
        out[token] = float(value)
    return out


def sampling_params(body: dict, *, chat: bool) -> pb.SamplingParams:
    s = pb.SamplingParams()
    if (n := _integer(body, "n", minimum=1, maximum=MAX_N)) is not None:
        s.n = n
    for key in ("presence_penalty", "frequency_penalty"):
        if (v := _number(body, key, minimum=-2.0, maximum=2.0)) is not None:
            setattr(s, key, v)
    for token, bias in _logit_bias(body).items():
        s.logit_bias[token] = bias
    if (mp := _number(body, "min_p", minimum=0.0, maximum=1.0)) is not None:
        s.min_p = mp
    if (mt := _integer(body, "min_tokens", minimum=0, maximum=INT32_MAX)) is not None:
        s.min_tokens = mt
    if _boolean(body, "include_stop_str_in_output"):
        s.include_stop_str_in_output = True
    if (t := _number(body, "temperature", minimum=0.0)) is not None:
        s.temperature = t
    if (p := _number(body, "top_p", minimum=0.0, maximum=1.0, exclusive_min=True)) is not None:
        s.top_p = p
    if (k := _integer(body, "top_k", minimum=-1, maximum=INT32_MAX)) is not None:
        s.top_k = k
    if (r := _number(body, "repetition_penalty", minimum=0.0, exclusive_min=True)) is not None:
        s.repetition_penalty = r
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for key in keys:  # max_completion_tokens wins over the deprecated max_tokens
        if (m := _integer(body, key, minimum=1, maximum=(1 << 31) - 1)) is not None:
            s.max_tokens = m
            break
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
            raise bad_request("stop must be a non-empty string or a list of non-empty strings", "stop")
        s.stop.extend(stops)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise bad_request("stop_token_ids must be a list of integers", "stop_token_ids")
        if any(not 0 <= x <= INT32_MAX for x in ids):
            raise bad_request(f"stop_token_ids must be token ids in [0, {INT32_MAX}]", "stop_token_ids")
        s.stop_token_ids.extend(ids)
    if (seed := _integer(body, "seed")) is not None:
        if not -UINT64 // 2 <= seed < UINT64:
            raise bad_request("seed must fit in 64 bits", "seed")
        s.seed = seed % UINT64
    if _boolean(body, "ignore_eos"):
        s.ignore_eos = True
    if (skip := _boolean(body, "skip_special_tokens")) is not None:
        s.skip_special_tokens = skip
    if chat:
        want = _boolean(body, "logprobs")
        top = _integer(body, "top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
        if top and not want:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        s.logprobs = 1 if want else 0
        s.top_logprobs = top or 0
    else:  # completions: logprobs k is the sampled token's logprob and k alternatives
        lp = _integer(body, "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
        s.logprobs = 1 if lp is not None else 0
        s.top_logprobs = lp or 0
    if (pl := _integer(body, "prompt_logprobs", minimum=0, maximum=MAX_PROMPT_LOGPROBS)) is not None:
        if _boolean(body, "stream"):  # vLLM's rule: they come whole, in the response body
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        s.prompt_logprobs = pl
    structured = structured_output(body)
    if structured is not None:
        s.structured.CopyFrom(structured)
    return s


# ---- structured output ----------------------------------------------------------------------------
def _schema_text(value, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request(f"{param} must be a JSON schema (an object, or its JSON text)", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON schema object", param)
    return json.dumps(value)


def _choices(value, param: str) -> pb.ChoiceList:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
    return pb.ChoiceList(choices=value)


def _string(value, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    return value


def structured_output(body: dict) -> pb.StructuredOutput | None:
    """response_format, vLLM's guided_* fields and its structured_outputs object: at most one of them."""
    found: list[tuple[str, pb.StructuredOutput]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise bad_request("response_format.type must be text, json_object or json_schema", "response_format")
        if fmt["type"] == "json_object":
            found.append(("response_format", pb.StructuredOutput(json_object=True)))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise bad_request("response_format.json_schema must be an object with a schema",
                                  "response_format.json_schema")
            found.append(("response_format", pb.StructuredOutput(
                json_schema=_schema_text(spec["schema"], "response_format.json_schema.schema"))))
    guided = {
        "guided_json": lambda v, p: pb.StructuredOutput(json_schema=_schema_text(v, p)),
        "guided_regex": lambda v, p: pb.StructuredOutput(regex=_string(v, p)),
        "guided_choice": lambda v, p: pb.StructuredOutput(choice=_choices(v, p)),
        "guided_grammar": lambda v, p: pb.StructuredOutput(grammar=_string(v, p)),
    }
    for key, make in guided.items():
        if body.get(key) is not None:
            found.append((key, make(body[key], key)))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        kinds = {"json": lambda v, p: pb.StructuredOutput(json_schema=_schema_text(v, p)),
                 "regex": guided["guided_regex"], "choice": guided["guided_choice"],
                 "grammar": guided["guided_grammar"],
                 "json_object": lambda v, p: pb.StructuredOutput(json_object=True) if v is True else None}
        for key, value in so.items():
            param = f"structured_outputs.{key}"
            if value is None or (key == "json_object" and value is False):
                continue
            if key not in kinds:
                _unsupported(param, "structured_outputs takes json, regex, choice, grammar or json_object")
            made = kinds[key](value, param)
            if made is None:
                raise bad_request(f"{param} must be true or false", param)
            found.append((param, made))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"give one kind of structured output, not {names}", found[1][0])
    return found[0][1] if found else None


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = bool(_boolean(body, "stream"))
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(opts, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        include_usage = bool(_boolean(opts, "include_usage"))
    return stream, include_usage


def requested_model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    return model or None


# ---- /v1/chat/completions -------------------------------------------------------------------------
def _content_parts(content, m: int, limits: Limits, item_params: list[str],
                   fetches: list[MediaFetch]) -> list[pb.ContentPart]:
    param = f"messages[{m}].content"
    if content is None:
        return []
    if isinstance(content, str):
        return [pb.ContentPart(text=content)]
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of content parts", param)
    parts = []
    for j, part in enumerate(content):
        pj = f"{param}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request("a content part must be an object with a 'type'", pj)
        kind = part["type"]
        if kind in ("text", "refusal"):
            text = part.get(kind)
            if not isinstance(text, str):
                raise bad_request(f"a {kind} part needs '{kind}': string", f"{pj}.{kind}")
            parts.append(pb.ContentPart(text=text))
            continue
        item_params.append(pj)
        if kind == "image_url":
            image = image_input(part, param=pj, max_bytes=limits.max_image_bytes, local_root=limits.local_media_root,
                                fetch=limits.fetch)
            item = pb.EncodeItem(data=image.data or b"")
            if image.detail == "low":  # as vLLM's mm_processor_kwargs max_pixels; high / auto: the checkpoint's
                item.max_pixels = limits.low_detail_max_pixels
            if image.url is not None:
                fetches.append(MediaFetch(image.url, image.param, m, len(parts)))
            parts.append(pb.ContentPart(item=pb.MultimodalItem(modality=pb.IMAGE, input=item)))
        elif kind == "video_url":  # vLLM's extension: the vision encoder decodes it and samples its frames
            video = video_input(part, param=pj, max_bytes=limits.max_video_bytes, local_root=limits.local_media_root,
                                fetch=limits.fetch)
            if video.url is not None:
                fetches.append(MediaFetch(video.url, video.param, m, len(parts), kind="video"))
            parts.append(pb.ContentPart(item=pb.MultimodalItem(modality=pb.VIDEO,
                                                               input=pb.EncodeItem(video=video.data or b""))))
        elif kind == "input_audio":
            data = audio_bytes(part, param=pj, max_bytes=limits.max_audio_bytes)
            parts.append(pb.ContentPart(item=pb.MultimodalItem(modality=pb.AUDIO, input=pb.EncodeItem(data=data))))
        elif kind == "audio_url":  # vLLM's extension: data:audio/...;base64,...
            spec = part.get("audio_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            if not isinstance(url, str) or not url.lower().startswith("data:"):
                raise bad_request("audio_url.url must be a data:audio/...;base64,... URL", f"{pj}.audio_url")
            data = parse_data_url(url, what=f"{pj}.audio_url", param=f"{pj}.audio_url", kind="audio",
                                  max_bytes=limits.max_audio_bytes)
            parts.append(pb.ContentPart(item=pb.MultimodalItem(modality=pb.AUDIO, input=pb.EncodeItem(data=data))))
        else:
            raise bad_request(f"content part type {kind!r} is not supported; use text, image_url, video_url or "
                              "input_audio",
                              f"{pj}.type", "unsupported_content_type")
    return parts


def chat_request(body: dict, limits: Limits, request_id: str) -> ParsedRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    refuse_unsupported(body, chat=True)
    if _boolean(body, "echo"):  # vLLM's chat echo: the last message's content repeated in the answer
        _unsupported("echo", "chat completions do not echo the last message")
    chat = pb.Chat()
    item_params: list[str] = []
    fetches: list[MediaFetch] = []
    for m, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request("each message must be an object", f"messages[{m}]")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"role {role!r} is not supported; use system, developer, user, assistant or tool",
                              f"messages[{m}].role")
        if message.get("function_call"):
            _unsupported(f"messages[{m}].function_call", "the deprecated function_call: use tool_calls")
        if message.get("tool_calls") and role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", f"messages[{m}].tool_calls")
        parts = _content_parts(message.get("content"), m, limits, item_params, fetches)
        msg = pb.ChatMessage(role=ROLES[role], content=parts, tool_calls=tools_mod.message_tool_calls(message, m))
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request("a tool message needs the tool_call_id it answers", f"messages[{m}].tool_call_id")
            msg.tool_call_id = call_id
            if isinstance(message.get("name"), str):
                msg.name = message["name"]
        chat.messages.append(msg)
    if (add := _boolean(body, "add_generation_prompt")) is not None:
        chat.add_generation_prompt = add
    if _boolean(body, "continue_final_message"):
        if add:  # vLLM's rule; unset, add_generation_prompt defaults to false here (vLLM wants it sent)
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")
        chat.continue_final_message = True
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
        if kwargs:  # the LLM checks the names against apply_chat_template's own
            chat.chat_template_kwargs_json = json.dumps(kwargs, ensure_ascii=False)
    stream, include_usage = _stream_options(body)
    sampling = sampling_params(body, chat=True)
    tool_req = tools_mod.tool_request(body)
    if tool_req is not None:
        chat.tools = json.dumps(tool_req.tools, ensure_ascii=False)
        schema = tool_req.grammar_schema()
        if schema is not None:  # required / named: the grammar makes the model call
            if sampling.HasField("structured"):
                raise bad_request("tool_choice required or named cannot be combined with structured output",
                                  "tool_choice")
            sampling.structured.tool_call = schema
    grpc_request = pb.GenerateRequest(request_id=request_id, chat=chat, sampling=sampling)
    return ParsedRequest("chat", requested_model(body), grpc_request, stream, include_usage, sampling.logprobs > 0,
                         item_params, sampling.top_logprobs, tools=tool_req if tool_req and tool_req.parse else None,
                         fetches=fetches, prompt_logprobs=_prompt_logprobs(sampling))


# ---- /v1/completions ------------------------------------------------------------------------------
def completion_request(body: dict, request_id: str) -> ParsedRequest:
    refuse_unsupported(body, chat=False)
    if body.get("response_format") is not None:  # a chat field: completions constrain with guided_* / structured_outputs
        _unsupported("response_format", "a chat completions field; use structured_outputs here")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    req = pb.GenerateRequest(request_id=request_id)
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        req.text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t <= INT32_MAX for t in prompt):
            raise bad_request(f"prompt token ids must be in [0, {INT32_MAX}]", "prompt")
        req.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        _unsupported("prompt", "one prompt per request (send the prompts of a batch as separate requests)")
    else:
        raise bad_request("prompt must be a string or a list of token ids", "prompt")
    stream, include_usage = _stream_options(body)
    req.sampling.CopyFrom(sampling_params(body, chat=False))
    echo = ""
    asked = _prompt_logprobs(req.sampling)
    if _boolean(body, "echo"):
        if not req.HasField("text"):
            _unsupported("echo", "echo needs a text prompt (the gateway has no tokenizer to show token ids as text)")
        echo = req.text
        if req.sampling.logprobs:  # the prompt's tokens lead the choice's logprobs, scored by the LLM
            req.sampling.prompt_logprobs = max(req.sampling.top_logprobs, asked or 0)
            if asked is None:  # vLLM's rule: echo with logprobs k asks for prompt_logprobs k too
                asked = req.sampling.top_logprobs
    return ParsedRequest("completion", requested_model(body), req, stream, include_usage, req.sampling.logprobs > 0,
                         top_logprobs=req.sampling.top_logprobs, echo=echo, prompt_logprobs=asked)


def _prompt_logprobs(sampling: pb.SamplingParams) -> int | None:
    return sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None


# ---- responses ------------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(u: pb.Usage) -> dict:
    out = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
           "total_tokens": u.prompt_tokens + u.completion_tokens}
    if u.cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": u.cached_tokens}
    return out


def token_strings(delta: pb.GenerateResponse) -> list[str]:
    """A string per token of a delta: each token's own text as the LLM decoded it alone (vLLM's form), or
    from an LLM that sends none, the delta's text when it holds one token and some text, else vLLM's
    ``token_id:<id>`` form (the gateway has no tokenizer; the LLM holds back incomplete UTF-8 and
    text that may start a stop string, so a delta's text is not always its token's)."""
    if len(delta.tokens) == len(delta.token_ids):
        return list(delta.tokens)
    if len(delta.token_ids) == 1 and delta.text:
        return [delta.text]
    return [f"token_id:{t}" for t in delta.token_ids]


@dataclass
class Accumulator:
    """Folds a Generate stream into the parts of an OpenAI response."""

    kind: str
    logprobs: bool
    top_logprobs: int = 0  # alternatives per token the client asked for
    echo: str = ""  # completions' echo: the prompt, before the generated text
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: alternatives per prompt token, when asked
    text: list[str] = field(default_factory=list)
    chat_logprobs: list[dict] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    completion_top: list[dict | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    prompt: pb.PromptLogprobs | None = None  # the LLM's scores of the prompt (its first message's)
    _chars: int = 0
    _echo_pending: bool = False  # echo with logprobs: the prompt's entries come with the first message

    def __post_init__(self):
        if self.echo:
            self.text.append(self.echo)
            self._chars = len(self.echo)
            self._echo_pending = self.logprobs

    def _alternatives(self, delta: pb.GenerateResponse, n: int) -> list[list[tuple[str, float]]]:
        out = []
        for j in range(n):
            if j < len(delta.top_logprobs) and self.top_logprobs:
                out.append(_top_pairs(delta.top_logprobs[j], self.top_logprobs))
            else:
                out.append([])
        return out

    def _echoed_prompt(self) -> tuple[list[str], list[float | None], list[dict | None], list[int]]:
        """Completions' echo with logprobs: the prompt's tokens as the choice's first entries, the first
        token unscored (None), as OpenAI and vLLM show it. Offsets count each token's text, and the generated
        tokens' go on from there (vLLM's count: a BOS token's text moves them past len(echo))."""
        p = self.prompt
        if p is None:  # the request ended before its first token: no scores came
            return [], [], [], []
        strings = list(p.tokens) if len(p.tokens) == len(p.token_ids) else [f"token_id:{t}" for t in p.token_ids]
        values = [None, *p.logprobs]
        top = [None, *(_top_dict(s, v, t, self.top_logprobs) for s, v, t in zip(strings[1:], p.logprobs, p.top))]
        offsets = []
        self._chars = 0
        for token in strings:
            offsets.append(self._chars)
            self._chars += len(token)
        return strings, values, top if self.top_logprobs else [], offsets

    def add(self, delta: pb.GenerateResponse) -> tuple[str, dict | None]:
        """Fold one delta in; returns its text and its logprobs in the response's format (or None)."""
        if delta.HasField("prompt_logprobs") and self.prompt is None:
            self.prompt = delta.prompt_logprobs
        text, lp = delta.text, None
        strings, values, top, offsets = [], [], [], []
        if self._echo_pending:  # echo with logprobs: the prompt leads the first message, with its scores
            self._echo_pending = False
            text = self.echo + delta.text
            strings, values, top, offsets = self._echoed_prompt()
        self.text.append(delta.text)
        if self.logprobs and delta.token_ids:
            generated = token_strings(delta)
            alternatives = self._alternatives(delta, len(generated))
            if self.kind == "chat":
                chat_values = list(delta.logprobs) + [None] * (len(generated) - len(delta.logprobs))
                content = [{"token": s, "logprob": v, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": a, "logprob": av, "bytes": list(a.encode())} for a, av in alts]}
                           for s, v, alts in zip(generated, chat_values, alternatives)]
                self.chat_logprobs += content
                lp = {"content": content, "refusal": None}
            else:
                strings += generated
                values += list(delta.logprobs) + [None] * (len(generated) - len(delta.logprobs))
                offsets += [self._chars] * len(generated)
                # OpenAI's shape: per position {token text: logprob}, the chosen token's among them (so up to k + 1)
                top += [_top_dict(s, v, None, 0) | dict(alts) for s, v, alts in zip(generated, values[-len(generated):],
                                                                                    alternatives)]
        if self.kind != "chat" and strings:
            self.tokens += strings
            self.token_logprobs += values
            self.text_offset += offsets
            if self.top_logprobs:
                self.completion_top += top
            lp = {"tokens": strings, "token_logprobs": values, "top_logprobs": top if self.top_logprobs else None,
                  "text_offset": offsets}
        self._chars += len(delta.text)
        if delta.finish_reason:
            self.finish_reason = FINISH_REASONS.get(delta.finish_reason, "stop")
            self.usage = usage(delta.usage)
        return text, lp

    def full_logprobs(self) -> dict | None:
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return {"content": self.chat_logprobs, "refusal": None}
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.completion_top if self.top_logprobs else None, "text_offset": self.text_offset}

    def vllm_prompt_logprobs(self) -> list | None:
        """vLLM's prompt_logprobs: None for the first token, then per token {id: {logprob, rank, decoded_token}}
        holding the token itself and its k most likely alternatives (rank 1..k)."""
        if self.prompt_logprobs is None or self.prompt is None:
            return None
        p, k = self.prompt, self.prompt_logprobs
        texts = list(p.tokens) if len(p.tokens) == len(p.token_ids) else [None] * len(p.token_ids)
        out: list = [None]
        for i in range(1, len(p.token_ids)):
            entry = {str(p.token_ids[i]): {"logprob": p.logprobs[i - 1], "rank": p.ranks[i - 1],
                                           "decoded_token": texts[i]}}
            if k and i - 1 < len(p.top):
                alts = p.top[i - 1]
                for rank, (tid, value) in enumerate(zip(list(alts.token_ids)[:k], alts.logprobs), 1):
                    text = alts.tokens[rank - 1] if len(alts.tokens) == len(alts.token_ids) else None
                    entry.setdefault(str(tid), {"logprob": value, "rank": rank, "decoded_token": text})
            out.append(entry)
        return out


def _top_dict(token: str, value: float | None, top: pb.TopLogprobs | None, k: int) -> dict:
    """One completions position's {token text: logprob}: the chosen token's, then its k alternatives."""
    out = {token: value} if value is not None else {}
    if top is not None:
        for text, v in _top_pairs(top, k):
            out.setdefault(text, v)
    return out


def _top_pairs(top: pb.TopLogprobs, k: int) -> list[tuple[str, float]]:
    strings = list(top.tokens) if len(top.tokens) == len(top.token_ids) else [f"token_id:{t}" for t in top.token_ids]
    return list(zip(strings, top.logprobs))[:k]


class Choices:
    """The n choices of one response, each its own Accumulator (the LLM tags each message with its index)."""

    def __init__(self, kind: str, parsed: ParsedRequest):
        n = parsed.grpc.sampling.n or 1
        self.kind = kind
        self.by_index = [Accumulator(kind, parsed.logprobs, parsed.top_logprobs, parsed.echo, parsed.prompt_logprobs)
                         for _ in range(n)]
        self.tools = parsed.tools  # with tools, answers are parsed for tool calls

    def __getitem__(self, index: int) -> Accumulator:
        if not 0 <= index < len(self.by_index):
            raise ValueError(f"the LLM answered for choice {index} of {len(self.by_index)}")
        return self.by_index[index]

    @property
    def finished(self) -> bool:
        return all(acc.finish_reason is not None for acc in self.by_index)

    @property
    def usage(self) -> dict | None:
        """One usage for the response: the prompt once, the completions of every choice together."""
        if not self.finished:
            return None
        prompt = self.by_index[0].usage["prompt_tokens"]
        completion = sum(acc.usage["completion_tokens"] for acc in self.by_index)
        out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        details = self.by_index[0].usage.get("prompt_tokens_details")
        if details:
            out["prompt_tokens_details"] = details
        return out


def _choice(kind: str, index: int, acc: Accumulator, tools: tools_mod.ToolRequest | None = None) -> dict:
    text = "".join(acc.text)
    if kind == "chat":
        message = {"role": "assistant", "content": text, "refusal": None}
        finish = acc.finish_reason
        if tools is not None:
            content, calls = tools_mod.parse(text, parallel=tools.parallel)
            if calls:
                message.update(content=content, tool_calls=calls)
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": index, "message": message, "logprobs": acc.full_logprobs(), "finish_reason": finish}
    out = {"index": index, "text": text, "logprobs": acc.full_logprobs(), "finish_reason": acc.finish_reason}
    if acc.prompt_logprobs is not None:  # vLLM puts a completion's in each choice
        out["prompt_logprobs"] = acc.vllm_prompt_logprobs()
    return out


def completion_body(kind: str, rid: str, model: str, acc: Accumulator | Choices, fingerprint: str | None) -> dict:
    if isinstance(acc, Accumulator):
        choices, total = [_choice(kind, 0, acc)], acc.usage
    else:
        choices, total = [_choice(kind, i, a, acc.tools) for i, a in enumerate(acc.by_index)], acc.usage
    obj = "chat.completion" if kind == "chat" else "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint, "choices": choices, "usage": total}
    first = acc if isinstance(acc, Accumulator) else acc.by_index[0]
    if kind == "chat" and first.prompt_logprobs is not None:  # vLLM puts a chat's once, beside the choices
        body["prompt_logprobs"] = first.vllm_prompt_logprobs()
    return body


class ChunkMaker:
    """The ``data:`` payloads of a streamed response, shaped as OpenAI's chunks."""

    def __init__(self, kind: str, rid: str, model: str, include_usage: bool, fingerprint: str | None):
        self.kind = kind
        self.include_usage = include_usage
        self.base = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                     "created": int(time.time()), "model": model, "system_fingerprint": fingerprint}

    def _chunk(self, choice: dict | None) -> dict:
        out = {**self.base, "choices": [choice] if choice is not None else []}
        if self.include_usage:
            out["usage"] = None
        return out

    def role(self, index: int = 0) -> dict:
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def content(self, text: str, logprobs: dict | None, finish_reason: str | None = None, index: int = 0) -> dict:
        if self.kind == "chat":
            delta = {"content": text} if (text or finish_reason is None) else {}
            return self._chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})
        return self._chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})

    def finish(self, finish_reason: str, index: int = 0) -> dict:
        return self.content("", None, finish_reason, index)

    def tool_calls(self, deltas: list[dict], index: int = 0) -> dict:
        return self._chunk({"index": index, "delta": {"tool_calls": deltas}, "logprobs": None, "finish_reason": None})

    def usage(self, u: dict) -> dict:
        return {**self.base, "choices": [], "usage": u}
