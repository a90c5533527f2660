"""Teacher-forced scan vs decode replay of one trace: the scan finds t* in one forward instead of
T decode steps. Default: a 256-token trace (DESIGN target: scan >= 20x faster).

    python benchmarks/scan.py --model replay_audit/assets/tiny-llama --device cpu --threads 1
    python benchmarks/scan.py --tinyllama --device cuda

The trace is produced by our own decode in the logged format (`--logged-dtype`, default bf16);
the replay runs in `--dtype` (default fp16). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import build_engine, random_tinyllama, sync

from replay_audit.engine.protocol import Target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tinyllama", action="store_true")
    ap.add_argument("--logged-dtype", default="bf16")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--cache", default="dynamic", choices=["dynamic", "static"])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

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


if __name__ == "__main__":
    main()
