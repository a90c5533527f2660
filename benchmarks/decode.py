"""Decode speed at batch size 1: our KV-cache loop (dynamic cache; static cache + CUDA graph),
with and without gated Intervention C, against transformers' `generate()` and a plain
transformers KV-cache loop.

    python benchmarks/decode.py --model replay_audit/assets/tiny-llama --device cpu --threads 1
    python benchmarks/decode.py --tinyllama --device cuda --tokens 256

Prints one JSON object (tokens/s per variant, C's overhead and trigger rate). Each variant is
timed `--repeats` times after one warm-up; the median is reported.
"""

from __future__ import annotations

import argparse
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


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, Any]:
    fn()  # warm-up (and CUDA graph capture)
    times, out = [], None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


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
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument(
        "--only-static", action="store_true", help="time the static-cache variants only"
    )
    ap.add_argument("--max-cache-len", type=int, default=4096, help="static cache length")
    ap.add_argument("--no-deterministic", action="store_true")
    ap.add_argument("--profile", action="store_true", help="top CUDA kernels of the static path")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target = Target(args.dtype, attn_kernel=args.attn_kernel)
    model = random_tinyllama(args.dtype, args.device, args.attn_kernel) if args.tinyllama else None
    dyn = build_engine(args.model, target, args.device, model=model)
    model = dyn.model
    static = build_engine(None, target, args.device, cache="static", model=model)
    static.max_cache_len = args.max_cache_len
    if args.no_deterministic:
        torch.use_deterministic_algorithms(False)
    device = dyn.device
    n = args.tokens
    prompt = [(i * 7919) % (dyn.vocab_size - 20) + 10 for i in range(args.prompt_len)]
    c_gated = Intervention("C", tau=1e-3)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "attn_kernel": args.attn_kernel,
        "model": "random TinyLlama-1.1B shape" if args.tinyllama else str(args.model),
        "tokens": n,
        "prompt_len": args.prompt_len,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }

    def ours(engine: Any, iv: Intervention) -> Callable[[], Any]:
        return lambda: engine.decode(prompt, n, (), iv)

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

    variants: list[tuple[str, Callable[[], Any]]] = [
        ("ours_dynamic", ours(dyn, Intervention())),
        ("ours_dynamic_gated_C", ours(dyn, c_gated)),
        (
            "ours_static" + ("_cuda_graph" if device.type == "cuda" else ""),
            ours(static, Intervention()),
        ),
        ("ours_static_gated_C", ours(static, c_gated)),
        ("hf_kv_loop", hf_loop),
    ]
    if not args.skip_generate:
        variants.append(("hf_generate", hf_generate))
    if args.only_static:
        variants = [v for v in variants if v[0].startswith("ours_static")]
    for name, fn in variants:
        seconds, out = timed(fn, device, args.repeats)
        entry: dict[str, Any] = {"seconds": seconds, "tokens_per_s": n / seconds}
        steps = getattr(out, "steps", None)
        if steps is not None:
            entry["trigger_rate"] = float(steps.gate_fired.mean())
            entry["changed_steps"] = int(steps.changed.sum())
        results[name] = entry
        print(f"{name:28s} {n / seconds:9.1f} tok/s", file=sys.stderr)
    for base in ("ours_dynamic", next(k for k in results if k.startswith("ours_static"))):
        gated = "ours_dynamic_gated_C" if base == "ours_dynamic" else "ours_static_gated_C"
        if base in results and gated in results:
            results[f"{gated}_overhead"] = results[gated]["seconds"] / results[base]["seconds"] - 1
    results["deterministic"] = torch.are_deterministic_algorithms_enabled()
    results["max_cache_len"] = args.max_cache_len
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            static.decode(prompt, 32, (), Intervention())
            sync(device)
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25), file=sys.stderr)
    results["cuda_graph"] = static._static is not None and static._static.graph is not None
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
