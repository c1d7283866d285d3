"""Turn a GenerateRequest into what the engine runs: token ids, spliced embeddings, positions.

A placeholder token (``<|image_pad|>`` for images, ``<|AUDIO|>`` for audio) marks
where an item's embedding rows go. Each item matches the next run of its
modality's placeholder in the prompt: a run of one token is expanded to the
item's rows (vLLM style), a run already as long as the rows is taken as is
(Hugging Face processor style); anything else is an error naming both counts.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field

import jinja2
import torch

from modalmesh import pb
from modalmesh.config import ModelConfig
from modalmesh.errors import InvalidArgument
from modalmesh.image_grid import ImageGrid
from services.llm.embedding import Embedding
from services.llm.mrope import VisionSpan, mrope_positions


@dataclass
class MultimodalSpan:
    start: int  # index of the first placeholder token in the prompt
    embedding: torch.Tensor | None  # (rows, hidden); None: the rows' K/V are in the prefix cache (not encoded)
    grid_thw: tuple[int, ...] = ()
    modality: int = pb.IMAGE
    rows: int = 0
    digest: bytes = b""  # the item's content digest: its rows' prefix-cache keys take it
    second_per_grid_t: float = 0.0  # a video: seconds one temporal grid step spans (Qwen2.5-VL's positions)

    def __post_init__(self):
        if self.embedding is not None:
            self.rows = int(self.embedding.shape[0])

    @property
    def end(self) -> int:
        return self.start + self.rows


@dataclass
class PreparedPrompt:
    token_ids: list[int]
    spans: list[MultimodalSpan] = field(default_factory=list)
    mrope: torch.Tensor | None = None  # (3, len(token_ids)) positions for M-RoPE models
    mrope_delta: int = 0


# Video positions as HF's get_rope_index computes them (mrope.py): Qwen2-VL's temporal grid steps one position
# apart, Qwen2.5-VL's tokens_per_second x the seconds each step spans (the item's second_per_grid_t) apart.
VIDEO_ARCHITECTURES = frozenset({"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"})


def placeholder_ids(cfg: ModelConfig) -> dict[int, int]:
    """modality -> placeholder token id, for what this checkpoint supports."""
    ids = {}
    if cfg.image_token_id is not None:
        ids[pb.IMAGE] = cfg.image_token_id
    if cfg.audio_token_id is not None:
        ids[pb.AUDIO] = cfg.audio_token_id
    if cfg.video_token_id is not None and VIDEO_ARCHITECTURES.intersection(cfg.architectures):
        ids[pb.VIDEO] = cfg.video_token_id
    return ids


def _chat_messages(chat: pb.Chat) -> tuple[list[dict], list[pb.MultimodalItem]]:
    messages, items = [], []
    for m, message in enumerate(chat.messages):
        if not message.role:
            raise InvalidArgument(f"chat.messages[{m}].role is empty")
        parts = []
        for part in message.content:
            if part.HasField("text"):
                parts.append({"type": "text", "text": part.text})
            elif part.HasField("item"):
                kind = {pb.IMAGE: "image", pb.AUDIO: "audio", pb.VIDEO: "video"}.get(part.item.modality)
                if kind is None:
                    raise InvalidArgument(f"chat.messages[{m}]: an item has no modality (IMAGE, AUDIO or VIDEO)")
                parts.append({"type": kind})
                items.append(part.item)
        # Text-only messages as plain strings: every chat template understands those.
        if all(p["type"] == "text" for p in parts):
            entry = {"role": message.role, "content": "".join(p["text"] for p in parts)}
        else:
            entry = {"role": message.role, "content": parts}
        if message.tool_calls:
            entry["tool_calls"] = [_tool_call(call, f"chat.messages[{m}].tool_calls[{c}]")
                                   for c, call in enumerate(message.tool_calls)]
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        if message.name:
            entry["name"] = message.name
        messages.append(entry)
    return messages, items


def _tool_call(call: pb.ToolCall, where: str) -> dict:
    """A call as chat templates read it (HF's convention): arguments as an object, not its JSON text."""
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except ValueError:
        raise InvalidArgument(f"{where}.arguments is not JSON") from None
    if not isinstance(arguments, dict):
        raise InvalidArgument(f"{where}.arguments must be a JSON object")
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def _tools(chat: pb.Chat) -> list[dict] | None:
    if not chat.tools:
        return None
    try:
        tools = json.loads(chat.tools)
    except ValueError:
        raise InvalidArgument("chat.tools is not JSON") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidArgument("chat.tools must be a JSON list of tool objects")
    return tools


# apply_chat_template's own parameters and the variables it sets itself: a chat_template_kwargs key
# naming one would change how the prompt is built rather than pass a value to the template.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def template_kwargs(chat: pb.Chat) -> dict:
    """chat_template_kwargs_json -> the keyword arguments it gives the template (INVALID_ARGUMENT naming the
    problem)."""
    if not chat.chat_template_kwargs_json:
        return {}
    try:
        kwargs = json.loads(chat.chat_template_kwargs_json)
    except ValueError as exc:
        raise InvalidArgument(f"chat.chat_template_kwargs_json is not JSON ({exc})") from None
    if not isinstance(kwargs, dict):
        raise InvalidArgument("chat.chat_template_kwargs_json must be a JSON object")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise InvalidArgument(f"chat_template_kwargs: {', '.join(reserved)} cannot be set there (a request field "
                              "or the server decides it)")
    return kwargs


def render_chat(chat: pb.Chat, tokenizer, chat_template: str | None = None) -> tuple[str, list[pb.MultimodalItem]]:
    """The chat as the template renders it: `chat_template` (--chat-template) or else the checkpoint's."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidArgument("chat: this checkpoint has no chat template; send a text prompt, or start the "
                              "service with --chat-template FILE")
    messages, items = _chat_messages(chat)
    kwargs = template_kwargs(chat)
    cont = chat.continue_final_message
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else not cont
    if cont and add:
        raise InvalidArgument("chat: continue_final_message and add_generation_prompt cannot both be true")
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tools=_tools(chat), tokenize=False,
                                             add_generation_prompt=add, continue_final_message=cont, **kwargs)
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        # The template's own raise_exception (a role it does not take, ...) or a value it cannot use: the
        # request's fault. TypeError: a kwarg of the wrong type used in an expression.
        raise InvalidArgument(f"chat: the chat template could not render this conversation "
                              f"({type(exc).__name__}: {exc})") from None
    return text, items


def tokenize_prompt(request: pb.GenerateRequest, tokenizer, vocab_size: int,
                    chat_template: str | None = None) -> tuple[list[int], list[pb.MultimodalItem]]:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return list(tokenizer(request.text)["input_ids"]), list(request.items)
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"token_ids: {bad[:5]} outside the vocabulary [0, {vocab_size})")
        return ids, list(request.items)
    if kind == "chat":
        if request.items:
            raise InvalidArgument("items: with a chat prompt, put items inside the messages")
        text, items = render_chat(request.chat, tokenizer, chat_template)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]), items
    raise InvalidArgument("prompt: give text, token_ids or chat")


def check_modalities(items: list[pb.MultimodalItem] | list[Embedding], cfg: ModelConfig) -> None:
    """Refuse items this checkpoint cannot take, before anything is sent to an encoder."""
    placeholders = placeholder_ids(cfg)
    for i, item in enumerate(items):
        if item.modality not in placeholders:
            name = pb.Modality.Name(item.modality) if item.modality in pb.Modality.values() else item.modality
            raise InvalidArgument(f"items[{i}]: this model takes no {name} input")
        if not isinstance(item, pb.MultimodalItem) or item.WhichOneof("source") != "input":
            continue
        source = item.input.WhichOneof("source")
        if (item.modality == pb.VIDEO) != (source == "video"):
            want = "EncodeItem.video (an encoded video file)" if item.modality == pb.VIDEO else "no video"
            raise InvalidArgument(f"items[{i}]: a raw {pb.Modality.Name(item.modality)} item takes {want}, not "
                                  f"{source or 'nothing'}")


def _placeholder_runs(ids: list[int], items: list[pb.MultimodalItem] | list[Embedding],
                      placeholders: dict[int, int]) -> dict[int, list[tuple[int, int, int]]]:
    """Runs of placeholder tokens, (modality, start, length) in prompt order, by modality; one per item."""
    runs: list[tuple[int, int, int]] = []
    token_to_modality = {tok: mod for mod, tok in placeholders.items()}
    j = 0
    while j < len(ids):
        mod = token_to_modality.get(ids[j])
        if mod is None:
            j += 1
            continue
        k = j
        while k < len(ids) and ids[k] == ids[j]:
            k += 1
        runs.append((mod, j, k - j))
        j = k
    by_modality = {m: [r for r in runs if r[0] == m] for m in placeholders}
    item_counts = {m: sum(1 for it in items if it.modality == m) for m in placeholders}
    for m in placeholders:
        if len(by_modality[m]) != item_counts[m]:
            raise InvalidArgument(f"prompt has {len(by_modality[m])} {pb.Modality.Name(m).lower()} placeholder(s) "
                                  f"but the request has {item_counts[m]} {pb.Modality.Name(m).lower()} item(s)")
    return by_modality


def prompt_length_before_encoding(ids: list[int], items: list[pb.MultimodalItem], cfg: ModelConfig, *,
                                  image_grid: ImageGrid | None = None) -> int:
    """The prompt's length once every item's rows are spliced in, known before any item is encoded:
    embeddings by their rows, raw images by their size (read from the header; Qwen2-VL's grid), expanded
    placeholder runs by their length, anything else at least one row. A request that cannot fit is then
    refused before a single Encode (300 images were once encoded, then refused)."""
    placeholders = placeholder_ids(cfg)
    check_modalities(items, cfg)
    by_modality = _placeholder_runs(ids, items, placeholders)
    next_run = {m: iter(by_modality[m]) for m in placeholders}
    total = len(ids)
    for item in items:
        _, _, length = next(next_run[item.modality])
        total += _rows_before_encoding(item, length, image_grid) - length
    return total


def _rows_before_encoding(item: pb.MultimodalItem, length: int, grid: ImageGrid | None) -> int:
    if length > 1:  # already expanded: the encoder's answer must match it
        return length
    source = item.WhichOneof("source")
    if source == "embedding":
        shape = item.embedding.embedding.shape
        return max(1, int(shape[0])) if len(shape) == 2 else 1
    if source != "input" or item.modality != pb.IMAGE or grid is None:
        return 1
    raw = item.input
    try:
        if raw.WhichOneof("source") == "pixels" and len(raw.pixels.shape) in (2, 3):
            height, width = int(raw.pixels.shape[0]), int(raw.pixels.shape[1])
        elif raw.WhichOneof("source") == "data":
            from PIL import Image

            with Image.open(io.BytesIO(raw.data)) as image:  # the header only: nothing is decoded
                width, height = image.size
        else:
            return 1
        return grid.rows(width, height, min_pixels=max(0, raw.min_pixels), max_pixels=max(0, raw.max_pixels))
    except Exception:  # noqa: BLE001 - unreadable here: the encoder says precisely what is wrong with it
        return 1


def splice_items(ids: list[int], embeddings: list[Embedding], cfg: ModelConfig,
                 *, uses_mrope: bool, spatial_merge: int = 2, tokens_per_second: float | None = None) -> PreparedPrompt:
    """Match each item's embedding to its placeholder run, expand runs of one, check counts, compute
    M-RoPE positions. `embeddings` are the request's items, in order, as the fan-out resolved them.
    `tokens_per_second`: Qwen2.5-VL's (its vision config's), whose video positions are time-scaled; None:
    Qwen2-VL's, whose are not."""
    placeholders = placeholder_ids(cfg)
    check_modalities(embeddings, cfg)
    by_modality = _placeholder_runs(ids, embeddings, placeholders)
    # Pair the n-th item of a modality with its n-th run, then rebuild the ids with runs expanded.
    next_run = {m: iter(by_modality[m]) for m in placeholders}
    pairs = []
    for i, item in enumerate(embeddings):
        item.check(i, cfg.hidden_size)
        _, start, length = next(next_run[item.modality])
        rows = item.rows
        if length not in (1, rows):
            raise InvalidArgument(f"items[{i}]: the prompt has {length} placeholder tokens for it but its embedding "
                                  f"has {rows} rows")
        pairs.append((start, length, item))
    pairs.sort(key=lambda p: p[0])
    out: list[int] = []
    spans: list[MultimodalSpan] = []
    cursor = 0
    for start, length, item in pairs:
        out += ids[cursor:start]
        spans.append(MultimodalSpan(len(out), item.tensor, item.grid_thw, item.modality, item.rows, item.digest,
                                    item.second_per_grid_t))
        out += [placeholders[item.modality]] * item.rows
        cursor = start + length
    out += ids[cursor:]
    prepared = PreparedPrompt(out, spans)
    if uses_mrope:
        vision_spans = []
        for span in spans:
            if span.modality not in (pb.IMAGE, pb.VIDEO):
                continue
            grid = span.grid_thw
            kind = "video" if span.modality == pb.VIDEO else "image"
            if len(grid) != 3 or min(grid) <= 0 or grid[0] * (grid[1] // spatial_merge) * (grid[2] // spatial_merge) != span.rows:
                raise InvalidArgument(f"{kind} at token {span.start}: grid_thw {list(grid)} does not describe its "
                                      f"{span.rows} rows (merge {spatial_merge})")
            vision_spans.append(VisionSpan(span.start, grid, _time_interval(span, tokens_per_second)))
        prepared.mrope, prepared.mrope_delta = mrope_positions(len(out), vision_spans, spatial_merge)
    return prepared


MAX_SECOND_PER_GRID_T = 3600.0  # an hour a temporal step: a video sampled more sparsely than this is no video


def _time_interval(span: MultimodalSpan, tokens_per_second: float | None) -> float | None:
    """The temporal position step of a video's grid steps, as get_rope_index computes it (None: 1, unscaled)."""
    if span.modality != pb.VIDEO or tokens_per_second is None:
        return None
    seconds = span.second_per_grid_t
    if not 0 < seconds <= MAX_SECOND_PER_GRID_T:  # NaN too
        raise InvalidArgument(f"video at token {span.start}: second_per_grid_t {seconds:g} (seconds one temporal grid "
                              f"step spans) must be in (0, {MAX_SECOND_PER_GRID_T:g}]: this model's video positions "
                              "are scaled by it")
    # In float32, as HF multiplies the processor's float32 second_per_grid_ts by the config's tokens_per_second.
    return float(torch.tensor(seconds, dtype=torch.float32) * tokens_per_second)


def expand_known_items(ids: list[int], items: list[pb.MultimodalItem], rows: list[int | None],
                       cfg: ModelConfig) -> tuple[list[int], list[tuple[int, int, int]], bool]:
    """The prompt as `splice_items` will expand it, as far as the items' rows are known before encoding:
    `rows[i]` is item i's row count, None where unknown. Returns the expanded tokens up to the first item of
    unknown rows (all of them if none), each expanded item's (index, start, end) there, and whether the whole
    prompt is known. The prefix cache is looked up with these before anything is encoded."""
    placeholders = placeholder_ids(cfg)
    by_modality = _placeholder_runs(ids, items, placeholders)
    next_run = {m: iter(by_modality[m]) for m in placeholders}
    runs = sorted((next(next_run[item.modality])[1:], i) for i, item in enumerate(items))
    out: list[int] = []
    spans: list[tuple[int, int, int]] = []
    cursor = 0
    for (start, length), i in runs:
        out += ids[cursor:start]
        n = rows[i] if length == 1 else length  # a run already expanded says its rows itself
        if n is None or (length != 1 and rows[i] is not None and rows[i] != length):
            return out, spans, False
        spans.append((i, len(out), len(out) + n))
        out += [placeholders[items[i].modality]] * n
        cursor = start + length
    out += ids[cursor:]
    return out, spans, True
