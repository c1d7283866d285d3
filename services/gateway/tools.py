"""Tool calling at the gateway: the request's tools and tool_choice, and the Hermes / Qwen tool-call parser.

The model calls a tool by writing ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (the
form Hermes and Qwen2 / 2.5 / 3 chat templates teach, vLLM's ``hermes`` parser). The LLM renders the tools
through the checkpoint's chat template; ``required`` and a named tool_choice are enforced there with a
grammar (StructuredOutput.tool_call), ``auto`` leaves the choice to the model, ``none`` shows the tools
and parses nothing (what the model writes is content).

Parsing is lenient where it costs nothing (raw control characters in strings, as a random or small model
writes them) and re-serialises the arguments, so a client always gets valid JSON text; a block that is
not a call object is left in the content, as vLLM does.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from modalmesh import pb
from services.gateway.errors import bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asked of tools: `choice` is "auto", "none", "required" or a function's name."""

    tools: list[dict]
    choice: str
    names: tuple[str, ...]
    parallel: bool = True  # parallel_tool_calls: false keeps an answer's first call only

    @property
    def parse(self) -> bool:
        return self.choice != "none"

    def grammar_schema(self) -> str | None:
        """The JSON schema of the one call `required` / a named choice forces (None: the model decides)."""
        if self.choice in ("auto", "none"):
            return None
        wanted = [t["function"] for t in self.tools if self.choice == "required" or t["function"]["name"] == self.choice]
        options = [{"type": "object",
                    "properties": {"name": {"const": f["name"]},
                                   "arguments": f.get("parameters") or {"type": "object"}},
                    "required": ["name", "arguments"], "additionalProperties": False} for f in wanted]
        return json.dumps(options[0] if len(options) == 1 else {"anyOf": options})


def tool_request(body: dict) -> ToolRequest | None:
    """The request's tools and tool_choice, checked; None when it has no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    names = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request('each tool must be {"type": "function", "function": {...}}', where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request("a function name must be 1-64 letters, digits, _ or -", f"{where}.function.name")
        if name in names:
            raise bad_request(f"two tools are named {name!r}", f"{where}.function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request("parameters must be a JSON schema object", f"{where}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad_request("description must be a string", f"{where}.function.description")
        names.append(name)
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request('a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice")
        if fn["name"] not in names:
            raise bad_request(f"tool_choice names {fn['name']!r}, which is not among the tools", "tool_choice")
        choice = fn["name"]
    elif choice not in ("auto", "none", "required"):
        raise bad_request("tool_choice must be auto, none, required or a named function", "tool_choice")
    return ToolRequest(tools, choice, tuple(names), parallel is not False)


def message_tool_calls(message: dict, m: int) -> list[pb.ToolCall]:
    """An assistant message's tool_calls as the LLM takes them."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise bad_request("tool_calls must be a list", f"messages[{m}].tool_calls")
    out = []
    for c, call in enumerate(calls):
        where = f"messages[{m}].tool_calls[{c}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request('a tool call is {"id", "type": "function", "function": {"name", "arguments"}}', where)
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise bad_request("arguments must be a JSON string", f"{where}.function.arguments")
        try:
            if not isinstance(json.loads(arguments), dict):
                raise ValueError
        except ValueError:
            raise bad_request("arguments must be the JSON text of an object", f"{where}.function.arguments") from None
        out.append(pb.ToolCall(id=str(call.get("id") or ""), name=fn["name"], arguments=arguments))
    return out


def _call(block: str) -> dict | None:
    """One block's call in OpenAI's shape, or None if it is not {"name": str, "arguments": object}."""
    try:
        obj = json.loads(block.strip(), strict=False)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse(text: str, *, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """Content and tool calls of a whole answer (vLLM's hermes parser: the content is what precedes the
    first call; an answer with no call object is all content). Not `parallel`: the first call only."""
    calls = [c for c in (_call(m.group(1)) for m in _BLOCK.finditer(text)) if c is not None][:None if parallel else 1]
    if not calls:
        return text, []
    content = text[:text.index(OPEN)]
    return (content if content.strip() else None), calls


@dataclass
class StreamParser:
    """Splits a streamed answer into content deltas and tool calls as OpenAI streams them: content until a
    call begins (text that may begin "<tool_call>" is held back), each call once its block closes (a
    delta with its id, type, name and empty arguments, then one with its arguments). What it sends adds up
    to what `parse` makes of the whole answer."""

    parallel: bool = True  # False: calls after the first are dropped, as `parse` drops them
    buffer: str = ""  # text not yet parsed
    held: str = ""  # all text since the first "<tool_call>": content after all if no call comes of it
    in_calls: bool = False
    calls: list[dict] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """New text -> (content to send now, tool-call deltas to send now)."""
        self.buffer += text
        content, deltas = "", []
        if not self.in_calls:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self.buffer, OPEN)
                content, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return content, []
            content, self.buffer, self.in_calls = self.buffer[:start], self.buffer[start:], True
            self.held = self.buffer
        else:
            self.held += text
        while True:
            match = _BLOCK.search(self.buffer)
            if match is None:
                break
            call = _call(match.group(1))
            self.buffer = self.buffer[match.end():]
            if call is not None and (self.parallel or not self.calls):
                deltas += self._deltas(call)
        return content, deltas

    def _deltas(self, call: dict) -> list[dict]:
        index = len(self.calls)
        self.calls.append(call)
        fn = call["function"]
        return [{"index": index, "id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}},
                {"index": index, "function": {"arguments": fn["arguments"]}}]

    def finish(self) -> str:
        """The answer ended: with no call made, what was held is content after all (with calls, the text
        after the first call's tag is dropped, as `parse` drops it)."""
        rest = self.buffer if not self.in_calls else ("" if self.calls else self.held)
        self.buffer = self.held = ""
        return rest


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
