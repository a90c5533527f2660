"""The batched scan's layout (replay_audit/engine/batch.py, pure) and the fake engine's
`scan_batch`: properties over generated inputs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_audit.engine import FakeEngine, Intervention, Target
from replay_audit.engine.batch import (
    MIN_BUCKET,
    RowKey,
    bucket_length,
    context_length,
    pack_batch,
    plan_rows,
    plan_scan,
    plan_scan_batches,
    plan_steps,
    scan_extras,
)
from replay_audit.engine.protocol import ScanItem, ScanRun

lengths_st = st.lists(st.integers(1, 3000), max_size=120)
budget_st = st.integers(1, 20000)
ids_st = st.lists(st.integers(0, 96), max_size=24)
items_st = st.lists(
    st.builds(ScanItem, st.lists(st.integers(0, 96), min_size=1, max_size=24), ids_st),
    max_size=30,
)


def test_bucket_lengths() -> None:
    assert [bucket_length(n) for n in (1, 16, 17, 32, 33, 511, 512, 513)] == [
        MIN_BUCKET, 16, 32, 32, 64, 512, 512, 1024
    ]  # fmt: skip
    with pytest.raises(ValueError):
        bucket_length(0)


@given(lengths_st, budget_st)
def test_plan_loses_no_trace_and_keeps_the_budget(lengths: list[int], budget: int) -> None:
    batches = plan_scan_batches(lengths, budget)
    placed = [i for b in batches for i in b.indices]
    assert sorted(placed) == list(range(len(lengths)))  # each trace exactly once
    for b in batches:
        assert list(b.indices) == sorted(b.indices)  # rows keep the callers' order
        assert all(lengths[i] <= b.padded_length for i in b.indices)  # every context fits
        buckets = {bucket_length(lengths[i]) for i in b.indices}
        if buckets == {b.padded_length} and b.padded_length <= budget:
            assert b.tokens <= budget
        else:  # a trace whose bucket alone exceeds the budget: alone, unpadded
            (i,) = b.indices
            assert bucket_length(lengths[i]) > budget and b.padded_length == lengths[i]


@given(lengths_st, budget_st)
def test_plan_fills_batches_and_pads_by_own_length_only(lengths: list[int], budget: int) -> None:
    batches = plan_scan_batches(lengths, budget)
    by_length: dict[int, list[int]] = {}
    for b in batches:
        by_length.setdefault(b.padded_length, []).append(b.rows)
    for length, rows in by_length.items():
        if length <= budget:  # all a bucket's batches full but its last
            assert all(r == budget // length for r in rows[:-1]) and rows[-1] <= budget // length
    # A trace's padded length is what it would get alone: its batch-mates never change it.
    for b in batches:
        for i in b.indices:
            assert plan_scan_batches([lengths[i]], budget)[0].padded_length == b.padded_length


@given(items_st, st.integers(0, 96), st.integers(0, 40))
def test_packed_rows_hold_the_contexts_and_padding_is_never_read(
    items: list[ScanItem], pad_id: int, extra: int
) -> None:
    items = [it for it in items if it.output_ids]
    if not items:
        return
    length = max(context_length(it) for it in items) + extra
    packed = pack_batch(items, length, pad_id)
    assert packed.input_ids.shape == (len(items), length)
    assert packed.row_steps[-1] == packed.output_positions.size
    for r, it in enumerate(items):
        full = [*it.prompt_ids, *it.output_ids]
        n, p = context_length(it), len(it.prompt_ids)
        assert packed.input_ids[r, :n].tolist() == full[:n]
        assert (packed.input_ids[r, n:] == pad_id).all() and packed.lengths[r] == n
        pos = packed.output_positions[packed.row_steps[r] : packed.row_steps[r + 1]]
        assert pos.size == len(it.output_ids)
        # every position read is a real one of this row: never padding, never another row; and
        # all its padding comes after it, so under the causal mask it reads none of it
        assert ((pos >= r * length) & (pos < r * length + n)).all()
        # position p - 1 + t holds context token p - 1 + t and predicts output token t
        assert (pos - r * length).tolist() == list(range(p - 1, p - 1 + len(it.output_ids)))
        assert packed.input_ids.reshape(-1)[pos].tolist() == full[p - 1 : p - 1 + pos.size]
        assert full[p : p + pos.size] == list(it.output_ids)
    assert packed.padded == any(context_length(it) < length for it in items)


def test_pack_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        pack_batch([ScanItem([1, 2, 3], [4, 5])], 3, 0)
    with pytest.raises(ValueError, match="at least one prompt"):
        pack_batch([ScanItem([], [4, 5])], 8, 0)


def test_plan_scan_skips_empty_outputs_and_refuses_an_empty_prompt() -> None:
    items = [ScanItem([1], []), ScanItem([1, 2], [3]), ScanItem([], []), ScanItem([4], [5, 6])]
    batches = plan_scan(items, 64)
    assert [b.indices for b in batches] == [(1, 3)]
    with pytest.raises(ValueError, match="prompt token"):
        plan_scan([ScanItem([], [1, 2])], 64)


def test_scan_extras_name_the_shapes() -> None:
    batches = plan_scan_batches([20, 20, 20, 5, 100, 300], 64)
    extras = scan_extras(batches, 64)
    assert extras["scan_token_budget"] == 64
    # 2 rows of 32, 1 of 32, 1 of 16, 100 and 300 alone (their buckets exceed the budget)
    assert extras["scan_batch_shapes"] == "1x16,1x32,2x32,1x100,1x300"
    assert "right" in str(extras["scan_padding"])


def _equal(a: ScanRun, b: ScanRun) -> bool:
    fields = ("token_ids", "native_token_ids", "top_k_ids", "top_k_logits", "margins")
    more = ("margins_ulps", "gate_fired")
    same = all(np.array_equal(getattr(a.steps, f), getattr(b.steps, f)) for f in fields + more)
    return same and np.array_equal(a.agrees, b.agrees)


def _margin_by_context(context: tuple[int, ...]) -> tuple[int, float]:
    return (sum(context) * 7 + len(context)) % 97, (len(context) % 5) * 2e-4


@settings(max_examples=50, deadline=None)
@given(items_st, st.integers(1, 400), st.sampled_from(["none", "A", "C"]))
def test_fake_scan_batch_is_its_scan_in_order(
    items: list[ScanItem], budget: int, kind: str
) -> None:
    engine = FakeEngine(
        Target("bf16"), next_token=_margin_by_context, repair_fn=lambda c, t: (t + 1) % 97
    )
    iv = Intervention(kind)  # type: ignore[arg-type]
    batched = engine.scan_batch(items, iv, top_k=3, token_budget=budget)
    assert len(batched) == len(items)
    for it, run in zip(items, batched, strict=True):
        assert _equal(run, engine.scan(it.prompt_ids, it.output_ids, iv, top_k=3))
    extras = engine.environment()["extras"]
    assert extras == scan_extras(plan_scan(items, budget), budget)


@given(
    lengths=st.lists(st.integers(1, 300), max_size=60),
    budget=st.integers(1, 2048),
)
@settings(max_examples=200, deadline=None)
def test_plan_steps_groups_one_length_per_forward_unpadded(lengths: list[int], budget: int) -> None:
    batches = plan_steps(lengths, budget)
    seen = sorted(i for b in batches for i in b.indices)
    assert seen == list(range(len(lengths)))  # every context once
    for b in batches:
        assert {lengths[i] for i in b.indices} == {b.padded_length}  # one length, no padding
        assert list(b.indices) == sorted(b.indices)  # order kept
        assert b.rows == 1 or b.tokens <= budget


def test_the_fake_batches_steps_as_step_does() -> None:
    e = FakeEngine(Target("bf16"))
    contexts = [[1, 2, 3], [4, 5, 6], [7, 8], [1, 2, 3, 4]]
    batched = e.step_batch(contexts, Intervention(), 3, token_budget=6)
    for c, b in zip(contexts, batched, strict=True):
        a = e.step(c, [], Intervention(), 3)
        assert (a.token, a.margin) == (b.token, b.margin)
    assert e.environment()["extras"]["step_batch_shapes"] == "1x2,2x3,1x4"
    with pytest.raises(ValueError, match="context token"):
        e.step_batch([[]], Intervention())


row_keys_st = st.lists(
    st.one_of(
        st.none(),
        st.tuples(
            st.sampled_from([(3, 5), (4, 4, 4), (2, 7)]), st.integers(0, 2), st.integers(0, 1)
        ),
    ),
    max_size=40,
)


@given(row_keys_st)
def test_plan_rows_runs_each_batch_once_per_row(keys: list[RowKey | None]) -> None:
    """Every request is planned once; a run together holds two or more rows of one batch and
    prefix length, each row once; a key of None decodes alone; a request decodes alone only
    where no other request of its batch could share its run."""
    plan = plan_rows(keys)
    planned = [i for run in plan.together for i in run] + plan.alone
    assert sorted(planned) == list(range(len(keys)))
    for run in plan.together:
        assert len(run) >= 2
        batches = {(keys[i][0], keys[i][1]) for i in run}  # type: ignore[index]
        assert len(batches) == 1
        rows = [keys[i][2] for i in run]  # type: ignore[index]
        assert len(set(rows)) == len(rows)
        assert run == sorted(run)  # the requests' order within a batch
    # As few runs of each batch as its most asked-for row needs: a request decodes alone only
    # where its batch has nothing else left to run with it.
    for batch in {(k[0], k[1]) for k in keys if k is not None}:
        mine = [i for i, k in enumerate(keys) if k is not None and (k[0], k[1]) == batch]
        runs = [r for r in plan.together if r[0] in mine] + [[i] for i in plan.alone if i in mine]
        most = max(Counter(keys[i][2] for i in mine).values())  # type: ignore[index]
        assert len(runs) == most
