"""Incremental detokenisation: equals the full decode, never splits UTF-8, never leaks stop strings."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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


def _deltas(tokenizer, prompt, ids, **kw):
    detok = IncrementalDetokenizer(tokenizer, prompt, **kw)
    return [detok.add(t) for t in ids] + [detok.finish()]


def _same_deltas(tokenizer, prompt, ids, skip):
    assert (_deltas(tokenizer, prompt, ids, skip_special_tokens=skip)
            == _deltas(tokenizer, prompt, ids, skip_special_tokens=skip, stream=False))


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """Llama-2's decoder (▁ for spaces, <0xNN> byte tokens fused, the first space stripped): unlike byte-level
    BPE, its text can change at the start as tokens arrive, where DecodeStream raises "Invalid prefix"."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator([c.encode("ascii", "ignore").decode() for c in tiny._CORPUS] * 4,
                            trainer=trainers.BpeTrainer(vocab_size=600, show_progress=False, special_tokens=[
                                "<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


def test_both_test_tokenizers_take_the_stream(tokenizer, byte_fallback_tokenizer):
    """Else the comparisons below would compare the Python window with itself."""
    for tok in (tokenizer, byte_fallback_tokenizer):
        assert IncrementalDetokenizer(tok, [3])._stream is not None


@pytest.mark.parametrize("prompt, text, skip", [
    ("日", "本語", True),  # the context ends inside a character (the stream is not used)
    ("Say:", "é🙂", True),  # characters split over several outputs
    ("", "<|im_end|><|im_start|>", False),  # special tokens only, kept
    ("", "<|im_end|><|im_start|>", True),  # ... and skipped: no text at all
])
def test_the_stream_in_tokenizers_emits_what_the_python_window_does_on_pinned_cases(tokenizer, prompt, text, skip):
    ids = tokenizer(text)["input_ids"]
    context = tokenizer(prompt)["input_ids"][:1] if prompt == "日" else tokenizer(prompt)["input_ids"]
    _same_deltas(tokenizer, context, ids, skip)
    _same_deltas(tokenizer, [3], [5, len(tokenizer) + 3, 7, *ids], skip)  # an id past the vocabulary


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, 404), max_size=6), ids=st.lists(st.integers(0, 404), min_size=1, max_size=30),
       skip=st.booleans())
def test_the_stream_in_tokenizers_emits_what_the_python_window_does_token_by_token(tokenizer, prompt, ids, skip):
    """DecodeStream against the Python window, delta for delta: contexts and outputs of any ids (the tiny
    tokenizer's 400 and a few past them), single bytes that split characters, special tokens kept or skipped."""
    assert len(tokenizer) == 400
    _same_deltas(tokenizer, prompt, ids, skip)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, 602), max_size=6), ids=st.lists(st.integers(0, 602), min_size=1, max_size=30),
       skip=st.booleans(), text=st.sampled_from(["", "Hello world, the quick fox", " two  spaces", "a\tb"]))
def test_a_byte_fallback_tokenizer_streams_what_the_python_window_does(byte_fallback_tokenizer, prompt, ids, skip,
                                                                       text):
    """The same comparison with Llama-2's decoder, where the stream raises and the Python window takes over
    mid-sequence (with special tokens kept, byte tokens after a leading space often do)."""
    tok = byte_fallback_tokenizer
    assert len(tok) == 600
    _same_deltas(tok, prompt, tok(text, add_special_tokens=False)["input_ids"] + ids, skip)


def test_a_stream_that_fails_midway_hands_over_to_the_python_window(tokenizer, monkeypatch):
    """tokenizers raises "Invalid prefix encountered" when a token changes text already decoded (vllm#17448):
    the Python window goes on from the same offsets, and the text is the full decode all the same."""
    from services.llm import detokenizer

    real = detokenizer.DecodeStream

    class FailsAtFifth:
        calls = 0

        def __init__(self, **kw):
            self.stream = real(**kw)

        def step(self, backend, token_id):
            type(self).calls += 1
            if type(self).calls == 5:
                raise Exception("Invalid prefix encountered")
            return self.stream.step(backend, token_id)

    monkeypatch.setattr(detokenizer, "DecodeStream", FailsAtFifth)
    text = "Héllo wörld 🙂🚀 日本語 and plain words."
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, tokenizer("Say:")["input_ids"])
    deltas = [detok.add(t) for t in ids] + [detok.finish()]
    assert FailsAtFifth.calls == 5 and detok._stream is None
    assert "".join(deltas) == text
    assert deltas == _deltas(tokenizer, tokenizer("Say:")["input_ids"], ids, stream=False)
