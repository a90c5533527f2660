"""Scan fidelity on a trained model that diverges (issue 13): does the batched scan find what the
bs=1 scan finds, and does the scan flag the traces whose decode replay diverges?

    python benchmarks/fidelity.py --model .models/py-12x768 --device cuda > fidelity.json

For each pair of arms (logged format -> replay format; default bf16 -> fp16 and fp16 -> bf16):

1. logged traces: the model's greedy continuations of the prompts in the logged format, all at
   once with transformers' `generate()` (prompts cut to one length, every row `--tokens` long);
2. the replay format's batched scan of every trace (`Engine.scan_batch`, `--token-budget`) and its
   bs=1 scan (`Engine.scan`), same engine, same run: the first mismatch of each;
3. the decode replay of every trace in the replay format (`replays.pipeline.replay_trace`, mode
   decode: the engine's faithful piecewise decode, token-identical to `generate()`), with its t*,
   category and the margins, until `--decode-budget-s` runs out (the traces decoded are counted).

Reported per pair: `batched_equals_bs1` (share of traces whose batched first mismatch is the bs=1
one; target >= 99%), `scan_recall` (decode divergences the batched scan flags; target >= 95%) and
the same for the bs=1 scan, misses by category, false flags (flagged, decode exact), t* agreement
on the flagged divergences, and the miss rate a scan-then-decode run's statistics would estimate
from a control sample of the unflagged traces (`stats/report.screening_report`, every unflagged
trace decoded here, so the control is all of them). One JSON object on stdout.

Near-tie flagging (`scan_flag_ulps`, replays/pipeline.py): from the same batched scan, for each
threshold of `--flag-ulps` (default 0,1,2,4,8,16 ulps of the replay format at the top-1 logit),
a trace is flagged when the scan mismatches or some step's top-2 margin along the logged path is
at most that many ulps (`diff.first_near_tie`; the logged arm's margins are not used here: these
traces carry no logged top-k). Reported per threshold (`near_tie_sweep`): recall (decode
divergences flagged), the misses left by category, the share of all scanned traces a
scan-then-decode run would decode for the flags (mismatch + near-tie, before the control
sample), and the near-tie flags whose decode was exact (the flag's cost). Pick the smallest
threshold whose recall reaches the target at an affordable decoded share.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import build_engine

from replay_audit.diff import first_near_tie
from replay_audit.engine import EnginePool
from replay_audit.engine.protocol import DEFAULT_SCAN_TOKEN_BUDGET, ScanItem, Target
from replay_audit.replays.domain import LoggedTrace
from replay_audit.replays.pipeline import replay_trace
from replay_audit.stats.report import ComparisonInput, ResultFigures, screening_report


def prompts_ids(engine: Any, path: Path, limit: int, max_len: int) -> list[list[int]]:
    """The prompts tokenised and cut to one length (the shortest, at most `max_len`)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ids = [engine.tokenizer(r["prompt"])["input_ids"] for r in rows[:limit]]
    length = max(4, min(max_len, min(len(x) for x in ids)))
    return [x[:length] for x in ids if len(x) >= length]


def logged_outputs(
    model: Any, prompts: list[list[int]], n_new: int, device: Any
) -> list[list[int]]:
    batch = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        out = model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            do_sample=False,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            pad_token_id=0,
        )
    return [row[len(prompts[0]) :] for row in out.tolist()]


def trace(vocab: int, logged: str, prompt: list[int], out: list[int]) -> Any:
    return LoggedTrace.from_parts(
        external_id=None,
        weights_sha256="-",
        vocab_size=vocab,
        config={"dtype": logged, "attn_kernel": "sdpa"},
        decoding={"strategy": "greedy", "max_new_tokens": len(out), "stop_reason": "length"},
        prompt_token_ids=prompt,
        output_token_ids=out,
        top_k_logits=None,
    )


def pair(args: argparse.Namespace, logged: str, replay: str) -> dict[str, Any]:
    device = args.device
    log_engine = build_engine(args.model, Target(logged, attn_kernel="sdpa"), device)
    prompts = prompts_ids(log_engine, args.prompts, args.limit, args.prompt_len)
    t0 = time.perf_counter()
    outputs = logged_outputs(log_engine.model, prompts, args.tokens, log_engine.device)
    generate_s = time.perf_counter() - t0
    del log_engine
    pool = EnginePool(device=device)
    target = Target(replay, attn_kernel="sdpa")
    engine: Any = pool.get(args.model, target)
    items = [ScanItem(p, o) for p, o in zip(prompts, outputs, strict=True)]
    t0 = time.perf_counter()
    batched = engine.scan_batch(items, None, 5, token_budget=args.token_budget)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    batched_s = time.perf_counter() - t0
    shapes = engine.environment()["extras"].get("scan_batch_shapes")
    t0 = time.perf_counter()
    single = [engine.scan(it.prompt_ids, it.output_ids, None, 5) for it in items]
    single_s = time.perf_counter() - t0
    first_b = [r.first_disagreement for r in batched]
    first_1 = [r.first_disagreement for r in single]
    # The smallest margin (ulps) along the logged path, over the steps before any mismatch.
    min_ulps = [
        float(
            r.steps.margins_ulps[: r.first_disagreement or len(r.steps)].min(initial=float("inf"))
        )
        for r in batched
    ]

    decoded: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        if time.perf_counter() - t0 > args.decode_budget_s:
            break
        r = replay_trace(
            trace(engine.vocab_size, logged, p, o),
            target,
            pool,
            model_dir=args.model,
            mode="decode",
            check_weights=False,
        )
        decoded.append(
            {
                "i": i,
                "t_star": r.first_divergence_step,
                "category": r.category,
                "scan": first_b[i],
                "scan_bs1": first_1[i],
                "margin_b": r.b.margin.abs if r.b.margin else None,
                "margin_b_ulps": r.b.margin.ulps if r.b.margin else None,
                "scan_min_ulps": min_ulps[i],
            }
        )
    decode_s = time.perf_counter() - t0
    div = [d for d in decoded if d["t_star"] is not None]
    flagged = [d for d in div if d["scan"] is not None]
    flagged_1 = [d for d in div if d["scan_bs1"] is not None]
    missed = [d for d in div if d["scan"] is None]
    false_flags = [d for d in decoded if d["t_star"] is None and d["scan"] is not None]
    figures = [
        ResultFigures(
            trace_id=d["i"],
            trace_public_id=str(d["i"]),
            external_id=None,
            status="ok",
            exact_match=d["t_star"] is None,
            first_divergence_step=d["t_star"],
            category=d["category"],
            margin_a=None,
            margin_a_ulps=None,
            margin_b=None,
            margin_b_ulps=None,
            gate_triggers=None,
            n_steps=None,
            mean_gap=None,
            gate_triggers_a=None,
            n_steps_a=None,
            length_difference=None,
            answer_extractor=None,
            answer_a=None,
            answer_b=None,
            screen="flagged" if d["scan"] is not None else "control",
        )
        for d in decoded
    ]
    screening = screening_report(ComparisonInput(0, "logged", 0, "", False, figures, 1.0, 0))
    n = len(items)
    sweep = []
    for k in args.flag_ulps:
        flagged_k = [
            first_b[i] is not None or first_near_tie(batched[i].steps.margins_ulps, k) is not None
            for i in range(n)
        ]
        found = [d for d in div if flagged_k[d["i"]]]
        left = [d for d in div if not flagged_k[d["i"]]]
        near_only = [d for d in decoded if flagged_k[d["i"]] and d["scan"] is None]
        sweep.append(
            {
                "flag_ulps": k,
                "recall": len(found) / len(div) if div else None,
                "misses": len(left),
                "misses_by_category": dict(Counter(d["category"] for d in left)),
                "decoded_share": sum(flagged_k) / n,
                "near_tie_flagged": sum(flagged_k) - sum(x is not None for x in first_b),
                "near_tie_exact_among_decoded": sum(d["t_star"] is None for d in near_only),
            }
        )
    return {
        "logged": logged,
        "replay": replay,
        "traces": n,
        "prompt_tokens": len(prompts[0]),
        "output_tokens": args.tokens,
        "generate_s": generate_s,
        "scan_batched_s": batched_s,
        "scan_bs1_s": single_s,
        "scan_batch_shapes": shapes,
        "scan_flagged": sum(x is not None for x in first_b),
        "batched_equals_bs1": sum(a == b for a, b in zip(first_b, first_1, strict=True)) / n,
        "batched_differs_at": [
            {"i": i, "batched": a, "bs1": b}
            for i, (a, b) in enumerate(zip(first_b, first_1, strict=True))
            if a != b
        ],
        "decoded": len(decoded),
        "decode_s": decode_s,
        "decode_divergent": len(div),
        "decode_categories": dict(Counter(d["category"] for d in div)),
        "scan_recall": len(flagged) / len(div) if div else None,
        "scan_recall_bs1": len(flagged_1) / len(div) if div else None,
        "scan_t_star_equal": sum(d["scan"] == d["t_star"] for d in flagged) / len(flagged)
        if flagged
        else None,
        "misses": len(missed),
        "misses_by_category": dict(Counter(d["category"] for d in missed)),
        "false_flags": len(false_flags),
        "screening": screening.model_dump(mode="json") if screening is not None else None,
        "near_tie_sweep": sweep,
        "per_trace": decoded,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, default=Path("replay_audit/assets/prompts.jsonl"))
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=96, help="logged output tokens per trace")
    ap.add_argument("--device", default=None)
    ap.add_argument("--token-budget", type=int, default=DEFAULT_SCAN_TOKEN_BUDGET)
    ap.add_argument("--decode-budget-s", type=float, default=100.0, help="per pair of arms")
    ap.add_argument("--pairs", nargs="*", default=["bf16:fp16", "fp16:bf16"])
    ap.add_argument(
        "--flag-ulps",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[0.0, 1.0, 2.0, 4.0, 8.0, 16.0],
        help="near-tie thresholds to sweep, comma-separated ulps",
    )
    args = ap.parse_args()
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": str(args.model),
    }
    results = []
    for spec in args.pairs:
        logged, replay = spec.split(":")
        results.append(pair(args, logged, replay))
        r = results[-1]
        print(
            f"{logged}->{replay}: {r['traces']} traces, "
            f"batched==bs1 {r['batched_equals_bs1']:.3f}, "
            f"decoded {r['decoded']} ({r['decode_divergent']} diverge), recall {r['scan_recall']}, "
            f"misses {r['misses_by_category']}, false flags {r['false_flags']}",
            file=sys.stderr,
        )
        for row in r["near_tie_sweep"]:
            print(
                f"  flag <= {row['flag_ulps']:g} ulps: recall {row['recall']}, "
                f"decoded share {row['decoded_share']:.3f}, misses {row['misses_by_category']}",
                file=sys.stderr,
            )
    json.dump({"environment": env, "pairs": results}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
