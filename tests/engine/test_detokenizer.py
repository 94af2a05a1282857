from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferd.engine.detokenizer import IncrementalDetokenizer


def _bytes_vocab(text: str, cut: list[int]) -> tuple[list[bytes], list[int]]:
    """Split the UTF-8 of ``text`` at the given byte offsets into a one-token-per-piece vocab."""
    data = text.encode()
    points = sorted({c for c in cut if 0 < c < len(data)})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    return pieces, list(range(len(pieces)))


def _run(
    pieces: list[bytes], ids: list[int], stop: tuple[str, ...] = ()
) -> tuple[str, str | None, list[str]]:
    detok = IncrementalDetokenizer(lambda i: pieces[i], stop=stop)
    deltas = []
    for i in ids:
        step = detok.push(i)
        deltas.append(step.text)
        if step.stop_string is not None:
            return "".join(deltas), step.stop_string, deltas
    deltas.append(detok.flush())
    return "".join(deltas), None, deltas


@given(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 200), max_size=20))
def test_any_byte_split_reassembles_the_text_and_never_splits_a_character(
    text: str, cut: list[int]
) -> None:
    pieces, ids = _bytes_vocab(text, cut)
    out, stop, deltas = _run(pieces, ids)
    assert out == text and stop is None
    for delta in deltas:  # every delta is whole characters: it round-trips through UTF-8
        assert delta.encode().decode() == delta


def test_emoji_split_across_tokens_is_emitted_once_complete() -> None:
    data = "a🙂b".encode()
    pieces = [data[:2], data[2:4], data[4:]]
    detok = IncrementalDetokenizer(lambda i: pieces[i])
    assert detok.push(0).text == "a"
    assert detok.push(1).text == ""  # half an emoji waits
    assert detok.push(2).text == "🙂b"


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("Hello world. Bye", ("world",), "Hello "),
        ("one\n\ntwo", ("\n\n",), "one"),
        ("abcabd", ("abd",), "abc"),
        ("no stop here", ("zzz",), "no stop here"),
        ("x END y STOP", ("STOP", "END"), "x "),
    ],
)
def test_stop_strings_are_never_emitted(text: str, stop: tuple[str, ...], expected: str) -> None:
    pieces = [c.encode() for c in text]  # one character per token: worst case for hold-back
    out, hit, _ = _run(pieces, list(range(len(pieces))), stop)
    assert out == expected
    assert (hit is not None) == (expected != text)


def test_partial_stop_prefix_is_held_then_released() -> None:
    pieces = [b"ab", b"c", b"d"]
    detok = IncrementalDetokenizer(lambda i: pieces[i], stop=("cx",))
    assert detok.push(0).text == "ab"
    assert detok.push(1).text == ""  # "c" might start "cx"
    assert detok.push(2).text == "cd"  # diverged: released


def test_skipped_special_tokens_produce_no_text() -> None:
    pieces = [b"hi", b"<|im_end|>"]
    detok = IncrementalDetokenizer(lambda i: pieces[i], skip_ids=frozenset({1}))
    assert detok.push(0).text == "hi"
    assert detok.push(1).text == ""
