"""Every surface of a replay run shows the same figures (issue 9, "How we will know").

Random runs through the fake engine (hypothesis, a fixed small number of examples, derandomized):
3-12 traces, each with its own plan: whether and at which step the FP16 arm takes the runner-up,
with which margin and why (a flip the gate sees and the single-step re-run reproduces, one that
needs the KV cache, one above τ that the body caused), a near miss where C's repair picks another
token (so C can break a trace), an early EOS after a flip, logged top-2 logits or not, answers
or not, and failures: traces the FP16 engine crashes on and traces whose checkpoint no model
directory holds. Targets among FP16, FP16 + C and BF16 + C compared with the logged output (with
or without `compare_with: "self"`, in any mode), or BF16, FP16, BF16 + C, FP16 + C compared
pairwise (both arms run here). Two hand-made runs with every feature are examples besides.

Once a run is finished, each comparison's figures and each lift are recomputed here from the
export CSV and the results pages, and must be the same on `GET /v1/replays/{id}`
(`statistics`), on `/report` and on the web UI's run page (as the page formats them). The CLI's
`--summary-json` is checked against the API in its own test. SQLite and PostgreSQL (the
`db_url` fixture).
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from html import unescape
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given
from hypothesis import settings as examples
from hypothesis import strategies as st
from typer.testing import CliRunner

from replay_audit.cli import app as cli
from replay_audit.config import Settings, get_settings
from replay_audit.engine import EnginePool, FakeEngine, Intervention, Target, weights_sha256
from replay_audit.formats import BASELINES, CATEGORIES
from replay_audit.stats import mcnemar_exact, paired_bootstrap_lift, proportion
from replay_audit.traces.schemas import TraceCreate
from replay_audit.ui.templating import NONE, num, pct, pp, pvalue
from replay_audit.worker import context
from tests.replays.conftest import HoldingRunner, all_results, ingest
from tests.ui.conftest import SESSION_SECRET, sign_in

VOCAB = 97
#: The end-of-sequence id: only an FP16 arm that has flipped ever says it (see `Flip.stops`).
EOS = VOCAB - 1
PROMPT_LEN = 3
#: The margin of a near miss: below τ in both formats, which still pick the same token.
NEAR_MARGIN = 2e-4
#: FP16's margins are BF16's times this (so arm A's and arm B's margins differ).
MARGIN_SCALE = {"bf16": 1.0, "fp16": 0.5}
FLIP_CATEGORY = {"head": "head_reachable", "kv": "kv_dependent", "body": "body_dominated"}

# -- the fake model: one plan per trace, found by the trace's prompt ------------------------------


@dataclass(frozen=True)
class Flip:
    """FP16 takes the runner-up at `step`, where the BF16 and FP16 margins are `margins`. `head`:
    the gate sees it and the from-scratch re-run reproduces it; `kv`: the re-run does not;
    `body`: the margins are above τ. `stops`: having flipped, FP16 says EOS at the next step."""

    step: int
    margins: tuple[float, float]
    kind: Literal["head", "kv", "body"]
    stops: bool


@dataclass(frozen=True)
class TracePlan:
    length: int
    #: The margin at every other step (above τ).
    gap: float
    flip: Flip | None
    #: A step with a margin below τ where both formats agree; C's repair there picks another
    #: token when `repair_breaks` (so C breaks a trace that was exact without it).
    near_miss: int | None
    repair_breaks: bool
    fate: Literal["ok", "crash", "missing"]
    #: The trace carries a reference answer (so answers are extracted); `mute`: its logged text
    #: has no number in it (no answer).
    reference: bool
    mute: bool
    #: The trace carries its top-2 logits (else arm A's margin at t* is reconstructed here).
    top_k: bool = True


#: The plans of the traces being replayed, by prompt (prompts are unique per generated trace).
PLANS: dict[tuple[int, ...], TracePlan] = {}
_prompt_numbers = itertools.count(1)


def _base(context: tuple[int, ...]) -> int:
    """BF16's token (never EOS)."""
    return (sum(context) * 31 + len(context)) % EOS


def _model(dtype: str, *, from_scratch: bool = False) -> Callable[[tuple[int, ...]], Any]:
    """The plan's model in `dtype`; `from_scratch`: the single-step re-run (no KV cache)."""

    scale = MARGIN_SCALE[dtype]

    def next_token(context: tuple[int, ...]) -> tuple[int, float]:
        plan = PLANS[context[:PROMPT_LEN]]
        step = len(context) - PROMPT_LEN
        token = _base(context)
        if dtype == "fp16" and plan.fate == "crash":
            raise RuntimeError("fake FP16 kernel crashed")
        flip = plan.flip
        if flip is not None and step == flip.step:
            flips = dtype == "fp16" and not (from_scratch and flip.kind == "kv")
            return ((token + 1) % EOS if flips else token), flip.margins[dtype == "fp16"]
        flipped_before = step > 0 and context[-1] != _base(context[:-1])
        if flip is not None and flip.stops and step == flip.step + 1 and flipped_before:
            return EOS, plan.gap * scale  # only FP16 ever flips
        if step == plan.near_miss:
            return token, NEAR_MARGIN * scale
        return token, plan.gap * scale

    return next_token


def _repair(context: tuple[int, ...], _token: int) -> int:
    """What C picks where its gate fires: BF16's token, except at a near miss that breaks."""
    plan = PLANS[context[:PROMPT_LEN]]
    good = _base(context)
    if len(context) - PROMPT_LEN == plan.near_miss and plan.repair_breaks:
        return (good + 2) % EOS
    return good


def piece(token: int) -> str:
    """The fake tokenizer: a text's GSM8K answer is its last token id."""
    return f" {token}"


def planned_engine(directory: Path, target: Target, _tp: int = 1, **_options: Any) -> FakeEngine:
    """The loader of the pool (and, for the CLI, `load_engine`): reads PLANS at each step."""
    return FakeEngine(
        target,
        next_token=_model(target.dtype),
        vocab_size=VOCAB,
        step_fn=_model(target.dtype, from_scratch=True),
        # A scan is one forward from scratch: a flip that needs the KV cache is invisible to it.
        scan_fn=_model(target.dtype, from_scratch=True),
        repair_fn=_repair,
        pieces=piece,
    )


# -- what hypothesis draws ----------------------------------------------------------------------

#: (BF16, FP16) margins at a flip: below τ in both (a tie in one arm or the other: margin 0), or
#: above τ in both.
GATED_MARGINS = [(3e-4, 1.5e-4), (0.0, 2e-5), (1e-5, 0.0), (9e-4, 4e-4)]
BODY_MARGINS = [(4e-3, 2e-3), (0.05, 0.1), (0.4, 0.2)]
LOGGED_TARGETS: dict[str, dict[str, Any]] = {
    "fp16": {"dtype": "fp16"},
    "fp16+C": {"dtype": "fp16", "intervention": {"kind": "C", "tau": 1e-3}},
    "bf16+C": {"dtype": "bf16", "intervention": {"kind": "C", "tau": 1e-3}},
}
PAIRWISE_TARGETS: dict[str, dict[str, Any]] = {"bf16": {"dtype": "bf16"}, **LOGGED_TARGETS}


@st.composite
def trace_plans(draw: st.DrawFn, *, offline: bool = False) -> TracePlan:
    """A trace's plan; `offline`: one the CLI replays as the API does (it cannot fail, and it
    carries a reference answer, as `--extractor` extracts answers from every trace)."""
    length = draw(st.integers(4, 10))
    kind = draw(st.sampled_from([None, "head", "kv", "body"]))
    flip = None
    if kind is not None:
        margins = BODY_MARGINS if kind == "body" else GATED_MARGINS
        step, pair = draw(st.integers(0, length - 1)), draw(st.sampled_from(margins))
        flip = Flip(step, pair, kind, stops=draw(st.booleans()))
    near_miss = draw(st.none() | st.integers(0, length - 1))
    if flip is not None and near_miss == flip.step:
        near_miss = None
    fates = ["ok"] * 6 + ([] if offline else ["crash", "missing"])
    reference = offline or draw(st.booleans())
    return TracePlan(
        length=length,
        gap=draw(st.sampled_from([0.25, 1.0, 3.0])),
        flip=flip,
        near_miss=near_miss,
        repair_breaks=near_miss is not None and draw(st.booleans()),
        fate=draw(st.sampled_from(fates)),
        reference=reference,
        mute=reference and draw(st.integers(0, 3)) == 0,
        top_k=draw(st.integers(0, 3)) > 0,
    )


@dataclass(frozen=True)
class RunCase:
    plans: list[TracePlan]
    compare: Literal["logged", "pairwise"]
    mode: Literal["decode", "scan", "scan_then_decode"]
    #: Names of the targets (keys of PAIRWISE_TARGETS), in order; "self" last when asked for.
    targets: list[str]
    with_self: bool
    pairs: list[tuple[int, int]] | None
    #: scan_then_decode: the share of unflagged traces decoded anyway (None: the default).
    control_fraction: float | None = None
    #: scan_then_decode: the share of mismatch-flagged traces decoded (None: the default, 1).
    flagged_fraction: float | None = None

    def request(self, trace_ids: list[str]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "trace_ids": trace_ids,
            "targets": [PAIRWISE_TARGETS[t] for t in self.targets],
            "compare": self.compare,
            "mode": self.mode,
        }
        if self.with_self:
            body["compare_with"] = "self"
        if self.pairs is not None:
            body["pairs"] = [list(p) for p in self.pairs]
        if self.control_fraction is not None:
            body["control_fraction"] = self.control_fraction
        if self.flagged_fraction is not None:
            body["flagged_fraction"] = self.flagged_fraction
        return body

    def arm_names(self) -> list[str]:
        return [*self.targets, *(["self"] if self.with_self else [])]


@st.composite
def run_cases(draw: st.DrawFn) -> RunCase:
    plans = draw(st.lists(trace_plans(), min_size=3, max_size=12))
    compare = draw(st.sampled_from(["logged", "logged", "pairwise"]))
    pairs = None
    if compare == "logged":
        targets = draw(
            st.lists(st.sampled_from(sorted(LOGGED_TARGETS)), unique=True, min_size=1, max_size=3)
        )
        with_self = draw(st.booleans())
    else:
        targets = draw(
            st.lists(st.sampled_from(sorted(PAIRWISE_TARGETS)), unique=True, min_size=2, max_size=4)
        )
        with_self = draw(st.booleans())
        n = len(targets) + with_self
        pair = st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)).filter(
            lambda p: p[0] != p[1]
        )
        pairs = draw(st.none() | st.lists(pair, min_size=1, max_size=4, unique=True))
    mode = draw(st.sampled_from(["decode", "decode", "scan", "scan_then_decode"]))
    control = draw(st.sampled_from([None, 0.5, 1.0])) if mode == "scan_then_decode" else None
    flagged = draw(st.sampled_from([None, 0.5])) if mode == "scan_then_decode" else None
    return RunCase(plans, compare, mode, targets, with_self, pairs, control, flagged)


def _plan(length: int = 6, **overrides: Any) -> TracePlan:
    values: dict[str, Any] = {
        "length": length,
        "gap": 1.0,
        "flip": None,
        "near_miss": None,
        "repair_breaks": False,
        "fate": "ok",
        "reference": True,
        "mute": False,
    }
    return TracePlan(**(values | overrides))


#: Traces with every feature at least once, run as explicit examples besides the drawn ones:
#: flips of each kind (a tie in arm B only, in arm A only, an early EOS that makes the arms'
#: steps and gate firings differ), a trace C breaks, one whose answers neither arm gives, one
#: FP16 crashes on, one whose checkpoint is missing.
EVERY_FEATURE = [
    _plan(),
    _plan(flip=Flip(2, (1e-5, 0.0), "head", stops=False), gap=3.0),
    _plan(8, flip=Flip(1, (0.0, 2e-5), "head", stops=True), near_miss=5),
    _plan(flip=Flip(3, (3e-4, 1.5e-4), "kv", stops=False), near_miss=1),
    _plan(7, flip=Flip(0, (0.05, 0.1), "body", stops=True), reference=False),
    _plan(near_miss=2, repair_breaks=True, gap=0.25),
    _plan(mute=True),
    _plan(flip=Flip(2, (3e-4, 1.5e-4), "head", stops=False), fate="crash"),
    _plan(fate="missing"),
    _plan(flip=Flip(1, (9e-4, 4e-4), "head", stops=True), top_k=False),
]
ALL_LOGGED = RunCase(EVERY_FEATURE, "logged", "decode", ["fp16", "fp16+C", "bf16+C"], True, None)
ALL_PAIRS = RunCase(
    EVERY_FEATURE, "pairwise", "decode", ["bf16", "fp16", "bf16+C", "fp16+C"], True, None
)
#: Every feature, scan-then-decode against the logged output, half the unflagged decoded.
ALL_SCREENED = RunCase(
    EVERY_FEATURE, "logged", "scan_then_decode", ["fp16", "fp16+C"], True, None, 0.5
)
#: The same with half the mismatch-flagged traces decoded (the flagged sample).
ALL_SAMPLED = RunCase(
    EVERY_FEATURE, "logged", "scan_then_decode", ["fp16", "fp16+C"], True, None, 0.5, 0.5
)


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def settings(make_settings: Callable[..., Settings], tmp_path: Path) -> Settings:
    """The web UI needs a session secret (kept out of the working tree)."""
    return make_settings(
        session_secret=SESSION_SECRET, session_secret_file=tmp_path / "session-secret"
    )


@pytest.fixture
def planned_engines(
    monkeypatch: pytest.MonkeyPatch, db_url: str, fake_model_dir: Path
) -> Iterator[EnginePool]:
    """Worker settings on the test database and a pool of engines that follow PLANS."""
    monkeypatch.setenv("REPLAY_AUDIT_DATABASE_URL", db_url)
    monkeypatch.setenv("REPLAY_AUDIT_MODEL_DIRS", str(fake_model_dir))
    pool = EnginePool(loader=planned_engine)
    context.install_worker_context(context.WorkerContext(get_settings(), pool))
    yield pool
    context.install_worker_context(None)
    PLANS.clear()


@pytest.fixture
def admin(headers: Callable[..., dict[str, str]]) -> dict[str, str]:
    return headers("admin")


@pytest.fixture
def signed_in(client: TestClient, api_key: Callable[..., str]) -> TestClient:
    """The client, signed in to the web UI as an auditor (API calls still send their key)."""
    assert sign_in(client, api_key("auditor")).status_code == 303
    return client


def seed_traces(
    client: TestClient, admin: dict[str, str], plans: list[TracePlan], model_dir: Path
) -> list[str]:
    """Register the plans under fresh prompts, log each trace with the BF16 arm, ingest them."""
    sha = weights_sha256(model_dir)
    number = next(_prompt_numbers)
    bodies = []
    for i, plan in enumerate(plans):
        prompt = [number % VOCAB, number // VOCAB % VOCAB, i]
        PLANS[tuple(prompt)] = plan
        run = planned_engine(model_dir, Target("bf16")).decode(
            prompt, plan.length, (EOS,), Intervention(), top_k=2
        )
        out = run.output_token_ids
        body: dict[str, Any] = {
            "external_id": f"case-{number}-{i}",
            "model": {
                "name": "fake",
                "weights_sha256": "ab" * 32 if plan.fate == "missing" else sha,
                "vocab_size": VOCAB,
            },
            "config": {"dtype": "bf16", "attn_kernel": "sdpa", "device": "cpu"},
            "decoding": {
                "strategy": "greedy",
                "max_new_tokens": plan.length,
                "eos_token_ids": [EOS],
                "stop_reason": "length",
            },
            "prompt_token_ids": prompt,
            "output_token_ids": out,
            "output_text": " (no final answer)" if plan.mute else "".join(piece(t) for t in out),
            "tags": ["surfaces"],
        }
        if plan.top_k:
            body["top_k"] = {
                "ids": run.steps.top_k_ids.tolist(),
                "logits": run.steps.top_k_logits.astype(float).tolist(),
            }
        if plan.reference:
            body["reference_answer"] = f"#### {out[-1] if i % 3 else out[-1] + 1}"
        bodies.append(body)
    return ingest(client, admin, bodies)


def replay(client: TestClient, runner: HoldingRunner, admin: dict[str, str], body: Any) -> Any:
    """Create the run, replay it to the end; `GET /v1/replays/{id}`."""
    r = client.post("/v1/replays", json=body, headers=admin)
    assert r.status_code == 201, r.text
    runner.run_all()
    run = client.get(f"/v1/replays/{r.json()['id']}", headers=admin).json()
    assert run["status"] in ("done", "failed"), run
    return run


# -- the figures, recomputed here from the export and the results pages ----------------------------


def _int(s: str) -> int | None:
    return None if s == "" else int(s)


def _float(s: str) -> float | None:
    return None if s == "" else float(s)


def _bool(s: str) -> bool | None:
    return None if s == "" else s == "true"


class Row(NamedTuple):
    """One CSV row, typed."""

    trace: str
    comparison: int
    ok: bool
    exact: bool | None
    t_star: int | None
    category: str | None
    margin_a: float | None
    margin_a_ulps: float | None
    margin_b: float | None
    margin_b_ulps: float | None
    gate_triggers: int | None
    n_steps: int | None
    gate_triggers_a: int | None
    n_steps_a: int | None
    trigger_rate: float | None
    mean_gap: float | None
    length_difference: int | None
    semantic_agree: bool | None
    screen: str | None
    trigger_rate_a: float | None
    mode: str
    baseline: str

    @classmethod
    def parse(cls, r: dict[str, str]) -> Row:
        return cls(
            trace=r["trace_id"],
            comparison=int(r["comparison"]),
            ok=r["status"] == "ok",
            exact=_bool(r["exact_match"]),
            t_star=_int(r["first_divergence_step"]),
            category=r["category"] or None,
            margin_a=_float(r["margin_a"]),
            margin_a_ulps=_float(r["margin_a_ulps"]),
            margin_b=_float(r["margin_b"]),
            margin_b_ulps=_float(r["margin_b_ulps"]),
            gate_triggers=_int(r["gate_triggers"]),
            n_steps=_int(r["n_steps"]),
            gate_triggers_a=_int(r["gate_triggers_a"]),
            n_steps_a=_int(r["n_steps_a"]),
            trigger_rate=_float(r["trigger_rate"]),
            mean_gap=_float(r["mean_gap"]),
            length_difference=_int(r["length_difference"]),
            semantic_agree=_bool(r["semantic_agree"]),
            screen=r["screen"] or None,
            trigger_rate_a=_float(r["trigger_rate_a"]),
            mode=r["mode"],
            baseline=r["baseline"],
        )

    def agrees_with(self, x: dict[str, Any]) -> None:
        """The CSV row says what the results page's item says."""
        assert self.baseline == x["baseline"]
        arms = x["arms"] or {"a": {}, "b": {}}
        m = x["margin_at_divergence"]
        semantic = x["semantic"]
        assert (self.ok, self.exact, self.t_star, self.category) == (
            x["status"] == "ok",
            x["exact_match"],
            x["first_divergence_step"],
            x["category"],
        )
        assert (self.gate_triggers, self.n_steps, self.trigger_rate, self.mean_gap) == (
            x["gate_triggers"],
            arms["b"].get("steps"),
            x["trigger_rate"],
            x["mean_gap"],
        )
        assert (self.gate_triggers_a, self.n_steps_a, self.trigger_rate_a) == (
            arms["a"].get("gate_triggers"),
            arms["a"].get("steps"),
            arms["a"].get("trigger_rate"),
        )
        assert self.mode == x["mode"] or x["mode"] is None
        if self.ok:  # an arm's trigger rate is its gate firings over its replayed steps
            assert self.trigger_rate == (self.gate_triggers or 0) / (self.n_steps or 1)
            if self.n_steps_a is not None:
                assert arms["a"]["trigger_rate"] == (self.gate_triggers_a or 0) / self.n_steps_a
        margins = (self.margin_a, self.margin_a_ulps, self.margin_b, self.margin_b_ulps)
        if m is None:
            assert margins == (None, None, None, None)
        else:
            assert margins == (m["a"]["abs"], m["a"]["ulps"], m["b"]["abs"], m["b"]["ulps"])
        assert self.length_difference == x["length_difference"]
        assert self.screen == x["screen"]
        # A scan has no replay text: the export shows no answer agreement for it.
        no_text = semantic is None or self.mode == "scan"
        assert self.semantic_agree == (None if no_text else semantic["agree"])
        if self.ok:  # one margin per replayed step in the display track
            assert len(arms["b"]["margins"]) == self.n_steps


def _prop(successes: int, n: int) -> dict[str, Any]:
    p = proportion(successes, n)
    low, high = p.interval.low, p.interval.high
    return {"successes": successes, "n": n, "estimate": p.estimate, "low": low, "high": high}


def _dist(values: list[Any]) -> dict[str, Any] | None:
    xs = np.asarray([float(v) for v in values if v is not None], dtype=np.float64)
    if not xs.size:
        return None
    median, p90 = np.quantile(xs, [0.5, 0.9])
    return {
        "n": int(xs.size),
        "min": float(xs.min()),
        "median": float(median),
        "p90": float(p90),
        "max": float(xs.max()),
        "mean": float(xs.mean()),
    }


#: What a comparison's SAR note says, by the mode of its results (decode: nothing).
SAR_NOTE = {
    "decode": None,
    "scan": "n/a: a scan has no replay text",
    "scan_then_decode": "decoded traces only (a trace only scanned has no replay text)",
}


def expected_comparison(rows: list[Row], items: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """A comparison's figures from its CSV rows (and its SAR from the results' answers): no SAR
    in a scan (no replay text), the decoded traces' in scan-then-decode."""
    ok = [r for r in rows if r.ok]
    # EAR and categories count established results: not a trace only scanned (scan_then_decode).
    established = [r for r in ok if r.exact is not None]
    diverged = [r for r in established if not r.exact]
    steps = sum(r.n_steps or 0 for r in ok)
    triggers = sum(r.gate_triggers or 0 for r in ok)
    with_a = [r for r in ok if r.n_steps_a is not None]
    steps_a = sum(r.n_steps_a or 0 for r in with_a) if with_a else None
    triggers_a = sum(r.gate_triggers_a or 0 for r in with_a) if with_a else None
    gapped = [r for r in ok if r.mean_gap is not None]
    gap_steps = sum(r.n_steps or 0 for r in gapped)
    answers = [
        x["semantic"]
        for x in items
        if x["status"] == "ok" and x["semantic"] is not None and x["exact_match"] is not None
    ]
    if mode == "scan":
        answers = []
    agree = sum(1 for s in answers if s["answer_a"] == s["answer_b"])
    answered = [r.semantic_agree for r in ok if r.semantic_agree is not None]
    assert (len(answered), sum(answered)) == (len(answers), agree)  # the CSV says the same
    return {
        "n": len(rows),
        "ok": len(ok),
        "failed": len(rows) - len(ok),
        "ear": _prop(len(established) - len(diverged), len(established)),
        "mode": mode,
        "sar": _prop(agree, len(answers)) if answers else None,
        "sar_note": SAR_NOTE[mode],
        "sar_neither_answered": sum(
            1 for s in answers if s["answer_a"] is None and s["answer_b"] is None
        ),
        "steps": steps,
        "gate_triggers": triggers,
        "trigger_rate": triggers / steps if steps else None,
        "mean_gap": (
            sum((r.mean_gap or 0.0) * (r.n_steps or 0) for r in gapped) / gap_steps
            if gap_steps
            else None
        ),
        "steps_a": steps_a,
        "gate_triggers_a": triggers_a,
        "trigger_rate_a": triggers_a / steps_a if steps_a and triggers_a is not None else None,
        "categories": {
            k: _prop(sum(r.category == k for r in established), len(established))
            for k in CATEGORIES
        },
        "first_divergence_step": _dist([r.t_star for r in diverged]),
        "length_difference": _dist([r.length_difference for r in diverged]),
        "margin_at_divergence": {
            "a": _dist([r.margin_a for r in diverged]),
            "a_ulps": _dist([r.margin_a_ulps for r in diverged]),
            "b": _dist([r.margin_b for r in diverged]),
            "b_ulps": _dist([r.margin_b_ulps for r in diverged]),
            "ties": sum(1 for r in diverged if r.margin_a == 0.0 or r.margin_b == 0.0),
        },
        "screening": expected_screening(ok),
        "baselines": {b: n for b in BASELINES if (n := sum(r.baseline == b for r in ok))},
    }


def expected_screening(ok: list[Row]) -> dict[str, Any] | None:
    """The counts of a scan-then-decode comparison's screening block (None in other modes)."""
    screened = [r for r in ok if r.screen is not None]
    if not screened:
        return None
    flagged = [r for r in screened if r.screen == "flagged"]
    kept = [r for r in screened if r.screen == "flagged_scanned"]
    assert all(r.exact is False and r.t_star is not None for r in kept)
    near = [r for r in screened if r.screen == "near_tie"]
    near_kept = [r for r in screened if r.screen == "near_tie_scanned"]
    control = [r for r in screened if r.screen == "control"]
    scanned = [r for r in screened if r.screen == "scanned"]
    unknown = scanned + near_kept
    assert all(r.exact is None and r.category is None and r.t_star is None for r in unknown)
    assert all(r.exact is not None for r in flagged + near + control)
    missed = [r for r in control if not r.exact]
    return {
        "scanned": len(screened),
        "flagged": len(flagged) + len(kept),
        "flagged_decoded": len(flagged),
        "flagged_scanned": len(kept),
        "near_tie": len(near) + len(near_kept),
        "near_tie_decoded": len(near),
        "near_tie_scanned": len(near_kept),
        "near_tie_diverged": sum(1 for r in near if not r.exact),
        "near_tie_divergence": _prop(sum(1 for r in near if not r.exact), len(near)),
        "decoded": len(flagged) + len(near) + len(control),
        "decoded_by_reason": {
            "mismatch": len(flagged),
            "near_tie": len(near),
            "control": len(control),
        },
        "scanned_only": len(scanned),
        "control": len(control),
        "control_diverged": len(missed),
        "false_flags": sum(1 for r in flagged if r.exact),
        "flagged_diverged": sum(1 for r in flagged if not r.exact),
        "false_flag_rate": _prop(sum(1 for r in flagged if r.exact), len(flagged)),
        "misses_by_category": {k: sum(r.category == k for r in missed) for k in CATEGORIES[1:]},
        "unflagged_divergence": _prop(len(missed), len(control)),
    }


def expected_lift(base: list[Row], treated: list[Row], index: int) -> dict[str, Any]:
    """The lift of comparison `index` over comparison 0, paired on the traces ok in both."""
    a = {r.trace: bool(r.exact) for r in base if r.ok and r.exact is not None}
    b = {r.trace: bool(r.exact) for r in treated if r.ok and r.exact is not None}
    common = sorted(a.keys() & b.keys())
    fixed = {t for t in common if b[t] and not a[t]}
    broke = {t for t in common if a[t] and not b[t]}
    n = len(common)
    low = high = None
    if n:
        boot = paired_bootstrap_lift([a[t] for t in common], [b[t] for t in common])
        low, high = boot.low, boot.high
    return {
        "comparison_a": 0,
        "comparison_b": index,
        "n": n,
        "ear_a": sum(a[t] for t in common) / n if n else None,
        "ear_b": sum(b[t] for t in common) / n if n else None,
        "lift": (len(fixed) - len(broke)) / n if n else None,
        "low": low,
        "high": high,
        "fixed": len(fixed),
        "broke": len(broke),
        "mcnemar_p": mcnemar_exact(len(broke), len(fixed)).p_value,
        "fixed_ids": fixed,
        "broke_ids": broke,
    }


#: Means summed in another order than the builder's (CSV order, float addition): equal to the
#: last few bits. Every other figure must be identical.
_SUMMED = ("mean", "mean_gap")


def same(actual: Any, expected: Any, where: str = "") -> None:
    """`actual` holds `expected` (dicts: every expected key, recursively)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), (where, actual, expected)
        for key, value in expected.items():
            if key.endswith(_SUMMED) and value is not None and actual.get(key) is not None:
                assert math.isclose(actual[key], value, rel_tol=1e-12), (
                    f"{where}.{key}",
                    actual[key],
                    value,
                )
            else:
                same(actual.get(key), value, f"{where}.{key}")
    else:
        assert actual == expected, (where, actual, expected)


# -- the web UI, as the run page formats the figures -------------------------------------------


def _text(fragment: str) -> str:
    """What a reader sees of an HTML fragment: tags dropped, entities read, spaces collapsed."""
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def _section(html: str, pattern: str) -> str:
    m = re.search(pattern, html, re.S)
    assert m is not None, pattern
    return m.group(1)


def _prop_text(p: dict[str, Any] | None) -> str:
    if p is None:
        return NONE
    if p["n"] == 0:
        return "n/a"
    return f"{pct(p['estimate'])} [{pct(p['low'])}, {pct(p['high'])}] {p['successes']}/{p['n']}"


def comparison_row_text(
    index: int, label: str, e: dict[str, Any], reproduction: bool = False
) -> str:
    """The row of the run page's agreement table that the figures `e` should give (with the
    column of results against a replayed baseline where the run reproduced first)."""
    failed = f" ({e['failed']} failed)" if e["failed"] else ""
    trigger = f"{pct(e['trigger_rate'], 2)} {e['gate_triggers']}/{e['steps']} steps"
    if e["steps_a"] is not None:  # both arms ran here: both arms' gates, labelled
        a = f"{pct(e['trigger_rate_a'], 2)} {e['gate_triggers_a']}/{e['steps_a']} steps"
        trigger = f"arm A {a} arm B {trigger}"
    sar = " ".join(x for x in (_prop_text(e["sar"]) if e["sar"] else "", e["sar_note"]) if x)
    text = (
        f"{index} {label} {e['ok']} / {e['n']}{failed} {_prop_text(e['ear'])} "
        f"{sar or NONE} {trigger} {num(e['mean_gap'])} "
        f"{e['margin_at_divergence']['ties']}"
    )
    if reproduction:
        b = e["baselines"]
        other = b.get("reproduced", 0) + b.get("replayed", 0)
        parts = [f"{b['reproduced']} not reproduced"] if b.get("reproduced") else []
        parts += [f"{b['replayed']} other engine"] if b.get("replayed") else []
        text += f" {other}" + (f" ({', '.join(parts)})" if parts else "")
    return text


def lift_row_text(label: str, lf: dict[str, Any]) -> str:
    return (
        f"{label} {lf['n']} {pp(lf['lift'])} [{pp(lf['low'])}, {pp(lf['high'])}] "
        f"{pvalue(lf['mcnemar_p'])} {lf['fixed']} {lf['broke']}"
    )


def check_run_page(
    html: str,
    labels: list[str],
    expected: list[dict[str, Any]],
    lifts: list[dict[str, Any]],
    pair: dict[str, Any] | None,
) -> None:
    table = _section(html, r'<table class="data" id="comparisons">(.*?)</table>')
    reproduction = 'id="engine-reproduction"' in html
    for i, (label, e) in enumerate(zip(labels, expected, strict=True)):
        row = _section(table, rf'<tr id="comparison-{i}">(.*?)</tr>')
        assert _text(row) == comparison_row_text(i, label, e, reproduction)
    if lifts:
        body = _section(html, r'<section class="card" id="lifts">.*?<tbody>(.*?)</tbody>')
        rows = [_text(r) for r in re.findall(r"<tr>(.*?)</tr>", body, re.S)]
        assert rows == [lift_row_text(labels[lf["comparison_b"]], lf) for lf in lifts]
    else:
        assert 'id="lifts"' not in html
    screened = [(i, e["screening"]) for i, e in enumerate(expected) if e["screening"] is not None]
    if screened:
        for i, s in screened:
            text = _text(_section(html, rf'<li id="screening-{i}">(.*?)</li>'))
            assert f"{i} {labels[i]}: scanned {s['scanned']}, decoded {s['decoded']} " in text
            assert (
                f"({s['flagged_decoded']} flagged by a mismatch, {s['false_flags']} of them exact; "
                in text
            )
            assert f"{s['near_tie_decoded']} by a near-tie " in text
            assert f"{s['near_tie_diverged']} of them diverged), " in text
            assert f"control sample {s['control']} " in text
            assert f"{s['control_diverged']} diverged in it" in text
            assert f"flagged sample {s['flagged_decoded']} of {s['flagged']} " in text
            if s["near_tie"]:
                assert f"near-tie sample {s['near_tie_decoded']} of {s['near_tie']} " in text
            assert text.endswith(f"only scanned {s['scanned_only']}")
    else:
        assert 'id="screening"' not in html
    if pair is not None:  # the lift of the default pair (any pair, at will)
        text = _text(_section(html, r'<section class="card" id="pair">(.*?)</section>'))
        assert f"Pairs (both ok) {pair['n']} " in text
        assert f"EAR baseline {pct(pair['ear_a'])} " in text
        assert f"EAR treated {pct(pair['ear_b'])} " in text
        assert f"Lift {pp(pair['lift'])} 95% CI [{pp(pair['low'])}, {pp(pair['high'])}]" in text
        assert f"Fixed {pair['fixed']} diverged" in text and f"Broke {pair['broke']} exact" in text


# -- the plan's own predictions ----------------------------------------------------------------


def _dtype(arm: str) -> str:
    return "bf16" if arm in ("logged", "self") else arm.split("+")[0]


def check_plans(
    plan_of: dict[str, TracePlan], arms: tuple[str, str], rows: list[Row], mode: str
) -> None:
    """Failures where the plan puts them; FP16 against the logged output diverges exactly at
    the planned flips, in the planned category."""
    for r in rows:
        plan = plan_of[r.trace]
        crashes = plan.fate == "crash" and "fp16" in {_dtype(arms[0]), _dtype(arms[1])}
        assert r.ok is not (plan.fate == "missing" or crashes), (r, plan, arms)
        if r.screen in ("scanned", "near_tie_scanned"):  # only scanned: nothing claimed
            assert (r.exact, r.t_star, r.category) == (None, None, None), (r, plan)
            continue
        if arms == ("logged", "fp16") and r.ok:
            flip = plan.flip
            if flip is not None and flip.kind == "kv" and mode != "decode":
                # The scan cannot see a flip that needs the KV cache: a scan reports the trace
                # exact; scan_then_decode only scanned it, or decoded it for its near-tie (where
                # the run's flag reaches the plan's kv margins) or in its control sample.
                if mode == "scan":
                    assert r.t_star is None and r.exact is True, (r, plan)
                    continue
                assert r.screen in ("near_tie", "control"), (r, plan)  # only scanned: above
            assert r.t_star == (None if flip is None else flip.step), (r, plan)
            assert r.category == ("agreed" if flip is None else FLIP_CATEGORY[flip.kind])
            stopped = flip is not None and flip.stops and flip.step + 1 < plan.length
            if (mode == "scan" or r.screen == "flagged_scanned") and flip is not None:
                # a scan stops at t*: no lengths to compare
                assert r.length_difference is None
            else:
                assert r.length_difference == (flip.step + 2 - plan.length if stopped else 0)
        if arms[1] == "self" and r.ok and arms[0] in ("logged", "bf16", "self"):
            assert r.exact, (r, plan)  # the logged configuration reproduces itself


# -- the tests -----------------------------------------------------------------------------------

EXAMPLES = examples(
    max_examples=8,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _csv(client: TestClient, run_id: str, admin: dict[str, str]) -> list[Row]:
    r = client.get(f"/v1/replays/{run_id}/export", params={"format": "csv"}, headers=admin)
    assert r.status_code == 200, r.text
    return [Row.parse(x) for x in csv.DictReader(io.StringIO(r.text, newline=""))]


@pytest.mark.usefixtures("planned_engines")
@EXAMPLES
@given(case=run_cases())
@example(case=ALL_LOGGED)
@example(case=ALL_PAIRS)
@example(case=ALL_SCREENED)
@example(case=ALL_SAMPLED)
def test_every_surface_shows_the_same_figures(
    client: TestClient,
    runner: HoldingRunner,
    admin: dict[str, str],
    signed_in: TestClient,
    fake_model_dir: Path,
    case: RunCase,
) -> None:
    trace_ids = seed_traces(client, admin, case.plans, fake_model_dir)
    plan_of = dict(zip(trace_ids, case.plans, strict=True))
    run = replay(client, runner, admin, case.request(trace_ids))
    run_id = run["id"]
    stats = run["statistics"]
    assert "aggregate" not in run  # one statistics object, no deprecated twin
    report = client.get(f"/v1/replays/{run_id}/report", headers=admin).json()
    rows = _csv(client, run_id, admin)
    items = all_results(client, run_id, admin, limit=7)
    comparisons = run["comparisons"]
    names = case.arm_names()
    if len(run["targets"]) == len(names) + 1:  # the reproduction check the run added
        assert run["targets"][-1]["self"] is True
        names = [*names, "self"]
    arms = [("logged" if c["a"] == "logged" else names[c["a"]], names[c["b"]]) for c in comparisons]

    # The export and the results pages: one row per (trace, comparison), saying the same.
    by_key = {(x["trace_id"], x["comparison"]): x for x in items}
    assert len(rows) == len(items) == len(by_key) == len(trace_ids) * len(comparisons)
    for r in rows:
        r.agrees_with(by_key[(r.trace, r.comparison)])
    rows_of = {c["index"]: [r for r in rows if r.comparison == c["index"]] for c in comparisons}
    items_of = {
        c["index"]: [x for x in items if x["comparison"] == c["index"]] for c in comparisons
    }
    # A run's mode is its comparisons' against the logged tokens; pairwise ones decode.
    modes = {c["index"]: case.mode if c["a"] == "logged" else "decode" for c in comparisons}
    assert all(r.mode == modes[r.comparison] for r in rows)
    expected = [expected_comparison(rows_of[i], items_of[i], modes[i]) for i in rows_of]
    # Every comparison but the baseline gets a lift over it, except where arm B is the self
    # target: a self-replay is a reproducibility check.
    treatments = [i for i, (_, b) in enumerate(arms) if i != 0 and b != "self"]
    lifts = [expected_lift(rows_of[0], rows_of[i], i) for i in treatments]

    # The run's statistics and /report against the recomputed figures.
    assert report["comparisons"] == stats["comparisons"]
    assert report["lifts"] == stats["lifts"] and report["accuracy"] == stats["accuracy"]
    labels = [c["label"] for c in stats["comparisons"]]
    for c, e, (a, b) in zip(stats["comparisons"], expected, arms, strict=True):
        check_plans(plan_of, (a, b), rows_of[c["index"]], case.mode)
        same(c, e, f"statistics.comparisons[{c['index']}]")
        hist = c["t_star_histogram"]
        t_stars = [r.t_star for r in rows_of[c["index"]] if r.ok and r.exact is False]
        if t_stars:
            edges = hist["edges"]
            assert edges[0] == 0 and edges[-1] > max(t_stars)
            assert hist["counts"] == [
                sum(lo <= t < hi for t in t_stars) for lo, hi in itertools.pairwise(edges)
            ]
        else:
            assert hist is None
        m = c["margin_at_divergence"]
        for arm in ("a", "b", "a_ulps", "b_ulps"):
            h, d = m[f"histogram_{arm}"], e["margin_at_divergence"][arm]
            assert (h is None) == (d is None)
            if h is not None:
                assert sum(h["counts"]) + h["zeros"] + h["below"] + h["above"] == d["n"]
        # By rule: EAR counts the ok results a replay established (all of them but the traces a
        # scan-then-decode run only scanned), failures are the failed results, and a result
        # that replays exactly and had its answers extracted agrees on the answer.
        ok_items = [x for x in items_of[c["index"]] if x["status"] == "ok"]
        scanned_only = [x for x in ok_items if x["screen"] in ("scanned", "near_tie_scanned")]
        assert c["ok"] == len(ok_items)
        assert c["ear"]["n"] == len(ok_items) - len(scanned_only)
        assert all(x["exact_match"] is None and x["category"] is None for x in scanned_only)
        screens = case.mode == "scan_then_decode" and c["a"] == "logged" and bool(ok_items)
        assert (c["screening"] is not None) == screens
        assert c["failed"] == sum(x["status"] == "failed" for x in items_of[c["index"]])
        exact_answered = [x for x in ok_items if x["exact_match"] and x["semantic"] is not None]
        assert all(x["semantic"]["agree"] for x in exact_answered)
        if c["mode"] == "scan":  # no replay text, no SAR, and every surface says why
            assert c["sar"] is None and c["sar_note"] == "n/a: a scan has no replay text"
        else:
            assert (c["sar"]["successes"] if c["sar"] else 0) >= len(exact_answered)
    assert run["progress"]["failed"] == sum(c["failed"] for c in stats["comparisons"])

    assert [lf["comparison_b"] for lf in stats["lifts"]] == treatments
    for lf, e in zip(stats["lifts"], lifts, strict=True):
        exp = {k: v for k, v in e.items() if not k.endswith("_ids")}
        same(lf, exp | {"run_a": run_id, "run_b": run_id}, f"lift {e['comparison_b']}")
        assert {t["id"] for t in lf["fixed_traces"]} == e["fixed_ids"]
        assert {t["id"] for t in lf["broke_traces"]} == e["broke_ids"]
        assert len(lf["fixed_traces"]) == e["fixed"] and len(lf["broke_traces"]) == e["broke"]

    # The web UI's run page prints the same numbers.
    page = signed_in.get(f"/ui/runs/{run_id}")
    assert page.status_code == 200, page.text
    # By default the pair block shows the first treatment over comparison 0 (never a self-replay).
    first = next((lf["comparison_b"] for lf in lifts), None)
    pair = expected_lift(rows_of[0], rows_of[first], first) if first is not None else None
    check_run_page(page.text, labels, expected, lifts, pair)
    if first is None:
        assert "Pairs (both ok)" not in page.text


@st.composite
def cli_cases(draw: st.DrawFn) -> tuple[list[TracePlan], str]:
    plans = draw(st.lists(trace_plans(offline=True), min_size=3, max_size=8))
    return plans, draw(st.sampled_from(sorted(LOGGED_TARGETS)))


@pytest.mark.usefixtures("planned_engines")
@examples(EXAMPLES, max_examples=4)
@given(case=cli_cases())
def test_cli_summary_is_the_api_comparison(
    client: TestClient,
    runner: HoldingRunner,
    admin: dict[str, str],
    fake_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    case: tuple[list[TracePlan], str],
) -> None:
    """`replay-audit replay --summary-json` on the run's traces (as `GET /v1/traces/{id}` gives
    them) prints the API's comparison 0. The CLI itself runs: its `EnginePool(device=, cache=)`
    loads engines through `replay_audit.engine.pool.load_engine`, replaced here by the fake, so no
    torch is needed. Every trace carries a reference answer, so `--extractor gsm8k` extracts
    answers where the API's job does."""
    plans, name = case
    trace_ids = seed_traces(client, admin, plans, fake_model_dir)
    target = LOGGED_TARGETS[name]
    run = replay(client, runner, admin, {"trace_ids": trace_ids, "targets": [target]})
    items = {x["trace_id"]: x for x in all_results(client, run["id"], admin)}

    r, out, summary, external = cli_replay(
        client, admin, trace_ids, target, fake_model_dir, tmp_path, monkeypatch
    )
    assert r.exit_code == 0, r.output
    printed = json.loads(summary.read_text())
    assert printed["mode"] == "decode" and printed.pop("target")["dtype"] == target["dtype"]
    check_cli_table(r.output, run["statistics"]["comparisons"][0])
    assert printed.pop("traces") == len(trace_ids) and printed.pop("interrupted") is False
    # The CLI reproduces before it compares, as the run did: its check and its figures are
    # the run's (both comparisons).
    assert printed.pop("comparisons") == run["statistics"]["comparisons"]
    reproduction, er = printed.pop("reproduction"), run["statistics"]["engine_reproduction"]
    # The same check, but the CLI names traces by their external ids (it stores none).
    assert [t["external_id"] for t in reproduction.pop("not_reproduced")] == [
        t["external_id"] for t in er.pop("not_reproduced")
    ]
    assert reproduction == er
    assert printed == run["statistics"]["comparisons"][0]
    assert f"({printed['ear']['successes']}/{printed['ear']['n']})" in r.output
    # Per trace, the CLI's output file says what the API's results say.
    by_external = {x["trace_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    for trace_id, x in items.items():
        mine = by_external[external[trace_id]]
        assert (mine["exact_match"], mine["first_divergence_step"], mine["category"]) == (
            x["exact_match"],
            x["first_divergence_step"],
            x["category"],
        )
        assert mine["gate_triggers"] == x["gate_triggers"] and mine["semantic"] == x["semantic"]


def cli_replay(
    client: TestClient,
    admin: dict[str, str],
    trace_ids: list[str],
    target: dict[str, Any],
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *options: str,
) -> tuple[Any, Path, Path, dict[str, str]]:
    """`replay-audit replay` of the traces (as `GET /v1/traces/{id}` gives them, in the run's
    order, which the statistics sum in) in `target` with `--extractor gsm8k`: the CLI's result,
    its --out and --summary-json files, and each trace's external id. The CLI itself runs: its
    `EnginePool(device=, cache=)` loads engines through `replay_audit.engine.pool.load_engine`,
    replaced here by the fake, so no torch is needed."""
    traces = tmp_path / f"traces-{trace_ids[0]}.jsonl"
    lines, external = [], {}
    for i in trace_ids:
        body = client.get(f"/v1/traces/{i}", headers=admin).json()
        external[i] = body["external_id"]
        lines.append(json.dumps({k: v for k, v in body.items() if k in TraceCreate.model_fields}))
    traces.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr("replay_audit.engine.pool.load_engine", planned_engine)
    monkeypatch.setenv("COLUMNS", "200")  # rich's table, unwrapped
    out, summary = tmp_path / f"out-{trace_ids[0]}.jsonl", tmp_path / f"sum-{trace_ids[0]}.json"
    iv = target.get("intervention")
    args = ["--intervention", iv["kind"], "--tau", str(iv["tau"])] if iv else []
    r = CliRunner().invoke(
        cli,
        ["replay", str(traces), "--model", str(model_dir), "--dtype", target["dtype"], *args,
         "--extractor", "gsm8k", "--out", str(out), "--summary-json", str(summary), *options],
    )  # fmt: skip
    return r, out, summary, external


def _cli_row(output: str, measure: str) -> str:
    """The value of one row of the CLI's summary table (rich draws it with box characters)."""
    m = re.search(rf"│ {re.escape(measure)} +│ +(.*?) *│", output)
    assert m is not None, (measure, output)
    return m.group(1)


def check_cli_table(output: str, c: dict[str, Any]) -> None:
    """The CLI's printed table shows the API's figures of comparison `c`: EAR, arm B's gate
    (arm A is the logged tokens: not run here), SAR or why there is none."""
    ear = c["ear"]
    assert _cli_row(output, "exact agreement (EAR)").endswith(f"({ear['successes']}/{ear['n']})")
    assert ear["estimate"] is None or _cli_row(output, "exact agreement (EAR)").startswith(
        f"{ear['estimate']:.1%} [{ear['low']:.1%}, {ear['high']:.1%}]"
    )
    gate = _cli_row(output, "trigger rate, arm B")
    assert "trigger rate, arm A" not in output
    rate = "-" if c["trigger_rate"] is None else f"{c['trigger_rate']:.2%}"
    assert gate == f"{rate} ({c['gate_triggers']}/{c['steps']})"
    ts = c["first_divergence_step"]  # steps: printed as the API's numbers, "23" not "23.0"
    want = " / ".join("-" if ts is None else f"{ts[k]:g}" for k in ("min", "median", "max"))
    assert _cli_row(output, "t* min / median / max") == want
    sar = _cli_row(output, "answer agreement (SAR)")
    if c["sar"] is None:
        assert sar == (c["sar_note"] or "- (no answers extracted)") and "%" not in sar
    else:
        assert sar.startswith(f"{c['sar']['estimate']:.1%} ({c['sar']['successes']}/")


# -- one run-statistics object, mode-aware, on every surface (issue 19) -----------------------

#: Offline-capable traces (all answerable, none failing): exact ones, flips the scan sees (at
#: the gate, in the body) and one it cannot (the KV cache's), one answered by neither arm.
MODE_PLANS = [
    _plan(),
    _plan(flip=Flip(2, (1e-5, 0.0), "head", stops=False), gap=3.0),
    _plan(7, flip=Flip(0, (0.05, 0.1), "body", stops=True)),
    _plan(mute=True),
    _plan(flip=Flip(3, (3e-4, 1.5e-4), "kv", stops=False)),
]


@pytest.mark.usefixtures("planned_engines")
@pytest.mark.parametrize("mode", ["decode", "scan", "scan_then_decode"])
def test_sar_is_mode_aware_and_the_cli_shows_the_api_figures(
    client: TestClient,
    runner: HoldingRunner,
    admin: dict[str, str],
    signed_in: TestClient,
    fake_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
) -> None:
    """A scan has no replay text: no SAR (it was 100%, over the agreed traces only) on the
    summary, /report, the UI, the export and the CLI, each saying why; scan-then-decode's SAR
    counts the decoded traces only, and says so; decode's counts every trace. The CLI prints
    the API's figures for the same traces."""
    trace_ids = seed_traces(client, admin, MODE_PLANS, fake_model_dir)
    body: dict[str, Any] = {"trace_ids": trace_ids, "targets": [{"dtype": "fp16"}], "mode": mode}
    control = ["--control-fraction", "0"] if mode == "scan_then_decode" else []
    if control:
        body["control_fraction"] = 0.0
    run = replay(client, runner, admin, body)
    c = run["statistics"]["comparisons"][0]
    items = all_results(client, run["id"], admin)
    decoded = [x for x in items if x["semantic"] is not None and x["exact_match"] is not None]
    assert c["mode"] == mode and c["ear"]["successes"] < c["ear"]["n"]
    if mode == "scan":
        # Answers were extracted (an agreed scan's logged text, twice), yet no SAR.
        assert decoded
        assert c["sar"] is None and c["sar_note"] == "n/a: a scan has no replay text"
    elif mode == "scan_then_decode":
        assert 0 < c["sar"]["n"] == len(decoded) < len(trace_ids)
        assert c["sar_note"].startswith("decoded traces only")
    else:
        assert c["sar"]["n"] == len(trace_ids) and c["sar_note"] is None
    report = client.get(f"/v1/replays/{run['id']}/report", headers=admin).json()
    assert report["comparisons"][0] == c

    page = signed_in.get(f"/ui/runs/{run['id']}").text
    cell = _text(_section(page, r'<tr id="comparison-0">.*?<td class="sar">(.*?)</td>'))
    if c["sar"] is None:
        assert cell == c["sar_note"] and "%" not in cell
    else:
        assert cell == " ".join(x for x in (_prop_text(c["sar"]), c["sar_note"]) if x)

    # The trace page of an exact trace with answers: no answer agreement for a scan either.
    exact = next((x for x in items if x["exact_match"] and x["semantic"] is not None), None)
    assert exact is not None or mode == "scan_then_decode"
    if exact is not None:
        url = f"/ui/runs/{run['id']}/traces/{exact['trace_id']}?comparison=0"
        answers = _text(_section(signed_in.get(url).text, r"<tr[^>]*><th>Answers(.*?)</tr>"))
        if mode == "scan":
            assert answers.endswith("n/a: a scan has no replay text") and "agree" not in answers
        else:
            assert answers.endswith("→ agree")

    rows = _csv(client, run["id"], admin)
    assert {r.mode for r in rows} == {mode}
    assert any(r.semantic_agree is not None for r in rows) is (mode != "scan")

    r, _, summary, _ = cli_replay(
        client, admin, trace_ids, {"dtype": "fp16"}, fake_model_dir, tmp_path, monkeypatch,
        "--mode", mode, *control,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    printed = json.loads(summary.read_text())
    assert printed.pop("traces") == len(trace_ids) and printed.pop("target")["dtype"] == "fp16"
    assert printed.pop("comparisons") == run["statistics"]["comparisons"]  # the check's too
    reproduction, er = printed.pop("reproduction"), run["statistics"]["engine_reproduction"]
    # The same check, but the CLI names traces by their external ids (it stores none).
    assert [t["external_id"] for t in reproduction.pop("not_reproduced")] == [
        t["external_id"] for t in er.pop("not_reproduced")
    ]
    assert reproduction == er
    assert printed.pop("interrupted") is False and printed == c
    check_cli_table(r.output, c)


#: Near misses (both arms' gates fire where C runs), a flip at the gate, one in the body.
BOTH_ARMS_PLANS = [
    _plan(near_miss=2),
    _plan(flip=Flip(2, (3e-4, 1.5e-4), "head", stops=False), near_miss=4),
    _plan(7, flip=Flip(1, (0.05, 0.1), "body", stops=True)),
    _plan(flip=Flip(3, (1e-5, 0.0), "head", stops=False)),
]


@pytest.mark.usefixtures("planned_engines")
def test_a_both_arms_comparison_shows_both_gates_everywhere(
    client: TestClient,
    runner: HoldingRunner,
    admin: dict[str, str],
    signed_in: TestClient,
    fake_model_dir: Path,
) -> None:
    """The paper's both-arms protocol (the demo's second run): each arm's gate trigger rate on
    the API, /report, the UI run page, the export and the demo's table; the trace page's
    margin track names each arm by what it is, not "logged"/"replayed"."""
    from rich.console import Console

    from replay_audit.cli.demo import _print_run
    from replay_audit.replays.schemas import ReplayRead

    trace_ids = seed_traces(client, admin, BOTH_ARMS_PLANS, fake_model_dir)
    names = ("bf16", "fp16", "bf16+C", "fp16+C")
    body = {
        "trace_ids": trace_ids,
        "targets": [PAIRWISE_TARGETS[k] for k in names],
        "compare": "pairwise",
        "pairs": [[0, 1], [2, 3]],
    }
    run = replay(client, runner, admin, body)
    comparisons = run["statistics"]["comparisons"]
    c = comparisons[1]  # BF16 + C vs FP16 + C: both arms' gates fire
    assert c["gate_triggers_a"] > 0 and c["gate_triggers"] > 0
    assert c["trigger_rate_a"] == c["gate_triggers_a"] / c["steps_a"] != c["trigger_rate"]
    report = client.get(f"/v1/replays/{run['id']}/report", headers=admin).json()
    assert report["comparisons"] == comparisons

    page = signed_in.get(f"/ui/runs/{run['id']}").text
    for x in comparisons:
        cell = _text(
            _section(page, rf'<tr id="comparison-{x["index"]}">.*?<td class="gate">(.*?)</td>')
        )
        b = f"{pct(x['trigger_rate'], 2)} {x['gate_triggers']}/{x['steps']} steps"
        if x["steps_a"] is None:  # the reproduction check: arm A is the logged tokens
            assert x["a"] == "logged" and cell == b
            continue
        a = f"{pct(x['trigger_rate_a'], 2)} {x['gate_triggers_a']}/{x['steps_a']} steps"
        assert cell == f"arm A {a} arm B {b}"

    rows = [r for r in _csv(client, run["id"], admin) if r.comparison == 1 and r.ok]
    assert sum(r.gate_triggers_a or 0 for r in rows) == c["gate_triggers_a"]
    assert all(r.trigger_rate_a == (r.gate_triggers_a or 0) / (r.n_steps_a or 1) for r in rows)
    # The run page's results table: each result's gate firings in both arms.
    listed = signed_in.get(f"/ui/runs/{run['id']}?comparison=1").text
    table = _text(
        _section(listed, r'<table class="data" id="results-table">.*?<tbody>(.*?)</tbody>')
    )
    assert sorted(re.findall(r"A \d+ · B \d+", table)) == sorted(
        f"A {r.gate_triggers_a} · B {r.gate_triggers}" for r in rows
    )

    console = Console(file=io.StringIO(), width=200)
    _print_run(console, ReplayRead.model_validate(run), "both arms")
    printed = console.file.getvalue()  # type: ignore[attr-defined]
    for x in comparisons:
        if x["trigger_rate_a"] is None:  # the reproduction check: arm A is the logged tokens
            assert x["a"] == "logged" and f"{100 * x['trigger_rate']:.2f}%" in printed
            continue
        assert f"A {100 * x['trigger_rate_a']:.2f}% · B {100 * x['trigger_rate']:.2f}%" in printed
    er = run["statistics"]["engine_reproduction"]
    assert (
        f"reproduced in their own logged configuration: {er['reproduced']['successes']}" in printed
    )

    diverged = next(
        x for x in all_results(client, run["id"], admin)
        if x["comparison"] == 0 and x["exact_match"] is False
    )  # fmt: skip
    trace = signed_in.get(f"/ui/runs/{run['id']}/traces/{diverged['trace_id']}?comparison=0")
    label_a, label_b = comparisons[0]["label"].split(" vs ")
    legend = re.findall(r'class="legend legend-\w+"[^>]*>([^<]*)<', trace.text)[::-1]
    assert legend == [f"arm A: {label_a}"[:30], f"arm B: {label_b}"[:30], "gate fired"]
    assert "logged arm" not in trace.text and "replayed arm" not in trace.text


@pytest.mark.usefixtures("planned_engines")
def test_no_lift_for_a_self_comparison_and_report_lifts_are_the_stored_ones(
    client: TestClient,
    runner: HoldingRunner,
    admin: dict[str, str],
    signed_in: TestClient,
    fake_model_dir: Path,
    db_url: str,
) -> None:
    """A self comparison (arm B the trace's own logged configuration) is a reproducibility
    check: no lift on the API, /report, the UI (nor its default pair) or the demo's lines, in
    a run against the logged tokens and in a pairwise one. /report's lifts are the run's
    stored statistics' (recomputed at another list limit: the same figures)."""
    from rich.console import Console
    from sqlalchemy import select

    from replay_audit.cli.demo import _print_run
    from replay_audit.db.unit_of_work import session_scope
    from replay_audit.replays.models import ReplayRun
    from replay_audit.replays.schemas import ReplayRead

    trace_ids = seed_traces(client, admin, EVERY_FEATURE, fake_model_dir)
    pairwise = {
        "trace_ids": trace_ids,
        "targets": [{"dtype": "bf16"}, {"dtype": "fp16"}],
        "compare": "pairwise",
        "compare_with": "self",
        "pairs": [[0, 1], [0, 2], [1, 0], [1, 2]],
    }
    for body in (ALL_LOGGED.request(trace_ids), pairwise):
        run = replay(client, runner, admin, body)
        stats = run["statistics"]
        selfs = {c["index"] for c in stats["comparisons"] if run["targets"][c["b"]].get("self")}
        assert selfs and not any(stats["comparisons"][i]["treatment"] for i in selfs)
        lifted = [lf["comparison_b"] for lf in stats["lifts"]]
        assert lifted and not selfs & set(lifted)

        report = client.get(f"/v1/replays/{run['id']}/report", headers=admin).json()
        with session_scope(db_url) as s:
            stored = s.scalar(select(ReplayRun.aggregate).where(ReplayRun.public_id == run["id"]))
        assert stored is not None and report["lifts"] == stored["lifts"] == stats["lifts"]
        listed = ("fixed_traces", "broke_traces", "fixed_more", "broke_more")
        other = client.get(f"/v1/replays/{run['id']}/report?list_limit=1", headers=admin).json()
        assert [{k: v for k, v in lf.items() if k not in listed} for lf in other["lifts"]] == [
            {k: v for k, v in lf.items() if k not in listed} for lf in stored["lifts"]
        ]

        page = signed_in.get(f"/ui/runs/{run['id']}").text
        lifts_table = _section(page, r'<section class="card" id="lifts">.*?<tbody>(.*?)</tbody>')
        assert [int(b) for b in re.findall(r"b=(\d+)&amp;kind=fixed", lifts_table)] == lifted
        pick_b = _section(page, r'<select name="b">(.*?)</select>')
        assert re.findall(r'<option value="(\d+)" selected>', pick_b) == [str(lifted[0])]

        console = Console(file=io.StringIO(), width=300)
        _print_run(console, ReplayRead.model_validate(run), "lifts")
        printed = console.file.getvalue()  # type: ignore[attr-defined]
        assert printed.count("EAR lift of") == len(lifted)
        for i in selfs:
            assert f"EAR lift of [{stats['comparisons'][i]['label']}]" not in printed
