"""The batched scan under `torch.profiler`: where its time goes (`benchmarks/scan.py --profile`).

The engine's scan is annotated from the outside (its methods wrapped on the instance in
`record_function` ranges, nothing in the engine changed):

    scan.batch     Engine.scan_batch: planning, packing rows on the host, every forward
    scan.forward   one forward (`_scan_packed`): ids to the device, the body, the steps
    scan.body      the transformer body (`Body.forward_rows`: transformers' `model.model`)
    scan.steps     what follows the body (`_scan_steps`): top-k, margins, logged evidence
    scan.lm_head   the native lm_head over the output positions (`LmHead.native_steps`)

Each GPU kernel is attributed to the innermost range that was open on the host thread when it
was launched (its CUDA runtime call, matched by correlation id) and to the innermost `aten::`
op that launched it, then put in one class:

    body GEMM            matrix products launched inside scan.body
    lm_head GEMM         matrix products launched inside scan.lm_head
    attention            SDPA's kernels (flash, memory-efficient, cuDNN)
    norm/elementwise/RoPE  the rest of the body: RMSNorm's reductions, RoPE, SiLU*up, residuals
    copies/casts         memcpy, memset, dtype casts and copies (aten::copy_, _to_copy, clone)
    other                everything else: top-k, gathers, the logged tokens' evidence

On the CPU (no kernels) the same classes are given to the `aten::` ops' self time, so the mode
runs anywhere; its GPU figures (idle share, TFLOP/s, share of peak) are then null.

FLOPs are counted from the model's shape: per layer the linear layers (q, k, v, o, gate, up,
down), causal attention (QK^T and PV over the n(n+1)/2 query-key pairs of each row, as flash
attention computes them), and the lm_head over the output positions only (the scan computes no
logits for the prompt or for padding). `executed` counts what the forwards ran (rows padded to
their bucket length); `per_traced_token` counts the traces' own tokens (prompt + output) only.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

#: The annotated ranges, outermost first (the innermost open one names a kernel's region).
REGIONS = ("scan.batch", "scan.forward", "scan.body", "scan.steps", "scan.lm_head")
CLASSES = (
    "body GEMM",
    "lm_head GEMM",
    "attention",
    "norm/elementwise/RoPE",
    "copies/casts",
    "other",
)
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_mm")
GEMM_KERNEL_WORDS = ("gemm", "xmma", "nvjet", "cublas", "cutlass", "wgmma", "s16816", "s1688")
ATTENTION_WORDS = ("flash", "fmha", "attention", "sdpa", "scaled_dot_product", "attn")
COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous")
BODY_REGIONS = ("scan.body",)


# -- annotation --------------------------------------------------------------------------------


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def annotated(engine: Any) -> Iterator[None]:
    """`engine`'s scan methods wrapped in the named ranges (instance attributes, removed after)."""
    patches = [
        (engine, "scan_batch", "scan.batch"),
        (engine, "_scan_packed", "scan.forward"),
        (engine, "_scan_steps", "scan.steps"),
        (engine.body, "forward_rows", "scan.body"),
        (engine.head, "native_steps", "scan.lm_head"),
    ]
    for obj, attr, name in patches:
        object.__setattr__(obj, attr, _wrap(name, getattr(obj, attr)))
    try:
        yield
    finally:
        for obj, attr, _ in patches:
            with contextlib.suppress(AttributeError):
                object.__delattr__(obj, attr)


# -- FLOPs -------------------------------------------------------------------------------------


def model_shape(model: Any) -> dict[str, int]:
    c = model.config
    heads = int(c.num_attention_heads)
    hidden = int(c.hidden_size)
    head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
    return {
        "hidden": hidden,
        "intermediate": int(c.intermediate_size),
        "layers": int(c.num_hidden_layers),
        "heads": heads,
        "kv_heads": int(getattr(c, "num_key_value_heads", None) or heads),
        "head_dim": head_dim,
        "vocab": int(c.vocab_size),
    }


def flops(shape: dict[str, int], rows: Sequence[tuple[int, int, int]]) -> dict[str, float]:
    """FLOPs of scanning rows (context length n, padded length L, output positions o):
    body GEMMs, attention and the lm_head, executed (at L) and useful (at n)."""
    d, f, lay = shape["hidden"], shape["intermediate"], shape["layers"]
    q, kv = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    linear_per_token = 2 * lay * (d * q + 2 * d * kv + q * d + 3 * d * f)
    attn_per_pair = 2 * 2 * lay * q  # QK^T and PV, 2 FLOPs a multiply-add

    def attn(n: int) -> float:
        return attn_per_pair * n * (n + 1) / 2

    head = sum(2 * d * shape["vocab"] * o for _, _, o in rows)
    return {
        "body_gemm_executed": float(sum(linear_per_token * padded for _, padded, _ in rows)),
        "body_gemm_useful": float(sum(linear_per_token * n for n, _, _ in rows)),
        "attention_executed": float(sum(attn(padded) for _, padded, _ in rows)),
        "attention_useful": float(sum(attn(n) for n, _, _ in rows)),
        "lm_head": float(head),
        "linear_per_token": float(linear_per_token),
    }


# -- the trace ---------------------------------------------------------------------------------


def _is_gemm(name: str, op: str | None) -> bool:
    low = name.lower()
    if any(w in low for w in ATTENTION_WORDS):
        return False
    return any(w in low for w in GEMM_KERNEL_WORDS) or (op is not None and op in GEMM_OPS)


def _is_attention(name: str, op: str | None) -> bool:
    low = (name + " " + (op or "")).lower()
    return any(w in low for w in ATTENTION_WORDS)


def classify(name: str, cat: str, region: str | None, op: str | None) -> str:
    """A kernel's (or a CPU op's) class, from its name, its launching aten op and its region."""
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "copies/casts"
    if _is_attention(name, op):
        return "attention"
    if _is_gemm(name, op):
        if region == "scan.lm_head":
            return "lm_head GEMM"
        if region in BODY_REGIONS:
            return "body GEMM"
        return "other"
    low = name.lower()
    if (op is not None and op in COPY_OPS) or "copy" in low or "memcpy" in low:
        return "copies/casts"
    if region in BODY_REGIONS:
        return "norm/elementwise/RoPE"
    return "other"


def _sweep(
    events: list[dict[str, Any]], queries: list[float]
) -> list[tuple[str | None, str | None]]:
    """For each moment of `queries`, the innermost annotated region (REGIONS) and the innermost
    `aten::` op open on one thread at that moment, from that thread's host events (cpu ops and
    user annotations, properly nested)."""
    evs = sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0)))
    order = sorted(range(len(queries)), key=lambda i: queries[i])
    out: list[tuple[str | None, str | None]] = [(None, None)] * len(queries)
    stack: list[dict[str, Any]] = []
    j = 0
    for qi in order:
        t = queries[qi]
        while j < len(evs) and evs[j]["ts"] <= t:
            ev = evs[j]
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < ev["ts"]:
                stack.pop()
            stack.append(ev)
            j += 1
        while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < t:
            stack.pop()
        open_now = [e for e in stack if e["ts"] + e.get("dur", 0) >= t]
        out[qi] = _region_and_op(open_now)
    return out


def _self_times(events: list[dict[str, Any]]) -> list[tuple[str, float, str | None]]:
    """One thread's `cpu_op` events as (name, self time, innermost region): each op's duration
    less its direct child ops' (annotations in between are transparent)."""
    evs = sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0)))
    out: list[tuple[str, float, str | None]] = []
    # (event, time of its child ops, region it is in)
    stack: list[tuple[dict[str, Any], list[float], str | None]] = []

    def end(e: dict[str, Any]) -> float:
        return float(e["ts"] + e.get("dur", 0))

    def pop() -> None:
        ev, child, region = stack.pop()
        if ev.get("cat") == "cpu_op":
            out.append((ev["name"], float(ev.get("dur", 0)) - child[0], region))

    for ev in evs:
        while stack and end(stack[-1][0]) <= ev["ts"]:
            pop()
        region = stack[-1][2] if stack else None
        if ev.get("cat") == "user_annotation" and ev["name"] in REGIONS:
            region = ev["name"]
        if ev.get("cat") == "cpu_op":
            for parent, child, _ in reversed(stack):
                if parent.get("cat") == "cpu_op":
                    child[0] += float(ev.get("dur", 0))
                    break
        stack.append((ev, [0.0], region))
    while stack:
        pop()
    return out


def _region_and_op(open_events: list[dict[str, Any]]) -> tuple[str | None, str | None]:
    region = op = None
    for e in open_events:  # outermost first: the last match is the innermost
        if e.get("cat") == "user_annotation" and e["name"] in REGIONS:
            region = e["name"]
        elif e.get("cat") == "cpu_op" and e["name"].startswith("aten::"):
            op = e["name"]
    return region, op


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def analyse_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-class and per-kernel device time of a chrome trace's events (torch.profiler's
    export), or the CPU ops' self time where the trace has no kernels."""
    host: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    launches: dict[Any, dict[str, Any]] = {}
    device: list[dict[str, Any]] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        if cat in ("cpu_op", "user_annotation"):
            host[(e.get("pid"), e.get("tid"))].append(e)
        elif cat in ("cuda_runtime", "cuda_driver"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = e
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            device.append(e)
    by_class: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
    by_kernel: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    by_region: dict[str, float] = defaultdict(float)

    def count(name: str, cls: str, region: str | None, dur: float) -> None:
        by_class[cls] += dur
        by_region[region or "outside"] += dur
        slot = by_kernel[(name, cls)]
        slot[0] += dur
        slot[1] += 1

    host_us: dict[str, float] = defaultdict(float)
    for evs in host.values():
        for e in evs:
            if e.get("cat") == "user_annotation" and e["name"] in REGIONS:
                host_us[e["name"]] += float(e.get("dur", 0.0))
    span: float | None = None
    unattributed = 0
    if device:
        # Each kernel's launch (its runtime call on a host thread), looked up per thread.
        per_thread: dict[Any, list[int]] = defaultdict(list)
        launch_of: list[dict[str, Any] | None] = []
        for i, k in enumerate(device):
            launch = launches.get((k.get("args") or {}).get("correlation"))
            launch_of.append(launch)
            if launch is not None:
                per_thread[(launch.get("pid"), launch.get("tid"))].append(i)
        found: dict[int, tuple[str | None, str | None]] = {}
        for key, idx in per_thread.items():
            times = [float(launch_of[i]["ts"]) for i in idx]  # type: ignore[index]
            for i, ro in zip(idx, _sweep(host.get(key, []), times), strict=True):
                found[i] = ro
        unattributed = sum(1 for i in range(len(device)) if i not in found)
        for i, k in enumerate(device):
            region, op = found.get(i, (None, None))
            count(
                k["name"],
                classify(k["name"], k.get("cat", ""), region, op),
                region,
                float(k.get("dur", 0.0)),
            )
        busy = _union_length([(k["ts"], k["ts"] + k.get("dur", 0.0)) for k in device])
        span = max(k["ts"] + k.get("dur", 0.0) for k in device) - min(k["ts"] for k in device)
        source = "device kernels"
    else:  # CPU: aten ops' self time
        for evs in host.values():
            for name, own, region in _self_times(evs):
                count(name, classify(name, "cpu_op", region, name), region, own)
        busy = sum(by_class.values())
        source = "cpu ops (self time)"
    total = sum(by_class.values()) or 1.0
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:15]
    return {
        "source": source,
        "time_us": {c: round(v, 1) for c, v in by_class.items()},
        "share": {c: round(v / total, 4) for c, v in by_class.items()},
        "time_us_by_region": {r: round(v, 1) for r, v in sorted(by_region.items())},
        "busy_us": round(busy, 1),
        "host_us_by_region": {r: round(host_us[r], 1) for r in REGIONS},
        "device_events": len(device),
        "device_events_without_launch": unattributed,
        "span_us": round(span, 1) if span is not None else None,
        "top": [
            {
                "name": name[:160],
                "class": cls,
                "calls": int(n),
                "time_us": round(t, 1),
                "share": round(t / total, 4),
            }
            for (name, cls), (t, n) in top
        ],
    }


# -- the run -----------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile_scan(
    engine: Any,
    items: Sequence[Any],
    run_batch: Callable[[], Any],
    *,
    budget: int,
    warmup: int,
    timed: int,
    profiled: int,
    peak_flops: float,
    trace_out: Path | None = None,
) -> dict[str, Any]:
    """Warm-up, `timed` plain runs of `run_batch` (the wall time per batch), then `profiled`
    runs under the profiler; the analysis as one JSON-able dict."""
    from replay_audit.engine.batch import context_length, plan_scan

    device = engine.device
    plan = plan_scan(list(items), budget)
    rows = []
    for b in plan:
        for i in b.indices:
            it = items[i]
            n = context_length(it)
            rows.append((n, b.padded_length if b.rows > 1 else n, len(it.output_ids)))
    shape = model_shape(engine.model)
    fl = flops(shape, rows)
    traced_tokens = sum(len(it.prompt_ids) + len(it.output_ids) for it in items)
    executed = fl["body_gemm_executed"] + fl["attention_executed"] + fl["lm_head"]
    useful = fl["body_gemm_useful"] + fl["attention_useful"] + fl["lm_head"]
    params = sum(p.numel() for p in engine.model.parameters())

    with annotated(engine):
        for _ in range(warmup):
            run_batch()
        _sync(device)
        walls = []
        for _ in range(timed):
            _sync(device)
            t0 = time.perf_counter()
            run_batch()
            _sync(device)
            walls.append(time.perf_counter() - t0)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        prof_walls = []
        with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
            for _ in range(profiled):
                _sync(device)
                t0 = time.perf_counter()
                run_batch()
                _sync(device)
                prof_walls.append(time.perf_counter() - t0)
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        raw = Path(tmp).read_bytes()
    finally:
        os.unlink(tmp)
    if trace_out is not None:
        trace_out.write_bytes(gzip.compress(raw, 6) if trace_out.suffix == ".gz" else raw)
    events = json.loads(raw)["traceEvents"]
    analysis = analyse_trace(events)

    wall = statistics.median(walls) if walls else statistics.median(prof_walls)
    prof_wall_us = sum(prof_walls) * 1e6
    on_gpu = device.type == "cuda"
    per = {c: v / profiled for c, v in analysis["time_us"].items()}  # us per batch
    gemm_us = per["body GEMM"] + per["lm_head GEMM"]

    def tflops(f: float, us: float) -> float | None:
        return round(f / (us * 1e-6) / 1e12, 1) if on_gpu and us > 0 else None

    tokens_per_s = traced_tokens / wall
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "model_shape": shape,
        "parameters": params,
        "traces": len(items),
        "traced_tokens": traced_tokens,
        "forwards_per_batch": len(plan),
        "batch_shapes": sorted({f"{b.rows}x{b.padded_length}" for b in plan}),
        "token_budget": budget,
        "warmup": warmup,
        "timed_batches": timed,
        "profiled_batches": profiled,
        "wall_s_per_batch": round(wall, 6),
        "wall_s_per_batch_profiled": round(statistics.median(prof_walls), 6),
        "traces_per_hour": round(len(items) / wall * 3600),
        "tokens_per_s": round(tokens_per_s),
        "flops": {
            "body_gemm_per_batch": fl["body_gemm_executed"],
            "attention_per_batch": fl["attention_executed"],
            "lm_head_per_batch": fl["lm_head"],
            "executed_per_batch": executed,
            "useful_per_batch": useful,
            "per_traced_token": round(useful / traced_tokens),
            "two_x_params_per_token": 2 * params,
        },
        "peak_flops": peak_flops if on_gpu else None,
        "fraction_of_peak": {
            "useful": round(tokens_per_s * useful / traced_tokens / peak_flops, 4)
            if on_gpu
            else None,
            "executed": round(executed / wall / peak_flops, 4) if on_gpu else None,
            "two_x_params": round(tokens_per_s * 2 * params / peak_flops, 4) if on_gpu else None,
        },
        "tflops": {
            "whole_step": tflops(executed, wall * 1e6),
            "gemms": tflops(fl["body_gemm_executed"] + fl["lm_head"], gemm_us),
            "body_gemms": tflops(fl["body_gemm_executed"], per["body GEMM"]),
            "lm_head_gemm": tflops(fl["lm_head"], per["lm_head GEMM"]),
            "attention": tflops(fl["attention_executed"], per["attention"]),
        },
        "time_source": analysis["source"],
        "share_of_time": analysis["share"],
        "ms_per_batch": {c: round(v / 1e3, 3) for c, v in per.items()},
        # Device time (CPU: ops' self time) by the innermost range open at launch.
        "ms_per_batch_by_region": {
            r: round(v / profiled / 1e3, 3) for r, v in analysis["time_us_by_region"].items()
        },
        "host_ms_per_batch_by_range": {
            r: round(v / profiled / 1e3, 3) for r, v in analysis["host_us_by_region"].items()
        },
        "device_events": analysis["device_events"],
        "device_events_without_launch": analysis["device_events_without_launch"],
        "gpu_busy_ms_per_batch": round(analysis["busy_us"] / profiled / 1e3, 3) if on_gpu else None,
        "gpu_idle_share_of_wall": round(1 - analysis["busy_us"] / prof_wall_us, 4)
        if on_gpu
        else None,
        "gpu_idle_share_of_span": round(1 - analysis["busy_us"] / analysis["span_us"], 4)
        if on_gpu and analysis["span_us"]
        else None,
        "gemm_share_of_wall": round(gemm_us * profiled / prof_wall_us, 4) if on_gpu else None,
        "top_kernels": analysis["top"],
    }
    return out


def print_table(result: dict[str, Any], file: Any = sys.stderr) -> None:
    """A short human table of `profile_scan`'s result."""
    p = print
    p(
        f"\nbatched scan on {result['device']}: {result['traces']} traces, "
        f"{result['traced_tokens']} tokens, {result['forwards_per_batch']} forward(s) "
        f"{', '.join(result['batch_shapes'])}; {result['wall_s_per_batch'] * 1e3:.1f} ms a batch, "
        f"{result['traces_per_hour']:,} traces/h",
        file=file,
    )
    frac = result["fraction_of_peak"]
    if frac["useful"] is not None:
        t = result["tflops"]
        p(
            f"share of bf16 peak ({result['peak_flops'] / 1e12:.0f} TFLOP/s): {frac['useful']:.1%} "
            f"(useful FLOPs, {result['flops']['per_traced_token'] / 1e9:.3f} GFLOP per traced "
            f"token), {frac['two_x_params']:.1%} at 2 x params; TFLOP/s whole step "
            f"{t['whole_step']}, GEMMs {t['gemms']} (body {t['body_gemms']}, lm_head "
            f"{t['lm_head_gemm']}), attention {t['attention']}",
            file=file,
        )
        span = result["gpu_idle_share_of_span"]
        p(
            f"GPU idle: {result['gpu_idle_share_of_wall']:.1%} of the wall time "
            f"({'n/a' if span is None else f'{span:.1%}'} of the kernels' span); GEMMs fill "
            f"{result['gemm_share_of_wall']:.1%} of the wall time",
            file=file,
        )
    host = result["host_ms_per_batch_by_range"]
    p(
        "host time in the ranges (ms a batch, each including the ranges inside it): "
        + ", ".join(f"{r} {v:.2f}" for r, v in host.items()),
        file=file,
    )
    p(f"\n{'class':<24}{'ms/batch':>10}{'share':>8}   ({result['time_source']})", file=file)
    for c in CLASSES:
        p(
            f"{c:<24}{result['ms_per_batch'][c]:>10.3f}{result['share_of_time'][c]:>8.1%}",
            file=file,
        )
    p(f"\n{'top kernels':<88}{'class':<22}{'calls':>6}{'ms':>9}{'share':>8}", file=file)
    n_batches = result["profiled_batches"]
    for k in result["top_kernels"]:
        p(
            f"{k['name'][:86]:<88}{k['class']:<22}{k['calls'] // n_batches:>6}"
            f"{k['time_us'] / n_batches / 1e3:>9.3f}{k['share']:>8.1%}",
            file=file,
        )
