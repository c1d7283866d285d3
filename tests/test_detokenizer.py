"""Incremental detokenisation: equals the full decode, never splits UTF-8, never leaks stop strings."""

import random

import pytest
from transformers import AutoTokenizer

from modalmesh.testing import tiny
from services.llm.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(tiny.ensure("qwen2", tmp_path_factory.mktemp("tok")))


def _stream(tokenizer, prompt, ids, **kw):
    detok = IncrementalDetokenizer(tokenizer, prompt, **kw)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.finish())
    return deltas, detok


def test_text_with_multibyte_characters_streams_exactly(tokenizer):
    text = "Héllo wörld 🙂🚀 日本語 and plain words."
    ids = tokenizer(text)["input_ids"]
    prompt = tokenizer("Say:")["input_ids"]
    deltas, _ = _stream(tokenizer, prompt, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d) > 10  # it really streams


def test_random_token_sequences_equal_the_full_decode(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(30):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        deltas, _ = _stream(tokenizer, [1, 2, 3], ids)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer("a<|im_end|>b")["input_ids"]
    assert "".join(_stream(tokenizer, [], ids)[0]) == "ab"
    assert "".join(_stream(tokenizer, [], ids, skip_special_tokens=False)[0]) == "a<|im_end|>b"


@pytest.mark.parametrize("stop, expected", [
    (("world",), "Hello "),
    (("lo w", "xyz"), "Hel"),
    (("🚀",), "Hello world 🙂"),
    (("never",), "Hello world 🙂🚀 end"),
    (("d 🙂", "o"), "Hell"),
])
def test_stop_strings_truncate_and_never_leak(tokenizer, stop, expected):
    ids = tokenizer("Hello world 🙂🚀 end")["input_ids"]
    deltas, detok = _stream(tokenizer, [], ids, stop=stop)
    assert "".join(deltas) == expected
    assert detok.stopped == (expected != "Hello world 🙂🚀 end")
    emitted = ""
    for d in deltas:  # at no point did the client see the start of a stop string that then completed
        emitted += d
        assert not any(s in emitted for s in stop)


def test_include_stop_str_keeps_the_stop_string_and_min_tokens_lets_an_early_one_pass(tokenizer):
    text = "one, two, three, four."
    ids = tokenizer(text)["input_ids"]
    cut, detok = _stream(tokenizer, [], ids, stop=(", t",))
    assert "".join(cut) == "one" and detok.stopped
    kept, _ = _stream(tokenizer, [], ids, stop=(", t",), include_stop=True)
    assert "".join(kept) == "one, t"
    # Before min_tokens tokens a stop string ends nothing (vLLM): the first ", t" passes, a later one stops.
    first_stop = next(i for i in range(1, len(ids) + 1) if ", t" in tokenizer.decode(ids[:i]))
    late, detok = _stream(tokenizer, [], ids, stop=(", t",), min_tokens=first_stop + 1)
    assert "".join(late) == "one, two" and detok.stopped
