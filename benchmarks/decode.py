"""Decode speed at batch size 1: our KV-cache loop (dynamic cache; static cache + CUDA graph;
static cache + torch.compile'd step in the CUDA graph), each with and without gated
Intervention C, against transformers' `generate()` and a plain transformers KV-cache loop.

    python benchmarks/decode.py --model replay_audit/assets/tiny-llama --device cpu --threads 1
    python benchmarks/decode.py --tinyllama --device cuda --tokens 256 \\
        --variants dynamic static compiled --max-cache-len 4096

Prints one JSON object (tokens/s per variant, C's overhead and trigger rate, which path ran) and
a short table on stderr. Each engine variant runs once untimed (capture, compile), then its
plain and gated-C decodes are timed alternately `--repeats` times; medians are reported. A
variant name ending in `_eff` runs the same engine under SDPA's memory-efficient backend.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import build_engine, random_tinyllama, sync

from replay_audit.engine.protocol import Intervention, Target

ENGINE_VARIANTS = ("dynamic", "static", "compiled")
HF_VARIANTS = ("hf_kv_loop", "hf_generate")


def once(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, help="checkpoint directory")
    ap.add_argument("--tinyllama", action="store_true", help="random TinyLlama-shaped model")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--attn-kernel", default="sdpa")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dynamic-repeats", type=int, default=None, help="default: --repeats")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["dynamic", "static", *HF_VARIANTS],
        choices=[*ENGINE_VARIANTS, *HF_VARIANTS],
    )
    ap.add_argument("--max-cache-len", type=int, default=4096, help="largest static cache")
    ap.add_argument("--tau", type=float, default=1e-3, help="gated C's threshold")
    ap.add_argument("--no-deterministic", action="store_true")
    ap.add_argument("--profile", default=None, help="an engine variant: its top CUDA kernels")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target = Target(args.dtype, attn_kernel=args.attn_kernel)
    model = random_tinyllama(args.dtype, args.device, args.attn_kernel) if args.tinyllama else None
    first = build_engine(args.model, target, args.device, model=model)
    model = first.model
    if args.no_deterministic:
        torch.use_deterministic_algorithms(False)
    device = first.device
    n = args.tokens
    prompt = [(i * 7919) % (first.vocab_size - 20) + 10 for i in range(args.prompt_len)]
    c_gated = Intervention("C", tau=args.tau)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "attn_kernel": args.attn_kernel,
        "model": "random TinyLlama-1.1B shape" if args.tinyllama else str(args.model),
        "tokens": n,
        "prompt_len": args.prompt_len,
        "max_cache_len": args.max_cache_len,
        "tau": args.tau,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    engines: dict[str, Any] = {}
    table: list[tuple[str, float, float | None, float | None, float | None]] = []

    for name in args.variants:
        if name in HF_VARIANTS:
            continue
        engine = (
            first
            if name == "dynamic"
            else build_engine(None, target, args.device, cache=name, model=model)
        )
        engine.max_cache_len = args.max_cache_len
        engines[name] = engine
        reps = args.dynamic_repeats if name == "dynamic" and args.dynamic_repeats else args.repeats
        plain = functools.partial(engine.decode, prompt, n, (), Intervention())
        gated = functools.partial(engine.decode, prompt, n, (), c_gated)
        first_s, _ = once(plain, device)
        once(gated, device)
        plain_t, gated_t, gated_out, plain_out = [], [], None, None
        for _ in range(reps):  # alternate, so drift hits both alike
            t, plain_out = once(plain, device)
            plain_t.append(t)
            t, gated_out = once(gated, device)
            gated_t.append(t)
        plain_s, gated_s = statistics.median(plain_t), statistics.median(gated_t)
        assert plain_out is not None and gated_out is not None
        steps = gated_out.steps
        entry: dict[str, Any] = {
            "tokens_per_s": n / plain_s,
            "seconds": plain_s,
            "seconds_all": plain_t,
            "first_call_seconds": first_s,
            "gated_C_tokens_per_s": n / gated_s,
            "gated_C_seconds_all": gated_t,
            "gated_C_overhead": gated_s / plain_s - 1,
            "trigger_rate": float(steps.gate_fired.mean()),
            "changed_steps": int(steps.changed.sum()),
            "extras": engine.environment()["extras"],
            "tokens_sha": hash(tuple(plain_out.output_token_ids)),
        }
        results[name] = entry
        spread = (max(plain_t) - min(plain_t)) / plain_s if len(plain_t) > 1 else None
        table.append((name, n / plain_s, n / gated_s, entry["gated_C_overhead"], spread))
        print(
            f"{name:14s} {n / plain_s:8.1f} tok/s  gated C {n / gated_s:8.1f}  "
            f"first call {first_s:6.1f} s  {entry['extras']}",
            file=sys.stderr,
        )

    # Token agreement between the engine paths (same prompt, same model).
    base = next((k for k in ("static", "dynamic") if k in results), None)
    if base is not None:
        results["same_tokens_as_" + base] = {
            k: results[k]["tokens_sha"] == results[base]["tokens_sha"] for k in engines if k != base
        }

    def hf_generate() -> Any:
        x = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            return model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )

    def hf_loop() -> list[int]:
        from transformers import DynamicCache

        out: list[int] = []
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            logits = model(torch.tensor([prompt], device=device), past_key_values=cache).logits
            for _ in range(n):
                tok = int(torch.argmax(logits[0, -1]))
                out.append(tok)
                logits = model(torch.tensor([[tok]], device=device), past_key_values=cache).logits
        return out

    for name, fn in (("hf_kv_loop", hf_loop), ("hf_generate", hf_generate)):
        if name not in args.variants:
            continue
        fn()
        times = [once(fn, device)[0] for _ in range(args.dynamic_repeats or args.repeats)]
        s = statistics.median(times)
        results[name] = {"tokens_per_s": n / s, "seconds": s, "seconds_all": times}
        table.append((name, n / s, None, None, None))

    results["deterministic"] = torch.are_deterministic_algorithms_enabled()
    if args.profile in engines:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            # the timed length: the same static cache, so nothing is compiled or captured here
            engines[args.profile].decode(prompt, n, (), Intervention())
            sync(device)
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(f"profile of {args.profile}, {n} tokens:", file=sys.stderr)
        print(prof.key_averages().table(sort_by=key, row_limit=25), file=sys.stderr)
    print(json.dumps(results, indent=2))
    print(
        f"\n{'variant':14s} {'tok/s':>8s} {'gated C':>8s} {'C ovh':>7s} {'spread':>7s}",
        file=sys.stderr,
    )
    for name, tps, gtps, ovh, spread in table:
        g = f"{gtps:8.1f}" if gtps is not None else f"{'':8s}"
        o = f"{100 * ovh:+6.1f}%" if ovh is not None else f"{'':7s}"
        sp = f"{100 * spread:6.1f}%" if spread is not None else f"{'':7s}"
        print(f"{name:14s} {tps:8.1f} {g} {o} {sp}", file=sys.stderr)


if __name__ == "__main__":
    main()
