"""Tensor parallel against TP 1: how many greedy outputs each TP degree flips, whether TP-k
traces replay exactly at TP k, and what a TP-1 replay of them reports (t*, categories).

    python benchmarks/tp.py --device cuda --degrees 2 --traces 48 --tokens 128   # 2 GPUs
    python benchmarks/tp.py --device cpu --model replay_audit/assets/tiny-llama \\
        --traces 6 --tokens 16 --threads 1                                      # gloo, a check

For each degree k: the prompts are generated at TP 1 and at TP k with transformers' own
`generate()` (`TraceGenerator`, as `replay-audit generate --tp k`: every rank runs it), the TP-k
traces are replayed in their logged configuration at TP k (the self-replay: `compare_with:
self`), then at TP 1 (a target asking `tp_degree: 1`), then at TP k again in the same pool,
through the service's replay pipeline (`replays.pipeline.replay_items`, decode mode, the pool of
a worker owning k devices). The model is a random TinyLlama-1.1B-shaped Llama (saved once to
--model-dir) unless --model names a checkpoint. Prints one JSON object; measured, never
asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _models import save_random_tinyllama

from replay_audit.engine import EnginePool, Target
from replay_audit.engine.generate import TraceGenerator
from replay_audit.engine.tensor_parallel import NVLS_OFF
from replay_audit.replays.domain import LoggedTrace, ReplayOutcome, RunTarget
from replay_audit.replays.pipeline import ReplayItem, ReplayOptions, replay_items
from replay_audit.traces.schemas import TraceCreate

PROMPTS = Path(__file__).resolve().parent.parent / "replay_audit/assets/prompts.jsonl"


def prompts(n: int) -> list[tuple[str, str]]:
    rows = [json.loads(x) for x in PROMPTS.read_text().splitlines() if x.strip()]
    texts = [str(r["prompt"]) for r in rows]
    return [
        (f"p{i}", texts[i % len(texts)] + ("" if i < len(texts) else f" ({i})")) for i in range(n)
    ]


def nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def generate(model: Path, args: argparse.Namespace, tp: int) -> tuple[list[TraceCreate], float]:
    """The prompts' traces at TP `tp` and the seconds it took (loading excluded)."""
    with TraceGenerator(
        model,
        dtype=args.dtype,
        attn_kernel="sdpa",
        device=args.device,
        threads=args.threads,
        tp_degree=tp,
    ) as gen:
        start = time.perf_counter()
        traces = [
            TraceCreate.model_validate(gen.trace(text, max_new_tokens=args.tokens, external_id=pid))
            for pid, text in prompts(args.traces)
        ]
        return traces, time.perf_counter() - start


def replay(
    traces: list[TraceCreate], target: RunTarget, pool: EnginePool, model: Path
) -> tuple[list[ReplayOutcome], float]:
    items = [ReplayItem(LoggedTrace.from_json(t.model_dump()), target, model) for t in traces]
    replay_items(items[:1], pool, ReplayOptions("decode"))  # loads the arms (and starts ranks)
    start = time.perf_counter()
    results = replay_items(items, pool, ReplayOptions("decode"))
    seconds = time.perf_counter() - start
    failed = [r for r in results if not isinstance(r, ReplayOutcome)]
    if failed:
        raise SystemExit(f"{len(failed)} replays failed, the first: {failed[0]!r}")
    return [r for r in results if isinstance(r, ReplayOutcome)], seconds


def summary(results: list[ReplayOutcome], seconds: float) -> dict[str, Any]:
    """What a replay of n traces reports: exact ones, t*, categories, the degree that ran, and
    the seconds it took, the arms already loaded."""
    stars = [r.first_divergence_step for r in results if r.first_divergence_step is not None]
    resolved = {
        (r.b.resolved.tp_degree, r.b.resolved.logged_tp_degree) for r in results if r.b.resolved
    }
    env = results[0].b.environment or {} if results else {}
    return {
        "n": len(results),
        "exact": sum(bool(r.exact_match) for r in results),
        "diverged": len(stars),
        "diverged_fraction": round(len(stars) / len(results), 4) if results else None,
        "categories": dict(Counter(r.category for r in results if r.category != "agreed")),
        "t_star_median": statistics.median(stars) if stars else None,
        "t_star_min": min(stars) if stars else None,
        "ran_tp_logged_tp": sorted(resolved),
        "decoder": env.get("extras", {}).get("decoder"),
        "tp_backend": env.get("extras", {}).get("tp_backend"),
        "seconds": round(seconds, 2),
    }


def _in_child(fn: Any, *args: Any) -> Any:
    """`fn(*args)` in a fresh spawned process (its own torch.distributed world)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(fn, *args).result()


def _generate_json(model: Path, args: argparse.Namespace, k: int) -> tuple[list[Any], float]:
    traces, seconds = generate(model, args, k)
    return [t.model_dump(mode="json") for t in traces], seconds


def _replay_rows(
    model: Path, args: argparse.Namespace, k: int, traces_json: list[Any]
) -> dict[str, Any]:
    traces = [TraceCreate.model_validate(t) for t in traces_json]
    pool = EnginePool(device=args.device, threads=args.threads, devices=k)
    row: dict[str, Any] = {}
    results, seconds = replay(traces, RunTarget(None), pool, model)
    row[f"self_replay_at_tp{k}"] = summary(results, seconds)
    at_1 = RunTarget(Target(args.dtype, attn_kernel="sdpa"), tp_degree=1)
    results, seconds = replay(traces, at_1, pool, model)
    row["replay_at_tp1"] = summary(results, seconds)
    # Back to TP k in the same pool, after the TP-1 arm ran: the group serves again, bitwise.
    results, seconds = replay(traces, RunTarget(None), pool, model)
    row[f"self_replay_again_at_tp{k}"] = summary(results, seconds)
    pool.close()
    return row


def _degree_row(
    model: Path, args: argparse.Namespace, k: int, base: list[TraceCreate]
) -> dict[str, Any]:
    """TP k against TP 1: its generation, then its replays (each in a child process of its
    own with --children)."""
    in_child = _in_child if args.children else (lambda fn, *a: fn(*a))
    traces_json, gen_s = in_child(_generate_json, model, args, k)
    traces = [TraceCreate.model_validate(t) for t in traces_json]
    flips = [a.output_token_ids != b.output_token_ids for a, b in zip(base, traces, strict=True)]
    row: dict[str, Any] = {
        "generate_s": round(gen_s, 2),
        "outputs_flipped_vs_tp1": sum(flips),
        "flip_fraction_vs_tp1": round(sum(flips) / len(flips), 4),
    }
    row.update(in_child(_replay_rows, model, args, k, traces_json))
    print(f"tp {k}: {json.dumps(row)}", file=sys.stderr, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, help="a checkpoint (default: random TinyLlama shape)")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/tp-bench-tinyllama"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--degrees", type=int, nargs="+", default=[2])
    ap.add_argument("--traces", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--children",
        action="store_true",
        help="generate and replay each degree in a spawned process of its own",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = args.model or save_random_tinyllama(args.model_dir, args.dtype, args.device)
    out: dict[str, Any] = {
        "model": str(args.model) if args.model else "random TinyLlama-1.1B shape",
        "dtype": args.dtype,
        "traces": args.traces,
        "max_new_tokens": args.tokens,
        "device": args.device,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "nccl": nccl_version(),
        "nvls_off": {k: os.environ.get(k) for k in NVLS_OFF},
        "seconds_to_model": round(time.perf_counter() - started, 1),
    }
    base, base_s = generate(model, args, 1)
    out["tp1_generate_s"] = round(base_s, 2)
    pool = EnginePool(device=args.device, threads=args.threads, devices=max(args.degrees))
    results, seconds = replay(base, RunTarget(None), pool, model)
    out["tp1_self_replay"] = summary(results, seconds)
    pool.close()
    for k in args.degrees:
        # The generator's ranks and the pool's are child processes (`TpGroup`), so this
        # process joins no process group and one process can use both: a second NCCL group in
        # one process segfaulted in transformers' device-mesh setup (torch 2.11 + cu130, 2x
        # H200) before every rank was a child. --children keeps the old isolation.
        out[f"tp{k}"] = _degree_row(model, args, k, base)
    out["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
