"""Scan-then-decode: the scan screens, the flagged traces and a seeded control sample of the
others are decoded, and the control sample estimates what the scan misses.

A fake FP16 engine whose scan misses known traces, and flags others falsely (`false`: the scan
takes the other token of a tie, the decode does not): a flip that needs the decode's KV cache
(`kv`) is invisible to the teacher-forced scan and to the single-step re-run; a flip the head
sees (`head`) shows in both. The run's control sample finds the kv flips among the traces it
decodes, and the estimated miss rate's interval covers the true one. The pure builder's interval
is also checked by simulation: it covers the truth in about 95% of random runs.

Near-tie flagging: the kv flips sit at a near-tie (a scan margin of 0.06 ulps of FP16), so a
run whose flag is 1 ulp decodes them (screen `near_tie`) and finds every one; `tie` traces sit
at the same near-tie without flipping (the flag's cost: decoded, exact); `kv_far` flips need
the KV cache at a wide scan margin (64 ulps), which no flag of 1 ulp sees: the control sample,
drawn from the traces neither rule flags, still estimates those misses without bias.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from fastapi.testclient import TestClient

from replay_audit.config import Settings, get_settings
from replay_audit.engine import EnginePool, FakeEngine, Intervention, Target, weights_sha256
from replay_audit.replays.domain import (
    LARGE_RUN_DECODE_WINDOW,
    LARGE_RUN_FLAGGED_FRACTION,
    ControlSample,
    resolve_mode,
)
from replay_audit.stats.proportion import wilson_interval
from replay_audit.stats.report import ComparisonInput, ResultFigures, screening_report
from replay_audit.worker import context
from tests.replays.conftest import HoldingRunner, all_results, ingest
from tests.ui.conftest import SESSION_SECRET, sign_in

VOCAB = 97
PROMPT_LEN = 3
FLIP_STEP = 2
LENGTH = 6
Kind = Literal["none", "head", "kv", "kv_far", "tie", "false"]
#: The flip kind of each trace, by prompt.
KINDS: dict[tuple[int, ...], Kind] = {}
#: Every engine the worker's pool loaded.
LOADED: list[FakeEngine] = []


def _base(context: tuple[int, ...]) -> tuple[int, float]:
    return (sum(context) * 31 + len(context)) % VOCAB, 1.0


def _fp16(*, from_scratch: bool) -> Callable[[tuple[int, ...]], tuple[int, float]]:
    """FP16 flips at FLIP_STEP on head traces always, on kv traces only with its KV cache."""

    def next_token(context: tuple[int, ...]) -> tuple[int, float]:
        token, margin = _base(context)
        kind = KINDS.get(context[:PROMPT_LEN], "none")
        if len(context) - PROMPT_LEN == FLIP_STEP and kind == "false":
            # A false flag: the scan (and probe) take the other token of a tie, the decode not.
            return ((token + 1) % VOCAB if from_scratch else token), 0.0
        if len(context) - PROMPT_LEN == FLIP_STEP and kind != "none":
            near = 0.5 if kind == "kv_far" else 5e-4  # 64 or 0.06 ulps of FP16 at 10
            if kind == "head" or (kind in ("kv", "kv_far") and not from_scratch):
                return (token + 1) % VOCAB, near
            return token, near
        return token, margin

    return next_token


def loader(_directory: Path, target: Target, _tp: int = 1) -> FakeEngine:
    if target.dtype != "fp16":
        return FakeEngine(target, next_token=_base, vocab_size=VOCAB)
    scratch = _fp16(from_scratch=True)
    return FakeEngine(
        target,
        next_token=_fp16(from_scratch=False),
        step_fn=scratch,
        scan_fn=scratch,
        vocab_size=VOCAB,
    )


@pytest.fixture
def settings(make_settings: Callable[..., Settings], tmp_path: Path) -> Settings:
    """The app's settings: a run of 20 traces or more is large."""
    return make_settings(
        large_run_traces=20,
        session_secret=SESSION_SECRET,
        session_secret_file=tmp_path / "session-secret",
    )


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch, db_url: str, fake_model_dir: Path) -> Iterator[None]:
    monkeypatch.setenv("REPLAY_AUDIT_DATABASE_URL", db_url)
    monkeypatch.setenv("REPLAY_AUDIT_MODEL_DIRS", str(fake_model_dir))

    def recording(directory: Path, target: Target, _tp: int = 1) -> FakeEngine:
        LOADED.append(loader(directory, target))
        return LOADED[-1]

    pool = EnginePool(loader=recording)
    context.install_worker_context(context.WorkerContext(get_settings(), pool))
    yield
    context.install_worker_context(None)
    KINDS.clear()
    LOADED.clear()


@pytest.fixture
def runner(client: TestClient) -> HoldingRunner:
    r = HoldingRunner()
    state = client.app.state  # type: ignore[attr-defined]
    state.queue = dataclasses.replace(state.queue, runner=r)
    return r


def seed(
    client: TestClient, h: dict[str, str], kinds: list[Kind], model_dir: Path, salt: int
) -> list[str]:
    sha = weights_sha256(model_dir)
    bodies = []
    for i, kind in enumerate(kinds):
        prompt = [salt, i // VOCAB, i % VOCAB]
        KINDS[tuple(prompt)] = kind
        run = loader(model_dir, Target("bf16")).decode(prompt, LENGTH, (), Intervention(), 2)
        bodies.append(
            {
                "model": {"name": "fake", "weights_sha256": sha, "vocab_size": VOCAB},
                "config": {"dtype": "bf16", "attn_kernel": "sdpa", "device": "cpu"},
                "decoding": {"strategy": "greedy", "max_new_tokens": LENGTH},
                "prompt_token_ids": prompt,
                "output_token_ids": run.output_token_ids,
                "top_k": {
                    "ids": run.steps.top_k_ids.tolist(),
                    "logits": run.steps.top_k_logits.astype(float).tolist(),
                },
            }
        )
    return ingest(client, h, bodies)


@pytest.mark.usefixtures("engines")
def test_the_control_sample_finds_what_the_scan_misses(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    api_key: Callable[..., str],
    fake_model_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = headers("admin")
    kinds: list[Kind] = ["kv"] * 12 + ["head"] * 24 + ["none"] * 44
    random.Random(3).shuffle(kinds)
    ids = seed(client, h, kinds, fake_model_dir, salt=11)
    kind_of = dict(zip(ids, kinds, strict=True))
    # Near-tie flagging off: the control sample alone finds the kv flips. Probes from scratch,
    # so that every scan_batch below is a scan of the traces (teacher-forced probes are
    # scan_batch calls too: tests/replays/test_pipeline.py).
    body = {
        "trace_ids": ids,
        "targets": [{"dtype": "fp16"}],
        "control_fraction": 0.5,
        "flagged_fraction": 1,  # every flagged trace decoded (the flagged sample: below)
        "scan_flag_ulps": -1,
        "single_step": "from_scratch",
    }
    r = client.post("/v1/replays", json=body, headers=h)
    assert r.status_code == 201, r.text
    with caplog.at_level("INFO", logger="replay_audit.replays.tasks"):
        assert runner.run_all() == 2  # 80 traces, 64 a scan-then-decode job (decode: 16)
    # The worker scanned each job's traces in one batched call, never one trace per call, and
    # logged each job's throughput.
    [fp16] = [e for e in LOADED if e.target.dtype == "fp16"]
    assert fp16.calls.count("scan_batch") == 2 and "scan" not in fp16.calls
    lines = [m for m in caplog.messages if m.startswith("replay job")]
    assert len(lines) == 2 and all("traces/s" in m and "scanned" in m for m in lines)
    # Each trace twice: FP16, and the reproduction check every run begins with (both scanned).
    assert "scanned 128 in " in lines[0] and "scanned 32 in " in lines[1]
    assert lines[0].endswith("run at 128/160 results")
    assert lines[1].endswith("run at 160/160 results")
    run = client.get(f"/v1/replays/{r.json()['id']}", headers=h).json()
    assert run["status"] == "done" and run["mode"] == "scan_then_decode"  # 80 >= 20: large
    assert run["request"]["control_seed"] == 0 and run["results_per_s"] > 0

    sample = ControlSample(0.5, 0)
    items = {x["trace_id"]: x for x in all_results(client, run["id"], h) if x["comparison"] == 0}
    for trace_id, x in items.items():
        kind = kind_of[trace_id]
        if kind == "head":  # flagged, decoded from the flip
            assert x["screen"] == "flagged" and x["category"] == "head_reachable"
        elif sample.includes(trace_id):  # unflagged, in the control sample: decoded in full
            assert x["screen"] == "control"
            assert x["category"] == ("kv_dependent" if kind == "kv" else "agreed")
            assert x["exact_match"] is (kind == "none")
        else:  # only scanned: never claimed agreed, even where the decode would diverge
            assert x["screen"] == "scanned"
            assert x["exact_match"] is None and x["category"] is None

    c = run["statistics"]["comparisons"][0]
    s = c["screening"]
    control = [i for i in ids if kind_of[i] != "head" and sample.includes(i)]
    missed = [i for i in control if kind_of[i] == "kv"]
    assert missed, "the seed draws some kv traces into the control sample"
    assert (s["scanned"], s["flagged"], s["control"], s["control_diverged"]) == (
        80,
        24,
        len(control),
        len(missed),
    )
    assert s["decoded"] == 24 + len(control) and s["scanned_only"] == 80 - s["decoded"]
    assert (s["control_fraction"], s["control_seed"]) == (0.5, 0)
    assert s["misses_by_category"] == {
        "head_reachable": 0,
        "kv_dependent": len(missed),
        "body_dominated": 0,
    }
    assert s["false_flags"] == 0 and s["flagged_diverged"] == 24
    # EAR counts decoded results only: the scanned-only ones are neither exact nor divergent.
    assert c["ear"]["n"] == s["decoded"]
    assert c["ear"]["successes"] == len(control) - len(missed)
    # The scan misses 12 kv flips of 36 decode divergences. What the run can know of that is
    # its control sample: the figures are its Wilson interval carried to the unflagged 56.
    # (Whether such intervals cover the truth is a property over many samples, tested below;
    # this one sample depends on the database's ids, so its interval may miss, 5% of the time.)
    assert_carried_from_sample(
        s,
        missed=len(missed),
        control=len(control),
        unflagged=56,
        flagged_diverged=24,
        flagged_exact=0,
        scanned=80,
    )
    assert s["miss_rate"]["estimate"] is not None and 0 < s["miss_rate"]["estimate"] < 1

    # The run page shows the split.
    assert sign_in(client, api_key("auditor")).status_code == 303
    page = client.get(f"/ui/runs/{run['id']}")
    assert page.status_code == 200
    assert 'id="screening"' in page.text
    assert f"control sample {len(control)}" in page.text
    assert "only scanned" in page.text  # in the results table
    scanned = next(i for i, x in items.items() if x["screen"] == "scanned")
    trace_page = client.get(f"/ui/runs/{run['id']}/traces/{scanned}")
    assert trace_page.status_code == 200 and 'id="only-scanned"' in trace_page.text


def assert_carried_from_sample(
    s: dict[str, dict[str, float]],
    *,
    missed: int,
    control: int,
    unflagged: int,
    flagged_diverged: int,
    flagged_exact: int,
    scanned: int,
) -> None:
    """The screening block's estimates are the control sample's Wilson interval (`missed` of
    `control`) carried to the `unflagged` traces: misses, the share of all decode divergences
    they are, and the EAR of all scanned traces (whose high end comes from the rate's low)."""
    w = wilson_interval(missed, control)
    p = missed / control

    def rate(q: float) -> float:
        return unflagged * q / (flagged_diverged + unflagged * q)

    def ear(q: float) -> float:
        return (flagged_exact + unflagged * (1 - q)) / scanned

    got = {
        k: (s[k]["low"], s[k]["estimate"], s[k]["high"])
        for k in ("estimated_misses", "miss_rate", "ear")
    }
    want = {
        "estimated_misses": (unflagged * w.low, unflagged * p, unflagged * w.high),
        "miss_rate": (rate(w.low), rate(p), rate(w.high)),
        "ear": (ear(w.high), ear(p), ear(w.low)),
    }
    assert got == {k: pytest.approx(v, rel=1e-12) for k, v in want.items()}


def _run(
    client: TestClient, runner: HoldingRunner, h: dict[str, str], ids: list[str], **extra: object
) -> dict[str, object]:
    body = {
        "trace_ids": ids,
        "targets": [{"dtype": "fp16"}],
        "control_fraction": 0.5,
        "flagged_fraction": 1,
        **extra,
    }
    r = client.post("/v1/replays", json=body, headers=h)
    assert r.status_code == 201, r.text
    runner.run_all()
    run: dict[str, object] = client.get(f"/v1/replays/{r.json()['id']}", headers=h).json()
    assert run["status"] == "done" and run["mode"] == "scan_then_decode"
    return run


@pytest.mark.usefixtures("engines")
def test_near_tie_flagging_decodes_the_kv_flips_the_scan_cannot_see(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    api_key: Callable[..., str],
    fake_model_dir: Path,
) -> None:
    h = headers("admin")
    kinds: list[Kind] = ["kv"] * 10 + ["tie"] * 6 + ["kv_far"] * 8 + ["head"] * 12 + ["none"] * 44
    random.Random(5).shuffle(kinds)
    ids = seed(client, h, kinds, fake_model_dir, salt=13)
    kind_of = dict(zip(ids, kinds, strict=True))
    # The ids are the database's: take the first seed whose control sample holds a kv_far trace
    # (a miss the near-tie flag cannot see), so the misses below are never an empty case.
    kv_far = [i for i, kd in kind_of.items() if kd == "kv_far"]
    seed_ = next(k for k in range(64) if any(ControlSample(0.5, k).includes(i) for i in kv_far))
    sample = ControlSample(0.5, seed_)

    # The deployment's default (exact ties only, 0 ulps) is recorded with a run naming none;
    # here the run names 1 ulp.
    default = _run(client, runner, h, ids[:20])
    assert default["request"]["scan_flag_ulps"] == 0.0  # type: ignore[index]
    run = _run(client, runner, h, ids, scan_flag_ulps=1, control_seed=seed_)
    assert run["request"]["scan_flag_ulps"] == 1.0  # type: ignore[index]
    items = {
        x["trace_id"]: x for x in all_results(client, str(run["id"]), h) if x["comparison"] == 0
    }
    for trace_id, x in items.items():
        kind = kind_of[trace_id]
        if kind == "head":
            assert x["screen"] == "flagged"
        elif kind in ("kv", "tie"):  # at a near-tie: decoded in full, never a control
            assert x["screen"] == "near_tie"
            assert x["exact_match"] is (kind == "tie")
            assert x["category"] == ("kv_dependent" if kind == "kv" else "agreed")
        else:
            assert x["screen"] == ("control" if sample.includes(trace_id) else "scanned")
    s = run["statistics"]["comparisons"][0]["screening"]  # type: ignore[index]
    control = [i for i in ids if kind_of[i] in ("kv_far", "none") and sample.includes(i)]
    missed = [i for i in control if kind_of[i] == "kv_far"]
    assert missed, "the seed draws some kv_far traces into the control sample"
    assert (s["flagged"], s["near_tie"], s["near_tie_diverged"]) == (12, 16, 10)
    assert s["scan_flag_ulps"] == 1.0
    assert s["decoded_by_reason"] == {"mismatch": 12, "near_tie": 16, "control": len(control)}
    assert s["decoded"] == 28 + len(control) and s["scanned_only"] == 80 - s["decoded"]
    assert (s["control"], s["control_diverged"]) == (len(control), len(missed))
    # A wide margin at t*: the gate (1e-3) does not fire there, so the body is blamed.
    assert s["misses_by_category"]["body_dominated"] == len(missed)
    assert s["false_flags"] == 0 and s["flagged_diverged"] == 12
    # The truth is 8 kv_far misses of 30 decode divergences; the run reports its control
    # sample's interval carried to the 52 traces neither rule flags.
    assert_carried_from_sample(
        s,
        missed=len(missed),
        control=len(control),
        unflagged=52,
        flagged_diverged=22,
        flagged_exact=6,
        scanned=80,
    )
    assert sign_in(client, api_key("auditor")).status_code == 303
    page = client.get(f"/ui/runs/{run['id']}")
    assert "16 by a near-tie (margin at most 1.0 ulps), 10 of them diverged" in page.text
    assert "(near-tie)" in page.text  # the results table says why a trace was decoded

    # Off: the kv flips are misses again, found only where the control sample holds them.
    off = _run(client, runner, h, ids, scan_flag_ulps=-1, control_seed=seed_)
    items = {
        x["trace_id"]: x for x in all_results(client, str(off["id"]), h) if x["comparison"] == 0
    }
    assert not any(x["screen"] == "near_tie" for x in items.values())
    for trace_id, x in items.items():
        if kind_of[trace_id] == "kv":
            assert x["screen"] == ("control" if sample.includes(trace_id) else "scanned")
            assert x["exact_match"] is (None if x["screen"] == "scanned" else False)
    s = off["statistics"]["comparisons"][0]["screening"]  # type: ignore[index]
    assert (s["near_tie"], s["scan_flag_ulps"]) == (0, -1.0)
    # The 12 head flips are flagged; the other 68 traces are unflagged, their misses (the kv
    # and kv_far flips, 18 of the 30 divergences) estimated from the control sample alone.
    # (Whether one draw's interval covers 18 / 30 depends on the database's ids, which the
    # sample hashes; coverage is the simulation tests'.)
    unflagged = [i for i in ids if kind_of[i] != "head"]
    control = [i for i in unflagged if sample.includes(i)]
    missed = [i for i in control if kind_of[i] in ("kv", "kv_far")]
    assert (s["control"], s["control_diverged"]) == (len(control), len(missed))
    assert_carried_from_sample(
        s,
        missed=len(missed),
        control=len(control),
        unflagged=68,
        flagged_diverged=12,
        flagged_exact=0,
        scanned=80,
    )


@pytest.mark.usefixtures("engines", "runner")
def test_a_bad_near_tie_flag_is_a_422_naming_the_field(
    client: TestClient, headers: Callable[..., dict[str, str]], fake_model_dir: Path
) -> None:
    # The runner holds the valid run's job: run in the background, it would still be writing
    # while the tables are emptied after the test (a deadlock on PostgreSQL).
    h = headers("admin")
    ids = seed(client, h, ["none"] * 2, fake_model_dir, salt=14)
    for bad in (2000, -5, "many", None):
        body = {"trace_ids": ids, "targets": [{"dtype": "fp16"}], "mode": "scan_then_decode"}
        r = client.post("/v1/replays", json={**body, "scan_flag_ulps": bad}, headers=h)
        if bad is None:  # null: the deployment's
            assert r.status_code == 201, r.text
            continue
        assert r.status_code == 422 and "scan_flag_ulps" in r.text, (bad, r.text)


@pytest.mark.usefixtures("engines")
def test_a_run_naming_no_mode_is_scan_then_decode_when_large(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    fake_model_dir: Path,
) -> None:
    """... and decodes only to t* + the deployment's large-run window (32) unless the request
    names its mode or a window: a nightly audit pays for t*, margins and categories, not for
    the cascade after them."""
    h = headers("admin")
    ids = seed(client, h, ["none"] * 20, fake_model_dir, salt=12)

    def planned(n: int, **extra: object) -> tuple[str, int | None, float]:
        body = {"trace_ids": ids[:n], "targets": [{"dtype": "fp16"}], **extra}
        r = client.post("/v1/replays", json=body, headers=h)
        assert r.status_code == 201, r.text
        run = client.get(f"/v1/replays/{r.json()['id']}", headers=h).json()
        assert run["request"]["decode_window"] == run["decode_window"]  # one story
        # The flagged fraction that runs, as the request records it (read back by workers).
        return run["mode"], run["decode_window"], run["request"]["flagged_fraction"]

    std, window, fraction = "scan_then_decode", LARGE_RUN_DECODE_WINDOW, LARGE_RUN_FLAGGED_FRACTION
    assert fraction == 0.05
    assert planned(19) == ("decode", None, 1.0)
    assert planned(20) == (std, window, fraction)
    assert planned(20, decode_window=4) == (std, 4, fraction)
    assert planned(20, flagged_fraction=0.5) == (std, window, 0.5)
    assert planned(20, mode=std) == (std, None, 1.0)
    assert planned(20, mode=std, flagged_fraction=0.25) == (std, None, 0.25)
    assert planned(20, mode="decode") == ("decode", None, 1.0)
    assert planned(19, decode_window=0) == ("decode", 0, 1.0)
    bad = client.post(
        "/v1/replays",
        json={"trace_ids": ids, "targets": [{"dtype": "fp16"}], "control_fraction": 1.5},
        headers=h,
    )
    assert bad.status_code == 422 and "control_fraction" in bad.text


def test_resolve_mode_and_the_control_sample_are_seeded() -> None:
    assert resolve_mode(None, 999, 1000) == "decode"
    assert resolve_mode(None, 1000, 1000) == "scan_then_decode"
    assert resolve_mode("scan", 5, 1000) == "scan"
    keys = [f"tr_{i}" for i in range(4000)]
    a = [k for k in keys if ControlSample(0.05, 1).includes(k)]
    assert a == [k for k in keys if ControlSample(0.05, 1).includes(k)]  # reproducible
    assert a != [k for k in keys if ControlSample(0.05, 2).includes(k)]  # the seed matters
    assert 140 <= len(a) <= 260  # about 5% of 4000 (200 +- 4.2 sd)
    assert not any(ControlSample(0.0, 1).includes(k) for k in keys)
    assert all(ControlSample(1.0, 1).includes(k) for k in keys)


def _figure(i: int, screen: str, exact: bool) -> ResultFigures:
    return ResultFigures(
        trace_id=i,
        trace_public_id=f"tr_{i}",
        external_id=None,
        status="ok",
        exact_match=None if screen == "scanned" else exact,
        first_divergence_step=None if exact or screen == "scanned" else 1,
        category=None if screen == "scanned" else ("agreed" if exact else "kv_dependent"),
        margin_a=None,
        margin_a_ulps=None,
        margin_b=None,
        margin_b_ulps=None,
        gate_triggers=0,
        n_steps=4,
        mean_gap=1.0,
        gate_triggers_a=None,
        n_steps_a=None,
        length_difference=None,
        answer_extractor=None,
        answer_a=None,
        answer_b=None,
        screen=screen,
    )


def test_near_tie_flags_keep_the_control_estimate_unbiased() -> None:
    """Random runs of 2,000 traces: 20% flagged by a mismatch, 10% by a near-tie (half of which
    diverge), 3% of the rest diverge unseen, a 5% control sample of the rest. A near-tie trace
    counts as flagged, never in the control sample: the miss-rate interval still covers each
    run's truth in about 95% of runs, and the mean estimate sits at the true rate."""
    rng = random.Random(1)
    runs, covered, estimates, truths = 300, 0, [], []
    for _ in range(runs):
        figures, misses, divergences = [], 0, 0
        for i in range(2000):
            u = rng.random()
            screen = "flagged" if u < 0.2 else "near_tie" if u < 0.3 else None
            p = 0.9 if screen == "flagged" else 0.5 if screen == "near_tie" else 0.03
            diverges = rng.random() < p
            divergences += diverges
            misses += diverges and screen is None
            if screen is None:
                screen = "control" if rng.random() < 0.05 else "scanned"
            figures.append(_figure(i, screen, not diverges))
        report = screening_report(
            ComparisonInput(0, "logged", 0, "fp16", False, figures, 0.05, 0, 1.0)
        )
        assert report is not None and report.decoded_by_reason["near_tie"] > 0
        truth = misses / divergences
        covered += report.miss_rate.low <= truth <= report.miss_rate.high  # type: ignore[operator]
        assert report.miss_rate.estimate is not None
        estimates.append(report.miss_rate.estimate)
        truths.append(truth)
    assert covered / runs >= 0.9, covered
    bias = sum(estimates) / runs - sum(truths) / runs
    assert abs(bias) < 0.01, bias


def test_the_miss_rate_interval_covers_the_truth_in_about_95_percent_of_runs() -> None:
    """Random runs of 2,000 traces: 25% flagged (most diverge), 4% of the unflagged diverge
    unseen, a 5% control sample. The interval of the miss rate covers each run's true miss rate
    (misses / decode divergences) in about 95% of runs."""
    rng = random.Random(0)
    runs, covered, ear_covered = 300, 0, 0
    for _ in range(runs):
        figures, misses, divergences, exact = [], 0, 0, 0
        for i in range(2000):
            flagged = rng.random() < 0.25
            diverges = rng.random() < (0.9 if flagged else 0.04)
            divergences += diverges
            misses += diverges and not flagged
            exact += not diverges
            control = not flagged and rng.random() < 0.05
            screen = "flagged" if flagged else "control" if control else "scanned"
            figures.append(_figure(i, screen, not diverges))
        c = ComparisonInput(0, "logged", 0, "fp16", False, figures, 0.05, 0)
        report = screening_report(c)
        assert report is not None
        covered += report.miss_rate.low <= misses / divergences <= report.miss_rate.high  # type: ignore[operator]
        ear = report.ear
        ear_covered += ear.low <= exact / 2000 <= ear.high  # type: ignore[operator]
    assert covered / runs >= 0.9, covered
    assert ear_covered / runs >= 0.9, ear_covered


@pytest.mark.usefixtures("engines")
def test_a_decode_window_keeps_t_star_and_cuts_only_the_continuation(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    api_key: Callable[..., str],
    fake_model_dir: Path,
) -> None:
    """The same traces scanned then decoded with and without `decode_window: 1`: flagged
    (head) and control (kv, decoded from the prompt) divergences get the same t*, margins,
    single-step re-runs and categories; their outputs stop one token after t*, exactly the
    whole decode's prefix, and say so; the exact ones decode to the end as before."""
    h = headers("admin")
    kinds: list[Kind] = ["head"] * 6 + ["kv"] * 4 + ["none"] * 10
    random.Random(7).shuffle(kinds)
    ids = seed(client, h, kinds, fake_model_dir, salt=17)
    common = {"mode": "scan_then_decode", "control_fraction": 1.0, "scan_flag_ulps": -1}
    full = _run(client, runner, h, ids, **common)
    cut = _run(client, runner, h, ids, decode_window=1, **common)
    assert full["decode_window"] is None
    assert cut["decode_window"] == 1 and cut["request"]["decode_window"] == 1  # type: ignore[index]
    whole = {
        x["trace_id"]: x for x in all_results(client, str(full["id"]), h) if x["comparison"] == 0
    }
    windowed = {
        x["trace_id"]: x for x in all_results(client, str(cut["id"]), h) if x["comparison"] == 0
    }
    assert whole.keys() == windowed.keys() == set(ids)
    same = (
        "screen",
        "exact_match",
        "first_divergence_step",
        "margin_at_divergence",
        "category",
        "tie",
        "single_step",
    )
    kind_of = dict(zip(ids, kinds, strict=True))
    for trace_id, w in windowed.items():
        f = whole[trace_id]
        assert {k: w[k] for k in same} == {k: f[k] for k in same}, trace_id
        out_w, out_f = w["arms"]["b"]["output_token_ids"], f["arms"]["b"]["output_token_ids"]
        assert f["window_cut"] is False
        if kind_of[trace_id] == "none":  # no divergence: decoded to the end, nothing cut
            assert w["window_cut"] is False and out_w == out_f and len(out_f) == LENGTH
            continue
        t_star = w["first_divergence_step"]
        screen = "flagged" if kind_of[trace_id] == "head" else "control"
        assert t_star == FLIP_STEP and w["screen"] == screen
        assert w["window_cut"] is True
        assert len(out_w) == t_star + 1 + 1 < len(out_f) == LENGTH
        assert out_w == out_f[: len(out_w)]
        # What reads the continuation is not given for a prefix.
        assert f["cascade_length"] is not None and f["length_difference"] is not None
        assert w["cascade_length"] is None and w["length_difference"] is None

    c_full = full["statistics"]["comparisons"][0]  # type: ignore[index]
    c_cut = cut["statistics"]["comparisons"][0]  # type: ignore[index]
    for key in ("ear", "categories", "first_divergence_step", "margin_at_divergence"):
        assert c_cut[key] == c_full[key], key
    assert (c_full["window_cut"], c_full["decode_window"]) == (0, None)
    assert (c_cut["window_cut"], c_cut["decode_window"]) == (10, 1)
    assert c_full["length_difference"]["n"] == 10 and c_cut["length_difference"] is None

    export = client.get(f"/v1/replays/{cut['id']}/export?format=jsonl", headers=h)
    assert export.status_code == 200
    rows = [json.loads(line) for line in export.text.splitlines()]
    assert sum(r["window_cut"] for r in rows) == 10

    assert sign_in(client, api_key("auditor")).status_code == 303
    page = client.get(f"/ui/runs/{cut['id']}")
    assert page.status_code == 200 and 'id="decode-window">t* + 1:' in page.text
    assert "10 results decoded only to t* + 1 not counted" in page.text
    assert page.text.count('class="muted window-cut"') == 10
    plain = client.get(f"/ui/runs/{full['id']}")
    assert "none: decoded to eos or the budget" in plain.text and "window-cut" not in plain.text
    flagged = next(i for i in ids if kind_of[i] == "head")
    trace_page = client.get(f"/ui/runs/{cut['id']}/traces/{flagged}")
    assert trace_page.status_code == 200 and 'id="window-cut"' in trace_page.text
    assert "t* + 1 only" in trace_page.text


@pytest.mark.usefixtures("engines", "runner")
def test_a_bad_decode_window_is_a_422_naming_the_field(
    client: TestClient, headers: Callable[..., dict[str, str]], fake_model_dir: Path
) -> None:
    h = headers("admin")
    ids = seed(client, h, ["none"] * 2, fake_model_dir, salt=18)
    body = {"trace_ids": ids, "targets": [{"dtype": "fp16"}], "mode": "scan_then_decode"}
    for bad in (-1, 65_537, "3", 1.5, True):
        r = client.post("/v1/replays", json={**body, "decode_window": bad}, headers=h)
        assert r.status_code == 422 and r.json()["field"] == "decode_window", (bad, r.text)
    # A window where nothing would be cut: a scan decodes nothing, a pairwise run has no
    # logged output to stop after.
    for extra in (
        {"mode": "scan"},
        {"compare": "pairwise", "targets": [{"dtype": "fp16"}, {"dtype": "bf16"}]},
    ):
        r = client.post("/v1/replays", json={**body, **extra, "decode_window": 4}, headers=h)
        assert r.status_code == 422 and r.json()["field"] == "decode_window", (extra, r.text)
    for ok in (0, 65_536, None):
        r = client.post("/v1/replays", json={**body, "decode_window": ok}, headers=h)
        assert r.status_code == 201, (ok, r.text)


#: What a flagged trace in the flagged sample gets exactly as with every flagged trace decoded.
SAME = (
    "screen",
    "exact_match",
    "first_divergence_step",
    "margin_at_divergence",
    "category",
    "tie",
    "single_step",
    "window_cut",
    "cascade_length",
    "length_difference",
)


def _by_trace(client: TestClient, run_id: str, h: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {x["trace_id"]: x for x in all_results(client, run_id, h) if x["comparison"] == 0}


@pytest.mark.usefixtures("engines")
def test_the_flagged_sample_decodes_only_its_flagged_traces(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    api_key: Callable[..., str],
    fake_model_dir: Path,
    db_url: str,
) -> None:
    """`flagged_fraction` 0.4 against 1 over the same traces: a flagged trace in the sample
    gets exactly what it gets when every flagged trace is decoded; one outside it is not
    decoded (the FP16 engine's decodes are the sample's and the control's, nothing else) and
    keeps the scan's result (`flagged_scanned`, t* = the scan's s). The statistics count the
    false flags of the decoded sample only and carry both samples' intervals into the EAR of
    all scanned traces. A retried job draws the same sample."""
    h = headers("admin")
    kinds: list[Kind] = ["head"] * 24 + ["false"] * 16 + ["none"] * 40
    random.Random(9).shuffle(kinds)
    ids = seed(client, h, kinds, fake_model_dir, salt=19)
    kind_of = dict(zip(ids, kinds, strict=True))
    flagged = [i for i in ids if kind_of[i] != "none"]

    def sample_of(k: int) -> ControlSample:
        return ControlSample(0.5, k, flagged_fraction=0.4)

    def drawn(k: int, kind: Kind) -> list[bool]:
        return [sample_of(k).decodes_flagged(i) for i in flagged if kind_of[i] == kind]

    # The ids are the database's: the first seed whose sample holds and leaves out both kinds.
    seed_ = next(
        k for k in range(64) if all(len(set(drawn(k, kd))) == 2 for kd in ("head", "false"))
    )
    sample = sample_of(seed_)
    common = {"mode": "scan_then_decode", "scan_flag_ulps": -1, "control_seed": seed_}
    full = _run(client, runner, h, ids, **common)
    [fp16] = [e for e in LOADED if e.target.dtype == "fp16"]
    before = fp16.calls.count("decode")
    part = _run(client, runner, h, ids, flagged_fraction=0.4, **common)
    assert part["request"]["flagged_fraction"] == 0.4  # type: ignore[index]
    assert full["request"]["flagged_fraction"] == 1.0  # type: ignore[index]
    sampled = [i for i in flagged if sample.decodes_flagged(i)]
    control = [i for i in ids if kind_of[i] == "none" and sample.includes(i)]
    assert fp16.calls.count("decode") - before == len(sampled) + len(control)

    whole, got = _by_trace(client, str(full["id"]), h), _by_trace(client, str(part["id"]), h)
    for trace_id, x in got.items():
        f = whole[trace_id]
        out, out_full = x["arms"]["b"]["output_token_ids"], f["arms"]["b"]["output_token_ids"]
        if kind_of[trace_id] == "none" or trace_id in sampled:
            assert {k: x[k] for k in SAME} == {k: f[k] for k in SAME}, trace_id
            assert out == out_full
            continue
        # Not decoded: the scan's result, as mode scan has it.
        assert f["screen"] == "flagged" and x["screen"] == "flagged_scanned"
        assert x["exact_match"] is False and x["first_divergence_step"] == FLIP_STEP
        assert x["margin_at_divergence"]["b"]["source"] == "scan"
        assert x["cascade_length"] is None and x["window_cut"] is False
        assert len(out) == FLIP_STEP + 1 and out[:FLIP_STEP] == out_full[:FLIP_STEP]
        if kind_of[trace_id] == "head":  # a true flag: what the decode found at s
            assert out == out_full[: FLIP_STEP + 1] and x["category"] == f["category"]
        else:  # a false flag the decode would have undone; the probe's category
            assert f["exact_match"] is True and out[FLIP_STEP] != out_full[FLIP_STEP]
            assert x["category"] == "head_reachable"

    s = part["statistics"]["comparisons"][0]["screening"]  # type: ignore[index]
    false_flags = sum(1 for i in sampled if kind_of[i] == "false")
    kept = len(flagged) - len(sampled)
    assert (s["flagged"], s["flagged_decoded"], s["flagged_scanned"]) == (40, len(sampled), kept)
    assert s["flagged_fraction"] == 0.4
    assert (s["false_flags"], s["flagged_diverged"]) == (false_flags, len(sampled) - false_flags)
    assert s["decoded_by_reason"] == {
        "mismatch": len(sampled),
        "near_tie": 0,
        "control": len(control),
    }
    assert s["decoded"] == len(sampled) + len(control) and s["scanned_only"] == 40 - len(control)
    ff = s["false_flag_rate"]
    w_q = wilson_interval(false_flags, len(sampled))
    assert (ff["successes"], ff["n"]) == (false_flags, len(sampled))
    assert (ff["low"], ff["high"]) == pytest.approx((w_q.low, w_q.high), rel=1e-12)
    # The EAR of all scanned traces: the false-flag rate's and the unflagged divergence
    # rate's (no control trace diverges here) intervals at the box's corners.
    w_p = wilson_interval(0, len(control))

    def ear(q: float, p: float) -> float:
        return (false_flags + kept * q + 40 * (1 - p)) / 80

    e = s["ear"]
    want = (ear(w_q.low, w_p.high), ear(false_flags / len(sampled), 0.0), ear(w_q.high, w_p.low))
    assert (e["low"], e["estimate"], e["high"]) == pytest.approx(want, rel=1e-12)
    sf = full["statistics"]["comparisons"][0]["screening"]  # type: ignore[index]
    assert (sf["flagged_decoded"], sf["flagged_scanned"], sf["false_flags"]) == (40, 0, 16)
    # EAR of the comparison: the flagged_scanned results are established by the scan.
    c = part["statistics"]["comparisons"][0]  # type: ignore[index]
    assert c["ear"]["n"] == s["decoded"] + kept

    # Every surface says why: the page's block and results table, the export's screen column.
    export = client.get(f"/v1/replays/{part['id']}/export?format=jsonl", headers=h)
    rows = [json.loads(line) for line in export.text.splitlines()]
    assert sum(r["screen"] == "flagged_scanned" for r in rows) == kept
    assert sign_in(client, api_key("auditor")).status_code == 303
    page = client.get(f"/ui/runs/{part['id']}")
    assert page.status_code == 200
    assert f"flagged sample {len(sampled)} of 40 (40.0%) (false flags " in page.text
    assert f"; {kept} kept as the scan found them)" in page.text
    assert "(mismatch, scan only)" in page.text  # the results table (its first page)
    kept_one = next(i for i, x in got.items() if x["screen"] == "flagged_scanned")
    trace_page = client.get(f"/ui/runs/{part['id']}/traces/{kept_one}")
    assert trace_page.status_code == 200 and 'id="flagged-scanned"' in trace_page.text

    # A retried job: its results gone, it runs again and draws the same sample.
    _retry_draws_alike(db_url, client, h, str(part["id"]), got)


@pytest.mark.usefixtures("engines", "runner")
def test_a_bad_flagged_fraction_is_a_422_naming_the_field(
    client: TestClient, headers: Callable[..., dict[str, str]], fake_model_dir: Path
) -> None:
    h = headers("admin")
    ids = seed(client, h, ["none"] * 2, fake_model_dir, salt=20)
    body = {"trace_ids": ids, "targets": [{"dtype": "fp16"}], "mode": "scan_then_decode"}
    for bad in (0, -0.5, 1.01, "half", float("nan")):
        payload = json.dumps({**body, "flagged_fraction": bad})
        r = client.post(
            "/v1/replays", content=payload, headers={**h, "content-type": "application/json"}
        )
        assert r.status_code == 422 and r.json()["field"] == "flagged_fraction", (bad, r.text)
    for ok in (1, 0.01, None):
        r = client.post("/v1/replays", json={**body, "flagged_fraction": ok}, headers=h)
        assert r.status_code == 201, (ok, r.text)


def test_an_audit_schedule_passes_its_flagged_fraction_on() -> None:
    from replay_audit.audits.schemas import ScheduleReplay

    replay = ScheduleReplay.model_validate({"targets": [{"dtype": "fp16"}]})
    assert replay.to_request(["tr_1"], "k").flagged_fraction is None  # the large-run rule
    replay = ScheduleReplay.model_validate(
        {"targets": [{"dtype": "fp16"}], "flagged_fraction": 0.2}
    )
    assert replay.to_request(["tr_1"], "k").flagged_fraction == 0.2
    with pytest.raises(ValueError, match="flagged_fraction"):
        ScheduleReplay.model_validate({"targets": [{"dtype": "fp16"}], "flagged_fraction": 0})


def test_the_flagged_sample_is_seeded_and_apart_from_the_control_sample() -> None:
    keys = [f"tr_{i}" for i in range(4000)]
    a = [k for k in keys if ControlSample(0.05, 1, flagged_fraction=0.1).decodes_flagged(k)]
    assert a == [k for k in keys if ControlSample(0.05, 1, flagged_fraction=0.1).decodes_flagged(k)]
    assert a != [k for k in keys if ControlSample(0.05, 2, flagged_fraction=0.1).decodes_flagged(k)]
    assert 330 <= len(a) <= 470  # about 10% of 4000 (400 +- 3.7 sd)
    # Its own salt: not the control sample's draw at the same fraction and seed.
    assert a != [k for k in keys if ControlSample(0.1, 1).includes(k)]
    assert all(ControlSample(0.05, 1).decodes_flagged(k) for k in keys)  # default 1: all
    with pytest.raises(ValueError):
        ControlSample(0.05, 1, flagged_fraction=0.0)


def _sampled_figure(i: int, screen: str, exact: bool) -> ResultFigures:
    """A result as the run stores it: a flagged_scanned one is divergent by the scan."""
    f = _figure(i, screen, exact)
    if screen == "flagged_scanned":
        return f._replace(exact_match=False, first_divergence_step=1, category="head_reachable")
    return f


def test_the_flagged_sample_estimates_cover_the_truth() -> None:
    """Random runs of 2,000 traces: 30% flagged by a mismatch, of which 15% are false flags
    (exact when decoded), a 10% flagged sample decoded; 4% of the unflagged diverge unseen, a
    5% control sample. The false-flag rate's interval covers the flagged traces' true share,
    and the EAR and miss-rate intervals each run's truth, in at least 95% of runs (the box of
    two 95% intervals); the estimates are unbiased."""
    rng = random.Random(2)
    runs = 300
    covered = {"ear": 0, "miss_rate": 0, "false_flag_rate": 0}
    errors: list[float] = []
    for _ in range(runs):
        figures, exact, misses, divergences, false, flags = [], 0, 0, 0, 0, 0
        for i in range(2000):
            is_flagged = rng.random() < 0.3
            diverges = rng.random() < (0.85 if is_flagged else 0.04)
            exact += not diverges
            divergences += diverges
            misses += diverges and not is_flagged
            flags += is_flagged
            false += is_flagged and not diverges
            if is_flagged:
                screen = "flagged" if rng.random() < 0.1 else "flagged_scanned"
            else:
                screen = "control" if rng.random() < 0.05 else "scanned"
            figures.append(_sampled_figure(i, screen, not diverges))
        c = ComparisonInput(0, "logged", 0, "fp16", False, figures, 0.05, 0, flagged_fraction=0.1)
        report = screening_report(c)
        assert report is not None and report.flagged == flags
        assert report.flagged_decoded == flags - report.flagged_scanned
        assert report.false_flag_rate is not None
        ff = report.false_flag_rate
        covered["false_flag_rate"] += ff.low <= false / flags <= ff.high
        ear = report.ear
        covered["ear"] += ear.low <= exact / 2000 <= ear.high  # type: ignore[operator]
        rate = report.miss_rate
        covered["miss_rate"] += rate.low <= misses / divergences <= rate.high  # type: ignore[operator]
        assert ear.estimate is not None
        errors.append(ear.estimate - exact / 2000)
    assert covered["false_flag_rate"] / runs >= 0.9, covered
    assert covered["ear"] / runs >= 0.95, covered
    assert covered["miss_rate"] / runs >= 0.95, covered
    assert abs(sum(errors) / runs) < 0.005


def test_with_every_flagged_trace_decoded_the_figures_are_the_control_samples_alone() -> None:
    """Fraction 1 (no flagged_scanned): the estimates are exactly the control sample's Wilson
    interval carried through, as before the flagged sample."""
    rng = random.Random(4)
    figures = []
    for i in range(500):
        is_flagged = rng.random() < 0.3
        diverges = rng.random() < (0.8 if is_flagged else 0.05)
        screen = "flagged" if is_flagged else "control" if rng.random() < 0.2 else "scanned"
        figures.append(_figure(i, screen, not diverges))
    report = screening_report(ComparisonInput(0, "logged", 0, "fp16", False, figures, 0.2, 0))
    assert report is not None and report.flagged_scanned == 0
    s = json.loads(report.model_dump_json())
    flagged = [f for f in figures if f.screen == "flagged"]
    control = [f for f in figures if f.screen == "control"]
    assert_carried_from_sample(
        s,
        missed=sum(1 for f in control if not f.exact_match),
        control=len(control),
        unflagged=500 - len(flagged),
        flagged_diverged=sum(1 for f in flagged if not f.exact_match),
        flagged_exact=sum(1 for f in flagged if f.exact_match),
        scanned=500,
    )


# -- the flagged sample covers near-tie flags ----------------------------------------------------


@pytest.mark.usefixtures("engines")
def test_the_flagged_sample_decodes_only_its_near_tie_traces(
    client: TestClient,
    runner: HoldingRunner,
    headers: Callable[..., dict[str, str]],
    api_key: Callable[..., str],
    fake_model_dir: Path,
    db_url: str,
) -> None:
    """Near-tie flags (1 ulp) follow the flagged sample: `flagged_fraction` 0.5 against 1 over
    the same traces. A near-tie trace in the sample (the same per-trace draw as a mismatch's)
    gets exactly what it gets when every flag is decoded; one outside it is not decoded (the
    FP16 engine's decodes are the sample's and the control's only) and is only scanned:
    screen `near_tie_scanned`, exact match and category null, counted in no EAR. The
    statistics count the decoded near-ties' divergence rate with its Wilson interval and carry
    it, with the control sample's, into the EAR of all scanned traces. A retried job draws the
    same sample."""
    h = headers("admin")
    kinds: list[Kind] = ["kv"] * 16 + ["tie"] * 12 + ["head"] * 12 + ["none"] * 40
    random.Random(21).shuffle(kinds)
    ids = seed(client, h, kinds, fake_model_dir, salt=23)
    kind_of = dict(zip(ids, kinds, strict=True))
    near = [i for i in ids if kind_of[i] in ("kv", "tie")]

    def sample_of(k: int) -> ControlSample:
        return ControlSample(0.5, k, flagged_fraction=0.5)

    def drawn(k: int, kind: Kind) -> set[bool]:
        return {sample_of(k).decodes_flagged(i) for i in ids if kind_of[i] == kind}

    # The ids are the database's: the first seed whose sample holds and leaves out each kind.
    seed_ = next(k for k in range(64) if all(drawn(k, kd) == {True, False} for kd in KINDS_NT))
    sample = sample_of(seed_)
    common = {"mode": "scan_then_decode", "scan_flag_ulps": 1, "control_seed": seed_}
    full = _run(client, runner, h, ids, **common)
    [fp16] = [e for e in LOADED if e.target.dtype == "fp16"]
    before = fp16.calls.count("decode")
    part = _run(client, runner, h, ids, **{**common, "flagged_fraction": 0.5})
    sampled = [i for i in ids if kind_of[i] != "none" and sample.decodes_flagged(i)]
    control = [i for i in ids if kind_of[i] == "none" and sample.includes(i)]
    assert fp16.calls.count("decode") - before == len(sampled) + len(control)

    whole, got = _by_trace(client, str(full["id"]), h), _by_trace(client, str(part["id"]), h)
    for trace_id, x in got.items():
        f = whole[trace_id]
        if kind_of[trace_id] == "none" or trace_id in sampled:
            assert {k: x[k] for k in SAME} == {k: f[k] for k in SAME}, trace_id
            assert x["arms"]["b"]["output_token_ids"] == f["arms"]["b"]["output_token_ids"]
        elif kind_of[trace_id] == "head":
            assert x["screen"] == "flagged_scanned"
        else:  # a near-tie outside the sample: only scanned, unknown, never agreed
            assert f["screen"] == "near_tie" and x["screen"] == "near_tie_scanned"
            assert x["exact_match"] is None and x["category"] is None
            assert x["first_divergence_step"] is None and x["cascade_length"] is None

    s = part["statistics"]["comparisons"][0]["screening"]  # type: ignore[index]
    nt_decoded = [i for i in near if i in sampled]
    nt_div = sum(1 for i in nt_decoded if kind_of[i] == "kv")
    nt_kept = len(near) - len(nt_decoded)
    heads = [i for i in sampled if kind_of[i] == "head"]
    assert (s["near_tie"], s["near_tie_decoded"], s["near_tie_scanned"]) == (
        28,
        len(nt_decoded),
        nt_kept,
    )
    assert s["near_tie_diverged"] == nt_div
    assert s["decoded_by_reason"] == {
        "mismatch": len(heads),
        "near_tie": len(nt_decoded),
        "control": len(control),
    }
    assert s["decoded"] == len(sampled) + len(control)
    assert s["scanned_only"] == 40 - len(control)  # the unflagged ones: near-ties apart
    nd = s["near_tie_divergence"]
    w_r = wilson_interval(nt_div, len(nt_decoded))
    assert (nd["successes"], nd["n"]) == (nt_div, len(nt_decoded))
    assert (nd["low"], nd["high"]) == pytest.approx((w_r.low, w_r.high), rel=1e-12)
    # The EAR of all scanned traces: decoded near-ties as decoded (the ties exact), the others
    # exact at 1 - the near-tie rate; the head flags kept are divergent (no false flag: q's
    # interval, on an all-true sample, meets kept x q at its low end only); the unflagged at
    # 1 - p (no control trace diverges).
    w_q = wilson_interval(0, len(heads))
    w_p = wilson_interval(0, len(control))
    kept = 12 - len(heads)
    exact_near = len(nt_decoded) - nt_div

    def ear(q: float, p: float, r: float) -> float:
        return (exact_near + kept * q + nt_kept * (1 - r) + 40 * (1 - p)) / 80

    e = s["ear"]
    want = (
        ear(w_q.low, w_p.high, w_r.high),
        ear(0.0, 0.0, nt_div / len(nt_decoded)),
        ear(w_q.high, w_p.low, w_r.low),
    )
    assert (e["low"], e["estimate"], e["high"]) == pytest.approx(want, rel=1e-12)
    sf = full["statistics"]["comparisons"][0]["screening"]  # type: ignore[index]
    assert (sf["near_tie_decoded"], sf["near_tie_scanned"], sf["near_tie_diverged"]) == (28, 0, 16)
    # EAR of the comparison counts no near_tie_scanned result.
    c = part["statistics"]["comparisons"][0]  # type: ignore[index]
    assert c["ear"]["n"] == s["decoded"] + kept

    export = client.get(f"/v1/replays/{part['id']}/export?format=jsonl", headers=h)
    rows = [json.loads(line) for line in export.text.splitlines()]
    assert sum(r["screen"] == "near_tie_scanned" for r in rows) == nt_kept
    assert sign_in(client, api_key("auditor")).status_code == 303
    page = client.get(f"/ui/runs/{part['id']}")
    assert page.status_code == 200
    assert f"near-tie sample {len(nt_decoded)} of 28 (diverged " in page.text
    assert "(near-tie, scan only)" in page.text  # the results table
    one = next(i for i, x in got.items() if x["screen"] == "near_tie_scanned")
    trace_page = client.get(f"/ui/runs/{part['id']}/traces/{one}")
    assert trace_page.status_code == 200 and 'id="near-tie-scanned"' in trace_page.text

    # A retried job: its results gone, it runs again and draws the same sample.
    _retry_draws_alike(db_url, client, h, str(part["id"]), got)


#: The flag kinds the near-tie sample test needs both in and out of its sample.
KINDS_NT: tuple[Kind, ...] = ("kv", "tie", "head")


def _near_figure(i: int, screen: str, exact: bool) -> ResultFigures:
    """A result as the run stores it: a near_tie_scanned one is unknown, as a scanned one."""
    f = _sampled_figure(i, screen, exact)
    if screen == "near_tie_scanned":
        return f._replace(exact_match=None, first_divergence_step=None, category=None)
    return f


def test_the_near_tie_sample_estimates_cover_the_truth() -> None:
    """Random runs of 2,000 traces: 15% flagged by a mismatch (10% of them false), 20% by a
    near-tie (30% of which diverge), a 10% flagged sample of both decoded; 3% of the unflagged
    diverge unseen, a 5% control sample. The near-tie divergence rate's interval covers the
    near-tie traces' true share, and the EAR and miss-rate intervals each run's truth, in at
    least 95% of runs (the box of three 95% intervals); the estimates are unbiased."""
    rng = random.Random(6)
    runs = 300
    covered = {"ear": 0, "miss_rate": 0, "near_tie_divergence": 0}
    errors: list[float] = []
    for _ in range(runs):
        figures, exact, misses, divergences, near, near_div = [], 0, 0, 0, 0, 0
        for i in range(2000):
            u = rng.random()
            reason = "flagged" if u < 0.15 else "near_tie" if u < 0.35 else None
            p = {"flagged": 0.9, "near_tie": 0.3, None: 0.03}[reason]
            diverges = rng.random() < p
            exact += not diverges
            divergences += diverges
            misses += diverges and reason is None
            near += reason == "near_tie"
            near_div += diverges and reason == "near_tie"
            if reason is None:
                screen = "control" if rng.random() < 0.05 else "scanned"
            else:
                screen = reason if rng.random() < 0.1 else f"{reason}_scanned"
            figures.append(_near_figure(i, screen, not diverges))
        c = ComparisonInput(
            0,
            "logged",
            0,
            "fp16",
            False,
            figures,
            0.05,
            0,
            scan_flag_ulps=0.0,
            flagged_fraction=0.1,
        )
        report = screening_report(c)
        assert report is not None and report.near_tie == near
        assert report.near_tie_decoded == near - report.near_tie_scanned
        assert report.near_tie_divergence is not None
        nd = report.near_tie_divergence
        assert nd.n == report.near_tie_decoded and nd.successes == report.near_tie_diverged
        covered["near_tie_divergence"] += nd.low <= near_div / near <= nd.high
        ear = report.ear
        covered["ear"] += ear.low <= exact / 2000 <= ear.high  # type: ignore[operator]
        rate = report.miss_rate
        covered["miss_rate"] += rate.low <= misses / divergences <= rate.high  # type: ignore[operator]
        assert ear.estimate is not None
        errors.append(ear.estimate - exact / 2000)
    assert covered["near_tie_divergence"] / runs >= 0.9, covered
    assert covered["ear"] / runs >= 0.95, covered
    assert covered["miss_rate"] / runs >= 0.95, covered
    assert abs(sum(errors) / runs) < 0.005


def test_with_every_near_tie_decoded_the_figures_are_as_before_the_near_tie_sample() -> None:
    """Fraction 1 (no near_tie_scanned, nor flagged_scanned): every figure is the control
    sample's Wilson interval carried through with near-tie flags counted as flags, as before
    the flagged sample covered near-ties; the new fields only count."""
    rng = random.Random(8)
    figures = []
    for i in range(600):
        u = rng.random()
        screen = "flagged" if u < 0.2 else "near_tie" if u < 0.4 else None
        diverges = rng.random() < {"flagged": 0.8, "near_tie": 0.4, None: 0.05}[screen]
        if screen is None:
            screen = "control" if rng.random() < 0.2 else "scanned"
        figures.append(_figure(i, screen, not diverges))
    report = screening_report(
        ComparisonInput(0, "logged", 0, "fp16", False, figures, 0.2, 0, flagged_fraction=1.0)
    )
    assert report is not None and report.near_tie_scanned == report.flagged_scanned == 0
    s = json.loads(report.model_dump_json())
    flagged = [f for f in figures if f.screen in ("flagged", "near_tie")]
    control = [f for f in figures if f.screen == "control"]
    near = [f for f in figures if f.screen == "near_tie"]
    assert s["near_tie"] == s["near_tie_decoded"] == len(near) > 0
    nd = s["near_tie_divergence"]
    assert (nd["successes"], nd["n"]) == (s["near_tie_diverged"], len(near))
    assert_carried_from_sample(
        s,
        missed=sum(1 for f in control if not f.exact_match),
        control=len(control),
        unflagged=600 - len(flagged),
        flagged_diverged=sum(1 for f in flagged if not f.exact_match),
        flagged_exact=sum(1 for f in flagged if f.exact_match),
        scanned=600,
    )


def _retry_draws_alike(
    db_url: str,
    client: TestClient,
    h: dict[str, str],
    run_id: str,
    got: dict[str, dict[str, Any]],
) -> None:
    """The run's results deleted and its jobs queued again: run again, every trace gets the
    screen it got (the samples are drawn alike)."""
    from sqlalchemy import delete, select, update

    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.replays.models import ReplayJob, ReplayResult, ReplayRun
    from replay_audit.replays.tasks import run_replay_job

    with session_scope(db_url) as session:
        pk = session.scalar(select(ReplayRun.id).where(ReplayRun.public_id == run_id))
        session.execute(delete(ReplayResult).where(ReplayResult.run_id == pk))
        jobs = list(session.scalars(select(ReplayJob.id).where(ReplayJob.run_id == pk)))
        session.execute(
            update(ReplayJob).where(ReplayJob.run_id == pk).values(status="queued", attempts=0)
        )
    for job in jobs:
        run_replay_job(job)
    again = _by_trace(client, run_id, h)
    assert {i: x["screen"] for i, x in again.items()} == {i: x["screen"] for i, x in got.items()}
