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


class Decoder:
    """`tokenizer.decode`, one list of ids or many at once.

    With a Rust tokenizer whose decode has no clean-up pass, its own `decode` (several times cheaper per
    call than transformers' wrapper) and `decode_batch`, which decodes with the GIL released: the engine
    decodes every sequence of a step in one call while the event loop runs (py-spy on the H200 at 256
    streams: one `decode` per sequence and token was 18 % of the engine thread's GIL time)."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "_tokenizer", None)
        self._tokenizer = tokenizer
        self._backend = None if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True) else backend
        self._vocab = self._backend.get_vocab_size(with_added_tokens=True) if self._backend is not None else 0

    def _in_vocab(self, ids: list[int]) -> list[int]:
        # The slow path's behaviour for ids past the vocabulary (random weights can produce them): skipped.
        return [i for i in ids if 0 <= i < self._vocab] if max(ids, default=0) >= self._vocab else ids

    def one(self, ids: list[int], skip_special_tokens: bool) -> str:
        if self._backend is None:
            return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._backend.decode(self._in_vocab(ids), skip_special_tokens=skip_special_tokens)

    def many(self, batch: list[list[int]], skip_special_tokens: bool) -> list[str]:
        if self._backend is None:
            return [self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch]
        return self._backend.decode_batch([self._in_vocab(ids) for ids in batch],
                                          skip_special_tokens=skip_special_tokens)


def add_batch(detokenizers: list[IncrementalDetokenizer], tokens: list[int]) -> list[str]:
    """`d.add(t)` for each pair, with the decodes of all of them in one `decode_batch` per decoder and
    skip_special_tokens setting: the same texts as one `add` after another (each detokenizer is its own)."""
    out = [""] * len(detokenizers)
    groups: dict[tuple[int, bool], list[tuple[int, tuple[list[int], list[int]]]]] = {}
    decoders: dict[int, Decoder] = {}
    for i, (d, token) in enumerate(zip(detokenizers, tokens)):
        windows = d.windows(token)
        if windows is not None:
            decoders[id(d.decoder)] = d.decoder
            groups.setdefault((id(d.decoder), d.skip_special_tokens), []).append((i, windows))
    for (key, skip), items in groups.items():
        texts = decoders[key].many([w for _, pair in items for w in pair], skip)
        for n, (i, _) in enumerate(items):
            out[i] = detokenizers[i].accept(texts[2 * n], texts[2 * n + 1])
    return out


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), decoder: Decoder | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.decoder = decoder or Decoder(tokenizer)  # the engine hands every request its one Decoder
        self.stop = tuple(stop)
        self._scan = StopMatcher.for_strings(self.stop).start() if self.stop else None
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""  # all final text produced so far (including any held tail)
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.decoder.one(ids, self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text that became final (may be "")."""
        windows = self.windows(token_id)
        if windows is None:
            return ""
        return self.accept(self._decode(windows[0]), self._decode(windows[1]))

    def windows(self, token_id: int) -> tuple[list[int], list[int]] | None:
        """First half of `add`: take the token; the two id windows to decode (None once stopped)."""
        if self.stopped:
            return None
        self.ids.append(token_id)
        return self.ids[self.prefix_offset:self.read_offset], self.ids[self.prefix_offset:]

    def accept(self, prefix_text: str, new_text: str) -> str:
        """Second half of `add`, given the decoded `windows`: the text that became final (may be "")."""
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            final = new_text[len(prefix_text):]
            self.text += final
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            if self._scan is not None:
                # Each final character goes through the stop automaton once: the cost of a token is the
                # text it adds, not the number or length of the stop strings.
                hit = self._scan.feed(final)
                if hit is not None:
                    self.text = self.text[:hit[0]]
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
