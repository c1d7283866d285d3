"""Incremental detokenisation with stop strings.

Text is emitted only once it is final: a token that ends inside a multi-byte
UTF-8 character (decoded as U+FFFD) is held until the character completes, and
a tail that could be the start of a stop string is held until it is known not
to be one, so a stop string never reaches the client. Stop strings are matched
incrementally (services/llm/stops.py): each final character is fed once. Decoding works on a
sliding window of tokens (the vLLM scheme), not on the whole output each step.
"""

from __future__ import annotations

from services.llm.stops import StopMatcher

# Prompt tokens used as left context, so the first output token decodes as it would mid-text.
_CONTEXT_TOKENS = 5


def fast_decoder(tokenizer):
    """The Rust tokenizer's own decode when that is what `tokenizer.decode` amounts to (no clean-up pass):
    several times cheaper per call, which adds up over a batch of hundreds of sequences every step."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    vocab = backend.get_vocab_size(with_added_tokens=True)

    def decode(ids, skip_special_tokens=True):
        # The slow path's behaviour for ids past the vocabulary (random weights can produce them): skipped.
        return backend.decode([i for i in ids if 0 <= i < vocab] if max(ids, default=0) >= vocab else ids,
                              skip_special_tokens=skip_special_tokens)

    return decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), include_stop: bool = False, min_tokens: int = 0):
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

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text that became final (may be "")."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        self.num_tokens += 1
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            final = new_text[len(prefix_text):]
            self.text += final
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            if self._scan is not None:
                # Each final character goes through the stop automaton once: the cost of a token is the
                # text it adds, not the number or length of the stop strings.
                hit = self._scan.feed(final)
                if hit is not None and self.num_tokens >= self.min_tokens:
                    self.text = self.text[:hit[1] if self.include_stop else hit[0]]
                    self.stopped = True
                    return self._flush()
        return self._release()

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
