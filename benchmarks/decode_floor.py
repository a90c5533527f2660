"""What bounds a faithful decode: the GPU time of the kernels `generate()` runs at batch 1.

A decode token-identical to transformers' `generate()` must run, one after another, the kernels
`generate()` runs: the weight reads (cuBLAS's batch-1 GEMMs) and several hundred small unfused
kernels per step (RMSNorm, RoPE, SiLU, residuals, casts). However they are launched (eagerly,
piecewise CUDA graphs, one graph), a step cannot take less than the sum of those kernels' GPU
time. This script profiles one piecewise decode uncaptured (the same kernels the graphs replay,
each seen by the profiler) and reports kernels per step, their GPU time per step and the
tokens/s ceiling it implies, next to the HBM bound and the piecewise decode's own speed measured
in the same run, and checks the decode's tokens against `generate()`. GPU only:

    python benchmarks/decode_floor.py --tokens 256 --out $OUT/floor.json

An experiment kept out of the engine (BENCHMARKS.md): N such decoders on N CUDA streams, launched
together, overlapped their kernels (339 tok/s together at N = 2 on an H100) but their logits
were not bitwise those of the same decode on one stream, so concurrency is not a faithful path.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import build_engine, random_tinyllama
from decode import measure_hbm

from replay_audit.engine.piecewise import PiecewiseDecoder
from replay_audit.engine.protocol import Target


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    return [
        [(i * 7919 + j * 104729) % (vocab - 20) + 10 for i in range(length)] for j in range(count)
    ]


def kernel_floor(decoder: PiecewiseDecoder, prompt: list[int], steps: int) -> dict[str, Any]:
    """GPU kernel time and kernel count per step of one piecewise decode (profiled)."""
    from torch.profiler import ProfilerActivity, profile

    out = decoder.prefill(prompt, 2)
    tok = int(out.top.native[0])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            tok = int(decoder.step(tok).top.native[0])
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.device_time for e in events)
    by_name: dict[str, float] = {}
    for e in events:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {
        "steps": steps,
        "kernels_per_step": len(events) / steps,
        "kernel_ms_per_step": total_us / steps / 1e3,
        "kernel_floor_tokens_per_s": steps / (total_us / 1e6) if total_us else None,
        "top_kernels_ms_per_step": {k[:90]: v / steps / 1e3 for k, v in top},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--profile-steps", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "GPU only"
    model = random_tinyllama(args.dtype, "cuda", "sdpa")
    engine = build_engine(None, Target(args.dtype), "cuda", cache="piecewise", model=model)
    n = args.tokens
    prompt = prompts(1, args.prompt_len, engine.vocab_size)[0]
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "tokens": n,
        "prompt_len": args.prompt_len,
        "hbm": measure_hbm(engine.device, 2.0, model, args.prompt_len + n / 2),
    }
    bound = result["hbm"]["bound_tokens_per_s"]

    def decode(decoder: PiecewiseDecoder) -> tuple[float, list[int]]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = decoder.prefill(prompt, 2)
        tokens = [int(out.top.native[0])]
        for _ in range(n - 1):
            tokens.append(int(decoder.step(tokens[-1]).top.native[0]))
        torch.cuda.synchronize()
        return time.perf_counter() - t0, tokens

    piecewise = PiecewiseDecoder(engine.body, engine.head)
    decode(piecewise)  # capture
    times = []
    for _ in range(3):
        t, tokens = decode(piecewise)
        times.append(t)
    s = sorted(times)[1]
    x = torch.tensor([prompt], device="cuda")
    g = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=0,
    )
    result["piecewise"] = {
        "tokens_per_s": n / s,
        "pct_of_bound": 100 * n / s / bound,
        "buffered_cache": piecewise.buffered,
        "graphs": len(piecewise.graphs),
        "capture_error": piecewise.capture_error,
        "tokens_equal_generate": tokens == g[0, x.shape[1] :].tolist(),
    }
    eager = PiecewiseDecoder(engine.body, engine.head, graphs=False)
    floor = result["kernel_floor"] = kernel_floor(eager, prompt, args.profile_steps)
    ceiling = floor["kernel_floor_tokens_per_s"]
    floor["pct_of_bound"] = 100 * ceiling / bound
    floor["piecewise_pct_of_floor"] = 100 * (n / s) / ceiling
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str))
    print(
        f"HBM bound {bound:.0f} tok/s; one step runs {floor['kernels_per_step']:.0f} kernels,"
        f" {floor['kernel_ms_per_step']:.3f} ms of GPU time -> at most {ceiling:.0f} tok/s"
        f" ({floor['pct_of_bound']:.1f}% of the bound); the piecewise decode {n / s:.0f} tok/s"
        f" ({floor['piecewise_pct_of_floor']:.0f}% of that ceiling)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    with torch.inference_mode():
        main()
