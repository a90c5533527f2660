"""The replayer and the diff it produces, against fake engines (fast, no torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from replay_audit.engine import EnginePool, FakeEngine, Intervention, Target, weights_sha256
from replay_audit.exceptions import BadRequest, ModelMismatch, UnsupportedFormat
from replay_audit.formats import SingleStepKind
from replay_audit.replays.domain import ArmMargin, LoggedTrace, ReplayOutcome, RunTarget
from replay_audit.replays.models import ReplayResult
from replay_audit.replays.pipeline import (
    ReplayItem,
    ReplayOptions,
    compare_arms,
    replay_items,
    replay_one,
    replay_trace,
    scan_items,
)
from replay_audit.replays.results import result_read, result_values
from replay_audit.traces.schemas import TraceCreate

PROMPT = [3, 1, 4, 1, 5]
FLIP_AT = 3  # output step where the replay format flips
EOS = 96


def base(ctx: tuple[int, ...]) -> tuple[int, float]:
    return (sum(ctx) * 31 + len(ctx)) % 90, 1.0


def flipped(margin: float) -> Callable[[tuple[int, ...]], tuple[int, float]]:
    def fn(ctx: tuple[int, ...]) -> tuple[int, float]:
        tok, m = base(ctx)
        if len(ctx) == len(PROMPT) + FLIP_AT:
            return (tok + 1) % 90, margin
        return tok, m

    return fn


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    (tmp_path / "model.safetensors").write_bytes(b"not really weights")
    return tmp_path


def make_trace(ckpt: Path, *, top_k: bool = True, n: int = 8, **over: Any) -> LoggedTrace:
    logged = FakeEngine(Target("bf16"), next_token=base).decode(PROMPT, n, [EOS])
    body: dict[str, Any] = {
        "external_id": "t1",
        "model": {"name": "fake", "weights_sha256": weights_sha256(ckpt), "vocab_size": 97},
        "config": {"dtype": "bf16", "attn_kernel": "sdpa"},
        "decoding": {"max_new_tokens": n, "eos_token_ids": [EOS], "stop_reason": "length"},
        "prompt_token_ids": PROMPT,
        "output_token_ids": logged.output_token_ids,
    }
    if top_k:
        logits = logged.steps.top_k_logits.tolist()
        logits[FLIP_AT][1] = logits[FLIP_AT][0] - 2e-4  # a close call in the logged arm too
        body["top_k"] = {"ids": logged.steps.top_k_ids.tolist(), "logits": logits}
    body.update(over)
    return LoggedTrace.from_json(TraceCreate.model_validate(body).model_dump())


def fake_pool(models: dict[str, dict[str, Any]]) -> EnginePool:
    """A pool whose engines are fakes, chosen by the target's body dtype."""

    def loader(_: Path, target: Target, _tp: int = 1) -> FakeEngine:
        return FakeEngine(target, **models.get(target.dtype, {"next_token": base}))

    return EnginePool(loader)


def test_exact_replay_is_agreed(ckpt: Path) -> None:
    r = replay_trace(make_trace(ckpt), Target("bf16"), fake_pool({}), model_dir=ckpt)
    assert r.exact_match and r.first_divergence_step is None and r.category == "agreed"
    assert r.a.margin is None and r.b.margin is None
    assert r.cascade_length == 0 and r.length_difference == 0
    assert r.b.steps == 8 and r.gate_triggers == 0 and r.b.trigger_rate == 0.0
    assert r.b.mean_gap == 1.0
    assert r.b.target is not None
    assert r.b.target.dtype == "bf16" and r.b.target.attn_kernel == "sdpa"  # logged kernel


def test_head_reachable_flip(ckpt: Path) -> None:
    pool = fake_pool({"fp16": {"next_token": flipped(5e-4)}})
    r = replay_trace(make_trace(ckpt), Target("fp16"), pool, model_dir=ckpt)
    assert r.first_divergence_step == FLIP_AT and not r.exact_match
    assert r.category == "head_reachable"
    ma, mb = r.a.margin, r.b.margin
    assert ma is not None and ma.source == "logged_top_k"
    assert ma.abs == pytest.approx(2e-4, abs=1e-6)
    assert mb is not None and mb.abs == pytest.approx(5e-4, abs=1e-6)
    assert r.single_step is not None and r.single_step.disagree is True
    assert r.single_step.a is not None and r.single_step.a.source == "rerun"
    assert r.gate_triggers == 1 and r.cascade_length == 8 - FLIP_AT
    assert r.b.output_token_ids is not None
    assert r.b.output_token_ids[FLIP_AT] != make_trace(ckpt).output_token_ids[FLIP_AT]


def test_kv_dependent_flip(ckpt: Path) -> None:
    # decoding flips, but a from-scratch re-run in the replay format agrees with the logged arm
    pool = fake_pool({"fp16": {"next_token": flipped(5e-4), "step_fn": base}})
    r = replay_trace(make_trace(ckpt), Target("fp16"), pool, model_dir=ckpt)
    assert r.category == "kv_dependent"
    assert r.single_step is not None and r.single_step.disagree is False


def test_body_dominated_flip(ckpt: Path) -> None:
    pool = fake_pool({"fp16": {"next_token": flipped(0.5)}})
    trace = make_trace(ckpt, top_k=False)
    r = replay_trace(trace, Target("fp16"), pool, model_dir=ckpt)
    assert r.category == "body_dominated"
    m = r.a.margin
    # no logged top-k: the logged margin is reconstructed by re-running the logged format
    assert m is not None and m.source == "reconstructed" and m.abs == 1.0


def test_logged_format_unavailable_falls_back_to_the_logged_token(ckpt: Path) -> None:
    from replay_audit.exceptions import UnsupportedFormat

    def loader(_: Path, target: Target, _tp: int = 1) -> FakeEngine:
        if target.dtype == "bf16":  # the logged format cannot run here
            raise UnsupportedFormat("no bf16 here")
        return FakeEngine(target, next_token=flipped(5e-4))

    r = replay_trace(
        make_trace(ckpt, top_k=False), Target("fp16"), EnginePool(loader), model_dir=ckpt
    )
    assert r.a.margin == ArmMargin(None, None, "unavailable")
    assert r.single_step is not None and r.single_step.a is not None
    assert r.single_step.a.source == "logged_token"
    assert r.category == "head_reachable"  # the replay margin alone opens the gate


def test_intervention_repairs_and_is_counted(ckpt: Path) -> None:
    pool = fake_pool({"fp16": {"next_token": flipped(5e-4), "repair_fn": lambda c, t: base(c)[0]}})
    target = Target("fp16", intervention=Intervention("C"))
    r = replay_trace(make_trace(ckpt), target, pool, model_dir=ckpt)
    assert r.exact_match and r.b.changed_steps == 1 and r.gate_triggers == 1


@pytest.mark.parametrize("mode", ["scan", "scan_then_decode"])
def test_scan_modes_find_the_same_t_star_as_decode(ckpt: Path, mode: str) -> None:
    pool = fake_pool({"fp16": {"next_token": flipped(5e-4)}})
    trace = make_trace(ckpt)
    dec = replay_trace(trace, Target("fp16"), pool, model_dir=ckpt)
    r = replay_trace(trace, Target("fp16"), pool, model_dir=ckpt, mode=mode)  # type: ignore[arg-type]
    assert r.first_divergence_step == dec.first_divergence_step == FLIP_AT
    assert r.category == dec.category
    if mode == "scan":
        assert dec.b.output_token_ids is not None
        assert r.b.output_token_ids == dec.b.output_token_ids[: FLIP_AT + 1]
        assert r.cascade_length is None and r.length_difference is None
    else:
        assert r.b.output_token_ids == dec.b.output_token_ids
        assert r.cascade_length == dec.cascade_length and r.b.steps == dec.b.steps
        assert r.gate_triggers == dec.gate_triggers


def test_scan_then_decode_skips_the_decode_when_the_scan_agrees(ckpt: Path) -> None:
    engines: list[FakeEngine] = []

    def loader(_: Path, target: Target, _tp: int = 1) -> FakeEngine:
        engines.append(FakeEngine(target, next_token=base))
        return engines[-1]

    r = replay_trace(
        make_trace(ckpt),
        Target("fp16"),
        EnginePool(loader),
        model_dir=ckpt,
        mode="scan_then_decode",
    )
    # Not decoded: not claimed exact, nor agreed; the result says it was only scanned.
    assert r.screen == "scanned" and r.exact_match is None and r.category is None
    assert r.b.steps == 8 and r.first_divergence_step is None
    assert engines[0].calls == ["scan"]


def kv_flip(from_scratch: bool) -> Callable[[tuple[int, ...]], tuple[int, float]]:
    """FP16 flips at FLIP_AT in its decode (KV cache), not in a forward from scratch (the scan
    and the single-step re-run): a kv_dependent flip, invisible to a teacher-forced scan."""
    return base if from_scratch else flipped(5e-4)


def kv_pool(engines: list[FakeEngine] | None = None) -> EnginePool:
    def loader(_: Path, target: Target, _tp: int = 1) -> FakeEngine:
        if target.dtype != "fp16":
            return FakeEngine(target, next_token=base)
        e = FakeEngine(target, next_token=kv_flip(False), step_fn=base, scan_fn=base)
        if engines is not None:
            engines.append(e)
        return e

    return EnginePool(loader)


def test_scan_then_decode_never_reports_a_decode_divergence_as_agreed(ckpt: Path) -> None:
    trace = make_trace(ckpt)
    decoded = replay_trace(trace, Target("fp16"), kv_pool(), model_dir=ckpt)
    assert decoded.category == "kv_dependent" and decoded.first_divergence_step == FLIP_AT
    # The scan misses the flip; outside the control sample the trace is only scanned: unknown.
    scanned = replay_trace(
        trace, Target("fp16"), kv_pool(), model_dir=ckpt, mode="scan_then_decode"
    )
    assert scanned.screen == "scanned"
    assert scanned.exact_match is None and scanned.category is None
    row = result_values(0, scanned)
    assert row["exact_match"] is None and row["category"] is None
    read = result_read(ReplayResult(trace_id=1, **row), "tr_1", "rr_1")
    assert read.screen == "scanned" and read.exact_match is None and read.category is None
    # In the control sample it is decoded in full, and the divergence is reported as decode has it.
    engines: list[FakeEngine] = []
    control = replay_trace(
        trace,
        Target("fp16"),
        kv_pool(engines),
        model_dir=ckpt,
        mode="scan_then_decode",
        control=True,
    )
    assert control.screen == "control" and control.exact_match is False
    assert control.category == "kv_dependent"
    assert control.first_divergence_step == FLIP_AT
    assert engines[0].calls[:2] == ["scan", "decode"]


def test_scan_then_decode_decodes_what_the_scan_flags(ckpt: Path) -> None:
    pool = fake_pool({"fp16": {"next_token": flipped(5e-4)}})
    r = replay_trace(
        make_trace(ckpt), Target("fp16"), pool, model_dir=ckpt, mode="scan_then_decode"
    )
    assert r.screen == "flagged" and r.exact_match is False
    assert r.first_divergence_step == FLIP_AT and r.category == "head_reachable"


def test_a_flagged_trace_outside_the_flagged_sample_keeps_the_scans_result(ckpt: Path) -> None:
    """Scan-then-decode with `decode_flagged` False: no decode; the result is the scan's, as
    a scan run's (t* = the scan's first disagreement, established divergent, the probe's
    category), screen `flagged_scanned`. In the sample it is decoded from s as before."""
    engines: list[FakeEngine] = []

    def loader(_: Path, target: Target, _tp: int = 1) -> FakeEngine:
        engines.append(
            FakeEngine(target, next_token=flipped(5e-4) if target.dtype == "fp16" else base)
        )
        return engines[-1]

    trace = make_trace(ckpt)
    scan = replay_trace(trace, Target("fp16"), EnginePool(loader), model_dir=ckpt, mode="scan")
    engines.clear()
    kept = replay_trace(
        trace,
        Target("fp16"),
        EnginePool(loader),
        model_dir=ckpt,
        mode="scan_then_decode",
        decode_flagged=False,
    )
    assert "decode" not in [c for e in engines for c in e.calls]
    assert kept.screen == "flagged_scanned" and kept.mode == "scan_then_decode"
    assert kept.exact_match is False and kept.first_divergence_step == FLIP_AT
    assert kept.b.output_token_ids == scan.b.output_token_ids
    assert kept.b.margin == scan.b.margin and kept.b.margin.source == "scan"
    assert (kept.category, kept.single_step) == (scan.category, scan.single_step)
    # Nothing after t* was computed: no cascade, length difference or answers.
    assert kept.cascade_length is None and kept.length_difference is None
    assert kept.semantic is None and kept.window_cut is False
    row = result_values(0, kept)
    read = result_read(ReplayResult(trace_id=1, **row), "tr_1", "rr_1")
    assert read.screen == "flagged_scanned" and read.exact_match is False
    engines.clear()
    decoded = replay_trace(
        trace, Target("fp16"), EnginePool(loader), model_dir=ckpt, mode="scan_then_decode"
    )
    assert decoded.screen == "flagged" and decoded.first_divergence_step == FLIP_AT
    assert "decode" in [c for e in engines for c in e.calls]


def test_a_false_flag_is_seen_only_by_the_decode(ckpt: Path) -> None:
    """A scan that disagrees where the decode does not (at a tie: a false flag): decoded, the
    trace is exact; kept as the scan's, it is counted divergent at the scan's s."""
    pool = fake_pool({"fp16": {"next_token": base, "scan_fn": flipped(0.0), "step_fn": base}})
    trace = make_trace(ckpt)
    decoded = replay_trace(trace, Target("fp16"), pool, model_dir=ckpt, mode="scan_then_decode")
    assert decoded.screen == "flagged" and decoded.exact_match is True
    kept = replay_trace(
        trace, Target("fp16"), pool, model_dir=ckpt, mode="scan_then_decode", decode_flagged=False
    )
    assert kept.screen == "flagged_scanned" and kept.exact_match is False
    assert kept.first_divergence_step == FLIP_AT


def test_the_replay_may_run_longer_than_the_logged_arm(ckpt: Path) -> None:
    # the logged arm stopped on eos at step 2; the replay does not emit it and runs to the budget
    logged = FakeEngine(Target("bf16"), next_token=base).decode(PROMPT, 3, [])
    out = [*logged.output_token_ids[:2], EOS]
    trace = make_trace(
        ckpt,
        top_k=False,
        output_token_ids=out,
        decoding={"max_new_tokens": 6, "eos_token_ids": [EOS], "stop_reason": "eos"},
    )
    r = replay_trace(trace, Target("fp16"), fake_pool({}), model_dir=ckpt)
    assert r.first_divergence_step == 2
    assert r.b.output_token_ids is not None and len(r.b.output_token_ids) == 6
    assert r.length_difference == 3 and r.cascade_length == 4


def test_refuses_another_checkpoint_and_non_greedy_traces(ckpt: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(ModelMismatch, match="weights_sha256"):
        replay_trace(make_trace(ckpt), Target("fp16"), fake_pool({}), model_dir=other)
    sampled = make_trace(ckpt, decoding={"strategy": "sample"})
    with pytest.raises(BadRequest, match="greedy"):
        replay_trace(sampled, Target("fp16"), fake_pool({}), model_dir=ckpt)
    with pytest.raises(ModelMismatch, match="vocabulary"):
        pool = EnginePool(lambda d, t, k: FakeEngine(t, next_token=base, vocab_size=50))
        replay_trace(make_trace(ckpt), Target("fp16"), pool, model_dir=ckpt)


def test_a_trace_longer_than_the_checkpoints_context_is_refused_naming_it(ckpt: Path) -> None:
    """Positions past `max_position_embeddings` would replay extrapolated, not as logged: a
    trace of 5 + 8 tokens on a 12-position checkpoint is refused, one of 13 runs."""
    trace = make_trace(ckpt)
    assert trace.prompt_token_ids.size + trace.output_token_ids.size == 13

    def pool(positions: int) -> EnginePool:
        return EnginePool(lambda d, t, k: FakeEngine(t, next_token=base, max_positions=positions))

    with pytest.raises(UnsupportedFormat, match="13 tokens; the checkpoint's context is 12") as e:
        replay_trace(trace, Target("bf16"), pool(12), model_dir=ckpt)
    assert e.value.field == "prompt_token_ids"
    assert replay_trace(trace, Target("bf16"), pool(13), model_dir=ckpt).exact_match


def test_compare_arms_both_arms_protocol(ckpt: Path) -> None:
    pool = fake_pool({"fp16": {"next_token": flipped(5e-4)}})
    r = compare_arms(make_trace(ckpt), Target("bf16"), Target("fp16"), pool, model_dir=ckpt)
    assert r.first_divergence_step == FLIP_AT and r.category == "head_reachable"
    assert r.a.margin is not None and r.a.margin.source == "decode"
    assert r.a.target is not None and r.a.target.dtype == "bf16"
    assert r.a.output_token_ids is not None
    assert list(r.a.output_token_ids) == make_trace(ckpt).output_token_ids.tolist()
    # both arms were run here: both count their gate firings
    assert r.a.steps == r.b.steps == 8 and r.a.gate_triggers is not None


def test_result_json_has_the_design_fields_and_no_nan(ckpt: Path) -> None:
    pool = fake_pool({"fp16": {"next_token": flipped(0.0), "pieces": lambda i: f" {i}"}})
    r = replay_trace(make_trace(ckpt), Target("fp16"), pool, model_dir=ckpt, extractor="gsm8k")
    read = result_read(ReplayResult(trace_id=1, **result_values(0, r)), "tr_1", "rr_1")
    d = read.model_dump(mode="json")
    text = json.dumps(d, allow_nan=False)
    assert json.loads(text) == d
    for key in (
        "exact_match",
        "first_divergence_step",
        "margin_at_divergence",
        "category",
        "gate_triggers",
        "trigger_rate",
        "mean_gap",
        "tie",
        "cascade_length",
        "length_difference",
        "arms",
        "single_step",
        "mode",
        "semantic",
    ):
        assert key in d
    assert d["arms"]["b"]["output_token_ids"] and d["arms"]["b"]["environment"]
    assert d["arms"]["b"]["target"]["dtype"] == "fp16"
    assert set(d["margin_at_divergence"]) == {"a", "b"}  # one layout: no older names
    assert d["arms"]["b"]["resolved"]["attn_kernel"] == "sdpa"  # the trace's logged kernel
    assert d["arms"]["b"]["resolved"]["kernel_source"] == "logged"
    assert d["arms"]["a"]["resolved"] is None  # the logged tokens, not run here
    assert d["tie"] is True  # the replay margin at t* is exactly 0
    assert d["semantic"]["extractor"] == "gsm8k"
    assert d["semantic"]["agree"] is False and d["semantic"]["neither_answered"] is False


def test_replayer_and_protocol_do_not_import_torch() -> None:
    code = (
        "import sys; import replay_audit.engine, replay_audit.replays.pipeline, "
        "replay_audit.engine.fake, replay_audit.engine.pool; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_result_json_is_the_api_models_json(ckpt: Path) -> None:
    """The export streams `result_json` without the model; the API validates it into
    `ReplayResultRead`: both must give the same JSON (both arms run here, and the logged arm)."""
    from pydantic_core import to_jsonable_python

    from replay_audit.db.base import utcnow
    from replay_audit.replays.results import result_json

    pool = fake_pool({"fp16": {"next_token": flipped(5e-4), "pieces": lambda i: f" {i}"}})
    trace = make_trace(ckpt)
    for outcome in (
        replay_trace(trace, Target("fp16"), pool, model_dir=ckpt, extractor="gsm8k"),
        compare_arms(trace, Target("bf16"), Target("fp16"), pool, model_dir=ckpt),
    ):
        row = ReplayResult(trace_id=1, created_at=utcnow(), **result_values(0, outcome))
        plain = to_jsonable_python(result_json(row, "tr_1", "rr_1"))
        assert plain == result_read(row, "tr_1", "rr_1").model_dump(mode="json")


def test_self_replay_of_a_kernel_this_host_lacks_falls_back_to_the_engine_default(
    ckpt: Path,
) -> None:
    """An imported trace may log `attn_kernel: unknown` (or a kernel this host lacks): its
    self-replay runs with the engine's default kernel instead of failing the item."""
    from replay_audit.exceptions import UnsupportedFormat
    from replay_audit.replays.domain import RunTarget

    def loader(_: Path, target: Target, _tp: int = 1) -> FakeEngine:
        if target.attn_kernel == "unknown":
            raise UnsupportedFormat("cannot load with attention 'unknown'")
        return FakeEngine(target, next_token=base)

    trace = make_trace(ckpt, config={"dtype": "bf16", "attn_kernel": "unknown"})
    target = RunTarget(None).resolve(trace.config)
    r = replay_trace(trace, target, EnginePool(loader), model_dir=ckpt)
    # What ran is what every surface shows: the engine's default, and why.
    assert r.exact_match and r.b.target is not None and r.b.target.attn_kernel == "sdpa"
    assert r.b.resolved is not None and r.b.resolved.attn_kernel == "sdpa"
    assert r.b.resolved.kernel_source == "engine_default"


def test_a_margin_from_raw_logprobs_is_measured_in_ulps_of_the_logit(ckpt: Path) -> None:
    """Imported raw logprobs (logits less the log-softmax normaliser) give the logit margin,
    but not its size in ulps: a logprob near 0 has a far finer ulp than the logit. The ulps of
    a logprob margin are measured at the replayed arm's top-1 logit at t* (same step, same
    prefix): here both arms are BF16, so logged and replayed margins share one ulp."""
    pool = fake_pool({"bf16": {"next_token": flipped(5e-4)}})
    with_logits = make_trace(ckpt)
    assert with_logits.top_k_logits is not None
    logits = with_logits.top_k_logits.astype(float)
    logprobs = logits - (logits[:, :1] + 1e-3)  # top-1 logprob -1e-3, as a confident server's
    trace = make_trace(
        ckpt,
        config={"dtype": "bf16", "attn_kernel": "sdpa", "extras": {"top_k_values": "raw_logprobs"}},
        top_k={"ids": with_logits_ids(ckpt), "logits": logprobs.tolist()},
    )
    assert trace.top_k_values == "raw_logprobs"
    r = replay_trace(trace, Target("bf16"), pool, model_dir=ckpt)
    ref = replay_trace(with_logits, Target("bf16"), pool, model_dir=ckpt)
    assert r.first_divergence_step == ref.first_divergence_step == FLIP_AT
    ma, mb = r.a.margin, r.b.margin
    assert ma is not None and mb is not None and ma.abs is not None and mb.abs is not None
    assert ma.source == "logged_top_k"
    assert ref.a.margin is not None and ref.a.margin.abs is not None
    # The logit margin, to float32 rounding of values near the top-1 logit.
    assert ma.abs == pytest.approx(ref.a.margin.abs, abs=1e-6)
    assert ma.ulps is not None and mb.ulps is not None
    ulp_of_b = mb.abs / mb.ulps
    assert ma.ulps == pytest.approx(ma.abs / ulp_of_b, rel=1e-9)
    # The same margin from logged logits has the same size in ulps (same binade here); at the
    # logprob's magnitude it would be about 100 times larger.
    assert ref.a.margin.ulps is not None
    assert ma.ulps == pytest.approx(ref.a.margin.ulps, rel=1e-2)


def with_logits_ids(ckpt: Path) -> list[list[int]]:
    logged = FakeEngine(Target("bf16"), next_token=base).decode(PROMPT, 8, [EOS])
    return [[int(i) for i in row] for row in logged.steps.top_k_ids.tolist()]


def test_scan_traces_batches_per_engine_and_equals_each_scan(ckpt: Path) -> None:
    engines: list[FakeEngine] = []

    def loader(_: Path, target: Target, _tp: int = 1) -> FakeEngine:
        engines.append(FakeEngine(target, next_token=flipped(5e-4)))
        return engines[-1]

    pool = EnginePool(loader)
    traces = [make_trace(ckpt, n=n) for n in (4, 8, 6)]
    sampled = make_trace(ckpt, decoding={"strategy": "sample"})
    c = Target("fp16", intervention=Intervention("C"))
    requests = [
        ReplayItem(traces[0], RunTarget(Target("fp16")), ckpt),
        ReplayItem(sampled, RunTarget(Target("fp16")), ckpt),  # not greedy: left to its replay
        ReplayItem(traces[1], RunTarget(c), ckpt),
        ReplayItem(traces[2], RunTarget(Target("fp16")), ckpt),
    ]
    scans = scan_items(requests, pool, ReplayOptions("scan", top_k=3, token_budget=64))
    assert scans.runs[1] is None and scans.scanned == 3
    # One engine (the format), two interventions: two batched calls, no scan one by one.
    [engine] = engines
    assert engine.calls == ["scan_batch", "scan_batch"]
    for r, run in zip(requests, scans.runs, strict=True):
        if run is None:
            continue
        alone = engine.scan(
            r.trace.prompt_token_ids.tolist(),
            r.trace.output_token_ids.tolist(),
            r.b.resolve(r.trace.config).intervention,
            3,
        )
        assert run.first_disagreement == alone.first_disagreement
        assert (run.steps.token_ids == alone.steps.token_ids).all()
    # The replay given a batched scan does not scan again.
    engine.calls.clear()
    out = replay_trace(
        traces[1], c, pool, model_dir=ckpt, mode="scan_then_decode", scan=scans.runs[2], top_k=3
    )
    assert "scan" not in engine.calls and out.first_divergence_step == FLIP_AT


def test_a_near_tie_in_either_arm_flags_the_trace_for_a_full_decode(ckpt: Path) -> None:
    """The kv flip at FLIP_AT is invisible to the scan (its margin there is 1.0, 128 ulps of
    FP16); the logged top-2 there are 2e-4 apart (a near-tie of the logged BF16 arm)."""
    trace = make_trace(ckpt)
    engines: list[FakeEngine] = []
    r = replay_trace(
        trace,
        Target("fp16"),
        kv_pool(engines),
        model_dir=ckpt,
        mode="scan_then_decode",
        flag_ulps=1.0,
    )
    assert r.screen == "near_tie" and r.exact_match is False
    assert r.category == "kv_dependent" and r.first_divergence_step == FLIP_AT
    assert engines[0].calls[:2] == ["scan", "decode"]  # decoded in full, from the prompt

    def screen(t: LoggedTrace, flag: float) -> str | None:
        return replay_trace(
            t, Target("fp16"), kv_pool(), model_dir=ckpt, mode="scan_then_decode", flag_ulps=flag
        ).screen

    assert screen(trace, -1.0) == "scanned"  # off: a miss
    no_top_k = make_trace(ckpt, top_k=False)  # the replay arm's margins alone
    assert screen(no_top_k, 1.0) == "scanned"
    assert screen(no_top_k, 128.0) == "near_tie"  # every step's margin is 128 ulps
    assert screen(no_top_k, 127.0) == "scanned"


def test_a_near_tie_outside_the_flagged_sample_is_only_scanned(ckpt: Path) -> None:
    """The flagged sample covers near-tie flags too: with `decode_flagged` False a near-tie
    trace is not decoded (no engine decode), its screen `near_tie_scanned`, unknown as an
    unflagged trace only scanned (exact match and category None, never agreed), even where
    the control sample would draw it (drawn from traces neither rule flags). In the sample it
    is decoded in full and its kv flip found, as before."""
    trace = make_trace(ckpt)
    for control in (False, True):
        engines: list[FakeEngine] = []
        r = replay_trace(
            trace,
            Target("fp16"),
            kv_pool(engines),
            model_dir=ckpt,
            mode="scan_then_decode",
            flag_ulps=1.0,
            control=control,
            decode_flagged=False,
        )
        assert r.screen == "near_tie_scanned" and r.mode == "scan_then_decode"
        assert r.exact_match is None and r.category is None
        assert r.first_divergence_step is None and r.single_step is None
        assert r.cascade_length is None and r.length_difference is None
        assert [c for e in engines for c in e.calls] == ["scan"]
        row = result_values(0, r)
        assert row["exact_match"] is None and row["category"] is None
        read = result_read(ReplayResult(trace_id=1, **row), "tr_1", "rr_1")
        assert read.screen == "near_tie_scanned" and read.exact_match is None
        assert read.category is None
    engines = []
    sampled = replay_trace(
        trace,
        Target("fp16"),
        kv_pool(engines),
        model_dir=ckpt,
        mode="scan_then_decode",
        flag_ulps=1.0,
        decode_flagged=True,
    )
    assert sampled.screen == "near_tie" and sampled.category == "kv_dependent"
    assert engines[0].calls[:2] == ["scan", "decode"]
    # An unflagged trace outside the flagged sample is untouched by it: the control decodes it.
    unflagged = replay_trace(
        trace,
        Target("fp16"),
        kv_pool(),
        model_dir=ckpt,
        mode="scan_then_decode",
        control=True,
        decode_flagged=False,
    )
    assert unflagged.screen == "control" and unflagged.exact_match is False


@pytest.mark.parametrize("probe", ["from_scratch", "teacher_forced"])
def test_replay_traces_batches_the_single_step_probes_and_equals_each_replay(
    ckpt: Path, probe: SingleStepKind
) -> None:
    traces = [make_trace(ckpt, top_k=i % 2 == 0, external_id=f"t{i}") for i in range(4)]
    for mode in ("decode", "scan", "scan_then_decode"):
        engines: list[FakeEngine] = []

        def loader(
            _: Path, target: Target, _tp: int = 1, engines: list[FakeEngine] = engines
        ) -> FakeEngine:
            fn = flipped(5e-4) if target.dtype == "fp16" else base
            engines.append(FakeEngine(target, next_token=fn))
            return engines[-1]

        together = replay_items(
            [ReplayItem(t, RunTarget(Target("fp16")), ckpt) for t in traces],
            EnginePool(loader),
            ReplayOptions(mode, single_step=probe),  # type: ignore[arg-type]
        )
        if probe == "from_scratch":
            # One batched call per engine (replay format, logged format), no step alone.
            assert all(e.calls.count("step_batch") == 1 and "step" not in e.calls for e in engines)
            assert engines[0].environment()["extras"]["step_batch_shapes"]
        else:
            # No step at all: arm B's probes are its scan's rows where it scanned, the rest
            # one batched scan per engine.
            assert not any({"step", "step_batch"} & set(e.calls) for e in engines)
            [logged_format] = [e for e in engines if e.target.dtype == "bf16"]
            assert logged_format.calls == ["scan_batch"]
        for t, b in zip(traces, together, strict=True):
            item = ReplayItem(t, RunTarget(Target("fp16")), ckpt)
            a = replay_one(
                item,
                fake_pool({"fp16": {"next_token": flipped(5e-4)}}),
                ReplayOptions(mode, single_step=probe),  # type: ignore[arg-type]
            )
            assert isinstance(b, ReplayOutcome)
            assert (b.first_divergence_step, b.category) == (FLIP_AT, "head_reachable")
            assert b.single_step is not None and b.single_step.kind == probe
            assert b.b.resolved is not None and b.b.resolved.single_step == probe
            assert (a.single_step, a.a.margin, a.b.margin) == (
                b.single_step,
                b.a.margin,
                b.b.margin,
            )


def test_a_teacher_forced_probe_scans_no_further_than_t_star(ckpt: Path) -> None:
    """A probe that no scan of the run gives (both arms in decode mode; arm A against the
    logged tokens with no reproduction check's scan given) runs a teacher-forced forward over
    prompt ‖ arm A's tokens up to t* only: its row t* is the probe and nothing after it is
    read, so the rest of a long trace is not scanned again. The outcome is the same."""
    scanned: list[int] = []

    class Recording(FakeEngine):
        def scan_batch(self, items: Any, *args: Any, **kw: Any) -> Any:
            scanned.extend(len(it.output_ids) for it in items)
            return super().scan_batch(items, *args, **kw)

    def loader(_: Path, target: Target, _tp: int = 1) -> FakeEngine:
        return Recording(target, next_token=flipped(5e-4) if target.dtype == "fp16" else base)

    traces = [make_trace(ckpt, n=24, external_id=f"t{i}") for i in range(3)]
    for mode in ("decode", "scan"):
        scanned.clear()
        options = ReplayOptions(mode)  # type: ignore[arg-type]
        items = [ReplayItem(t, RunTarget(Target("fp16")), ckpt) for t in traces]
        out = replay_items(items, EnginePool(loader), options)
        for o in out:
            assert isinstance(o, ReplayOutcome) and o.first_divergence_step == FLIP_AT
            assert o.single_step is not None and o.single_step.kind == "teacher_forced"
            assert o.category == "head_reachable"
        # The probes' scans: t* + 1 rows each (arm B's own scan in a scan run, whole, runs
        # alone here: no `scans` given).
        assert scanned and all(n == FLIP_AT + 1 for n in scanned), (mode, scanned)


def test_a_result_carries_only_the_batch_extras_of_batches_its_trace_was_in(ckpt: Path) -> None:
    """An engine keeps its last batched scan's and batched re-runs' shapes in its extras; a
    result's environment keeps them only where its trace was in that scan or re-run: a trace
    that agrees had no re-run, a decode afterwards had neither, the logged arm had no scan."""

    def loader(_: Path, target: Target, _tp: int = 1) -> FakeEngine:
        return FakeEngine(target, next_token=flipped(5e-4) if target.dtype == "fp16" else base)

    pool = EnginePool(loader)
    diverges = make_trace(ckpt, n=8, external_id="d")  # flips at step FLIP_AT
    agrees = make_trace(ckpt, n=FLIP_AT, top_k=False, external_id="a")  # ends before the flip
    fp16 = Target("fp16")
    items = [ReplayItem(t, RunTarget(fp16), ckpt) for t in (diverges, agrees)]
    options = ReplayOptions("scan", single_step="from_scratch")
    scans = scan_items(items, pool, options)
    d, a = replay_items(items, pool, options, scans=scans.runs)
    assert isinstance(d, ReplayOutcome) and isinstance(a, ReplayOutcome)
    assert d.first_divergence_step == FLIP_AT and a.exact_match
    scan_keys, step_keys = {"scan_batch_shapes", "scan_token_budget"}, {"step_batch_shapes"}
    assert d.b.environment is not None and a.b.environment is not None
    assert scan_keys | step_keys <= set(d.b.environment["extras"])
    assert scan_keys <= set(a.b.environment["extras"])
    assert not step_keys & set(a.b.environment["extras"])
    assert d.a.environment is not None  # the logged format's re-run: batched, no scan
    assert step_keys <= set(d.a.environment["extras"])
    assert not scan_keys & set(d.a.environment["extras"])
    # The engine still holds both; a decode of the same format afterwards records neither.
    engine = pool.get(ckpt, Target("fp16", attn_kernel="sdpa"))  # the logged kernel
    assert scan_keys | step_keys <= set(engine.environment()["extras"])
    decoded = replay_trace(agrees, fp16, pool, model_dir=ckpt, mode="decode")
    assert decoded.b.environment is not None
    assert not (scan_keys | step_keys) & set(decoded.b.environment["extras"])


@pytest.mark.parametrize("probe", ["from_scratch", "teacher_forced"])
def test_every_arm_says_the_runs_probe_kind_a_scanned_only_one_too(
    ckpt: Path, probe: SingleStepKind
) -> None:
    """The probe kind is resolved into every arm of the run (`resolve_arm`), so a trace only
    scanned (no probe ran) says the run's kind too, not the default of stored rows."""
    options = ReplayOptions("scan_then_decode", single_step=probe)
    trace = make_trace(ckpt, n=FLIP_AT, top_k=False)  # ends before the flip: the scan agrees
    item = ReplayItem(trace, RunTarget(Target("fp16")), ckpt)
    scanned = replay_one(item, fake_pool({"fp16": {"next_token": flipped(5e-4)}}), options)
    assert scanned.screen == "scanned" and scanned.b.resolved is not None
    assert scanned.b.resolved.single_step == probe
