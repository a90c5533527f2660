"""Token pieces: the stored form, the text they give back, how they are shown."""

from __future__ import annotations

from replay_audit.diff.pieces import (
    from_json,
    joined,
    piece_of,
    piece_of_text,
    shown,
    to_json,
)


def test_bytes_that_are_text_are_text_and_the_rest_stay_bytes() -> None:
    assert piece_of(b" caf") == " caf"
    assert piece_of("é".encode()[:1]) == b"\xc3"  # half a character
    assert piece_of(b"a\x00") == b"a\x00"  # no database stores a NUL in text
    assert piece_of_text("\ud800") == b"\xed\xa0\x80"  # a lone surrogate: its bytes
    assert to_json([" caf", b"\xc3", b"\xa9", b"hi"]) == [" caf", [195], [169], "hi"]
    assert from_json([" caf", [195], [169]]) == (" caf", b"\xc3", b"\xa9")


def test_pieces_give_back_the_text_and_show_split_bytes_escaped() -> None:
    text = "naïve 日本 €"
    raw = text.encode()
    pieces = [piece_of(raw[i : i + 1]) for i in range(len(raw))]  # one byte a token
    assert joined(pieces) == text
    assert joined(from_json(to_json(pieces))) == text
    assert shown(b"\xe2\x82") == "\\xe2\\x82" and shown(" w") == " w"
