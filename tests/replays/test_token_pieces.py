"""Token pieces on the bundled model (real transformers, CPU): `generate` stores each output
token's piece with the trace, a replay stores the replayed arms' pieces (and the logged arm's,
where the trace has none), and the pieces give back the texts."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay_audit.diff.pieces import Piece, from_json, joined, shown
from replay_audit.engine import EnginePool, Target
from replay_audit.engine.loading import load_tokenizer
from replay_audit.engine.pieces import PieceReader
from replay_audit.replays.domain import LoggedTrace
from replay_audit.replays.pipeline import compare_arms, replay_trace
from replay_audit.replays.results import result_values
from replay_audit.traces.schemas import TraceCreate

#: Prompts with text beyond ASCII, so that byte-level tokens split characters.
PROMPTS = [("p0", "The café on the corner"), ("p1", "Once upon a time"), ("p2", "1 + 1 = ")]


def _text(pieces: tuple[Piece, ...], ids: list[int], eos: list[int]) -> str:
    # The texts are decoded without special tokens; the pieces keep them (`</s>` is shown).
    return joined(p for p, i in zip(pieces, ids, strict=True) if i not in eos)


@pytest.fixture(scope="module")
def traces(real_dir: Path) -> list[TraceCreate]:
    from replay_audit.engine.generate import TraceGenerator

    gen = TraceGenerator(real_dir, dtype="bf16", attn_kernel="sdpa", device="cpu")
    return [
        TraceCreate.model_validate(gen.trace(text, max_new_tokens=24, external_id=pid))
        for pid, text in PROMPTS
    ]


def test_the_tokenizers_pieces_give_back_any_text(real_dir: Path) -> None:
    tokenizer = load_tokenizer(real_dir)
    text = "naïve café: 日本語 €5\n\tdone  "
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = PieceReader(tokenizer)(ids)
    assert joined(pieces) == tokenizer.decode(ids) == text
    # Byte-level BPE splits characters: those pieces are bytes, shown escaped.
    split = [p for p in pieces if isinstance(p, bytes)]
    assert split and all(shown(p).startswith("\\x") for p in split)
    assert all(isinstance(p, str) for p in pieces if isinstance(p, str) and p.isascii())


def test_generate_stores_pieces_that_give_back_the_output_text(
    traces: list[TraceCreate],
) -> None:
    for tr in traces:
        assert tr.output_token_pieces is not None
        assert len(tr.output_token_pieces) == len(tr.output_token_ids)
        pieces = from_json(tr.output_token_pieces)
        assert _text(pieces, tr.output_token_ids, tr.decoding.eos_token_ids) == tr.output_text


def test_a_replay_stores_each_arms_pieces(
    traces: list[TraceCreate], real_dir: Path, pool: EnginePool
) -> None:
    for tr in traces:
        body = tr.model_dump()
        eos = tr.decoding.eos_token_ids
        # Against the logged tokens: the trace has its pieces, so the result stores arm B's.
        logged = LoggedTrace.from_json(body)
        outcome = replay_trace(logged, Target("fp16"), pool, model_dir=real_dir)
        detail = result_values(0, outcome)["detail"]["arms"]
        b_ids = list(outcome.b.output_token_ids or ())
        b_pieces = from_json(detail["b"]["pieces"])
        assert len(b_pieces) == len(b_ids)
        assert _text(b_pieces, b_ids, eos) == outcome.b.text
        assert "pieces" not in detail["a"]  # stored with the trace already

        # A trace stored without pieces: the worker reads the logged tokens' pieces itself.
        body["output_token_pieces"] = None
        bare = replay_trace(LoggedTrace.from_json(body), Target("fp16"), pool, model_dir=real_dir)
        a_pieces = from_json(result_values(0, bare)["detail"]["arms"]["a"]["pieces"])
        assert list(a_pieces) == list(from_json(tr.output_token_pieces or []))

    # Both arms run here: both arms' pieces.
    both = compare_arms(
        LoggedTrace.from_json(traces[0].model_dump()),
        Target("bf16"),
        Target("fp32"),
        pool,
        model_dir=real_dir,
    )
    arms = result_values(0, both)["detail"]["arms"]
    for name, arm in (("a", both.a), ("b", both.b)):
        ids = list(arm.output_token_ids or ())
        pieces = from_json(arms[name]["pieces"])
        assert _text(pieces, ids, traces[0].decoding.eos_token_ids) == arm.text
