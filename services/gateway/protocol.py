"""OpenAI request bodies -> GenerateRequest, and GenerateResponse deltas -> OpenAI responses.

Only what the LLM service can honour is accepted: anything it cannot (``n`` > 1,
tools, penalties other than vLLM's repetition penalty, top-k alternatives of
logprobs, ...) is a 400 naming the field, never silently ignored. vLLM's extra
sampling fields (``top_k``, ``repetition_penalty``, ``ignore_eos``,
``skip_special_tokens``, ``stop_token_ids``, ``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``) pass through, as the openai
client's ``extra_body`` sends them.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from modalmesh import pb
from services.gateway.errors import bad_request
from services.gateway.fetch import FetchPolicy
from services.gateway.media import audio_bytes, image_input, parse_data_url

FINISH_REASONS = {pb.STOP: "stop", pb.LENGTH: "length"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
UINT64 = 1 << 64


@dataclass(frozen=True)
class Limits:
    max_image_bytes: int
    max_audio_bytes: int
    local_media_root: Path | None = None
    fetch: FetchPolicy = FetchPolicy()  # which http(s) image URLs may be fetched (services/gateway/fetch.py)
    low_detail_max_pixels: int = 512 * 512  # --low-detail-max-pixels: an image's budget at detail "low"


@dataclass(frozen=True)
class MediaFetch:
    """An http(s) image the gateway fetches before the call: its bytes go to chat.messages[message].content[part]."""
    url: str
    param: str
    message: int
    part: int


@dataclass
class ParsedRequest:
    kind: str  # "chat" | "completion"
    model: str | None
    grpc: pb.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    item_params: list[str] = field(default_factory=list)  # request path of each image / audio, in order
    fetches: list[MediaFetch] = field(default_factory=list)  # http(s) images still to fetch (Gateway._fetch_media)


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
def sampling_params(body: dict, *, chat: bool) -> pb.SamplingParams:
    s = pb.SamplingParams()
    n = _integer(body, "n")
    if n is not None and n != 1:
        _unsupported("n", "one choice per request (n = 1)")
    if _integer(body, "best_of") not in (None, 1):
        _unsupported("best_of", "one candidate per request")
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key) not in (None, 0.0):
            _unsupported(key, "use repetition_penalty (vLLM's) instead")
    if body.get("logit_bias"):
        _unsupported("logit_bias", "no logit bias")
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
        top = _integer(body, "top_logprobs", minimum=0, maximum=20)
        if top and not want:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if top:
            _unsupported("top_logprobs", "the LLM returns the sampled token's logprob only (top_logprobs 0)")
        s.logprobs = 1 if want else 0
    else:
        lp = _integer(body, "logprobs", minimum=0, maximum=5)
        if lp:
            _unsupported("logprobs", "the LLM returns the sampled token's logprob only: send logprobs 0")
        s.logprobs = 1 if lp == 0 else 0
    return s


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
            raise bad_request(f"content part type {kind!r} is not supported; use text, image_url or input_audio",
                              f"{pj}.type", "unsupported_content_type")
    return parts


def chat_request(body: dict, limits: Limits, request_id: str) -> ParsedRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    if body.get("tools") or body.get("functions"):
        _unsupported("tools", "no tool calling")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        _unsupported("response_format", "text output only")
    chat = pb.Chat()
    item_params: list[str] = []
    fetches: list[MediaFetch] = []
    for m, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request("each message must be an object", f"messages[{m}]")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"role {role!r} is not supported; use system, developer, user or assistant",
                              f"messages[{m}].role")
        if message.get("tool_calls") or message.get("function_call"):
            _unsupported(f"messages[{m}].tool_calls", "no tool calling")
        parts = _content_parts(message.get("content"), m, limits, item_params, fetches)
        chat.messages.append(pb.ChatMessage(role=ROLES[role], content=parts))
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
    grpc_request = pb.GenerateRequest(request_id=request_id, chat=chat, sampling=sampling)
    return ParsedRequest("chat", requested_model(body), grpc_request, stream, include_usage, sampling.logprobs > 0,
                         item_params, fetches)


# ---- /v1/completions ------------------------------------------------------------------------------
def completion_request(body: dict, request_id: str) -> ParsedRequest:
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
    if _boolean(body, "echo"):
        _unsupported("echo", "the prompt is not echoed")
    if body.get("suffix"):
        _unsupported("suffix", "no insertion")
    stream, include_usage = _stream_options(body)
    req.sampling.CopyFrom(sampling_params(body, chat=False))
    return ParsedRequest("completion", requested_model(body), req, stream, include_usage, req.sampling.logprobs > 0)


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
    """A string per token of a delta: the delta's text when it holds one token and some text, else vLLM's
    ``token_id:<id>`` form (the gateway has no tokenizer; the LLM holds back incomplete UTF-8 and
    text that may start a stop string, so a delta's text is not always its token's)."""
    if len(delta.token_ids) == 1 and delta.text:
        return [delta.text]
    return [f"token_id:{t}" for t in delta.token_ids]


@dataclass
class Accumulator:
    """Folds a Generate stream into the parts of an OpenAI response."""

    kind: str
    logprobs: bool
    text: list[str] = field(default_factory=list)
    chat_logprobs: list[dict] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    _chars: int = 0

    def add(self, delta: pb.GenerateResponse) -> tuple[str, dict | None]:
        """Fold one delta in; returns its text and its logprobs in the response's format (or None)."""
        self.text.append(delta.text)
        lp = None
        if self.logprobs and delta.token_ids:
            strings = token_strings(delta)
            values = list(delta.logprobs) + [None] * (len(strings) - len(delta.logprobs))
            if self.kind == "chat":
                content = [{"token": s, "logprob": v, "bytes": list(s.encode()), "top_logprobs": []}
                           for s, v in zip(strings, values)]
                self.chat_logprobs += content
                lp = {"content": content, "refusal": None}
            else:
                offsets = [self._chars] * len(strings)
                self.tokens += strings
                self.token_logprobs += values
                self.text_offset += offsets
                lp = {"tokens": strings, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}
        self._chars += len(delta.text)
        if delta.finish_reason:
            self.finish_reason = FINISH_REASONS.get(delta.finish_reason, "stop")
            self.usage = usage(delta.usage)
        return delta.text, lp

    def full_logprobs(self) -> dict | None:
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return {"content": self.chat_logprobs, "refusal": None}
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": None,
                "text_offset": self.text_offset}


def completion_body(kind: str, rid: str, model: str, acc: Accumulator, fingerprint: str | None) -> dict:
    text = "".join(acc.text)
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                  "logprobs": acc.full_logprobs(), "finish_reason": acc.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": acc.full_logprobs(), "finish_reason": acc.finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint, "choices": [choice], "usage": acc.usage}


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

    def role(self) -> dict:
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def content(self, text: str, logprobs: dict | None, finish_reason: str | None = None) -> dict:
        if self.kind == "chat":
            delta = {"content": text} if (text or finish_reason is None) else {}
            return self._chunk({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})
        return self._chunk({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})

    def finish(self, finish_reason: str) -> dict:
        return self.content("", None, finish_reason)

    def usage(self, u: dict) -> dict:
        return {**self.base, "choices": [], "usage": u}
