"""The scan's per-token evidence (issue 23): the logged token's native logit and rank, measured
from the scan's own logits, batched or not, on the tiny random checkpoint."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from replay_audit.engine import Intervention, ScanItem
from replay_audit.engine.protocol import Engine


def _items(engine: Engine, prompts: list[list[int]], perturb: bool) -> list[ScanItem]:
    """Greedy outputs of the engine; with `perturb`, every third token replaced by another."""
    items = []
    for p in prompts[:8]:
        out = engine.decode(p, 12).output_token_ids
        if perturb:
            out = [(t + 7) % engine.vocab_size if i % 3 == 1 else t for i, t in enumerate(out)]
        items.append(ScanItem(p, out))
    return items


def test_evidence_is_rank_0_at_the_logits_top1_where_the_scan_agrees(
    tiny_engine: Callable[..., Engine], tiny_prompts: list[list[int]]
) -> None:
    engine = tiny_engine("bf16", attn_kernel="eager")
    for run in engine.scan_batch(_items(engine, tiny_prompts, True), Intervention(), 5):
        assert run.evidence is not None
        ev, top1 = run.evidence, run.steps.top_k_logits[:, 0]
        assert ev.logits.shape == ev.ranks.shape == run.agrees.shape
        # Rank 0 is the scan's own native choice, exactly where it agrees (no intervention).
        assert np.array_equal(ev.ranks == 0, run.agrees)
        assert np.array_equal(ev.logits[run.agrees], top1[run.agrees])
        # Any other logged token sits at or below the top-1, at its rank in the top-k.
        assert (ev.logits <= top1).all()
        for t in np.flatnonzero((ev.ranks > 0) & (ev.ranks < 5)):
            assert ev.logits[t] == run.steps.top_k_logits[t, ev.ranks[t]]
    assert not all(r.agrees.all() for r in engine.scan_batch(_items(engine, tiny_prompts, True)))


def test_batched_evidence_is_the_single_scans(
    tiny_engine: Callable[..., Engine], tiny_prompts: list[list[int]]
) -> None:
    engine = tiny_engine("fp16", attn_kernel="eager")
    items = _items(engine, tiny_prompts, True)
    for item, run in zip(items, engine.scan_batch(items, token_budget=64), strict=True):
        alone = engine.scan(item.prompt_ids, item.output_ids)
        assert run.evidence is not None and alone.evidence is not None
        assert np.array_equal(run.evidence.logits, alone.evidence.logits)
        assert np.array_equal(run.evidence.ranks, alone.evidence.ranks)
