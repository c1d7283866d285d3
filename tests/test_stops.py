"""Stop strings matched incrementally (Aho-Corasick) against a brute-force reference, chunk by chunk."""

from hypothesis import given, settings
from hypothesis import strategies as st

from services.llm.stops import StopMatcher


def _reference(stops, chunks):
    """Feed chunks; at the first chunk after which the text holds a stop string, the text before the
    earliest-starting one. Also the held tail after each chunk until then."""
    text, holds = "", []
    for chunk in chunks:
        text += chunk
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[:min(found)], holds
        holds.append(max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0))
    return None, holds


def _ours(stops, chunks):
    scan = StopMatcher.for_strings(tuple(stops)).start()
    text, holds = "", []
    for chunk in chunks:
        text += chunk
        hit = scan.feed(chunk)
        if hit is not None:
            return text[:hit[0]], holds
        holds.append(scan.partial)
    return None, holds


ALPHABET = "ab\nc"  # few letters: overlapping stop strings and partial matches are the common case


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=6),
       chunks=st.lists(st.text(ALPHABET, max_size=5), max_size=12))
def test_incremental_matching_equals_brute_force(stops, chunks):
    assert _ours(stops, chunks) == _reference(stops, chunks)


def test_overlapping_and_nested_stop_strings():
    # The earliest start wins within what arrives together ("abcd" before "bc"); shared prefixes and
    # failure links ("aab" after "aa") are followed.
    assert _ours(["bc", "abcd"], ["abcd"]) == ("", [])
    assert _ours(["bc", "abcd"], ["ab", "c"]) == ("a", [2])
    assert _ours(["aab"], ["a", "a", "a", "b"]) == ("a", [1, 2, 2])
    assert _ours(["xyz"], ["x", "y", "q"]) == (None, [1, 2, 0])


def test_a_matcher_is_built_once_per_set_of_strings():
    assert StopMatcher.for_strings(("a", "b")) is StopMatcher.for_strings(("a", "b"))
