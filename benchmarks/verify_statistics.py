"""Provider audit (issues 23 and 34): the decision rules compared on one set of per-token
evidence, calibrated as the service calibrates (`stats.verification.calibrate` on the null that
`verifications.null` generates: plain transformers generate(), distinct prompts batched as each
variation's name says), then judged on simulated providers of other prompts.

    python benchmarks/verify_statistics.py --model replay_audit/assets/tiny-llama --device cpu \
        --null-prompts 64 --eval-prompts 48 --max-new-tokens 96 --save /tmp/evidence.pkl

Rules: `outside_tie_band` (the tie band alone at the false-alarm rate) and
`tie_band_or_mean_deficit` (either statistic over its own threshold, each at half the rate,
`stats.verification.RULE_STATISTICS`). Per simulation and budget (up to the null's reach):
the share of its groups (drawn as the calibration draws them) each rule calls inconsistent;
for a benign one that share is a false-alarm rate, for the others the power. Benign
simulations: the null's variations on other prompts, and FP32 at batch 1 (not in the null).
`--load` re-analyses a saved run without generating.
"""

from __future__ import annotations

import argparse
import contextlib
import pickle
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from replay_audit.engine import EnginePool, Intervention, Target
from replay_audit.engine.testing import rtn_checkpoint
from replay_audit.screenings.sweep.outputs import ScreenPrompt
from replay_audit.screenings.sweep.worker import TorchFacts
from replay_audit.stats.verification import (
    RULE_STATISTICS,
    Calibration,
    calibrate,
    draw_groups,
)
from replay_audit.verifications.null import (
    BENIGN_VARIATIONS,
    NullTrace,
    NullVariation,
    _scan,
    generate,
)

#: Per simulation: one array of deficits in ulps per trace.
Evidence = list[np.ndarray]
CLAIM = Target("bf16", None, "sdpa", 1, Intervention())
#: Simulations that are benign (their flagged share is a false-alarm rate).
BENIGN = ("honest bf16 b1", "fp16 b1", "bf16 b8", "bf16 eager b1", "fp16 eager b8", "fp32 b1")


def _fp8_kv(model_dir: Path, prompts: list[ScreenPrompt], n: int, device: str) -> list[NullTrace]:
    """A provider with an FP8 (e4m3) KV cache (`engine.testing.fp8_kv_cache`), batch 1."""
    from replay_audit.engine.generate import TraceGenerator
    from replay_audit.engine.testing import fp8_kv_cache

    with TraceGenerator(model_dir, dtype="bf16", device=device) as g, fp8_kv_cache(g.model):
        return [
            NullTrace(list(p.token_ids), g.generate_ids(list(p.token_ids), n)[0]) for p in prompts
        ]


def measure(args: argparse.Namespace) -> dict[str, dict[str, Evidence]]:
    rows: list[Any]
    if args.stdlib_prompts:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from verify_scale import stdlib_prompts

        rows = stdlib_prompts(args.model, args.stdlib_prompts)
    else:
        import json

        path = args.model.parent / "prompts.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    random.Random(args.shuffle_prompts).shuffle(rows)
    facts = TorchFacts(args.model, args.device)
    device = facts.platform().device
    prompts = facts.prompts(rows[: args.null_prompts + args.eval_prompts])  # type: ignore[arg-type]
    null_p, eval_p = prompts[: args.null_prompts], prompts[args.null_prompts :]
    pool = EnginePool(device=device, devices=1)
    eos, n, m = facts.eos_ids(), args.max_new_tokens, args.model
    t0 = time.time()

    def run(v: NullVariation, ps: list[ScreenPrompt], model: Path = m) -> list[NullTrace]:
        return generate(v, ps, n, pool, model, eos, device=device)

    data: dict[str, dict[str, Evidence]] = {"null": {}, "sims": {}, "alt": {}}
    for v in BENIGN_VARIATIONS:
        data["null"][v.key] = _scan(run(v, null_p), CLAIM, pool, m)
        print(f"null {v.key}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rtn4 = rtn_checkpoint(m, root / "rtn4", bits=4)
        data["alt"]["4-bit RTN"] = _scan(run(NullVariation("bf16"), null_p, rtn4), CLAIM, pool, m)
        sims: dict[str, Callable[[], list[NullTrace]]] = {
            "honest bf16 b1": lambda: run(NullVariation("bf16"), eval_p),
            "fp16 b1": lambda: run(NullVariation("fp16"), eval_p),
            "bf16 b8": lambda: run(NullVariation("bf16", batch_size=8), eval_p),
            "bf16 eager b1": lambda: run(NullVariation("bf16", "eager"), eval_p),
            "fp16 eager b8": lambda: run(NullVariation("fp16", "eager", batch_size=8), eval_p),
            "fp32 b1": lambda: run(NullVariation("fp32"), eval_p),
            "8-bit RTN": lambda: run(
                NullVariation("bf16"), eval_p, rtn_checkpoint(m, root / "rtn8", bits=8)
            ),
            "4-bit RTN": lambda: run(NullVariation("bf16"), eval_p, rtn4),
            "FP8 KV cache": lambda: _fp8_kv(m, eval_p, n, device),
        }
        for name, make in sims.items():
            with contextlib.suppress(RuntimeError):
                data["sims"][name] = _scan(make(), CLAIM, pool, m)
            print(f"{name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return data


def flagged(
    cal: Calibration, traces: Evidence, budget: int, draws: int, seed: int
) -> dict[str, float]:
    """The share of `draws` groups of `budget` tokens of `traces` each rule calls inconsistent."""
    scores = {s: [cal.scorer.scores(u, s) for u in traces if len(u)] for s in RULE_STATISTICS}
    groups = draw_groups(scores, budget, draws, np.random.default_rng(seed))
    single = cal.at(budget, "outside_tie_band").threshold
    rule = cal.rule_at(budget)
    either = np.logical_or.reduce([groups[s] > rule.thresholds[s] for s in RULE_STATISTICS])
    return {
        "outside_tie_band": float((groups["outside_tie_band"] > single).mean()),
        "tie_band_or_mean_deficit": float(either.mean()),
    }


def analyse(data: dict[str, dict[str, Evidence]], draws: int, rate: float) -> None:
    cal = calibrate(
        data["null"],
        data["alt"]["4-bit RTN"],
        weights_sha256="bench",
        claim={"dtype": "bf16", "lm_head_dtype": "bf16", "attn_kernel": "sdpa"},
        platform={"device": "?", "gpu_name": None, "sm": None, "torch_version": None, "devices": 1},
        false_alarm_rate=rate,
        draws=draws,
    )
    reach = cal.reach or 0
    budgets = [b.tokens for b in cal.budgets["outside_tie_band"] if b.tokens <= reach]
    tokens = {k: sum(len(u) for u in v) for k, v in data["null"].items()}
    print(f"# null: {tokens} tokens per variation; reach {reach}; {draws} draws; rate {rate}")
    print("| simulation | rule | " + " | ".join(str(b) for b in budgets) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in budgets) + " |")
    worst: dict[str, float] = {"outside_tie_band": 0.0, "tie_band_or_mean_deficit": 0.0}
    for i, (name, traces) in enumerate(data["sims"].items()):
        rows = [flagged(cal, traces, b, draws, 1000 * i + j) for j, b in enumerate(budgets)]
        for rule in worst:
            print(f"| {name} | {rule} | " + " | ".join(f"{r[rule]:.3f}" for r in rows) + " |")
            if name in BENIGN:
                worst[rule] = max(worst[rule], *(r[rule] for r in rows))
    print(f"# worst benign false-alarm rate at any budget: {worst}")
    for b, r in zip(cal.budgets["outside_tie_band"], cal.rule, strict=True):
        if b.tokens <= reach:
            print(
                f"# {b.tokens}: tie band threshold {b.threshold:.4g} (power {b.power}); rule "
                f"{ {k: round(v, 4) for k, v in r.thresholds.items()} } (power {r.power})"
            )


def reach_simulation(nulls: int = 20, traces: int = 128, seed: int = 0) -> None:
    """How the false-alarm rate moves with the budget against the null's size (the reach rule,
    docs/verify.md "How far a null reaches"), on synthetic heterogeneous traces of 128 tokens,
    each flipping (1 ulp) at its own Beta(0.5, 20) rate: `nulls` nulls of `traces` traces, the
    99% threshold of each, 1,000 fresh groups each from a population of 20,000 other traces."""
    from replay_audit.stats.verification import draw_group_scores

    rng = np.random.default_rng(seed)

    def het(n: int) -> list[np.ndarray]:
        return [np.where(rng.random(128) < rng.beta(0.5, 20), 1.0, 0.0) for _ in range(n)]

    population, size = het(20000), traces * 128
    rates: dict[float, list[float]] = {}
    for _ in range(nulls):
        null = het(traces)
        for frac in (1 / 16, 1 / 4, 1 / 2, 1, 2, 8):
            b = int(size * frac)
            q = np.quantile(draw_group_scores(null, b, 1000, rng), 0.99, method="higher")
            fresh = draw_group_scores(population, b, 1000, rng)
            rates.setdefault(frac, []).append(float((fresh > q).mean()))
    for frac, r in rates.items():
        print(
            f"budget {frac:g} x the null's tokens: false alarms {np.mean(r):.3f} on average, "
            f"{max(r):.3f} at worst over {nulls} nulls"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=Path("replay_audit/assets/tiny-llama"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--stdlib-prompts", type=int, default=0, help="instead of the bundled ones")
    ap.add_argument("--shuffle-prompts", type=int, default=0, metavar="SEED")
    ap.add_argument("--null-prompts", type=int, default=64)
    ap.add_argument("--eval-prompts", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--draws", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--false-alarm-rate", type=float, default=0.01)
    ap.add_argument("--save", type=Path, default=None, help="keep the evidence here (pickle)")
    ap.add_argument("--load", type=Path, default=None, help="analyse a saved run instead")
    ap.add_argument(
        "--reach-simulation", action="store_true", help="only the reach rule's synthetic check"
    )
    args = ap.parse_args()
    if args.reach_simulation:
        reach_simulation()
        return
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.load is not None:
        data = pickle.loads(args.load.read_bytes())
    else:
        data = measure(args)
        if args.save is not None:
            args.save.write_bytes(pickle.dumps(data))
    analyse(data, args.draws, args.false_alarm_rate)


if __name__ == "__main__":
    main()
