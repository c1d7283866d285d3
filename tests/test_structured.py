"""Structured output below the service: xgrammar grammars compiled off the event loop and cached, applied as
a mask in the sampler to random logits (a random model must still produce valid output under the mask)."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import pytest
import torch

from modalmesh.errors import InvalidArgument
from modalmesh.testing import tiny
from services.llm.sampling import SamplerRow, SamplingParams, StructuredOutput, sample
from services.llm.structured import GrammarCompiler

VOCAB = tiny.VOCAB_SIZE


@pytest.fixture(scope="module")
def tokenizer():
    return tiny._qwen_tokenizer()


@pytest.fixture(scope="module")
def eos(tokenizer):
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.fixture()
def compiler(tokenizer, eos):
    return GrammarCompiler(tokenizer, VOCAB, (eos,))


def _generate(tokenizer, eos, grammar, spec, *, seed, steps=200, device="cpu"):
    """Sample from random logits under the grammar until EOS; the text, or None if it never ended."""
    gen = torch.Generator().manual_seed(seed)
    row = SamplerRow.create(SamplingParams(temperature=1.0, seed=seed, structured=spec), [], torch.device(device),
                            vocab_size=VOCAB, eos_token_ids=(eos,), grammar=grammar)
    out = []
    for _ in range(steps):
        logits = (torch.randn(1, VOCAB, generator=gen) * 3).to(device)
        token = sample(logits, [row])[0].item()
        if token == eos:
            return tokenizer.decode(out)
        row.observe(token)  # as the engine does once the token is on the host
        out.append(token)
    return None


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 500},
                                           "s": {"type": "string", "maxLength": 8},
                                           "l": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["n", "s", "l"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_under_the_mask_parses_and_validates(tokenizer, eos, compiler, seed):
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    grammar = asyncio.run(compiler.compile(spec))
    text = _generate(tokenizer, eos, grammar, spec, seed=seed)
    assert text is not None
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("spec, check", [
    (StructuredOutput("regex", r"[a-f]{2,4}@[0-9]+\.x"), lambda t: re.fullmatch(r"[a-f]{2,4}@[0-9]+\.x", t)),
    (StructuredOutput("choice", ("left", "right", "up \"quoted\"")), lambda t: t in ("left", "right", 'up "quoted"')),
    (StructuredOutput("grammar", 'root ::= "(" [0-9] ("+" [0-9])* ")"'), lambda t: re.fullmatch(r"\(\d(\+\d)*\)", t)),
])
def test_regex_choice_and_grammar_under_the_mask(tokenizer, eos, compiler, spec, check):
    grammar = asyncio.run(compiler.compile(spec))
    for seed in range(3):
        text = _generate(tokenizer, eos, grammar, spec, seed=seed)
        assert text is not None and check(text), text


def test_json_object_is_an_object(tokenizer, eos, compiler):
    spec = StructuredOutput("json_object")
    grammar = asyncio.run(compiler.compile(spec))
    ended = [t for t in (_generate(tokenizer, eos, grammar, spec, seed=s, steps=400) for s in range(4)) if t]
    assert ended  # random logits close an object now and then within the budget
    assert all(isinstance(json.loads(t), dict) for t in ended)


def test_compilation_is_cached_per_spec_and_runs_off_the_event_loop(compiler, monkeypatch):
    threads = []
    real = compiler._compile

    def spy(spec):
        threads.append(threading.get_ident())
        return real(spec)

    monkeypatch.setattr(compiler, "_compile", spy)

    async def run():
        a = StructuredOutput("regex", "a+")
        first = await compiler.compile(a)
        again = await compiler.compile(StructuredOutput("regex", "a+"))
        other = await compiler.compile(StructuredOutput("regex", "b+"))
        return first, again, other, threading.get_ident()

    first, again, other, loop_thread = asyncio.run(run())
    assert first is again and other is not first
    assert compiler.compilations == 2 and len(threads) == 2 and loop_thread not in threads


def test_the_cache_is_bounded(tokenizer, eos):
    small = GrammarCompiler(tokenizer, VOCAB, (eos,), cache_size=2)
    for pattern in ("a", "b", "c", "a"):
        asyncio.run(small.compile(StructuredOutput("regex", pattern)))
    assert small.compilations == 4 and len(small._cache) == 2  # "a" was evicted, then compiled again


@pytest.mark.parametrize("spec, match", [
    (StructuredOutput("json_schema", '{"type": "strange"}'), r"structured\.json_schema: xgrammar cannot compile it: "
                                                             r"Unsupported type"),
    (StructuredOutput("json_schema", "{not json"), r"structured\.json_schema: not JSON"),
    (StructuredOutput("json_schema", "[1]"), r"structured\.json_schema: a JSON schema must be an object"),
    (StructuredOutput("regex", "(a"), r"structured\.regex: xgrammar cannot compile it: .*parenthesis"),
    (StructuredOutput("grammar", "root ::= nothing"), r"structured\.grammar: xgrammar cannot compile it: .*nothing"),
])
def test_what_xgrammar_cannot_compile_is_invalid_argument_naming_it(compiler, spec, match):
    with pytest.raises(InvalidArgument, match=match):
        asyncio.run(compiler.compile(spec))
    assert compiler.compilations == 0


def test_control_characters_are_barred_from_json(compiler, tokenizer):
    # xgrammar 0.2.9 lets a token decoding to "\x00" into a JSON string; compact JSON never holds one.
    nul = tokenizer.convert_tokens_to_ids("Ā")
    assert tokenizer.decode([nul]) == "\x00" and nul in compiler.control_ids()
    grammar = asyncio.run(compiler.compile(StructuredOutput("json_object")))
    assert nul in grammar.barred_ids
    assert asyncio.run(compiler.compile(StructuredOutput("regex", "."))).barred_ids == ()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_json_schema_under_the_mask_on_cuda_validates(tokenizer, eos, compiler):
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    grammar = asyncio.run(compiler.compile(spec))
    for seed in range(2):
        on_cuda = _generate(tokenizer, eos, grammar, spec, seed=seed, device="cuda")
        assert on_cuda is not None
        jsonschema.validate(json.loads(on_cuda), SCHEMA)
