"""Structured output: compiling a request's schema / regex / grammar with xgrammar, off the engine thread.

The sampler applies a compiled grammar as a token mask (services/llm/sampling.py); this module turns
a `StructuredOutput` into the compiled grammar, once per distinct spec: compiling a JSON schema takes
milliseconds to seconds, so it runs in a worker thread (never on the event loop nor the engine thread)
and its result is kept in a bounded LRU cache. A spec xgrammar cannot compile is INVALID_ARGUMENT naming
the field, and never reaches the engine.

JSON is compiled without free whitespace (xgrammar's ``any_whitespace=False``: compact separators): a
small or random model otherwise can spend its whole budget on spaces and newlines inside a valid
document that never closes. Compact JSON never holds a raw control character (U+0000-U+001F must be
escaped inside strings), but xgrammar 0.2.9's mask lets tokens decoding to them into strings (a tiny
random model wrote ``"\x00"`` and json.loads refused it), so a JSON grammar also bars every token whose
bytes hold one (`Grammar.barred_ids`).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

from modalmesh.errors import InvalidArgument
from services.llm.sampling import StructuredOutput

CACHE_SIZE = 256  # compiled grammars kept (a few KB to a few MB each)
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[12:11:13] /project/cpp/x.cc:94: " (noise to a client)


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar, and tokens barred besides what its mask bars (see the module docstring)."""

    compiled: object  # xgrammar.CompiledGrammar
    barred_ids: tuple[int, ...] = ()


class GrammarCompiler:
    """One per LLM service: xgrammar's tokenizer info and compiler for its checkpoint, and the cache."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], *, cache_size: int = CACHE_SIZE):
        import xgrammar

        self._xgr = xgrammar
        # The model's vocabulary can be larger than the tokenizer's (padding rows): xgrammar masks those.
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                            stop_token_ids=sorted(eos_token_ids) or None)
        self._compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)  # ours below is bounded
        self._cache: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()
        self._cache_size = cache_size
        self.compilations = 0  # grammars actually compiled (the rest came from the cache)
        self._control_ids: tuple[int, ...] | None = None

    def control_ids(self) -> tuple[int, ...]:
        """Tokens whose bytes hold a control character (never part of compact JSON)."""
        if self._control_ids is None:
            special = set(self.info.special_token_ids)
            self._control_ids = tuple(i for i, piece in enumerate(self.info.decoded_vocab)
                                      if i not in special and any(b < 0x20 for b in piece))
        return self._control_ids

    async def compile(self, spec: StructuredOutput) -> Grammar:
        """The compiled grammar of `spec`, from the cache or compiled in a worker thread."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = await asyncio.to_thread(self._compile, spec)
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput):
        where = f"sampling.structured.{spec.kind}"
        c = self._compiler
        try:
            if spec.kind == "json_schema":
                try:
                    schema = json.loads(spec.spec)
                except ValueError as exc:
                    raise InvalidArgument(f"{where}: not JSON ({exc})") from None
                if not isinstance(schema, dict):
                    raise InvalidArgument(f"{where}: a JSON schema must be an object")
                compiled = c.compile_json_schema(spec.spec, any_whitespace=False)
            elif spec.kind == "json_object":
                # Any JSON object: the schema {"type": "object"} with any properties.
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif spec.kind == "regex":
                compiled = c.compile_regex(spec.spec)
            elif spec.kind == "choice":
                # An alternation of literal strings, each escaped as an EBNF string literal.
                body = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.spec)
                compiled = c.compile_grammar(f"root ::= {body}")
            elif spec.kind == "grammar":
                compiled = c.compile_grammar(spec.spec)
            elif spec.kind == "tool_call":
                compiled = c.compile_grammar(self._tool_call_grammar(spec.spec, where))
            else:
                raise InvalidArgument(f"sampling.structured: unknown kind {spec.kind!r}")
        except InvalidArgument:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own types
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            message = _CPP_PREFIX.sub("", message)
            raise InvalidArgument(f"{where}: xgrammar cannot compile it: {message}") from None
        self.compilations += 1
        # A tool call's wrapper holds newlines, so nothing is barred there; the gateway parses the call's JSON
        # leniently (raw control characters allowed) and sends it on re-serialised.
        barred = self.control_ids() if spec.kind in ("json_schema", "json_object") else ()
        return Grammar(compiled, barred)

    def _tool_call_grammar(self, schema_text: str, where: str):
        """Hermes / Qwen's tool-call block around a JSON object matching `schema_text`."""
        try:
            schema = json.loads(schema_text)
        except ValueError as exc:
            raise InvalidArgument(f"{where}: not JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise InvalidArgument(f"{where}: a JSON schema must be an object")
        g = self._xgr.Grammar
        return g.concat(g.from_ebnf('root ::= "<tool_call>\\n"'),
                        g.from_json_schema(schema_text, any_whitespace=False),
                        g.from_ebnf('root ::= "\\n</tool_call>"'))
