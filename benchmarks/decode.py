"""Decode speed at batch size 1: our KV-cache loop on each decode path (piecewise, the faithful
default: generate()'s prefill and cache with the rest of each step in CUDA graphs; compiled:
static cache + torch.compile'd step in the CUDA graph) and on the piecewise path's reference
and fallback, transformers' own `generate()` driven by the engine ("generate"), each with and
without gated Intervention C, against a user's plain `generate()` and a plain transformers
KV-cache loop, all in one run; optionally the HBM bound measured in the same run, and the
faithful path's identity with plain `generate()`. Nothing process-wide is set: every path runs
under torch's default switches (all SDPA backends, cuDNN attention included), as plain
`generate()` does, unless `--deterministic`.

    python benchmarks/decode.py --model replay_audit/assets/tiny-llama --device cpu --threads 1
    python benchmarks/decode.py --tinyllama --device cuda --tokens 256 \\
        --variants hf_generate hf_kv_loop generate piecewise compiled --hbm \\
        --identity bf16 fp16 --out decode.json          # benchmarks/gpu_decode_fast.sh

Speed: each engine variant runs once untimed first (for the piecewise and compiled paths at
the timed length: checks, captures, compiles happen there; for the slow generate() and
transformers paths 16 tokens), then its plain and (for the `--gated` variants) gated-C decodes
are timed alternately `--repeats` times (`--dynamic-repeats` for the slow ones); medians.

`--hbm`: device memory bandwidth measured here (a reduction over `--hbm-gib` GiB: read only; a
copy: read + write, both counted) and the bound it gives for this model at batch 1: the bytes a
decode step must read (every weight but the embedding table, of which one row, plus the KV cache
at the mean length) over the better of the two bandwidths. Each speed is also given as a
percentage of it, and of `--reference-bound` (686 tok/s, the bound BENCHMARKS.md has used for
the TinyLlama shape).

`--identity DTYPE...`: in each body dtype (after the speeds, or before with `--identity-first`),
`--identity-prompts` random prompts of 8 to 96 tokens, `--identity-tokens` new tokens each:
a user's plain `generate()` (greedy, eos as the model's generation config says, raw logits,
torch's default backends) against the piecewise decoder, token for token and each step's
float32 logits with `torch.equal`, and against the engine's own `generate()` path (the first
`--identity-dynamic-tokens` steps); plus the engine's own piecewise decode (its first-decode
check included) against plain `generate()`'s tokens, and the SDPA backends plain `generate()`
ran. A random-weight model has near-ties everywhere,
so any difference in bits shows up as a flipped token quickly.

Every measurement is guarded: an exception is recorded (`{"error": ...}`) and the run goes on;
`--out` is rewritten after each one, so a run cut short keeps what it measured. `--budget-s`
skips what would start after that many seconds. Defaults: 256 tokens, 3 repeats, 16 identity
prompts of 48 tokens (24 against the generate() path); `--quick`: 128 tokens, 2 repeats, 4
identity prompts of 32 tokens (8 against the generate() path).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import build_engine, random_tinyllama, sync

from replay_audit.engine.protocol import Intervention, Target

#: The decode paths, and "generate": the piecewise path's fallback (`_models.build_engine`).
ENGINE_VARIANTS = ("generate", "piecewise", "compiled")
HF_VARIANTS = ("hf_kv_loop", "hf_generate")
#: Variants whose first call is worth the timed length (a check, a capture or a compile).
CAPTURED = ("piecewise", "compiled")
#: The batch-1 bound BENCHMARKS.md has used for the TinyLlama shape on an H100 (tok/s).
REFERENCE_BOUND = 686.0


class Report:
    """The results so far, rewritten to `path` after every measurement."""

    def __init__(self, path: Path | None, budget_s: float | None) -> None:
        self.data: dict[str, Any] = {}
        self.path = path
        self.budget_s = budget_s
        self.start = time.perf_counter()

    def save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)

    def guarded(self, key: str, fn: Callable[[], Any]) -> Any:
        """`fn()` stored under `key`, or the error it raised; None when over the budget."""
        elapsed = time.perf_counter() - self.start
        if self.budget_s is not None and elapsed > self.budget_s:
            self.data[key] = {"skipped": f"time budget: {elapsed:.0f} s > {self.budget_s} s"}
            self.save()
            return None
        t0 = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:  # record and go on: a GPU run is too dear to lose
            value = {
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-3000:],
            }
            print(f"{key}: {value['error']}", file=sys.stderr)
        if isinstance(value, dict):
            value.setdefault("wall_s", round(time.perf_counter() - t0, 2))
        self.data[key] = value
        self.save()
        return value


def once(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def step_bytes(model: Any, context: float) -> int:
    """Bytes one batch-1 decode step must read: every weight but the embedding table (one row
    of it), plus the KV cache at `context` positions."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    total -= emb.numel() * emb.element_size() - emb.shape[1] * emb.element_size()
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * emb.element_size()
    return int(total + kv * context)


def measure_hbm(device: torch.device, gib: float, model: Any, context: float) -> dict[str, Any]:
    n = int(gib * 2**30) // 2
    x = torch.ones(n, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    reads, copies = [], []
    for _ in range(5):
        reads.append(once(lambda: x.sum(dtype=torch.float32), device)[0])
        copies.append(once(lambda: y.copy_(x), device)[0])
    nbytes = 2 * n
    read_bw, copy_bw = nbytes / min(reads), 2 * nbytes / min(copies)
    per_token = step_bytes(model, context)
    # The better of the two bandwidths: the tighter (higher) bound, so no percentage flatters.
    return {
        "gib": gib,
        "read_GBps": read_bw / 1e9,
        "copy_GBps_read_plus_write": copy_bw / 1e9,
        "bytes_per_token": per_token,
        "bound_tokens_per_s": max(read_bw, copy_bw) / per_token,
    }


def percent(tps: float, report: Report) -> dict[str, float]:
    out = {"pct_of_reference_bound": 100 * tps / report.data["reference_bound_tokens_per_s"]}
    hbm = report.data.get("hbm")
    if isinstance(hbm, dict) and "bound_tokens_per_s" in hbm:
        out["pct_of_measured_bound"] = 100 * tps / hbm["bound_tokens_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, help="checkpoint directory")
    ap.add_argument("--tinyllama", action="store_true", help="random TinyLlama-shaped model")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--attn-kernel", default="sdpa")
    ap.add_argument("--tokens", type=int, default=None, help="default 256 (--quick: 128)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (--quick: 2)")
    ap.add_argument(
        "--dynamic-repeats", type=int, default=None, help="the slow paths'; default: --repeats"
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["generate", "piecewise", *HF_VARIANTS],
        choices=[*ENGINE_VARIANTS, *HF_VARIANTS],
    )
    ap.add_argument(
        "--gated",
        nargs="*",
        default=None,
        choices=ENGINE_VARIANTS,
        help="engine variants also timed with gated C (default: all of them)",
    )
    ap.add_argument("--max-cache-len", type=int, default=4096, help="compiled: largest cache")
    ap.add_argument("--tau", type=float, default=1e-3, help="gated C's threshold")
    ap.add_argument(
        "--deterministic", action="store_true", help="deterministic algorithms (not plain's)"
    )
    ap.add_argument(
        "--sdpa-backend", default=None, help="limit SDPA to one backend (every path, plain too)"
    )
    ap.add_argument("--profile", default=None, help="an engine variant: its top CUDA kernels")
    ap.add_argument("--hbm", action="store_true", help="measure the HBM bound in this run")
    ap.add_argument("--hbm-gib", type=float, default=None, help="default 2 on CUDA, 0.25 else")
    ap.add_argument("--reference-bound", type=float, default=REFERENCE_BOUND)
    ap.add_argument("--identity", nargs="*", default=[], help="dtypes: identity vs generate()")
    ap.add_argument("--identity-prompts", type=int, default=None, help="default 16 (quick 4)")
    ap.add_argument("--identity-tokens", type=int, default=None, help="default 48 (quick 32)")
    ap.add_argument(
        "--identity-dynamic-tokens", type=int, default=None, help="default 24 (quick 8)"
    )
    ap.add_argument(
        "--identity-first", action="store_true", help="identity before speed (budget order)"
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-s", type=float, default=None, help="skip what starts after this")
    ap.add_argument("--out", type=Path, default=None, help="JSON, rewritten as results come")
    args = ap.parse_args()
    quick = args.quick
    n = args.tokens or (128 if quick else 256)
    repeats = args.repeats or (2 if quick else 3)
    slow_repeats = args.dynamic_repeats or repeats
    id_prompts = args.identity_prompts or (4 if quick else 16)
    id_tokens = args.identity_tokens or (32 if quick else 48)
    id_dynamic = args.identity_dynamic_tokens or (8 if quick else 24)
    gated_variants = ENGINE_VARIANTS if args.gated is None else tuple(args.gated)
    if args.threads:
        torch.set_num_threads(args.threads)

    report = Report(args.out, args.budget_s)
    results = report.data
    target = Target(
        args.dtype,
        attn_kernel=args.attn_kernel,
        deterministic=args.deterministic or None,
        sdpa_backend=args.sdpa_backend,
    )
    # Plain generate() and the plain loop run under the same switches as the engine's probes.
    from replay_audit.engine.loading import ProcessNumerics

    plain_switches = ProcessNumerics(args.deterministic or None, None, args.sdpa_backend)
    model = random_tinyllama(args.dtype, args.device, args.attn_kernel) if args.tinyllama else None
    first = build_engine(args.model, target, args.device, model=model, cache="generate")
    model = first.model
    device = first.device
    import transformers

    prompt = [(i * 7919) % (first.vocab_size - 20) + 10 for i in range(args.prompt_len)]
    c_gated = Intervention("C", tau=args.tau)
    results.update(
        {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "dtype": args.dtype,
            "attn_kernel": args.attn_kernel,
            "model": "random TinyLlama-1.1B shape" if args.tinyllama else str(args.model),
            "tokens": n,
            "prompt_len": args.prompt_len,
            "max_cache_len": args.max_cache_len,
            "tau": args.tau,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "threads": torch.get_num_threads(),
            "quick": quick,
            "reference_bound_tokens_per_s": args.reference_bound,
            "deterministic": bool(args.deterministic),
            "sdpa_backends": first.environment()["extras"].get("sdpa_backends"),
            "sdpa_backend": args.sdpa_backend,
        }
    )
    report.save()
    if args.hbm:
        gib = args.hbm_gib or (2.0 if device.type == "cuda" else 0.25)
        report.guarded("hbm", lambda: measure_hbm(device, gib, model, args.prompt_len + n / 2))

    engines: dict[str, Any] = {}
    table: list[tuple[str, float, float | None, float | None, float | None]] = []

    def engine_speed(name: str) -> dict[str, Any]:
        if name == "generate":
            engine = first
        else:
            engine = build_engine(None, target, args.device, cache=name, model=model)
        engine.max_cache_len = args.max_cache_len
        engines[name] = engine
        slow = name not in CAPTURED
        reps = slow_repeats if slow else repeats
        warm = min(n, 16) if slow else n
        gated_too = name in gated_variants
        plain = functools.partial(engine.decode, prompt, n, (), Intervention())
        gated = functools.partial(engine.decode, prompt, n, (), c_gated)
        first_s, _ = once(
            functools.partial(engine.decode, prompt, warm, (), Intervention()), device
        )
        if gated_too:
            once(functools.partial(engine.decode, prompt, warm, (), c_gated), device)
        plain_t: list[float] = []
        gated_t: list[float] = []
        plain_out: Any = None
        gated_out: Any = None
        for _ in range(reps):  # alternate, so drift hits both alike
            t, plain_out = once(plain, device)
            plain_t.append(t)
            if gated_too:
                t, gated_out = once(gated, device)
                gated_t.append(t)
        plain_s = statistics.median(plain_t)
        entry: dict[str, Any] = {
            "tokens_per_s": n / plain_s,
            **percent(n / plain_s, report),
            "seconds": plain_s,
            "seconds_all": plain_t,
            "first_call_seconds": first_s,
            "first_call_tokens": warm,
            "extras": engine.environment()["extras"],
            "output_token_ids": plain_out.output_token_ids,
        }
        spread = (max(plain_t) - min(plain_t)) / plain_s if len(plain_t) > 1 else None
        gtps = ovh = None
        if gated_too and gated_out is not None:
            gated_s = statistics.median(gated_t)
            gtps, ovh = n / gated_s, gated_s / plain_s - 1
            entry.update(
                {
                    "gated_C_tokens_per_s": gtps,
                    "gated_C_seconds_all": gated_t,
                    "gated_C_overhead": ovh,
                    "trigger_rate": float(gated_out.steps.gate_fired.mean()),
                    "changed_steps": int(gated_out.steps.changed.sum()),
                }
            )
        table.append((name, n / plain_s, gtps, ovh, spread))
        print(f"{name:14s} {n / plain_s:8.1f} tok/s  first call {first_s:6.1f} s", file=sys.stderr)
        return entry

    def hf_generate(tokens: int) -> list[int]:
        x = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                pad_token_id=0,
            )
        return [int(t) for t in out[0, len(prompt) :].tolist()]

    def hf_loop(tokens: int) -> list[int]:
        from transformers import DynamicCache

        out: list[int] = []
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            logits = model(torch.tensor([prompt], device=device), past_key_values=cache).logits
            for _ in range(tokens):
                tok = int(torch.argmax(logits[0, -1]))
                out.append(tok)
                logits = model(torch.tensor([[tok]], device=device), past_key_values=cache).logits
        return out

    def hf_speed(name: str) -> dict[str, Any]:
        with plain_switches.applied():
            return _hf_speed(name)

    def _hf_speed(name: str) -> dict[str, Any]:
        fn = hf_loop if name == "hf_kv_loop" else hf_generate
        fn(min(n, 16))
        runs = [once(functools.partial(fn, n), device) for _ in range(slow_repeats)]
        s = statistics.median(t for t, _ in runs)
        table.append((name, n / s, None, None, None))
        print(f"{name:14s} {n / s:8.1f} tok/s", file=sys.stderr)
        return {
            "tokens_per_s": n / s,
            **percent(n / s, report),
            "seconds": s,
            "seconds_all": [t for t, _ in runs],
            "output_token_ids": runs[-1][1],
        }

    def identities() -> None:
        for dtype in args.identity:
            report.guarded(
                f"identity_{dtype}",
                functools.partial(identity, args, dtype, model, id_prompts, id_tokens, id_dynamic),
            )
            if device.type == "cuda":  # what another dtype's model held
                torch.cuda.empty_cache()

    if args.identity_first:
        identities()
    for name in args.variants:
        fn = hf_speed if name in HF_VARIANTS else engine_speed
        report.guarded(name, functools.partial(fn, name))

    # Which paths produced the same 256 tokens (generate() suppresses eos until the last token,
    # so a path may differ from it where eos was the argmax; none does on the random model).
    outputs = {
        k: results[k]["output_token_ids"]
        for k in args.variants
        if isinstance(results.get(k), dict) and "output_token_ids" in results[k]
    }
    for base in ("hf_generate", "generate"):
        if base in outputs:
            results["same_tokens_as_" + base] = {
                k: v == outputs[base] for k, v in outputs.items() if k != base
            }
    report.save()

    if args.profile in engines:

        def profile() -> dict[str, Any]:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU]
            if device.type == "cuda":
                acts.append(ProfilerActivity.CUDA)
            with profile(activities=acts) as prof:
                engines[args.profile].decode(prompt, n, (), Intervention())
                sync(device)
            key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
            text = prof.key_averages().table(sort_by=key, row_limit=25)
            print(f"profile of {args.profile}, {n} tokens:\n{text}", file=sys.stderr)
            return {"table": text}

        report.guarded("profile_" + args.profile, profile)

    if not args.identity_first:
        identities()

    print(json.dumps(results, indent=2, default=str))
    print(
        f"\n{'variant':14s} {'tok/s':>8s} {'gated C':>8s} {'C ovh':>7s} {'spread':>7s}",
        file=sys.stderr,
    )
    for name, tps, gtps, ovh, spread in table:
        g = f"{gtps:8.1f}" if gtps is not None else f"{'':8s}"
        o = f"{100 * ovh:+6.1f}%" if ovh is not None else f"{'':7s}"
        sp = f"{100 * spread:6.1f}%" if spread is not None else f"{'':7s}"
        print(f"{name:14s} {tps:8.1f} {g} {o} {sp}", file=sys.stderr)
    for key, value in results.items():
        if key.startswith("identity_") and isinstance(value, dict):
            print(f"{key}: {value.get('summary', value.get('error'))}", file=sys.stderr)


def identity(
    args: argparse.Namespace,
    dtype: str,
    model: Any,
    prompts_n: int,
    tokens: int,
    dynamic_tokens: int,
) -> dict[str, Any]:
    """The engine's decode paths against a user's plain `generate()` in `dtype` (module
    docstring): per prompt, tokens and every step's float32 logits of the piecewise decoder
    (its check included) and, for the first `dynamic_tokens` steps, of the engine's own
    `generate()` path, with `torch.equal`; the SDPA backends each ran. `model` is reused when
    it is in `dtype`, else one is built (`--tinyllama`) or loaded (`--model`)."""
    from replay_audit.engine import attention
    from replay_audit.engine.decoder import StepOutput
    from replay_audit.engine.loading import TORCH_DTYPES, ProcessNumerics

    switches = ProcessNumerics(args.deterministic or None, None, args.sdpa_backend)
    target = Target(
        dtype,
        attn_kernel=args.attn_kernel,
        deterministic=switches.deterministic,
        sdpa_backend=switches.sdpa_backend,
    )
    if model is not None and next(model.parameters()).dtype != TORCH_DTYPES[dtype]:
        model = None
    if model is None and args.tinyllama:
        model = random_tinyllama(dtype, args.device, args.attn_kernel)
    engine = build_engine(args.model, target, args.device, model=model, cache="piecewise")
    reference = build_engine(None, target, args.device, model=engine.model, cache="generate")
    model = engine.model
    device = engine.device
    eos_cfg = model.generation_config.eos_token_id
    eos = [int(e) for e in (eos_cfg if isinstance(eos_cfg, list) else [eos_cfg])]
    eos = [e for e in eos if e is not None] or [0]
    rng = random.Random(2026)
    vocab = engine.vocab_size
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.choice((8, 16, 24, 32, 48, 64, 96)))]
        for _ in range(prompts_n)
    ]

    def steps(e: Any, p: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
        out: list[int] = []
        logits: list[torch.Tensor] = []

        def choose(s: StepOutput) -> tuple[int, bool]:
            logits.append(s.logits.clone())
            out.append(int(s.top.native[0]))
            return out[-1], out[-1] in eos or len(out) == n

        with torch.inference_mode(), e._probe():
            e._decoder(p, len(p) + n, None).run(p, n, choose, 5)
        return out, logits

    rows: list[dict[str, Any]] = []
    plain_backends = attention.Observed()
    for p in prompts:
        row: dict[str, Any] = {"prompt_len": len(p)}
        with torch.inference_mode(), switches.applied(), attention.observe() as seen:
            x = torch.tensor([p], device=device)
            g = model.generate(  # a user's plain call: default settings, raw logits kept
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=tokens,
                eos_token_id=eos,
                pad_token_id=eos[0],
                output_logits=True,
                return_dict_in_generate=True,
            )
        plain_backends.merge(seen)
        gen_tokens = [int(t) for t in g.sequences[0, len(p) :].tolist()]
        end = next((i + 1 for i, t in enumerate(gen_tokens) if t in eos), len(gen_tokens))
        gen_tokens = gen_tokens[:end]
        gen_logits = [z[0].float() for z in g.logits[:end]]
        ours, logits = steps(engine, p, tokens)
        _, ref_logits = steps(reference, p, dynamic_tokens)
        first = next(
            (
                t
                for t, (a, b) in enumerate(zip(logits, gen_logits, strict=False))
                if not torch.equal(a, b)
            ),
            None,
        )
        first_ref = next(
            (
                t
                for t, (a, b) in enumerate(zip(ref_logits, gen_logits, strict=False))
                if not torch.equal(a, b)
            ),
            None,
        )
        mismatch = next(
            (i for i, (u, v) in enumerate(zip(ours, gen_tokens, strict=False)) if u != v), None
        )
        row.update(
            tokens=len(gen_tokens),
            token_identical=ours == gen_tokens,
            first_token_mismatch=mismatch,
            first_logit_mismatch=first,
            logits_bitwise_vs_generate=first is None and len(logits) == len(gen_logits),
            engine_generate_path_bitwise=first_ref is None,
            engine_decode_identical=engine.decode(p, tokens, eos).output_token_ids == gen_tokens,
        )
        if first is not None:
            row["max_abs_logit_diff"] = float((logits[first] - gen_logits[first]).abs().max())
        rows.append(row)
    summary = {
        "prompts": len(rows),
        "tokens_per_prompt": tokens,
        "generate_path_steps_compared": dynamic_tokens,
        "token_identical": sum(r["token_identical"] for r in rows),
        "logits_bitwise_vs_generate": sum(r["logits_bitwise_vs_generate"] for r in rows),
        "engine_generate_path_bitwise": sum(r["engine_generate_path_bitwise"] for r in rows),
        "engine_decode_identical": sum(r["engine_decode_identical"] for r in rows),
        "plain_generate_attention_backends": plain_backends.backends(),
    }
    pw = engine._piecewise
    if pw is not None:
        summary.update(captured_graphs=len(pw.graphs), capture_error=pw.capture_error)
    return {"summary": summary, "extras": engine.environment()["extras"], "prompts": rows}


if __name__ == "__main__":
    main()
