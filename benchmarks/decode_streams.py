"""Faithful decode, overlapped: K batch-1 piecewise decodes in one process, each on its own
CUDA stream with its own CUDA graphs (one `PiecewiseDecoder` each, sharing the weights), driven
by K host threads. Aggregate tok/s against K, every stream's tokens and float32 logits compared
bitwise with the same prompt decoded alone, the lone decodes' tokens with transformers'
`generate()`, and the kernel timeline's overlap (a torch profiler trace: the sum of kernel
times over the time at least one kernel runs; 1.0 means no two kernels ever ran together).

Batching the K prompts into one forward would be faster, and would change the bits: batch size
is a numerical knob (the paper's batch-size appendix). Streams keep each decode's kernels, and
so its bits, those of a lone decode.

    python benchmarks/decode_streams.py --tinyllama --device cuda --streams 1 2 4 8 --out S.json
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.utils.deterministic
from _models import build_engine, random_tinyllama

from replay_audit.engine.piecewise import PiecewiseDecoder
from replay_audit.engine.protocol import Intervention, Target


def greedy(
    dec: PiecewiseDecoder, prompt: list[int], n: int, logits: torch.Tensor | None
) -> list[int]:
    """n greedy tokens from `prompt`; each step's float32 logits into `logits[i]` when given."""
    out = dec.prefill(prompt, 1)
    tokens: list[int] = []
    for i in range(n):
        token = int(out.top.native[0])
        tokens.append(token)
        if i + 1 == n:
            break
        out = dec.step(token)
        if logits is not None:
            logits[i].copy_(out.logits)
    return tokens


class Streams:
    """K host threads, each with its own CUDA stream and decoder, kept for the whole run:
    cuDNN's attention builds an execution plan per key length and per thread, so a new thread
    would pay for every length again (about 35 ms a step)."""

    def __init__(self, decoders: list[PiecewiseDecoder]) -> None:
        self.decoders = decoders
        dev = decoders[0].body.device
        self.streams = [torch.cuda.Stream(device=dev) for _ in decoders]
        self.inbox: list[queue.Queue[Any]] = [queue.Queue() for _ in decoders]
        self.done: queue.Queue[tuple[int, list[int]]] = queue.Queue()
        for i in range(len(decoders)):
            threading.Thread(target=self._work, args=(i,), daemon=True).start()

    def _work(self, i: int) -> None:
        with torch.inference_mode(), torch.cuda.stream(self.streams[i]):
            while True:
                prompt, n, logits, start = self.inbox[i].get()
                start.wait()
                tokens = greedy(self.decoders[i], prompt, n, logits)
                self.streams[i].synchronize()
                self.done.put((i, tokens))

    def run(
        self, k: int, prompts: list[list[int]], n: int, record: bool
    ) -> tuple[float, list[list[int]], list[torch.Tensor | None]]:
        """The first k decoders at once, each on its prompt; wall seconds."""
        dev = self.decoders[0].body.device
        vocab = self.decoders[0].head.vocab_size
        logits = [torch.empty((n, vocab), device=dev) if record else None for _ in range(k)]
        start = threading.Event()
        for i in range(k):
            self.inbox[i].put((prompts[i], n, logits[i], start))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.set()
        tokens: list[list[int]] = [[] for _ in range(k)]
        for _ in range(k):
            i, toks = self.done.get()
            tokens[i] = toks
        torch.cuda.synchronize()
        return time.perf_counter() - t0, tokens, logits


def overlap(trace_path: Path) -> dict[str, float]:
    """Sum of kernel durations over the union of their intervals, from a chrome trace."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in events
        if e.get("cat") == "kernel" and "dur" in e
    )
    busy, total, end = 0.0, 0.0, -1.0
    start = spans[0][0] if spans else 0.0
    for a, b in spans:
        total += b - a
        if a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    wall = (end - start) if spans else 0.0
    return {
        "kernels": float(len(spans)),
        "kernel_us_sum": total,
        "busy_us": busy,
        "window_us": wall,
        "overlap_factor": total / busy if busy else 0.0,
        "gpu_busy_share": busy / wall if wall else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, help="checkpoint directory")
    ap.add_argument("--tinyllama", action="store_true", help="random TinyLlama-shaped model")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--identity-tokens", type=int, default=64)
    ap.add_argument("--profile-streams", type=int, default=4, help="0: no profile")
    ap.add_argument("--host-profile", action="store_true", help="top host ops, alone vs thread")
    ap.add_argument("--start-at", type=float, default=None, help="one process of K: start time")
    ap.add_argument("--seed", type=int, default=0, help="the prompts' random seed")
    ap.add_argument("--no-cudnn-sdp", action="store_true", help="SDPA without cuDNN attention")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    target = Target(args.dtype, None, "sdpa", 1, Intervention())
    model = random_tinyllama(args.dtype, args.device) if args.tinyllama else None
    engine = build_engine(args.model, target, args.device, model=model)
    model = engine.body.model
    dev = engine.body.device
    vocab = engine.head.vocab_size
    # The engine's decode does this per step; K threads would race on the process-wide flag
    # (it changes no value: `PiecewiseDecoder.step`).
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    if args.no_cudnn_sdp:  # for generate() too: the whole process
        torch.backends.cuda.enable_cudnn_sdp(False)
    rng = random.Random(args.seed)
    kmax = max(args.streams)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(kmax)]
    if args.start_at is not None:
        kmax, prompts = 1, [[rng.randrange(3, vocab) for _ in range(args.prompt_len)]]
    decoders = [PiecewiseDecoder(engine.body, engine.head) for _ in range(kmax)]
    with torch.inference_mode():
        for d, p in zip(decoders, prompts, strict=True):
            greedy(d, p, 3, None)  # capture each decoder's graphs, one at a time
    if args.start_at is not None:  # one of K processes (under MPS): a lone decode, timed
        with torch.inference_mode():
            greedy(decoders[0], prompts[0], args.tokens, None)  # this thread's plans
            torch.cuda.synchronize()
            time.sleep(max(0.0, args.start_at - time.time()))
            t0 = time.time()
            for _ in range(args.repeats):
                tokens = greedy(decoders[0], prompts[0], args.tokens, None)
            torch.cuda.synchronize()
            end = time.time()
            x = torch.tensor(prompts, device=dev)
            generated = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=args.tokens,
                min_new_tokens=args.tokens,
                pad_token_id=0,
            )[0, args.prompt_len :].tolist()
        run = {"start": t0, "end": end, "tokens": args.tokens * args.repeats}
        differ = [i for i, (a, b) in enumerate(zip(tokens, generated, strict=True)) if a != b]
        first = differ[0] if differ else None
        print(json.dumps(run | {"same_as_generate": tokens == generated, "first_differs": first}))
        return
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "graphs": all(bool(d.graphs) for d in decoders),
        "capture_errors": [d.capture_error for d in decoders if d.capture_error],
        "runs": [],
    }

    # 1. Identity: each prompt decoded alone (default stream) vs in a K-stream run.
    m = args.identity_tokens
    alone_tokens, alone_logits = [], []
    with torch.inference_mode():
        for d, p in zip(decoders, prompts, strict=True):
            buf = torch.empty((m, vocab), device=dev)
            alone_tokens.append(greedy(d, p, m, buf))
            alone_logits.append(buf)
        generated = []
        for p in prompts:
            x = torch.tensor([p], device=dev)
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=m,
                min_new_tokens=m,
                pad_token_id=0,
            )
            generated.append([int(t) for t in out[0, len(p) :].tolist()])
    pool = Streams(decoders)
    pool.run(kmax, prompts, args.tokens, record=False)  # each thread's plans, every length
    _, toks, logits = pool.run(kmax, prompts, m, record=True)
    report["identity"] = {
        "streams": kmax,
        "tokens_equal_alone": all(a == b for a, b in zip(toks, alone_tokens, strict=True)),
        "logits_bitwise_alone": all(
            torch.equal(a[: m - 1], b[: m - 1])  # type: ignore[index]
            for a, b in zip(logits, alone_logits, strict=True)
        ),
        "alone_tokens_equal_generate": all(
            a == g for a, g in zip(alone_tokens, generated, strict=True)
        ),
    }
    print("identity", report["identity"], file=sys.stderr)

    # 2. Aggregate tok/s against K, after one decode alone on the default stream (the
    # single-stream figure as the engine's decode runs it).
    with torch.inference_mode():
        greedy(decoders[0], prompts[0], args.tokens, None)  # this thread's plans
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        greedy(decoders[0], prompts[0], args.tokens, None)
        torch.cuda.synchronize()
        report["alone_tokens_per_s"] = args.tokens / (time.perf_counter() - t0)
    print(f"alone: {report['alone_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    if args.host_profile:
        from torch.profiler import ProfilerActivity, profile

        for k in (0, 1):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                if k == 0:
                    with torch.inference_mode():
                        greedy(decoders[0], prompts[0], 16, None)
                else:
                    pool.run(1, prompts, 16, record=False)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
            print(
                f"host profile ({'alone' if k == 0 else 'one thread'}):\n{table}", file=sys.stderr
            )

    for k in args.streams:
        times = []
        for _ in range(args.repeats):
            s, _, _ = pool.run(k, prompts, args.tokens, record=False)
            times.append(s)
        best = min(times)
        run = {"streams": k, "seconds": times, "tokens_per_s": k * args.tokens / best}
        report["runs"].append(run)
        print(f"K={k}: {run['tokens_per_s']:.1f} tok/s aggregate", file=sys.stderr)
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))
    one = next((r for r in report["runs"] if r["streams"] == 1), None)
    if one:
        for r in report["runs"]:
            r["x_single"] = r["tokens_per_s"] / one["tokens_per_s"]

    # 3. The kernel timeline at K = profile_streams (and K = 1 to compare).
    if args.profile_streams and args.out:
        from torch.profiler import ProfilerActivity, profile

        report["timeline"] = {}
        for k in sorted({1, min(args.profile_streams, kmax)}):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                pool.run(k, prompts, 32, record=False)
            path = args.out.with_name(f"{args.out.stem}_trace_k{k}.json")
            prof.export_chrome_trace(str(path))
            report["timeline"][str(k)] = overlap(path)
            path.unlink()  # large; the figures above are what is kept
            print(f"timeline K={k}: {report['timeline'][str(k)]}", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
