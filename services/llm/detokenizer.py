"""Incremental detokenisation with stop strings.

Text is emitted only once it is final: a token that ends inside a multi-byte
UTF-8 character (decoded as U+FFFD) is held until the character completes, and
a tail that could be the start of a stop string is held until it is known not
to be one, so a stop string never reaches the client. Stop strings are matched
incrementally (services/llm/stops.py): each final character is fed once. Decoding works on a
sliding window of tokens (the vLLM scheme), not on the whole output each step. With a Rust
tokenizer the window runs inside `tokenizers` (its DecodeStream, as vLLM's fast detokenizer):
one call a token instead of two decodes and their slices, which adds up over hundreds of
sequences every step.
"""

from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream

from services.llm.stops import StopMatcher

log = logging.getLogger(__name__)

# Prompt tokens used as left context, so the first output token decodes as it would mid-text.
_CONTEXT_TOKENS = 5


def rust_backend(tokenizer):
    """The `tokenizers.Tokenizer` behind `tokenizer` when `tokenizer.decode` amounts to its decode (no
    clean-up pass), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend


def fast_decoder(tokenizer):
    """The Rust tokenizer's own decode when that is what `tokenizer.decode` amounts to: several times
    cheaper per call, which adds up over a batch of hundreds of sequences every step."""
    backend = rust_backend(tokenizer)
    if backend is None:
        return tokenizer.decode
    vocab = backend.get_vocab_size(with_added_tokens=True)

    def decode(ids, skip_special_tokens=True):
        # The slow path's behaviour for ids past the vocabulary (random weights can produce them): skipped.
        return backend.decode([i for i in ids if 0 <= i < vocab] if max(ids, default=0) >= vocab else ids,
                              skip_special_tokens=skip_special_tokens)

    return decode


class IncrementalDetokenizer:
    """`stream`: the window in `tokenizers` (DecodeStream) where the tokenizer is a Rust one without a
    clean-up pass; False keeps it in Python (both give the same text; the tests compare them)."""

    def __init__(self, tokenizer, prompt_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), include_stop: bool = False, min_tokens: int = 0, stream: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_fn = fast_decoder(tokenizer)
        self.stop = tuple(stop)
        self.include_stop = include_stop  # keep the stop string that ended the text (vLLM's option)
        self.min_tokens = min_tokens  # no stop string ends the text before this many tokens (as vLLM)
        self.num_tokens = 0
        self._scan = StopMatcher.for_strings(self.stop).start() if self.stop else None
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""  # all final text produced so far (including any held tail)
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False
        # self.prefix_offset / read_offset advance whenever the stream emits, which is when the Python window
        # would, so the Python window can take over at any token (the stream's own window may start later, past
        # tokens that decode to nothing). A context that ends inside a character stays with the Python window:
        # the stream would count that character as output.
        self._backend = rust_backend(tokenizer) if stream else None
        self._stream = None
        if self._backend is not None and not self._decode(context).endswith("\ufffd"):
            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text that became final (may be "")."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        self.num_tokens += 1
        final = self._step(token_id)
        if final:
            self.text += final
            if self._scan is not None:
                # Each final character goes through the stop automaton once: the cost of a token is the
                # text it adds, not the number or length of the stop strings.
                hit = self._scan.feed(final)
                if hit is not None and self.num_tokens >= self.min_tokens:
                    self.text = self.text[:hit[1] if self.include_stop else hit[0]]
                    self.stopped = True
                    return self._flush()
        return self._release()

    def _step(self, token_id: int) -> str:
        """The text that the token just appended makes final: "" while it ends inside a character or adds none."""
        if self._stream is not None:
            try:
                final = self._stream.step(self._backend, token_id)
            except Exception as exc:  # noqa: BLE001 - the Python window takes over, from the same offsets
                self._stream = None
                if "Invalid prefix" not in str(exc):  # that one is expected: the text's start changed (vllm#17448)
                    log.warning("tokenizers' DecodeStream failed (%s); this sequence decodes in Python", exc)
            else:
                if final is None:
                    return ""
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                return final
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def _release(self) -> str:
        hold = self._scan.partial if self._scan is not None else 0  # could still begin a stop string
        end = len(self.text) - hold
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

    def _flush(self) -> str:
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out

    def finish(self) -> str:
        """The request ended (EOS, length): release any held tail, including an incomplete character."""
        if self.stopped:
            return ""
        tail = self._decode(self.ids[self.prefix_offset:])
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        if len(tail) > len(prefix_text):
            self.text += tail[len(prefix_text):]
            self.prefix_offset = self.read_offset = len(self.ids)
        return self._flush()
