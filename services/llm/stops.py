"""Stop strings matched incrementally: an Aho-Corasick automaton fed each new character once.

    matcher = StopMatcher.for_strings(("</s>", "\\n\\nUser:"))   # built once per set of strings (cached)
    scan = matcher.start()
    hit = scan.feed("...new text...")    # (start, end) of the earliest-starting stop string in it, or None
    scan.partial                         # chars at the end that could still begin a stop string: hold them

The cost of a token is the number of characters it adds, whatever the number
and length of the stop strings (the engine thread runs this for every token of
every sequence). The automaton's state after the last character is the longest
tail of the text that is a prefix of some stop string — exactly what must be
held back so a stop string never reaches the client.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatcher:
    goto: tuple[dict[str, int], ...]  # per state: next state by character
    fail: tuple[int, ...]  # per state: the state of its longest proper suffix that is a trie node
    depth: tuple[int, ...]  # per state: length of the prefix it spells
    match: tuple[int, ...]  # per state: length of the longest stop string ending here (0: none)
    shortest: tuple[int, ...]  # per state: length of the shortest stop string ending here (0: none)

    @staticmethod
    @functools.lru_cache(maxsize=256)  # requests of one client or template repeat their stop strings
    def for_strings(strings: tuple[str, ...]) -> StopMatcher:
        goto: list[dict[str, int]] = [{}]
        depth, ends = [0], [[]]
        for s in strings:
            state = 0
            for ch in s:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][ch] = nxt
                    goto.append({})
                    depth.append(depth[state] + 1)
                    ends.append([])
                state = nxt
            ends[state].append(len(s))
        fail = [0] * len(goto)
        order = deque(goto[0].values())
        while order:  # breadth first: a state's failure link is set before its children's
            state = order.popleft()
            for ch, child in goto[state].items():
                order.append(child)
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0) if goto[f].get(ch, 0) != child else 0
                ends[child] = ends[child] + ends[fail[child]]
        return StopMatcher(tuple(goto), tuple(fail), tuple(depth), tuple(max(e, default=0) for e in ends),
                           tuple(min(e, default=0) for e in ends))

    def start(self) -> StopScan:
        return StopScan(self)


class StopScan:
    """One sequence's position in the automaton; `feed` the text as it becomes final."""

    __slots__ = ("matcher", "state", "seen")

    def __init__(self, matcher: StopMatcher):
        self.matcher = matcher
        self.state = 0
        self.seen = 0  # characters fed so far

    @property
    def partial(self) -> int:
        """Length of the longest tail of the text fed so far that is a proper prefix of a stop string."""
        return self.matcher.depth[self.state]

    def feed(self, text: str) -> tuple[int, int] | None:
        """Feed new text; the (start, end) offsets, in all text fed so far, of the stop string that starts
        earliest among those completed by this text (the longest one at that start), or None."""
        m = self.matcher
        goto, fail, longest = m.goto, m.fail, m.match
        state, best = self.state, None
        for i, ch in enumerate(text, self.seen + 1):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if longest[state]:
                start = i - longest[state]
                if best is None or start < best[0]:
                    best = (start, i)
            elif best is not None and i - m.depth[state] >= best[0]:
                break  # nothing that could still complete here starts before the match in hand
        self.state, self.seen = state, self.seen + len(text)
        return best
