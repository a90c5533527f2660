"""Provider audit (issue 23): candidate statistics, the service's and others, compared on one set
of per-token evidence, each calibrated as the service calibrates (`stats.verification`: groups of
exactly n tokens from bootstrap resamples of one benign variation's traces at a time, the
threshold at the highest of the variations' 99% quantiles).

    python benchmarks/verify_statistics.py --model replay_audit/assets/tiny-llama --device cpu \
        --null-prompts 128 --eval-prompts 72 --max-new-tokens 128 --tp-null \
        --save /tmp/evidence.pkl

Every statistic is a ratio of sums over a group's tokens, sum(numerator) / sum(denominator):
the service's three have denominator 1 per token; the near-tie ones divide by the tokens whose
reference top-2 margin is within tau ulps (the chances a benign rounding difference had to flip
a token), so a prompt set with more close calls does not look noisier. `--tp-null` adds TP 2 (two
gloo processes on a CPU, NCCL on two GPUs) to the null, as a two-GPU worker's null holds it.
`--load` re-analyses a saved run without generating.
"""

from __future__ import annotations

import argparse
import pickle
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from replay_audit.diff.deficit import token_deficits
from replay_audit.engine import EnginePool, Intervention, Target
from replay_audit.engine.protocol import ScanItem
from replay_audit.engine.testing import rtn_checkpoint, variant_checkpoint
from replay_audit.formats import ulp_array
from replay_audit.screenings.sweep.plan import ScreenConfig
from replay_audit.screenings.sweep.worker import TorchBackend
from replay_audit.stats.verification import (
    Statistic,
    TokenScorer,
    auc,
    bin_probabilities,
    draw_group_scores,
)
from replay_audit.verifications.null import BENIGN_VARIATIONS, CUDA_VARIATIONS, generate
from replay_audit.verifications.scan import claim_engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify import BUDGETS, Pairs, fp8_kv, stdlib_prompts, tensor_parallel

#: Per trace: the logged tokens' deficits and the reference's top-2 margins, in ulps.
Evidence = list[tuple[np.ndarray, np.ndarray]]
BENIGN = ("honest", "fp16", "batch 8", "eager", "TP=2")


def evidence(pool: EnginePool, model: Path, pairs: Pairs) -> Evidence:
    """The claimed BF16/sdpa scan of `pairs`: each logged token's deficit (`diff.deficit`, as
    the service computes it) and the reference's top-2 margin, in ulps at the top-1 value."""
    claim = Target("bf16", None, "sdpa", 1, Intervention())
    engine = claim_engine(pool, model, claim)
    head = engine.environment()["lm_head_dtype"]
    runs = engine.scan_batch([ScanItem(p, o, None) for p, o in pairs if o], claim.intervention, 2)
    out: Evidence = []
    for run in runs:
        assert run.evidence is not None
        top = np.asarray(run.steps.top_k_logits, dtype=np.float64)
        d = token_deficits(top[:, 0], run.evidence.logits, run.evidence.ranks, head)
        out.append((d.deficit_ulps, (top[:, 0] - top[:, 1]) / ulp_array(top[:, 0], head)))
    return out


def measure(args: argparse.Namespace) -> dict[str, dict[str, Evidence]]:
    rows = stdlib_prompts(args.model, args.stdlib_prompts)
    random.Random(args.shuffle_prompts).shuffle(rows)
    backend = TorchBackend(args.model, args.device)
    device = backend.platform().device
    prompts = backend.prompts(rows[: args.null_prompts + args.eval_prompts])  # type: ignore[arg-type]
    null_p, eval_p = prompts[: args.null_prompts], prompts[args.null_prompts :]
    pool = EnginePool(device=device, devices=1)
    n, m = args.max_new_tokens, args.model
    data: dict[str, dict[str, Evidence]] = {"null": {}, "sims": {}, "alt": {}}
    t0 = time.time()
    variations = [*BENIGN_VARIATIONS, *(CUDA_VARIATIONS if device == "cuda" else ())]
    for config in variations:
        data["null"][config.key] = evidence(pool, m, generate(backend, config, null_p, n))
        print(f"null {config.key}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    if args.tp_null:
        data["null"]["tp2"] = evidence(pool, m, tensor_parallel(m, null_p, "bf16", n, 2, device))
        print(f"null TP 2: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    base = ScreenConfig("bf16")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rtn4 = rtn_checkpoint(m, root / "rtn4", bits=4)
        # the likelihood ratio's alternative, as `benign_null` measures it: on the null prompts
        data["alt"]["4-bit RTN"] = evidence(pool, m, generate(backend, base, null_p, n, rtn4))
        sims: dict[str, Callable[[], Pairs]] = {
            "honest": lambda: generate(backend, base, eval_p, n),
            "fp16": lambda: generate(backend, ScreenConfig("fp16"), eval_p, n),
            "batch 8": lambda: generate(backend, ScreenConfig("bf16", batch_size=8), eval_p, n),
            "eager": lambda: generate(
                backend, ScreenConfig("bf16", attn_kernel="eager"), eval_p, n
            ),
            "TP=2": lambda: tensor_parallel(m, eval_p, "bf16", n, 2, device),
            "8-bit RTN": lambda: generate(
                backend, base, eval_p, n, rtn_checkpoint(m, root / "rtn8", bits=8)
            ),
            "4-bit RTN": lambda: generate(backend, base, eval_p, n, rtn4),
            "FP8 KV cache": lambda: fp8_kv(m, eval_p, "bf16", n, device),
            "swapped": lambda: generate(
                backend, base, eval_p, n, variant_checkpoint(m, root / "sw", noise=0.1, seed=1)
            ),
        }
        for name, run in sims.items():
            data["sims"][name] = evidence(pool, m, run())
            print(f"{name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return data


def statistics(data: dict[str, dict[str, Evidence]]) -> dict[str, Callable[..., tuple]]:
    """name -> (deficits, margins) -> (numerator, denominator) per token: the service's three
    statistics (`TokenScorer`, the likelihood ratio's bins from this null and a 4-bit RTN copy's
    traces on its prompts, as `benign_null` measures them), then the candidates."""
    scorer = TokenScorer(
        tuple(bin_probabilities([d for v in data["null"].values() for d, _ in v])),
        tuple(bin_probabilities([d for d, _ in data["alt"]["4-bit RTN"]])),
    )

    def service(stat: Statistic) -> Callable[..., tuple]:
        return lambda d, m: (scorer.scores(d, stat), np.ones_like(d))

    def per_tie(stat: Statistic | None, tau: float) -> Callable[..., tuple]:
        """flips (stat None) or `stat`'s token scores, over the tokens within tau ulps."""
        return lambda d, m: (
            (d > 0).astype(float) if stat is None else scorer.scores(d, stat),
            (m <= tau).astype(float),
        )

    return {
        "mean deficit": service("mean_deficit_ulps"),
        "outside the tie band": service("outside_tie_band"),
        "likelihood ratio": service("log_likelihood_ratio"),
        "flip rate": lambda d, m: ((d > 0).astype(float), np.ones_like(d)),
        "flips per near-tie (1 ulp)": per_tie(None, 1.0),
        "flips per near-tie (4 ulps)": per_tie(None, 4.0),
        "flips per near-tie (16 ulps)": per_tie(None, 16.0),
        "deficit per near-tie (4 ulps)": per_tie("mean_deficit_ulps", 4.0),
        "deficit per near-tie (16 ulps)": per_tie("mean_deficit_ulps", 16.0),
    }


def ratio_draws(traces: list[tuple], budget: int, draws: int, seed: int) -> np.ndarray:
    """Groups of `budget` tokens as `draw_group_scores` draws them, each scored
    sum(numerator) / sum(denominator): two draws from one seed pick the same tokens."""
    num = draw_group_scores([t[0] for t in traces], budget, draws, np.random.default_rng(seed))
    den = draw_group_scores([t[1] for t in traces], budget, draws, np.random.default_rng(seed))
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def analyse(data: dict[str, dict[str, Evidence]], draws: int) -> None:
    print(
        "| statistic | 4-bit RTN decided at (AUC there; AUC at 256) | FP8 KV cache decided at "
        "(AUC) | worst benign false alarm at those budgets | worst benign at any budget |"
    )
    print("| --- | --- | --- | --- | --- |")
    seeds = iter(range(10**6))
    for name, f in statistics(data).items():
        null = {k: [f(d, m) for d, m in v] for k, v in data["null"].items()}
        sims = {k: [f(d, m) for d, m in v] for k, v in data["sims"].items()}
        threshold = {
            b: max(np.quantile(ratio_draws(v, b, draws, next(seeds)), 0.99) for v in null.values())
            for b in BUDGETS
        }
        flagged: dict[str, dict[int, float]] = {}
        aucs: dict[str, dict[int, float]] = {}
        for sim, traces in sims.items():
            flagged[sim], aucs[sim] = {}, {}
            for b in BUDGETS:
                groups = ratio_draws(traces, b, draws, next(seeds))
                honest = ratio_draws(sims["honest"], b, draws, next(seeds))
                flagged[sim][b] = float((groups > threshold[b]).mean())
                aucs[sim][b] = auc(honest, groups)

        def decided(sim: str, flagged: dict[str, dict[int, float]] = flagged) -> int | None:
            return next((b for b in BUDGETS if flagged[sim][b] >= 0.95), None)

        cells = []
        for sim in ("4-bit RTN", "FP8 KV cache"):
            b = decided(sim)
            extra = f"; {aucs[sim][256]:.3f}" if sim == "4-bit RTN" else ""
            cells.append(f"{b} ({aucs[sim][b]:.3f}{extra})" if b else f"> {BUDGETS[-1]}")
        at = [decided(s) for s in ("4-bit RTN", "FP8 KV cache")]
        fa = " / ".join(
            f"{max(flagged[s][b] for s in BENIGN if s in flagged):.3f}" if b else "-" for b in at
        )
        rate, sim, b = max((flagged[s][b], s, b) for s in BENIGN if s in flagged for b in BUDGETS)
        print(f"| {name} | {cells[0]} | {cells[1]} | {fa} | {rate:.3f} ({sim} @{b}) |")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=Path("replay_audit/assets/tiny-llama"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--stdlib-prompts", type=int, default=200)
    ap.add_argument("--shuffle-prompts", type=int, default=0, metavar="SEED")
    ap.add_argument("--null-prompts", type=int, default=128)
    ap.add_argument("--eval-prompts", type=int, default=72)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tp-null", action="store_true", help="TP 2 in the null")
    ap.add_argument("--draws", type=int, default=300)
    ap.add_argument("--save", type=Path, default=None, help="keep the evidence here (pickle)")
    ap.add_argument("--load", type=Path, default=None, help="analyse a saved run instead")
    ap.add_argument(
        "--drop-null",
        nargs="+",
        default=(),
        metavar="KEY",
        help="leave these null variations out of the calibration (tp2: a null without TP 2)",
    )
    args = ap.parse_args()
    if args.load is not None:
        data = pickle.loads(args.load.read_bytes())
    else:
        data = measure(args)
        if args.save is not None:
            args.save.write_bytes(pickle.dumps(data))
    data["null"] = {k: v for k, v in data["null"].items() if k not in args.drop_null}
    print(
        f"# null: {', '.join(data['null'])} ({len(next(iter(data['null'].values())))} prompts "
        f"each); simulations: {len(data['sims']['honest'])} prompts each; {args.draws} draws"
    )
    analyse(data, args.draws)


if __name__ == "__main__":
    main()
