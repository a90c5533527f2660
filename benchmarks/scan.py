"""Teacher-forced scan vs decode replay of one trace: the scan finds t* in one forward instead of
T decode steps. Default: a 256-token trace (DESIGN target: scan >= 20x faster).

    python benchmarks/scan.py --model replay_audit/assets/tiny-llama --device cpu --threads 1
    python benchmarks/scan.py --tinyllama --device cuda

The trace is produced by our own decode in the logged format (`--logged-dtype`, default bf16);
the replay runs in `--dtype` (default fp16). Prints one JSON object.

With `--batch N`: the batched scan (`Engine.scan_batch`, `--token-budget` tokens a forward) of N
traces of `--tokens` tokens each (prompt + output; `--prompt-len` of them prompt) against N
bs=1 scans of the same traces in the same run (DESIGN target: 1,000,000 traces of 512 tokens
an hour on one H100, about 40% of its dense bf16 peak):

    python benchmarks/scan.py --tinyllama --device cuda --batch 64 --token-budget 32768 --tokens 512

It reports tokens/s (prompt + output tokens of the traces, padding not counted), traces/hour,
and on CUDA the fraction of `--peak-flops` (default: an H100 SXM's dense bf16, 989e12) at
2 x parameters FLOPs per token; and how far the batched results are from the bs=1 ones. The
logged outputs are the model's own greedy continuations in the logged format (transformers'
batched `generate()`, which is fast enough for N traces; `--logged random`: uniform random
tokens, for quick runs: the scan's cost does not depend on them).

With `--batch N --profile`: no bs=1 comparison; after `--profile-warmup` batches, the median
wall time of `--profile-timed` plain batches, then `--profile-batches` batches under
`torch.profiler` (CPU and CUDA activity): the share of the time by kernel class (body GEMMs,
the lm_head GEMM, attention, norms/elementwise/RoPE, copies/casts, the rest), the GPU's idle
share of the wall time, achieved TFLOP/s of the GEMMs and of the whole step, the FLOPs per
traced token counted from the model's shape and the share of `--peak-flops` they reach, and
the 15 kernels that take the most time (`benchmarks/_scan_profile.py` says how each is
classified). A table on stderr, the JSON on stdout; `--profile-trace t.json.gz` keeps the
profiler's chrome trace. On the CPU the classes are the `aten::` ops' self time and the GPU
figures are null (a smoke test):

    python benchmarks/scan.py --model replay_audit/assets/tiny-llama --device cpu --batch 4 \
        --tokens 64 --logged random --profile
    python benchmarks/scan.py --tinyllama --device cuda --dtype bf16 --batch 64 --tokens 512 \
        --token-budget 32768 --logged random --profile     # benchmarks/gpu_scan_profile.sh
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import build_engine, random_tinyllama, sync

from replay_audit.engine.protocol import Intervention, ScanItem, Target
from replay_audit.formats import INTERVENTION_KINDS

#: Dense bf16 tensor-core peak of an H100 SXM, FLOP/s (no sparsity).
H100_BF16_PEAK = 989e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tinyllama", action="store_true")
    ap.add_argument("--logged-dtype", default="bf16")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--cache", default="piecewise", choices=["piecewise", "compiled"])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="N traces: batched vs bs=1 scans")
    ap.add_argument("--token-budget", type=int, default=None, help="tokens a batched forward")
    ap.add_argument("--peak-flops", type=float, default=H100_BF16_PEAK)
    ap.add_argument("--logged", choices=["greedy", "random"], default="greedy")
    ap.add_argument("--intervention", choices=list(INTERVENTION_KINDS), default="none")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="with --batch: the batched scan under torch.profiler (benchmarks/_scan_profile.py)",
    )
    ap.add_argument("--profile-warmup", type=int, default=2, help="batches before timing")
    ap.add_argument("--profile-timed", type=int, default=5, help="batches timed unprofiled")
    ap.add_argument("--profile-batches", type=int, default=3, help="batches profiled")
    ap.add_argument(
        "--profile-trace", type=Path, default=None, help="keep the chrome trace (.json[.gz])"
    )
    args = ap.parse_args()
    if args.profile and args.batch is None:
        raise SystemExit("--profile profiles the batched scan: give --batch N")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batch is not None:
        batched(args)
        return

    model = random_tinyllama(args.dtype, args.device) if args.tinyllama else None
    replay = build_engine(
        args.model, Target(args.dtype), args.device, cache=args.cache, model=model
    )
    logged_engine = replay
    if not args.tinyllama and args.logged_dtype != args.dtype:
        logged_engine = build_engine(args.model, Target(args.logged_dtype), args.device)
    device = replay.device
    prompt = [(i * 7919) % (replay.vocab_size - 20) + 10 for i in range(args.prompt_len)]
    logged = logged_engine.decode(prompt, args.tokens, ()).output_token_ids

    def time_it(fn: Any) -> tuple[float, Any]:
        fn()
        times, out = [], None
        for _ in range(args.repeats):
            sync(device)
            t0 = time.perf_counter()
            out = fn()
            sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times), out

    t_decode, run = time_it(lambda: replay.decode(prompt, args.tokens, ()))
    t_scan, scan = time_it(lambda: replay.scan(prompt, logged))
    from replay_audit.diff import first_divergence

    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "model": "random TinyLlama-1.1B shape" if args.tinyllama else str(args.model),
        "logged_dtype": args.logged_dtype if not args.tinyllama else args.dtype,
        "replay_dtype": args.dtype,
        "kv_cache": args.cache,
        "trace_tokens": len(logged),
        "decode_seconds": t_decode,
        "scan_seconds": t_scan,
        "speedup": t_decode / t_scan,
        "decode_t_star": first_divergence(logged, run.output_token_ids),
        "scan_t_star": scan.first_disagreement,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=2))


def time_once(device: torch.device, fn: Any) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def logged_outputs(model: Any, prompts: torch.Tensor, n_new: int, how: str) -> list[list[int]]:
    """N logged outputs of `n_new` tokens: the model's greedy continuations of `prompts` (N, P),
    all N at once with transformers' `generate()` (every row runs to `n_new`), or random ids."""
    if how == "random":
        g = torch.Generator().manual_seed(1)
        vocab = int(model.config.vocab_size)
        return torch.randint(10, vocab - 10, (prompts.shape[0], n_new), generator=g).tolist()
    with torch.inference_mode():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=False,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            pad_token_id=0,
        )
    rows: list[list[int]] = out[:, prompts.shape[1] :].tolist()
    return rows


def batched(args: argparse.Namespace) -> None:
    """N traces: `scan_batch` against N bs=1 `scan`s, same engine, same run."""
    from replay_audit.diff import ulp_array
    from replay_audit.engine.protocol import DEFAULT_SCAN_TOKEN_BUDGET

    n, tokens, p_len = args.batch, args.tokens, args.prompt_len
    if n < 1 or args.repeats < 1:
        raise SystemExit("--batch and --repeats must be at least 1")
    if not 0 < p_len < tokens:
        raise SystemExit("--tokens is the whole trace (prompt + output): more than --prompt-len")
    budget = args.token_budget or DEFAULT_SCAN_TOKEN_BUDGET
    model = random_tinyllama(args.dtype, args.device) if args.tinyllama else None
    replay = build_engine(args.model, Target(args.dtype), args.device, model=model)
    logged_model = replay.model
    if not args.tinyllama and args.logged_dtype != args.dtype:
        logged_model = build_engine(args.model, Target(args.logged_dtype), args.device).model
    device = replay.device
    vocab = replay.vocab_size
    prompts = torch.tensor(
        [
            [(i * 7919 + j * 104729 + 13) % (vocab - 20) + 10 for j in range(p_len)]
            for i in range(n)
        ],
        device=device,
    )
    t_logged, outputs = time_once(
        device, lambda: logged_outputs(logged_model, prompts, tokens - p_len, args.logged)
    )
    items = [ScanItem(p, o) for p, o in zip(prompts.tolist(), outputs, strict=True)]
    iv = Intervention(args.intervention)

    def run_batch() -> Any:
        return replay.scan_batch(items, iv, token_budget=budget)

    if args.profile:
        from _scan_profile import print_table, profile_scan

        result = profile_scan(
            replay,
            items,
            run_batch,
            budget=budget,
            warmup=args.profile_warmup,
            timed=args.profile_timed,
            profiled=args.profile_batches,
            peak_flops=args.peak_flops,
            trace_out=args.profile_trace,
        )
        result |= {
            "model": "random TinyLlama-1.1B shape" if args.tinyllama else str(args.model),
            "replay_dtype": args.dtype,
            "attn_kernel": replay.target.attn_kernel,
            "intervention": args.intervention,
            "trace_tokens": tokens,
            "prompt_tokens": p_len,
            "logged": args.logged,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        }
        print_table(result)
        print(json.dumps(result, indent=2))
        return

    def run_single() -> Any:
        return [replay.scan(it.prompt_ids, it.output_ids, iv) for it in items]

    def ulps(run: Any) -> Any:
        return ulp_array(run.steps.top_k_logits[:, 0], args.dtype)

    run_batch()  # warm-up: allocator, kernels' first use
    run_single()
    t_batch, t_single = [], []
    for _ in range(args.repeats):  # interleaved, so drifting load hits both alike
        t, batch = time_once(device, run_batch)
        t_batch.append(t)
        t, single = time_once(device, run_single)
        t_single.append(t)
    tb, ts = statistics.median(t_batch), statistics.median(t_single)

    params = sum(p.numel() for p in replay.model.parameters())
    flops_per_token = 2 * params
    pairs = list(zip(single, batch, strict=True))
    same_t_star = sum(a.first_disagreement == b.first_disagreement for a, b in pairs)
    gap_ulps = max(
        float(np.max(np.abs(a.steps.margins - b.steps.margins) / ulps(a), initial=0.0))
        for a, b in pairs
    )

    def rate(seconds: float) -> dict[str, Any]:
        tok_s = n * tokens / seconds
        frac = tok_s * flops_per_token / args.peak_flops if device.type == "cuda" else None
        return {
            "seconds": seconds,
            "tokens_per_s": tok_s,
            "traces_per_hour": n / seconds * 3600,
            "fraction_of_peak": frac,
        }

    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "model": "random TinyLlama-1.1B shape" if args.tinyllama else str(args.model),
        "replay_dtype": args.dtype,
        "attn_kernel": replay.target.attn_kernel,
        "intervention": args.intervention,
        "traces": n,
        "trace_tokens": tokens,
        "prompt_tokens": p_len,
        "logged": args.logged,
        "logged_seconds": t_logged,
        "token_budget": budget,
        "batch_shapes": replay.environment()["extras"]["scan_batch_shapes"],
        "parameters": params,
        "flops_per_token": flops_per_token,
        "peak_flops": args.peak_flops if device.type == "cuda" else None,
        "repeats": args.repeats,
        "batched": rate(tb),
        "bs1": rate(ts),
        "speedup": ts / tb,
        "same_first_disagreement": f"{same_t_star}/{n}",
        "agreeing_traces_bs1": sum(a.first_disagreement is None for a in single),
        "max_margin_gap_ulps": gap_ulps,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
