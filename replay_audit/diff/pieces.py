"""Token pieces: the text of each token, so that token ids can be read.

The API process loads no tokenizer, so whoever has one (the worker, `generate`, an importer
whose source gives token strings) stores each output token's piece with the ids. A piece is the
token's bytes; byte-level BPE splits a character over several tokens, so a piece need not be
valid UTF-8 by itself. Pure: stdlib only.

    Piece        `str` when the token's bytes are valid UTF-8 alone (and hold no NUL, which no
                 database stores in text), else `bytes`
    stored form  a JSON array, one entry per token: the string, or the bytes as a list of
                 integers 0..255 (OpenAI's `bytes` field has the same shape), e.g.
                 ["Hello", ",", " w", [226, 130], [172], "orld"]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

#: A token's piece: its text, or its bytes when they are not valid UTF-8 text alone.
Piece = str | bytes
#: The stored (JSON) form of one piece.
PieceJson = str | list[int]

#: Longest piece accepted on ingest, in characters or bytes (tokenizers' longest tokens are
#: whitespace runs of a few hundred).
MAX_PIECE_LENGTH: Final = 1024


def piece_of(raw: bytes) -> Piece:
    """The piece of a token whose bytes are `raw`: text when they decode alone, else bytes."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return bytes(raw)
    return bytes(raw) if "\x00" in text else text


def piece_of_text(text: str) -> Piece:
    """The piece of a token a source gives as a string: that string, or its bytes where it
    holds what no database stores as text (a NUL, a lone surrogate)."""
    return piece_of(text.encode("utf-8", errors="surrogatepass"))


def piece_bytes(piece: Piece) -> bytes:
    return piece if isinstance(piece, bytes) else piece.encode("utf-8")


def to_json(pieces: Iterable[Piece]) -> list[PieceJson]:
    """The stored form of `pieces` (canonical: bytes that are valid text are stored as text)."""
    pieces = pieces if isinstance(pieces, list | tuple) else list(pieces)
    if all(type(p) is str for p in pieces):  # the common case: every piece text already
        return list(pieces)
    out: list[PieceJson] = []
    for p in pieces:
        q = piece_of(p) if isinstance(p, bytes) else p
        out.append(list(q) if isinstance(q, bytes) else q)
    return out


def from_json(values: Sequence[PieceJson]) -> tuple[Piece, ...]:
    """The pieces of a stored form (`to_json`'s inverse)."""
    return tuple(v if isinstance(v, str) else bytes(v) for v in values)


def joined(pieces: Iterable[Piece]) -> str:
    """The text of consecutive pieces: their bytes concatenated, decoded (invalid bytes as
    U+FFFD, as a tokenizer's decode shows them)."""
    return b"".join(piece_bytes(p) for p in pieces).decode("utf-8", errors="replace")


def shown(piece: Piece) -> str:
    """How a piece is displayed: its text, or each byte escaped as `\\xNN`."""
    if isinstance(piece, str):
        return piece
    return "".join(f"\\x{b:02x}" for b in piece)
