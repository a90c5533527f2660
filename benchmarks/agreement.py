"""Cross-format agreement and the paper's interventions on a checkpoint (both-arms protocol):
EAR of arm A vs arm B with no intervention, A, B (K = 2, 8) and C, each lift, trigger rates,
how often B's output equals C's, and the per-prompt categories of the baseline divergences.

    python benchmarks/agreement.py --model replay_audit/assets/tiny-llama \\
        --prompts replay_audit/assets/prompts.jsonl --device cpu --threads 1
    python benchmarks/agreement.py ... --a bf16 --b bf16:fp8_e4m3 --tau-ulps 1 2 4   # FP8 head

Arms are `dtype[:lm_head_dtype]`. Prints one JSON object. Measured, never asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from replay_audit.diff import first_divergence
from replay_audit.engine import EnginePool, Intervention, Target
from replay_audit.replays.domain import LoggedTrace
from replay_audit.replays.models import ReplayResult
from replay_audit.replays.pipeline import compare_arms
from replay_audit.replays.results import figures as result_figures
from replay_audit.replays.results import result_values
from replay_audit.stats.report import ComparisonInput, run_statistics
from replay_audit.traces.schemas import TraceCreate


def arm(spec: str, iv: Intervention) -> Target:
    dtype, _, head = spec.partition(":")
    return Target(dtype, head or None, "sdpa", 1, iv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, help='JSONL {"id","prompt"}; default: byte prompts')
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--a", default="bf16")
    ap.add_argument("--b", default="fp16")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--tau", type=float, default=1e-3)
    ap.add_argument("--tau-ulps", type=float, nargs="*", default=[])
    ap.add_argument("--configs", nargs="*", default=None, help="subset, e.g. none C")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    pool = EnginePool(device=args.device)
    base_a = pool.get(args.model, arm(args.a, Intervention()))
    tok: Any = base_a.tokenizer  # type: ignore[attr-defined]
    if args.prompts:
        rows = [json.loads(x) for x in args.prompts.read_text().splitlines() if x.strip()]
        prompts = [(str(r["id"]), tok(r["prompt"])["input_ids"]) for r in rows]
    else:
        prompts = [
            (f"p{i}", [(i * 37 + j * 11) % 250 + 1 for j in range(8 + i % 9)]) for i in range(40)
        ]
    prompts = prompts[: args.limit] if args.limit else prompts
    eos = [int(tok.eos_token_id)] if tok is not None and tok.eos_token_id is not None else []
    sha = pool.weights_sha256(args.model)
    n = args.max_new_tokens

    configs: list[tuple[str, Intervention]] = [
        ("none", Intervention("none", tau=args.tau)),
        ("A", Intervention("A", tau=args.tau)),
        ("B_K2", Intervention("B", tau=args.tau, top_k=2)),
        ("B_K8", Intervention("B", tau=args.tau, top_k=8)),
        ("C", Intervention("C", tau=args.tau)),
        ("C_ungated", Intervention("C", tau=0.0)),
    ]
    if args.configs:
        configs = [c for c in configs if c[0] in args.configs]
    configs += [(f"C_{k:g}ulps", Intervention("C", tau_ulps=k)) for k in args.tau_ulps]
    assert configs[0][0] == "none", "the baseline (none) is always measured first"
    outputs: dict[str, list[tuple[list[int], list[int]]]] = {}
    report: dict[str, Any] = {
        "model": str(args.model),
        "device": torch.cuda.get_device_name() if base_a.device.type == "cuda" else "cpu",  # type: ignore[attr-defined]
        "arms": [args.a, args.b],
        "n_prompts": len(prompts),
        "max_new_tokens": n,
        "tau": args.tau,
        "torch": torch.__version__,
    }
    for name, iv in configs:
        ea, eb = pool.get(args.model, arm(args.a, iv)), pool.get(args.model, arm(args.b, iv))
        pairs, exact, fired, steps, changed = [], 0, 0, 0, 0
        for _, p in prompts:
            ra, rb = ea.decode(p, n, eos, iv), eb.decode(p, n, eos, iv)
            pairs.append((ra.output_token_ids, rb.output_token_ids))
            exact += first_divergence(ra.output_token_ids, rb.output_token_ids) is None
            for r in (ra, rb):
                fired += int(r.steps.gate_fired.sum())
                steps += len(r.steps)
                changed += int(r.steps.changed.sum())
        outputs[name] = pairs
        report[name] = {
            "ear": exact / len(prompts),
            "exact": exact,
            "trigger_rate": fired / steps,
            "changed_steps": changed,
        }
        print(
            f"{name:12s} EAR {exact}/{len(prompts)}  trigger {fired / steps:.2%}", file=sys.stderr
        )
    for name, _ in configs[1:]:
        report[name]["lift"] = report[name]["ear"] - report["none"]["ear"]
    for k in (k for k in ("B_K2", "B_K8") if k in outputs and "C" in outputs):
        report[k]["same_outputs_as_C"] = sum(
            b == c for b, c in zip(outputs[k], outputs["C"], strict=True)
        )

    # categories of the baseline divergences (the paper's per-prompt stratification)
    figures = []
    for i, (pid, p) in enumerate(prompts):
        trace = TraceCreate.model_validate(
            {
                "external_id": pid,
                "model": {
                    "name": args.model.name,
                    "weights_sha256": sha,
                    "vocab_size": base_a.vocab_size,
                },
                "config": {"dtype": args.a.split(":")[0]},
                "decoding": {"max_new_tokens": n, "eos_token_ids": eos, "stop_reason": "length"},
                "prompt_token_ids": p,
                "output_token_ids": [0],
            }
        )
        cmp = compare_arms(
            LoggedTrace.from_json(trace.model_dump()),
            arm(args.a, configs[0][1]),
            arm(args.b, configs[0][1]),
            pool,
            model_dir=args.model,
        )
        row = ReplayResult(trace_id=i, **result_values(0, cmp))
        figures.append(result_figures(row, pid, pid))
    # the run statistics builder, as every surface of the service uses it
    s = run_statistics("benchmark", [ComparisonInput(0, 0, 1, "a vs b", False, figures)])
    c = s.comparisons[0]
    report["baseline_categories"] = {k: v.successes for k, v in c.categories.items()}
    report["baseline_t_star"] = (
        c.first_divergence_step.model_dump() if c.first_divergence_step else None
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
