"""Provider audit (issue 23): simulate providers from one reference checkpoint, verify their
traces against it, print AUC, tokens to a decision and the false-alarm rate per simulation.

    python benchmarks/verify.py --model replay_audit/assets/tiny-llama --device cpu \
        --null-prompts 16 --eval-prompts 16 --max-new-tokens 48          # bundled model, CPU
    python benchmarks/verify.py --model /path/to/checkpoint --device cuda \
        --null-prompts 48 --eval-prompts 96 --max-new-tokens 512         # a real checkpoint

The null (benign variations of the reference, `verifications.null.benign_null`) is measured on
the first prompts; the simulations run on the next ones, so no prompt is in both. Each
simulated provider claims the reference in its claimed configuration (`--dtype`, sdpa). For
each, at each token budget, groups of that many tokens are drawn from its traces and from the
held-out honest traces: AUC (simulation vs honest groups), power (share of its groups over the
calibrated threshold); tokens to decision = the smallest budget with power >= 0.95; the
false-alarm rate of a benign simulation is its power (it should be <= the nominal 1%).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from replay_audit.engine import EnginePool, Intervention, Target
from replay_audit.engine.testing import fp8_kv_cache, rtn_checkpoint, variant_checkpoint
from replay_audit.screenings.sweep.outputs import ScreenPrompt
from replay_audit.screenings.sweep.plan import ScreenConfig
from replay_audit.screenings.sweep.worker import TorchBackend
from replay_audit.stats.verification import STATISTICS, Calibration, auc, draw_group_scores
from replay_audit.verifications.null import _scan, benign_null, generate

PROMPTS = Path(__file__).resolve().parent.parent / "replay_audit" / "assets" / "prompts.jsonl"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify_scale import stdlib_prompts  # noqa: E402  (verify_statistics.py takes it from here)

BUDGETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

Pairs = list[tuple[list[int], list[int]]]


def sampled(
    model_dir: Path,
    prompts: list[ScreenPrompt],
    dtype: str,
    max_new: int,
    device: str,
    temperature: float = 0.3,
    seed: int = 0,
) -> Pairs:
    """Temperature sampling with transformers' generate(): a provider that samples and logs
    the result as greedy."""
    import torch
    from transformers import AutoModelForCausalLM

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).to(device).eval()
    torch.manual_seed(seed)
    out: Pairs = []
    for p in prompts:
        x = torch.tensor([list(p.token_ids)], device=device)
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
        )
        out.append((list(p.token_ids), [int(t) for t in y[0, x.shape[1] :].tolist()]))
    return out


def fp8_kv(
    model_dir: Path, prompts: list[ScreenPrompt], dtype: str, max_new: int, device: str
) -> Pairs:
    """A provider with an FP8 (e4m3) KV cache (`engine.testing.fp8_kv_cache`: SDPA on keys and
    values rounded to float8_e4m3fn with scale 1, vLLM's `kv_cache_dtype="fp8"` without
    calibrated scales): transformers' greedy generate() in `dtype`, a prompt at a time."""
    from replay_audit.engine.generate import eos_token_ids, greedy_generate
    from replay_audit.engine.loading import load_model, resolve_device

    dev = resolve_device(device)
    model, tokenizer = load_model(model_dir, dtype, "sdpa", dev)
    eos = eos_token_ids(model, tokenizer)
    out: Pairs = []
    with fp8_kv_cache(model):
        for p in prompts:
            ids, _ = greedy_generate(model, dev, [p.token_ids], max_new, eos).rows[0]
            out.append((list(p.token_ids), ids))
    return out


def _tp_pairs(
    model_dir: Path, prompts: list[list[int]], dtype: str, max_new: int, k: int, device: str
) -> Pairs:
    from replay_audit.engine.generate import TraceGenerator

    with TraceGenerator(
        model_dir, dtype=dtype, attn_kernel="sdpa", device=device, tp_degree=k
    ) as g:
        return [(p, g.generate_ids(p, max_new)[0]) for p in prompts]


def tensor_parallel(
    model_dir: Path, prompts: list[ScreenPrompt], dtype: str, max_new: int, k: int, device: str
) -> Pairs:
    """A provider serving at TP `k`: transformers' tensor-parallel plan over `k` GPUs (NCCL;
    gloo processes on a CPU), greedy generate() on every rank (`replay-audit generate --tp k`),
    in a spawned process of its own (its own torch.distributed world, see benchmarks/tp.py)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ids = [list(p.token_ids) for p in prompts]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(_tp_pairs, model_dir, ids, dtype, max_new, k, device).result()


def _targets(results: list[dict[str, Any]], stat: str) -> str:
    """The issue's three figures for one statistic: the tokens 4-bit RTN and the FP8 KV cache
    need to a decision (AUC at 4-bit's), and the worst benign simulation's flagged share at each
    of those budgets."""
    ran = [r for r in results if "skipped" not in r]

    def decision(prefix: str) -> tuple[str, int | None]:
        r = next((x for x in ran if x["simulation"].startswith(prefix)), None)
        if r is None:
            return "not run", None
        n = r[stat]["tokens_to_decision"]
        if n is None:
            return f"> {BUDGETS[-1]}", None
        return f"{n} (AUC {r[stat]['per_budget'][str(n)]['auc']:.3f})", n

    rtn, n_rtn = decision("4-bit")
    fp8, n_fp8 = decision("FP8")
    alarms = []
    for n in (n_rtn, n_fp8):
        if n is not None:
            worst = max(
                (r[stat]["per_budget"][str(n)]["flagged"], r["simulation"])
                for r in ran
                if r["benign"]
            )
            alarms.append(f"{worst[0]:.3f} at {n} ({worst[1]})")
    return f"{rtn} | {fp8} | {'; '.join(alarms) or '-'}"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="bf16", help="the claimed body dtype")
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
    ap.add_argument(
        "--stdlib-prompts",
        type=int,
        default=None,
        help="instead of --prompts: this many function beginnings of the Python standard "
        "library, cut as the bundled prompts are (more than the bundled 64)",
    )
    ap.add_argument(
        "--shuffle-prompts",
        type=int,
        default=None,
        metavar="SEED",
        help="shuffle the prompts (with this seed) before the null takes the first ones: the "
        "null's prompts and the simulations' then come from one distribution (--stdlib-prompts "
        "lists held-out files first, so unshuffled the null holds them and the simulations the "
        "training files')",
    )
    ap.add_argument("--null-prompts", type=int, default=16)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--draws", type=int, default=1000)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="run only the simulations whose names start with these (the honest one always)",
    )
    ap.add_argument(
        "--tp",
        type=int,
        default=None,
        help="the benign TP degree simulated (default 2 where 2 GPUs are visible; 0: none)",
    )
    ap.add_argument(
        "--null",
        type=Path,
        default=None,
        help="take the null from this earlier run's --json (same model, prompts and claim) "
        "instead of measuring it: a null too long for one device call measured once, the "
        "simulations in later calls",
    )
    ap.add_argument(
        "--with-results",
        type=Path,
        nargs="+",
        default=(),
        help="earlier runs' --json files (on the same null): their simulations join the tables "
        "(one run here replaces an earlier one of the same name)",
    )
    args = ap.parse_args()
    # The null's progress (each variation's generation and scan time) on stderr: a run cut by
    # its time limit still says how far it got.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    t0 = time.time()
    if args.stdlib_prompts is not None:
        rows = stdlib_prompts(args.model, args.stdlib_prompts)
    else:
        text = args.prompts.read_text(encoding="utf-8")
        rows = [json.loads(x) for x in text.splitlines() if x.strip()]
    if args.shuffle_prompts is not None:
        random.Random(args.shuffle_prompts).shuffle(rows)
    backend = TorchBackend(args.model, args.device)
    device = backend.platform().device
    prompts = backend.prompts(rows[: args.null_prompts + args.eval_prompts])  # type: ignore[arg-type]
    null_p, eval_p = prompts[: args.null_prompts], prompts[args.null_prompts :]
    tp = args.tp
    if tp is None:
        import torch

        tp = 2 if device == "cuda" and torch.cuda.device_count() >= 2 else 0
    # A pool owning the TP degree's GPUs: the null then holds TP 2 (`benign_null` adds it where
    # the pool owns two CUDA GPUs), as a two-GPU worker's does.
    pool = EnginePool(device=device, devices=max(1, tp))
    claim = Target(args.dtype, None, "sdpa", 1, Intervention())
    if args.null is not None:
        cal = Calibration.from_json(json.loads(args.null.read_text())["calibration"])
    else:
        cal = benign_null(
            args.model,
            claim,
            null_p,
            pool=pool,
            device=device,
            max_new_tokens=args.max_new_tokens,
            budgets=BUDGETS,
            draws=args.draws,
        )
    print(
        f"null: {len(cal.variations)} variations in {time.time() - t0:.0f} s ({cal.notes})",
        file=sys.stderr,
        flush=True,
    )
    if args.json:  # at once: a later call can take the null (--null)
        args.json.write_text(json.dumps({"calibration": cal.to_json(), "results": []}, indent=1))
    n = args.max_new_tokens
    dt = args.dtype
    other = "fp16" if dt != "fp16" else "bf16"

    def gen(config: ScreenConfig, model_dir: Path | None = None) -> Callable[[], Pairs]:
        return lambda: generate(backend, config, eval_p, n, model_dir)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpt = {
            "rtn8": lambda: rtn_checkpoint(args.model, root / "rtn8", bits=8),
            "rtn4": lambda: rtn_checkpoint(args.model, root / "rtn4", bits=4),
            "swapped": lambda: variant_checkpoint(args.model, root / "swap", noise=0.1, seed=1),
            "rope": lambda: variant_checkpoint(
                args.model,
                root / "rope",
                config={
                    "rope_theta": 5000.0,
                    "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"},
                },
            ),
        }
        base = ScreenConfig(dt)  # type: ignore[arg-type]
        sims: list[tuple[str, bool, Callable[[], Pairs] | str]] = [
            ("honest (claimed config)", True, gen(base)),
            (f"benign {other}", True, gen(ScreenConfig(other))),  # type: ignore[arg-type]
            ("benign batch 8", True, gen(ScreenConfig(dt, batch_size=8))),  # type: ignore[arg-type]
            ("benign eager attention", True, gen(ScreenConfig(dt, attn_kernel="eager"))),  # type: ignore[arg-type]
            ("8-bit RTN g128", False, lambda: gen(base, ckpt["rtn8"]())()),
            ("4-bit RTN g128", False, lambda: gen(base, ckpt["rtn4"]())()),
            (
                "FP8 KV cache (e4m3, scale 1)",
                False,
                lambda: fp8_kv(args.model, eval_p, dt, n, device),
            ),
            ("swapped checkpoint (10% noise)", False, lambda: gen(base, ckpt["swapped"]())()),
            (
                "temperature 0.3 logged as greedy",
                False,
                lambda: sampled(args.model, eval_p, dt, n, device),
            ),
            ("planted bug: RoPE base 5000", False, lambda: gen(base, ckpt["rope"]())()),
        ]
        if tp > 1:
            sims.insert(
                4,
                (
                    f"benign TP={tp}",
                    True,
                    lambda: tensor_parallel(args.model, eval_p, dt, n, tp, device),
                ),
            )
        elif device == "cuda":
            sims.insert(4, ("benign TP=2", True, "needs two GPUs (a two-GPU kind)"))
        # The honest simulation's deficits and outputs (it runs first).
        honest: tuple[list[np.ndarray], list[list[int]]] | None = None
        results = []
        rng = np.random.default_rng(0)
        if args.only:
            sims = [x for i, x in enumerate(sims) if i == 0 or x[0].startswith(tuple(args.only))]
        for name, benign, run in sims:
            if isinstance(run, str):
                results.append({"simulation": name, "skipped": run})
                continue
            pairs = run()
            deficits = _scan(pairs, claim, pool, args.model)
            outputs = [out for _, out in pairs]
            if honest is None:
                honest = deficits, outputs
            row: dict[str, Any] = {
                "simulation": name,
                "benign": benign,
                "tokens": int(sum(len(u) for u in deficits)),
                # the share of the prompts whose greedy output this provider changed against
                # the honest one (the same prompts): how often the variation flips a token
                "outputs_differing": round(
                    sum(a != b for a, b in zip(outputs, honest[1], strict=True))
                    / max(1, len(outputs)),
                    4,
                ),
            }
            for stat in STATISTICS:
                sc = [cal.scorer.scores(u, stat) for u in deficits]
                hc = [cal.scorer.scores(u, stat) for u in honest[0]]
                per: dict[int, dict[str, float]] = {}
                for b in cal.budgets[stat]:
                    sim = draw_group_scores(sc, b.tokens, args.draws, rng)
                    ref = draw_group_scores(hc, b.tokens, args.draws, rng)
                    per[b.tokens] = {
                        "auc": auc(ref, sim),
                        "flagged": float((sim > b.threshold).mean()),
                    }
                decided = [k for k, v in per.items() if v["flagged"] >= 0.95]
                row[stat] = {
                    "auc_256": per[256]["auc"],
                    "auc_max": max(v["auc"] for v in per.values()),
                    "tokens_to_decision": decided[0] if decided else None,
                    "flagged_256": per[256]["flagged"],
                    "flagged_max": max(v["flagged"] for v in per.values()),
                    "per_budget": {str(k): v for k, v in per.items()},
                }
            results.append(row)
            print(
                f"{name}: {json.dumps(row)} at {time.time() - t0:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            if args.json:  # as it goes: a run cut by its time limit keeps what it measured
                args.json.write_text(
                    json.dumps({"calibration": cal.to_json(), "results": results}, indent=1)
                )
    here = {r["simulation"] for r in results}
    earlier = [
        r
        for f in args.with_results
        for r in json.loads(f.read_text())["results"]
        if r["simulation"] not in here
    ]
    results = [*earlier, *results]
    print(
        f"# {args.model} claimed {dt}/sdpa on {device} "
        f"({platform.processor() or platform.machine()}), null {args.null_prompts} prompts x "
        f"{len(cal.variations)} variations, eval {args.eval_prompts} prompts x {n} tokens, "
        f"{time.time() - t0:.0f} s"
    )
    for stat in STATISTICS:
        print(f"\n{stat}{' (verdicts)' if stat == cal.statistic else ''}")
        print(
            "| simulation | tokens | outputs differing from honest | AUC @256 "
            "| tokens to decision | flagged @256 (benign: false-alarm rate) "
            "| flagged, worst budget |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in results:
            if "skipped" in r:
                print(f"| {r['simulation']} | | | | | not run: {r['skipped']} | |")
                continue
            s = r[stat]
            print(
                f"| {r['simulation']} | {r['tokens']} | {r.get('outputs_differing', '')} "
                f"| {s['auc_256']:.3f} | "
                f"{s['tokens_to_decision'] or '> ' + str(BUDGETS[-1])} | {s['flagged_256']:.3f} "
                f"| {s['flagged_max']:.3f} |"
            )
    print(
        "\nThe issue's three targets, per statistic: 4-bit RTN's decision budget (AUC there), "
        "the FP8 KV cache's, and the worst benign false-alarm rate at each of those budgets"
    )
    print("| statistic | 4-bit RTN | FP8 KV cache | worst benign false alarm at those budgets |")
    print("| --- | --- | --- | --- |")
    for stat in STATISTICS:
        print(f"| {stat} | {_targets(results, stat)} |")
    if args.json:
        args.json.write_text(
            json.dumps({"calibration": cal.to_json(), "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
