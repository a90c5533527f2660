"""A logged batch replayed row by row against the same batch replayed at once (issue 32):
`Engine.decode_batch` runs the rows of one logged batch in one `generate()` of that batch, each
at its logged row; a lone decode of a row runs the same batch with filler in the other rows.
Does each row get the lone decode's bits on this device, and how much faster is the batch?

One batched `generate()` call logs `--batch` prompts (plain transformers, left-padded, default
kernels: `engine.generate.TraceGenerator.trace_batch`, as a user's batched call). Then, for the
logged configuration (self) and each `--target` dtype at the logged batch size:

* `--alone` rows decoded alone (`Engine.decode` with the row's layout: a whole batch's decode
  for one row), timed;
* every row at once (`Engine.decode_batch`), timed;
* the alone rows compared with their rows of the batch, bit for bit: tokens, every step's top-k
  logits and margins; self-replay: every row of the batch against its logged tokens.

    python benchmarks/decode_rows.py --model replay_audit/assets/tiny-llama --device cpu \\
        --batch 8 --alone 3 --max-new-tokens 16                  # a CPU smoke run, seconds
    python benchmarks/decode_rows.py --model DIR --device cuda --batch 256 --alone 8 \\
        --max-new-tokens 128 --out $OUT                           # one lent GPU

Prompts: the bundled prompt set (`replay_audit/assets/prompts.jsonl`), reused round robin with a
numbered prefix where `--batch` asks for more. Writes `--out`/decode_rows.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replay_audit.engine import DecodeRequest, DecodeRun, EnginePool, Target  # noqa: E402
from replay_audit.engine.generate import TraceGenerator  # noqa: E402
from replay_audit.replays.domain import LoggedTrace  # noqa: E402
from replay_audit.traces.schemas import TraceCreate  # noqa: E402


def prompts(n: int) -> list[tuple[str, str]]:
    path = ROOT / "replay_audit" / "assets" / "prompts.jsonl"
    texts = [json.loads(x)["prompt"] for x in path.read_text().splitlines() if x.strip()]
    return [
        (f"p{i}", texts[i % len(texts)] if i < len(texts) else f"# {i}\n{texts[i % len(texts)]}")
        for i in range(n)
    ]


def same(a: DecodeRun, b: DecodeRun) -> bool:
    return (
        a.output_token_ids == b.output_token_ids
        and np.array_equal(a.steps.top_k_ids, b.steps.top_k_ids)
        and np.array_equal(a.steps.top_k_logits, b.steps.top_k_logits)
        and np.array_equal(a.steps.margins, b.steps.margins, equal_nan=True)
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def arm(
    pool: EnginePool, model: Path, target: Target, traces: list[LoggedTrace], args: Any
) -> dict[str, Any]:
    engine = pool.get(model, target)
    requests = [
        DecodeRequest(
            t.prompt_token_ids.tolist(),
            args.max_new_tokens,
            t.budget()[1],
            layout=t.batch_layout,
        )
        for t in traces
    ]
    # Warm-up: one row alone, then two together (kernels, cuDNN plans for these lengths).
    engine.decode_batch(requests[:1])
    engine.decode_batch(requests[:2])
    sync(args.device)
    t0 = time.perf_counter()
    alone = [engine.decode_batch([r])[0] for r in requests[: args.alone]]
    sync(args.device)
    alone_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    together = engine.decode_batch(requests)
    sync(args.device)
    together_s = time.perf_counter() - t0
    profile = where_time_goes(engine, requests[0], traces, args) if args.profile else None
    equal = sum(same(a, b) for a, b in zip(alone, together, strict=False))
    logged = [
        r.output_token_ids == t.output_token_ids.tolist()
        for r, t in zip(together, traces, strict=True)
    ]
    per_row = alone_s / max(1, args.alone)
    return {
        "target": {"dtype": target.dtype, "batch_size": target.batch_size},
        "rows": len(requests),
        "rows_together": sorted({r.rows for r in together}),
        "alone_rows": args.alone,
        "alone_s": round(alone_s, 3),
        "alone_s_per_row": round(per_row, 4),
        "together_s": round(together_s, 3),
        "speedup_per_row": round(per_row * len(requests) / together_s, 1),
        "alone_equal_together": f"{equal}/{min(args.alone, len(requests))}",
        "rows_equal_logged": f"{sum(logged)}/{len(logged)}",
        "tokens": sum(len(r.output_token_ids) for r in together),
        **({"profile": profile} if profile is not None else {}),
    }


def where_time_goes(
    engine: Any, request: DecodeRequest, traces: list[LoggedTrace], args: Any
) -> dict[str, Any]:
    """`--profile`: the user's plain `generate()` of the same batch (the same model object,
    the same rows, greedy, nothing read per step), timed against the arm's lone-row decode,
    and torch's profiler over that decode: where a logged batch's replay spends its steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from replay_audit.engine.decoder import left_padded

    gen = engine.generate
    model, dev = gen.body.model, gen.body.device
    ids, mask = left_padded([t.prompt_token_ids.tolist() for t in traces], gen.pad_id)
    x = torch.tensor(ids, device=dev)
    m = torch.tensor(mask, device=dev)
    steps = args.max_new_tokens

    def plain() -> int:
        with torch.inference_mode():
            out = model.generate(
                input_ids=x, attention_mask=m, do_sample=False, max_new_tokens=steps,
                min_new_tokens=steps, pad_token_id=gen.pad_id,
            )  # fmt: skip
        return int(out.shape[1] - x.shape[1])

    plain()
    sync(args.device)
    t0 = time.perf_counter()
    plain_steps = plain()
    sync(args.device)
    plain_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = engine.decode_batch([request])[0]
    sync(args.device)
    ours_s = time.perf_counter() - t0
    activities = [ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        engine.decode_batch([request])
        sync(args.device)
    table = prof.key_averages()
    text = "\n\n".join(
        table.table(sort_by=key, row_limit=25, max_name_column_width=60)
        for key in ("self_cpu_time_total", "self_device_time_total" if len(activities) > 1
                    else "cpu_time_total")
    )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"profile_{engine.target.dtype}.txt").write_text(text)
    ours_steps = len(ours.output_token_ids) - ours.start_step
    return {
        "plain_generate_s": round(plain_s, 3),
        "plain_generate_ms_per_step": round(1000 * plain_s / max(1, plain_steps), 2),
        "lone_row_decode_s": round(ours_s, 3),
        "lone_row_decode_ms_per_step": round(1000 * ours_s / max(1, ours_steps), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--target", nargs="*", default=["fp16"])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--alone", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("/tmp/decode_rows"))
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also time the user's plain generate() of the batch against a lone-row decode, "
        "and write torch's profiler tables of that decode (profile_DTYPE.txt)",
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    with TraceGenerator(args.model, dtype=args.dtype, device=args.device) as gen:
        logged = gen.trace_batch(prompts(args.batch), max_new_tokens=args.max_new_tokens)
    log_s = time.perf_counter() - t0
    traces = [LoggedTrace.from_json(TraceCreate.model_validate(t).model_dump()) for t in logged]
    layout = traces[0].batch_layout
    pool = EnginePool(device=args.device)
    logged_target = Target.from_config(traces[0].config)
    runs = [arm(pool, args.model, logged_target, traces, args)]
    for dtype in args.target:
        import dataclasses

        runs.append(
            arm(pool, args.model, dataclasses.replace(logged_target, dtype=dtype), traces, args)
        )
    import torch

    out = {
        "machine": {
            "device": torch.cuda.get_device_name(0)
            if args.device.startswith("cuda")
            else platform.processor(),
            "torch": torch.__version__,
        },
        "model": str(args.model),
        "batch": args.batch,
        "padded": bool(layout is not None and layout.padded),
        "max_new_tokens": args.max_new_tokens,
        "log_s": round(log_s, 2),
        "arms": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_rows.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
