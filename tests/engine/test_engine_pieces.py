"""The pieces a tokenizer's vocabulary gives: SentencePiece byte fallback here (byte-level BPE
on the bundled model is in tests/replays/test_token_pieces.py)."""

from __future__ import annotations

from types import SimpleNamespace

from tokenizers import decoders

from replay_audit.diff.pieces import joined
from replay_audit.engine.pieces import PieceReader


class _SentencePiece:
    """What PieceReader reads of a transformers tokenizer, for a Llama-2 style vocabulary
    (`▁` for a space, `<0xNN>` byte-fallback tokens, Metaspace-like decoder)."""

    vocab = ("<s>", "</s>", "▁the", "▁caf", "<0xC3>", "<0xA9>", "s")
    all_special_ids = (0, 1)
    backend_tokenizer = SimpleNamespace(
        decoder=decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    )

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.vocab[token_id]


def test_sentencepiece_byte_fallback_tokens_are_bytes() -> None:
    pieces = PieceReader(_SentencePiece())([2, 3, 4, 5, 6, 1])
    assert pieces == (" the", " caf", b"\xc3", b"\xa9", "s", "</s>")
    assert joined(pieces[:-1]) == " the cafés"
