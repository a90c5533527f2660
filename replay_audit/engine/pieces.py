"""Each token's piece (`diff.pieces.Piece`: its text, or its bytes) from a transformers tokenizer.

Decoding token by token (`decode([id])`) loses what a piece is: a byte-level BPE token holding
half of a character decodes to U+FFFD, and a SentencePiece token loses its leading space. So the
pieces are read from the vocabulary, in the tokenizer's own byte convention:

- byte-level decoders (GPT-2, Llama 3, Qwen, the bundled tiny model): each character of the
  token string stands for one byte (GPT-2's `bytes_to_unicode` table);
- SentencePiece byte fallback (Llama 2, Mistral): `<0xNN>` is the byte NN, `▁` a space;
- anything else: the token decoded alone.

Special tokens (`</s>`) keep their name. Duck-typed on the tokenizer: no torch or transformers
import here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

from replay_audit.diff.pieces import Piece, piece_of


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's table: printable bytes stand for themselves, the others are shifted past 255.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}


#: Character of a byte-level token string -> the byte it stands for.
BYTE_OF_CHAR: Final = {c: b for b, c in _bytes_to_unicode().items()}
_SP_SPACE: Final = "\u2581"


def _decoder_types(tokenizer: Any) -> set[str]:
    """The type names of the tokenizer's decoder and of its parts (a `Sequence`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    try:
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return {type(decoder).__name__}
    parts = [state, *(state.get("decoders") or [])]
    return {str(p.get("type")) for p in parts if isinstance(p, dict)}


class PieceReader:
    """Pieces of token ids for one tokenizer (each id's piece computed once)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        kinds = _decoder_types(tokenizer)
        self._byte_level = "ByteLevel" in kinds
        self._sentencepiece = bool(kinds & {"ByteFallback", "Metaspace"})
        self._special = {int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ()}
        self._cache: dict[int, Piece] = {}

    def __call__(self, ids: Sequence[int]) -> tuple[Piece, ...]:
        for i in map(int, ids):
            if i not in self._cache:
                self._cache[i] = self._piece(i)
        return tuple(self._cache[int(i)] for i in ids)

    def _piece(self, token_id: int) -> Piece:
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(token, str):
            return ""
        if token_id in self._special:
            return token
        if self._byte_level and all(c in BYTE_OF_CHAR for c in token):
            return piece_of(bytes(BYTE_OF_CHAR[c] for c in token))
        if self._sentencepiece:
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                try:
                    return piece_of(bytes([int(token[3:5], 16)]))
                except ValueError:
                    pass
            return piece_of(token.replace(_SP_SPACE, " ").encode("utf-8"))
        text = self._tokenizer.decode(
            [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return piece_of(str(text).encode("utf-8"))
