"""The torch engine's batched scan on CPU against `scan` of each trace alone, on the committed
small model (fp32, bf16, fp16).

What is exactly equal, and what is not (measured on this machine's CPU, an AMD EPYC with AVX2,
torch 2.13, for the bundled model's shapes):
- A trace's batched scan does not depend on the traces that share its batch: it is padded to
  its own bucket's length, and the CPU kernels give each row the same bits at any row count.
- Attention `eager`: batched = bs=1 bit for bit here (every field of every step) for the
  prompt set's contexts (38-80 tokens), in all three formats and with interventions A, B and
  C: the keys the causal mask hides (the padding among them) add exact zeros to the softmax
  and to probabilities x V. Not on every CPU: on an Intel host fp16 differed by 1 ulp on 3 of
  135 top-k logits (its GEMM blocks a batch's rows otherwise), so the tests assert what any
  CPU gives (`_assert_close`), as for `sdpa` below, and the batch shapes are recorded.
- Attention `sdpa` (transformers' default): not equal. torch's CPU flash attention takes its
  key block as long as the sequence (below 512 tokens), so a padded row sums its attention in
  another order. What holds: a trace with no padding (context = its bucket's length) is equal
  bit for bit; elsewhere margins and top-1 logits differ by at most 1 ulp of bf16/fp16 (fp32:
  8 ulps, under 2e-5), asserted within `_tolerance`, and a token differs only at a near-tie (both
  margins within that tolerance), so the first disagreement is the same wherever bs=1's margin
  there exceeds it.
- Not equal either (not exercised here): fp32 contexts under 12 tokens (MKL's small-row GEMM
  paths differ from the batch's) and fp32 eager rows padded beyond 200 tokens.
- A trace whose bucket exceeds the token budget runs alone and unpadded: exactly `scan`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from replay_audit.engine import EnginePool, Intervention, ScanRun, Target
from replay_audit.engine.batch import bucket_length, context_length, plan_scan, scan_extras
from replay_audit.engine.protocol import Engine, ScanItem
from replay_audit.formats import ulp_array

#: Small enough that the prompt set spreads over several forwards of several rows each.
BUDGET = 1024
FIELDS = (
    "token_ids",
    "native_token_ids",
    "top_k_ids",
    "top_k_logits",
    "margins",
    "margins_ulps",
    "gate_fired",
)


@pytest.fixture(scope="module")
def items(pool: EnginePool, real_dir: Path, real_prompts: list[tuple[str, str]]) -> list[ScanItem]:
    """24 traces of the prompt set decoded in fp32, 8 to 39 output tokens: contexts of 38 to 80
    tokens, in buckets of 64 and 128."""
    logged = pool.get(real_dir, Target("fp32"))
    tok = logged.tokenizer  # type: ignore[attr-defined]
    out = []
    for i, (_, text) in enumerate(real_prompts[::2][:24]):
        prompt = list(tok.encode(text))
        out.append(ScanItem(prompt, logged.decode(prompt, 8 + (i * 7) % 32, [1]).output_token_ids))
    return out


def _engine(pool: EnginePool, real_dir: Path, dtype: str, kernel: str) -> Engine:
    return pool.get(real_dir, Target(dtype, attn_kernel=kernel))


def _assert_equal(a: ScanRun, b: ScanRun) -> None:
    for f in FIELDS:
        np.testing.assert_array_equal(getattr(a.steps, f), getattr(b.steps, f), err_msg=f)
    np.testing.assert_array_equal(a.agrees, b.agrees)


def _assert_close(a: ScanRun, b: ScanRun, dtype: str) -> None:
    """Batched `b` against bs=1 `a`, as any CPU gives them: margins and top-1 logits within
    `_tolerance`, a token differing only at a near-tie (both margins within it), so the first
    disagreement is the same wherever bs=1's margin there exceeds it."""
    tol = _tolerance(a, dtype)
    assert np.all(np.abs(a.steps.margins - b.steps.margins) <= tol)
    top1 = np.abs(a.steps.top_k_logits[:, 0].astype(float) - b.steps.top_k_logits[:, 0])
    assert np.all(top1 <= tol)
    flips = np.flatnonzero(a.steps.native_token_ids != b.steps.native_token_ids)
    assert np.all(a.steps.margins[flips] <= tol[flips]), "a token flipped off a near-tie"
    assert np.all(b.steps.margins[flips] <= tol[flips])
    if a.first_disagreement != b.first_disagreement:
        t = min(x for x in (a.first_disagreement, b.first_disagreement) if x is not None)
        assert a.steps.margins[t] <= tol[t]


def _tolerance(run: ScanRun, dtype: str) -> npt.NDArray[np.float64]:
    """How far a batched margin or top-1 logit may be from bs=1's at each step: 2 ulps of the
    format at bs=1's top-1 (1 measured), and for fp32 at least 1e-4 (2e-5 measured)."""
    ulps = 2 * ulp_array(run.steps.top_k_logits[:, 0], dtype)
    return np.maximum(ulps, 1e-4) if dtype == "fp32" else ulps


def _shapes(items: list[ScanItem], budget: int) -> str:
    return str(scan_extras(plan_scan(items, budget), budget)["scan_batch_shapes"])


def _scan_alone(engine: Engine, items: list[ScanItem], iv: Intervention) -> list[ScanRun]:
    return [engine.scan(it.prompt_ids, it.output_ids, iv) for it in items]


def test_prompt_set_spreads_over_buckets_and_rows(items: list[ScanItem]) -> None:
    batches = plan_scan(items, BUDGET)
    assert {b.padded_length for b in batches} == {64, 128}
    assert len(batches) >= 3 and max(b.rows for b in batches) >= 8
    assert any(context_length(it) < bucket_length(context_length(it)) for it in items)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_eager_batched_scan_is_bs1_within_the_tolerance(
    pool: EnginePool, real_dir: Path, items: list[ScanItem], dtype: str
) -> None:
    """On this machine's CPU the eager batched scan is bs=1's bit for bit; on another one the
    GEMM may block the batch's rows otherwise (fp16 differed by 1 ulp on 3 of 135 logits on
    an Intel host): what every CPU gives is `_assert_close`, and the batch shapes that ran are
    recorded (`extras.scan_batch_shapes`)."""
    engine = _engine(pool, real_dir, dtype, "eager")
    batched = engine.scan_batch(items, token_budget=BUDGET)
    for a, b in zip(_scan_alone(engine, items, Intervention()), batched, strict=True):
        _assert_close(a, b, dtype)
    assert engine.environment()["extras"]["scan_batch_shapes"] == _shapes(items, BUDGET)


@pytest.mark.parametrize(
    "iv", [Intervention("C"), Intervention("A", tau=0.05), Intervention("B", tau=0.05)]
)
def test_eager_batched_interventions_are_bs1_bit_for_bit(
    pool: EnginePool, real_dir: Path, items: list[ScanItem], iv: Intervention
) -> None:
    """The gated steps of a forward are recomputed together (one FP32 product for B and C):
    on this CPU that chooses what the per-step recompute chooses (bit for bit here); on any,
    the native margins stay within the tolerance and the chosen tokens differ only at
    near-ties."""
    engine = _engine(pool, real_dir, "bf16", "eager")
    batched = engine.scan_batch(items, iv, token_budget=BUDGET)
    assert sum(int(r.steps.gate_fired.sum()) for r in batched) >= 10
    assert any(r.steps.changed.any() for r in batched) or iv.kind == "C"
    for a, b in zip(_scan_alone(engine, items, iv), batched, strict=True):
        _assert_close(a, b, "bf16")
        tol = _tolerance(a, "bf16")
        moved = np.flatnonzero(a.steps.token_ids != b.steps.token_ids)
        assert np.all(np.minimum(a.steps.margins, b.steps.margins)[moved] <= tol[moved])


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_sdpa_batched_scan_is_bs1_within_the_tolerance(
    pool: EnginePool, real_dir: Path, items: list[ScanItem], dtype: str
) -> None:
    engine = _engine(pool, real_dir, dtype, "sdpa")
    batched = engine.scan_batch(items, token_budget=BUDGET)
    for a, b in zip(_scan_alone(engine, items, Intervention()), batched, strict=True):
        _assert_close(a, b, dtype)


def test_sdpa_unpadded_traces_are_bs1_bit_for_bit(
    pool: EnginePool, real_dir: Path, items: list[ScanItem]
) -> None:
    """Outputs cut so that each context is exactly 64 tokens: rows without padding."""
    exact = [
        ScanItem(it.prompt_ids, it.output_ids[: 65 - len(it.prompt_ids)])
        for it in items
        if context_length(it) >= 64 and len(it.prompt_ids) < 64
    ]
    assert len(exact) >= 4
    for dtype in ("fp32", "bf16"):
        engine = _engine(pool, real_dir, dtype, "sdpa")
        batched = engine.scan_batch(exact, token_budget=BUDGET)
        assert engine.environment()["extras"]["scan_batch_shapes"] == f"{len(exact)}x64"
        for a, b in zip(_scan_alone(engine, exact, Intervention()), batched, strict=True):
            _assert_equal(a, b)


def test_a_trace_scans_the_same_whatever_shares_its_batch(
    pool: EnginePool, real_dir: Path, items: list[ScanItem]
) -> None:
    """sdpa bf16 (padding-sensitive): each trace alone, in the whole set at two budgets, and
    in reverse order, gives the same bits (it always runs at its bucket's length)."""
    engine = _engine(pool, real_dir, "bf16", "sdpa")
    together = engine.scan_batch(items, token_budget=BUDGET)
    wide = engine.scan_batch(items, token_budget=8 * BUDGET)
    assert engine.environment()["extras"]["scan_batch_shapes"] == _shapes(items, 8 * BUDGET)
    backwards = engine.scan_batch(items[::-1], token_budget=BUDGET)[::-1]
    for i in (0, 5, 11, 23):
        (alone,) = engine.scan_batch([items[i]], token_budget=BUDGET)
        for other in (together[i], wide[i], backwards[i]):
            _assert_equal(alone, other)
    for a, b in zip(together, wide, strict=True):
        _assert_equal(a, b)


def test_padding_is_never_read(
    pool: EnginePool, real_dir: Path, items: list[ScanItem], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another token in every padded position changes no bit of any result."""
    engine = _engine(pool, real_dir, "fp32", "sdpa")
    before = engine.scan_batch(items, token_budget=BUDGET)
    monkeypatch.setattr(engine, "scan_pad_id", 777)
    after = engine.scan_batch(items, token_budget=BUDGET)
    for a, b in zip(before, after, strict=True):
        _assert_equal(a, b)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_a_trace_over_the_budget_runs_alone_as_scan(
    pool: EnginePool, real_dir: Path, items: list[ScanItem], dtype: str
) -> None:
    engine = _engine(pool, real_dir, dtype, "sdpa")
    some = items[:4]
    batched = engine.scan_batch(some, token_budget=60)  # every bucket (64, 128) exceeds it
    lengths = sorted(context_length(it) for it in some)
    assert engine.environment()["extras"]["scan_batch_shapes"] == ",".join(
        f"1x{n}" for n in lengths
    )
    for a, b in zip(_scan_alone(engine, some, Intervention()), batched, strict=True):
        _assert_equal(a, b)


def test_results_keep_the_order_of_items_with_empty_outputs_among_them(
    pool: EnginePool, real_dir: Path, items: list[ScanItem]
) -> None:
    engine = _engine(pool, real_dir, "fp32", "eager")
    mixed = [items[3], ScanItem(items[0].prompt_ids, []), items[1], items[2]]
    runs = engine.scan_batch(mixed, top_k=3, token_budget=BUDGET)
    assert [len(r.steps) for r in runs] == [len(it.output_ids) for it in mixed]
    assert runs[1].steps.top_k_ids.shape == (0, 3) and runs[1].first_disagreement is None
    for it, run in zip(mixed, runs, strict=True):
        _assert_equal(engine.scan(it.prompt_ids, it.output_ids, top_k=3), run)
    assert engine.scan_batch([], token_budget=BUDGET) == []
    with pytest.raises(ValueError, match="prompt token"):
        engine.scan_batch([ScanItem([], [5, 6])])


def test_environment_records_the_batch_shape(
    pool: EnginePool, real_dir: Path, items: list[ScanItem]
) -> None:
    engine = pool.get(real_dir, Target("bf16", attn_kernel="eager"))
    engine.scan_batch(items, token_budget=BUDGET)
    env = engine.environment()
    extras = env["extras"]
    assert extras["scan_token_budget"] == BUDGET
    assert extras["scan_batch_shapes"] == _shapes(items, BUDGET)
    assert extras["kv_cache"] == "dynamic" and "transformers_version" in extras  # kept
    from replay_audit.traces.schemas import NumericalConfig

    NumericalConfig.model_validate(env)


@pytest.mark.parametrize(
    ("dtype", "kernel"), [("bf16", "sdpa"), ("fp16", "sdpa"), ("fp32", "eager")]
)
def test_batched_single_steps_are_step_bit_for_bit(
    pool: EnginePool, real_dir: Path, items: list[ScanItem], dtype: str, kernel: str
) -> None:
    """`step_batch` over every prefix of the prompt set's traces (contexts of one length share a
    forward, unpadded): each answer is `step` of the context alone, bit for bit, and the
    forwards hold several rows."""
    engine = _engine(pool, real_dir, dtype, kernel)
    contexts = [
        [*it.prompt_ids, *it.output_ids[:t]]
        for it in items
        for t in range(0, len(it.output_ids), 3)
    ]
    batched = engine.step_batch(contexts, Intervention(), 5, token_budget=BUDGET)
    assert len(batched) == len(contexts)
    for c, b in zip(contexts, batched, strict=True):
        a = engine.step(c, [], Intervention(), 5)
        assert (a.token, a.margin) == (b.token, b.margin), len(c)
        np.testing.assert_array_equal(a.top_k_ids, b.top_k_ids)
        np.testing.assert_array_equal(a.top_k_logits, b.top_k_logits)
    shapes = str(engine.environment()["extras"]["step_batch_shapes"]).split(",")
    assert max(int(s.split("x")[0]) for s in shapes) >= 2, shapes
