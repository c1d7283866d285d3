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


def fast_batch_decoder(tokenizer):
    """`decode(list_of_ids, skip_special_tokens) -> texts` in one call of the Rust tokenizer, which lets go of the
    GIL while it decodes (and, for one list, several times cheaper than `tokenizer.decode`: that adds up over
    hundreds of sequences a step); None where `tokenizer.decode` is more than that (a clean-up pass)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    vocab = backend.get_vocab_size(with_added_tokens=True)

    def decode(batch, skip_special_tokens=True):
        # The slow path's behaviour for ids past the vocabulary (random weights can produce them): skipped.
        batch = [[i for i in ids if 0 <= i < vocab] if max(ids, default=0) >= vocab else ids for ids in batch]
        if len(batch) == 1:  # decode_batch's thread pool costs more than it saves for one
            return [backend.decode(batch[0], skip_special_tokens=skip_special_tokens)]
        return backend.decode_batch(batch, skip_special_tokens=skip_special_tokens)

    return decode


def add_all(pairs: list[tuple[IncrementalDetokenizer, int]]) -> list[str]:
    """`detokenizer.add(token)` for each pair, in order: one step's tokens for every sequence. Their windows are
    decoded in one batch per setting of `skip_special_tokens` where the tokenizer allows it: the engine thread
    then holds the GIL for one call a step, not two per sequence (11 % of its GIL samples under image+text load,
    py-spy on the H200, issue 17). Each detokenizer at most once (a second token must see the first's text)."""
    first = pairs[0][0]
    batch = first.batch_decode
    if (len(pairs) == 1 or batch is None or len({id(d) for d, _ in pairs}) < len(pairs)
            or any(d.tokenizer is not first.tokenizer for d, _ in pairs)):
        return [d.add(t) for d, t in pairs]
    windows = [d.push(t) for d, t in pairs]
    texts: list[tuple[str, str] | None] = [None] * len(pairs)
    for skip in (True, False):
        todo = [i for i, w in enumerate(windows) if w is not None and pairs[i][0].skip_special_tokens is skip]
        if todo:
            decoded = batch([ids for i in todo for ids in windows[i]], skip)
            for k, i in enumerate(todo):
                texts[i] = decoded[2 * k], decoded[2 * k + 1]
    return ["" if t is None else d.settle(*t) for (d, _), t in zip(pairs, texts)]


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), include_stop: bool = False, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.batch_decode = fast_batch_decoder(tokenizer)
        self._decode_fn = tokenizer.decode if self.batch_decode is None else (
            lambda ids, skip_special_tokens: self.batch_decode([ids], skip_special_tokens)[0])
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
        windows = self.push(token_id)
        if windows is None:
            return ""
        return self.settle(*(self._decode(ids) for ids in windows))

    def push(self, token_id: int) -> tuple[list[int], list[int]] | None:
        """`add`'s first half: the token appended, and the two windows whose texts `settle` takes (the text
        before the token and with it); None once stopped."""
        if self.stopped:
            return None
        self.ids.append(token_id)
        self.num_tokens += 1
        return self.ids[self.prefix_offset:self.read_offset], self.ids[self.prefix_offset:]

    def settle(self, prefix_text: str, new_text: str) -> str:
        """`add`'s second half, with the windows' texts."""
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
