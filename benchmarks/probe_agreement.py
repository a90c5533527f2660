"""Issue 32: do the categories from the teacher-forced single-step probe agree with the
from-scratch rule? Traces of a checkpoint logged by transformers' own `generate()` (one prompt a
call, `replay_audit.engine.generate`) or read from a traces JSONL (`e2e_audit.py prepare`'s),
replayed in another format through the one pipeline (`replay_items` against the logged tokens,
scans batched as a replay job's) once per probe kind and mode; per flip, both kinds' t*,
category and probe tokens; every disagreement listed; the seconds each kind took (one run);
the flips by arm B's margin at t* in ulps (the two probes can only differ within about an ulp
of a tie) and the agreement on the flips beyond 1 ulp; and what a fallback would give that
probed from scratch every flip whose teacher-forced probe (either arm's) is within N ulps of a
tie (`fallback`: per N, the flips it would send from scratch, the agreement then, and their
from-scratch probes' cost: this run's from-scratch seconds beyond the teacher-forced ones, a
flip; `fallback_b`: gated on arm B's probe alone).

    python benchmarks/probe_agreement.py --model .models/smollm2-135m-instruct --device cpu \\
        --prompts 16 --tokens 32 --modes scan decode --out /tmp/probe.json
    python benchmarks/probe_agreement.py --model .models/e2e/model \\
        --traces .models/e2e/traces.jsonl --limit 256 --device cuda --modes scan decode

Prints one JSON object (and writes it to --out). Measured, never asserted.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from replay_audit.engine import EnginePool, Target
from replay_audit.replays.domain import LoggedTrace, ReplayOutcome, RunTarget
from replay_audit.replays.pipeline import ReplayItem, ReplayOptions, replay_items, scan_items
from replay_audit.traces.schemas import TraceCreate

KINDS = ("from_scratch", "teacher_forced")


def _prompts(n: int) -> list[tuple[str | None, str]]:
    path = Path(__file__).parent.parent / "replay_audit/assets/prompts.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [(str(r["id"]), str(r["prompt"])) for r in rows[:n]]


def _traces(args: argparse.Namespace) -> list[LoggedTrace]:
    if args.traces is not None:
        lines = args.traces.read_text().splitlines()[: args.limit]
        bodies = [json.loads(x) for x in lines if x.strip()]
    else:
        from replay_audit.engine.generate import generate_traces

        bodies = list(
            generate_traces(
                args.model,
                _prompts(args.prompts),
                dtype=args.logged,
                max_new_tokens=args.tokens,
                device=args.device,
            )
        )
    return [LoggedTrace.from_json(TraceCreate.model_validate(b).model_dump()) for b in bodies]


def _flip(o: ReplayOutcome) -> dict[str, Any]:
    s = o.single_step
    return {
        "t_star": o.first_divergence_step,
        "category": o.category,
        "probe_a": s.a.token if s is not None and s.a is not None else None,
        "probe_b": s.b.token if s is not None else None,
        "margin_b": o.b.margin.abs if o.b.margin is not None else None,
        "margin_b_ulps": _ulps(o),
        "probe_ulps": _probe_ulps(o),
    }


def _ulps(o: ReplayOutcome) -> float | None:
    """Arm B's margin at t* (its own run's) in ulps of its lm_head format."""
    return o.b.margin.ulps if o.b.margin is not None else None


def _probe_ulps(o: ReplayOutcome, sides: str = "ab") -> float | None:
    """The smaller of the probe margins at t* of `sides` (ulps of each arm's format): how near
    a tie the probe's own choices are. None: a probe without a margin (a logged token)."""
    s = o.single_step
    if s is None:
        return None
    chosen = [c for side, c in (("a", s.a), ("b", s.b)) if side in sides]
    found = [c.margin.ulps for c in chosen if c is not None and c.margin is not None]
    known = [u for u in found if u is not None]
    return min(known) if known else None


#: Upper edges (ulps) of the fallback table: exact ties, then within 1, 2 and 4 ulps.
FALLBACK_EDGES = (0.0, 1.0, 2.0, 4.0)


def _fallback(
    pairs: list[tuple[ReplayOutcome, bool]],
    flips: int,
    agree: int,
    per_flip_s: float,
    sides: str = "ab",
) -> dict[str, dict[str, float | int | None]]:
    """Per edge N: flips whose teacher-forced probe (of `sides`) is within N ulps (they would
    be probed from scratch, so they agree by construction), the agreement then, their cost."""
    out: dict[str, dict[str, float | int | None]] = {}
    for e in FALLBACK_EDGES:
        near = [same for tf, same in pairs if (u := _probe_ulps(tf, sides)) is not None and u <= e]
        mended = sum(1 for same in near if not same)
        out[f"<={e:g}"] = {
            "flips_from_scratch": len(near),
            "agreement": round((agree + mended) / flips, 4) if flips else None,
            "from_scratch_s": round(len(near) * per_flip_s, 2),
        }
    return out


#: Upper edges (ulps) of the histogram of arm B's margin at t* over the flips.
MARGIN_EDGES = (0.0, 1.0, 2.0, 4.0, 8.0)


def _margin_histogram(flips: list[ReplayOutcome]) -> dict[str, int]:
    """Flips by arm B's margin at t*: exactly 0, then up to each edge, then above; unknown.
    Where the two probes can disagree (within an ulp of a tie) against where they cannot."""
    out = {f"<={e:g}": 0 for e in MARGIN_EDGES} | {f">{MARGIN_EDGES[-1]:g}": 0, "unknown": 0}
    for o in flips:
        u = _ulps(o)
        key = (
            "unknown"
            if u is None
            else next((f"<={e:g}" for e in MARGIN_EDGES if u <= e), f">{MARGIN_EDGES[-1]:g}")
        )
        out[key] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--traces", type=Path, help="a traces JSONL (default: generate them)")
    ap.add_argument("--limit", type=int, default=None, help="first N traces of --traces")
    ap.add_argument("--prompts", type=int, default=16, help="bundled prompts to generate from")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--logged", default="bf16", help="the generating format (default bf16)")
    ap.add_argument("--target", default="fp16", help="the replay format (default fp16)")
    ap.add_argument("--modes", nargs="+", default=["scan", "decode"])
    ap.add_argument("--decode-window", type=int, default=None, help="decode mode: stop t*+N")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each kind (the last timed)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    t0 = time.perf_counter()
    traces = _traces(args)
    result: dict[str, Any] = {
        "model": str(args.model),
        "traces": len(traces),
        "logged": args.logged,
        "target": args.target,
        "load_and_generate_s": round(time.perf_counter() - t0, 1),
        "modes": {},
    }
    pool = EnginePool(device=args.device)
    for mode in args.modes:
        items = [ReplayItem(t, RunTarget(Target(args.target)), args.model) for t in traces]
        runs: dict[str, list[Any]] = {}
        seconds: dict[str, float] = {}
        window = args.decode_window if mode == "decode" else None
        for kind in KINDS * args.repeat:  # the last run of each kind is the one timed
            options = ReplayOptions(
                mode,  # type: ignore[arg-type]
                check_weights=False,
                decode_window=window,
                single_step=kind,  # type: ignore[arg-type]
            )
            t = time.perf_counter()
            scans = scan_items(items, pool, options).runs  # batched, as a replay job scans
            runs[kind] = replay_items(items, pool, options, scans=scans)
            seconds[kind] = round(time.perf_counter() - t, 2)
        flips = agree = beyond = beyond_agree = 0
        flipped: list[ReplayOutcome] = []
        probed: list[tuple[ReplayOutcome, bool]] = []  # teacher-forced outcome, agrees
        disagreements = []
        pairs = zip(traces, runs["from_scratch"], runs["teacher_forced"], strict=True)
        for n, (trace, fs, tf) in enumerate(pairs):
            if not isinstance(fs, ReplayOutcome) or not isinstance(tf, ReplayOutcome):
                disagreements.append({"trace": trace.external_id or n, "error": f"{fs!r} / {tf!r}"})
                continue
            if fs.first_divergence_step is None:
                continue
            flips += 1
            flipped.append(fs)
            a, b = _flip(fs), _flip(tf)
            same = (a["t_star"], a["category"]) == (b["t_star"], b["category"])
            u = _ulps(fs)
            if u is not None and u > 1.0:  # beyond an ulp of a tie: the probes should agree
                beyond += 1
                beyond_agree += same
            probed.append((tf, same))
            if same:
                agree += 1
            else:
                disagreements.append(
                    {"trace": trace.external_id or n, "from_scratch": a, "teacher_forced": b}
                )
        extra = max(seconds["from_scratch"] - seconds["teacher_forced"], 0.0)
        cats: dict[str, dict[str, int]] = {k: {} for k in KINDS}
        for kind in KINDS:
            for o in runs[kind]:
                if isinstance(o, ReplayOutcome) and o.category not in (None, "agreed"):
                    cats[kind][str(o.category)] = cats[kind].get(str(o.category), 0) + 1
        result["modes"][mode] = {
            "decode_window": window,
            "flips": flips,
            "categories_agree": agree,
            "agreement": round(agree / flips, 4) if flips else None,
            "categories": cats,
            "margin_b_ulps_at_t_star": _margin_histogram(flipped),
            "beyond_1_ulp": {"flips": beyond, "categories_agree": beyond_agree},
            # A from-scratch probe's cost: what the from-scratch run took beyond the
            # teacher-forced one (both replay the same traces), a flip.
            "fallback": _fallback(probed, flips, agree, extra / max(flips, 1)),
            # The same, gated on arm B's probe alone (arm A, the logged format, is at an
            # exact tie at most flips of a coarse format: BF16's ties are what flip).
            "fallback_b": _fallback(probed, flips, agree, extra / max(flips, 1), "b"),
            "seconds": seconds,
            "disagreements": disagreements,
        }
        print(json.dumps({mode: result["modes"][mode]}), flush=True)
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
