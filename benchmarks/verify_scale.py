"""Provider audit at scale (issue 34): does the benign null keep its promise at the budgets
audits use, how many tokens does each simulated provider need to a decision, and how does the
null move when the auditor's platform differs from the provider's.

For one checkpoint and one claim (`--dtype`, sdpa, the checkpoint's lm_head in the same format):

1. **Benign traces**, generated with plain transformers `generate()` (`engine.generate.
   TraceGenerator`: left-padded batches, default kernels, nothing process-wide set) under the
   benign variations: BF16, FP16 and FP32 with SDPA at the large batch (`--batch`), BF16 and
   FP16 with eager attention at the large batch, BF16 at batch 8, 4 and 1 on fewer prompts
   (`--small-prompts`, `--b1-prompts`: small batches are slow). The large-batch variations
   share what `--benign-tokens` leaves after the small ones, on the same prompts.
2. **Scanned in the claim** (`verifications.scan.scan_evidence`, batched by `Arm.scan_batch`):
   each token's deficit in ulps; the tail of each variation (tokens above 1, 2, 4, 8, 16, 64 ulps).
3. **The null split in two halves by prompt text**: thresholds from half A
   (`stats.verification.calibrate`, budgets 16 ... 131072, the 4-bit RTN alternative on half A's
   prompts), the benign false-alarm rate measured on half B at every budget, groups drawn from
   one variation at a time, as the calibration draws them (bootstrap resamples: a trace may
   come several times in a group) and again as a provider's come, of distinct half-B traces
   (`false_alarms_distinct`, only where a variation's half B holds the budget); per decision:
   each statistic alone, the combined rule, the tie band at its rare-event floor, and
   `per_budget`, what the calibration's verdicts use: the decision it chose at each budget by
   its own held-out split of half A (`null.choices`: the choice, its held-out false alarms,
   allowance, trusted); how far the null reaches (each variation's tokens in each half: a group
   larger than them repeats traces).
4. **Simulated providers** on half B's first `--eval-prompts` prompts, in the claimed
   configuration at the large batch: 4-bit and 8-bit RTN (group 128), an FP8 (e4m3) KV cache
   (`engine.testing.fp8_kv_cache`), temperature 0.3 sent as greedy, a RoPE bug (base 5000) and
   a swapped checkpoint (10% noise). Per statistic of `stats.verification.STATISTICS`: AUC
   against the honest traces of the same prompts (the claimed variation's) and power at half
   A's threshold at each budget; tokens to a decision (power >= 0.95).
5. `--sampled`: honest seeded sampling at temperature 0.7 against 4-bit RTN with the same seeds
   (`TraceGenerator.trace_batch(sampling=SamplingRecipe(...), seed=...)`), scanned as Token-DiFR
   evidence: AUC against tokens.

Prompts: `--prompts` JSONL ("prompt" texts) or `--stdlib-prompts N` (function beginnings of this
Python's standard library, as `benchmarks/verify.py` cuts them). Too few for the tokens asked:
they are reused round robin, each reuse a variant (a chat checkpoint: another system message and
framing of the user turn; otherwise a comment line before the text, then a shorter cut of it);
the output says how many distinct texts and variants were used. The halves split by text, so no
text (in any variant) is in both.

    # the bundled model on a CPU, toy size (a couple of minutes)
    python benchmarks/verify_scale.py --model replay_audit/assets/tiny-llama --device cpu \\
        --out /tmp/scale --save-traces /tmp/scale/traces.jsonl.gz --sampled   # the defaults
    # one lent H200 (benchmarks/gpu_verify_scale.sh runs it per checkpoint)
    python benchmarks/verify_scale.py --model DIR --device cuda --benign-tokens 1400000 \\
        --max-new-tokens 128 --batch 256 --eval-prompts 256 --out $OUT --save-traces ...
    # cross-platform: the H200's traces scanned on this CPU against a CPU null
    python benchmarks/verify_scale.py --model DIR --device cpu --scan-traces traces.jsonl.gz \\
        --scan-max-tokens 20000 --cpu-null-prompts 8 --max-new-tokens 128 --time-limit 1800 \\
        --out /tmp/cross

Measured on this project's 2-core CPU (no BF16 matrix units): the defaults above take ~2.5 min
on the bundled model; SmolLM2-135M in BF16 scans ~25 positions/s there (prompts included), so a
cross-platform scan of its H200 traces takes `--scan-max-tokens` ~1000 and `--cpu-null-prompts`
0-2 (gpu_verify_scale.sh runs it on the H200 host's 16 cores instead).

`--save-null FILE` keeps the null's per-token deficits (the 4-bit alternative's, each
simulated provider's and the honest evaluation traces' too) in a compressed .npz;
`--null-from FILE` measures the null's decisions again from it alone, on any machine (no model,
no GPU): the same false alarms and choices, and each provider's power and tokens to a decision,
so a decision rule can be tried on a GPU's null from a CPU.

    python benchmarks/verify_scale.py --null-from null.npz --draws 1000 --out /tmp/null

With it, `--null-variations bf16/sdpa/b256` keeps only those benign variations (a null pinned to
the claimed configuration) and `--sim-max-budget 32768` measures the providers' AUC and power up
to the tokens their files hold (default 8,192).

`--stage benign` stops after the benign traces' scan, keeping them in `--work`; `--stage rest`
takes them from there (two device commands on one warm machine). Writes `--out`/scale.json and
scale.md (or cross.json and cross.md), with the wall time of every phase.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import pickle
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from replay_audit.engine import EnginePool, Intervention, Target
from replay_audit.engine.testing import fp8_kv_cache, rtn_checkpoint, variant_checkpoint
from replay_audit.replays.domain import LoggedTrace
from replay_audit.stats import verification
from replay_audit.stats.verification import (
    STATISTICS,
    Calibration,
    auc,
    calibrate,
)
from replay_audit.verifications.scan import scan_evidence

log = logging.getLogger("verify_scale")

PROMPTS = Path(__file__).resolve().parent.parent / "replay_audit" / "assets" / "prompts.jsonl"

#: Budgets of the false-alarm measurement (the calibration's, extended to audits' sizes).
FA_BUDGETS = tuple(2**k for k in range(4, 18))  # 16 ... 131072
#: Budgets of the simulations' AUC and power.
SIM_BUDGETS = tuple(2**k for k in range(4, 14))  # 16 ... 8192
#: The honest evaluation traces' name among a --save-null file's providers.
HONEST = "honest"
#: Deficit levels (ulps) of the benign tail counts.
TAIL_ULPS = (1, 2, 4, 8, 16, 64)
POWER = 0.95
#: Variants of a reused prompt: system messages and framings for a chat checkpoint, comment
#: lines and cuts for a plain one.
SYSTEMS = (
    None,
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are an expert Python programmer.",
    "You are a patient teacher who explains step by step.",
    "You answer in plain English, without code unless asked.",
    "You are a careful code reviewer.",
    "You are a friendly assistant for beginners.",
)
FRAMINGS = (
    "{p}",
    "Explain what this code does:\n\n{p}",
    "Complete this code:\n\n{p}",
    "Write a docstring for this function:\n\n{p}",
    "Find a bug in this code, if there is one:\n\n{p}",
    "Rewrite this code more simply:\n\n{p}",
    "What would a good test for this look like?\n\n{p}",
    "Summarise this in one sentence:\n\n{p}",
)
COMMENTS = (
    "",
    "# utility module\n",
    "# helpers\n",
    "# -*- coding: utf-8 -*-\n",
    "# internal API\n",
    "# see the tests\n",
    "# TODO: simplify\n",
    "# compatibility layer\n",
)
CUTS = (1.0, 0.85, 0.7, 0.55, 0.4, 0.3, 0.2, 0.1)

Prompt = str | list[dict[str, str]]


# -- prompts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One prompt as generated: distinct text `text`, its `variant` (0: as given), the half it
    belongs to (by text), and the prompt itself (a text, or chat messages)."""

    index: int
    text: int
    variant: int
    half: str
    prompt: Prompt


def prompt_units(texts: Sequence[str], n: int, chat: bool) -> list[Unit]:
    """`n` prompts from `texts`, round robin: the k-th pass over them is variant k. Half A holds
    the even texts, B the odd ones (the texts come shuffled)."""
    out = []
    per = len(SYSTEMS) * len(FRAMINGS) if chat else len(COMMENTS) * len(CUTS)
    if n > per * len(texts):
        log.warning("%d prompts asked, %d distinct: capped", n, per * len(texts))
    for u in range(min(n, per * len(texts))):
        t, k = u % len(texts), (u // len(texts)) % per
        text = texts[t]
        prompt: Prompt
        if chat:
            system, framing = SYSTEMS[k % len(SYSTEMS)], FRAMINGS[k // len(SYSTEMS)]
            user = {"role": "user", "content": framing.format(p=text)}
            prompt = [{"role": "system", "content": system}, user] if system else [user]
        else:
            cut = CUTS[k // len(COMMENTS)]
            prompt = COMMENTS[k % len(COMMENTS)] + text[: max(8, int(len(text) * cut))]
        out.append(Unit(u, t, k, "A" if t % 2 == 0 else "B", prompt))
    return out


def stdlib_prompts(model: Path, n: int) -> list[dict[str, str]]:
    """`n` function beginnings of this Python's standard library (held-out files first, then
    the rest, three a file at most), cut by the checkpoint's tokenizer as
    `scripts/train_tiny_model.py` cuts the bundled prompts."""
    from tokenizers import Tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import train_tiny_model as corpus  # type: ignore[import-not-found]

    corpus.N_PROMPTS, corpus.PROMPTS_PER_FILE = n, 3
    stdlib = corpus.load_corpus()
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    rows: list[dict[str, str]] = corpus.extract_prompts(tokenizer, stdlib.held_out + stdlib.train)
    return rows


def load_texts(args: argparse.Namespace) -> list[str]:
    if args.stdlib_prompts:
        rows = stdlib_prompts(args.model, args.stdlib_prompts)
    else:
        lines = args.prompts.read_text(encoding="utf-8").splitlines()
        rows = [json.loads(x) for x in lines if x.strip()]
    texts = [str(r["prompt"]) for r in rows]
    random.Random(args.seed).shuffle(texts)
    return texts


# -- variations and generation ------------------------------------------------------------------


@dataclass(frozen=True)
class Variation:
    """A benign configuration of the provider: body format, attention kernel, batch size."""

    dtype: str
    kernel: str
    batch: int
    large: bool

    @property
    def key(self) -> str:
        return f"{self.dtype}/{self.kernel}/b{self.batch}"


def variations(args: argparse.Namespace) -> list[Variation]:
    d = args.dtype
    large = [(d, "sdpa"), ("fp16" if d != "fp16" else "bf16", "sdpa"), ("fp32", "sdpa")]
    large += [(d, "eager"), ("fp16" if d != "fp16" else "bf16", "eager")]
    out = [Variation(dt, k, args.batch, True) for dt, k in large]
    out += [Variation(d, "sdpa", b, False) for b in (8, 4, 1) if b < args.batch]
    return out


@dataclass
class Generated:
    """One provider's traces: per unit, prompt ids and output ids; its wall times."""

    units: list[Unit]
    prompt_ids: list[list[int]]
    outputs: list[list[int]]
    gen_s: float
    traces: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


@contextmanager
def generator(model: Path, dtype: str, kernel: str, device: str) -> Iterator[Any]:
    """A `TraceGenerator` on `model`, freed (and the GPU's cache emptied) after."""
    import torch

    from replay_audit.engine.generate import TraceGenerator

    g = TraceGenerator(model, dtype=dtype, attn_kernel=kernel, device=device)
    try:
        yield g
    finally:
        g.close()
        del g
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def encode(g: Any, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        return list(g.encode(prompt))
    return list(g.encode(g.render(prompt), add_special_tokens=False))


def trace_json(
    g: Any, prompt_ids: list[int], output: list[int], batch: list[list[int]], row: int, max_new: int
) -> dict[str, Any]:
    """A trace (`POST /v1/traces` JSON, as `TraceGenerator.trace_batch` writes it, without the
    top-k, texts and pieces, which a scan does not read)."""
    stop = "eos" if output and output[-1] in g.eos_ids else "length"
    decoding: dict[str, Any] = {
        "strategy": "greedy",
        "max_new_tokens": max_new,
        "eos_token_ids": g.eos_ids,
        "stop_reason": stop,
        "logits_processors": None,
    }
    if len(batch) > 1:
        decoding["batch"] = {"prompt_lengths": [len(p) for p in batch], "row": row}
    return {
        "model": {
            "name": g.model_name,
            "revision": None,
            "weights_sha256": g.weights_sha256,
            "vocab_size": g.vocab_size,
        },
        "config": {**g.config, "batch_size": len(batch)},
        "decoding": decoding,
        "prompt_token_ids": prompt_ids,
        "output_token_ids": output,
    }


def generate(
    g: Any,
    units: Sequence[Unit],
    batch: int,
    max_new: int,
    device: str,
    *,
    keep_traces: bool = False,
    until_tokens: int | None = None,
    until_seconds: float | None = None,
    call: Callable[[Any, list[list[int]]], list[list[int]]] | None = None,
) -> Generated:
    """Greedy `generate()` of `units` in batches of `batch` (`call(g, rows)` instead: another
    provider's generation), stopping after the batch that reaches `until_tokens` or
    `until_seconds` if given."""
    out = Generated([], [], [], 0.0)
    start = time.perf_counter()
    for i in range(0, len(units), batch):
        chunk = list(units[i : i + batch])
        rows = [encode(g, u.prompt) for u in chunk]
        if call is not None:
            outputs = call(g, rows)
        else:
            outputs = [ids for ids, _ in g.generate_batch(rows, max_new).rows]
        for r, (u, p, o) in enumerate(zip(chunk, rows, outputs, strict=True)):
            out.units.append(u)
            out.prompt_ids.append(p)
            out.outputs.append(o)
            if keep_traces:
                out.traces.append(trace_json(g, p, o, rows, r, max_new))
        if until_tokens is not None and out.tokens >= until_tokens:
            break
        if until_seconds is not None and time.perf_counter() - start >= until_seconds:
            log.warning("stopped at %d tokens: %.0f s spent", out.tokens, until_seconds)
            break
    _sync(device)
    out.gen_s = time.perf_counter() - start
    return out


def _generate_slice(job: tuple[Any, ...]) -> Generated:
    """`generate_parallel`'s work in one process: its own generator, the parent's threads."""
    import torch

    model, dtype, kernel, device, units, batch, max_new, keep, threads = job
    torch.set_num_threads(threads)
    with generator(model, dtype, kernel, device) as g:
        return generate(g, units, batch, max_new, device, keep_traces=keep)


def generate_parallel(
    model: Path,
    variation: Variation,
    units: Sequence[Unit],
    max_new: int,
    device: str,
    workers: int,
    *,
    keep_traces: bool = False,
) -> Generated:
    """`generate` of `units` in `workers` processes (spawned, each with its own generator),
    for the small-batch variations, whose `generate()` is bound by its host loop (batch 1:
    ~37 tokens/s on an H200, the GPU mostly idle). Each process takes whole batches (round
    robin), so every `generate()` call holds the same rows it holds in one process: the same
    computation, the same tokens (tests/test_benchmark_verify_scale.py)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    import torch

    batches = [list(units[i : i + variation.batch]) for i in range(0, len(units), variation.batch)]
    n = max(1, min(workers, len(batches)))
    share = [batches[k::n] for k in range(n)]  # round robin: each process's share of batches
    jobs = [
        (
            model,
            variation.dtype,
            variation.kernel,
            device,
            [u for b in mine for u in b],
            variation.batch,
            max_new,
            keep_traces,
            torch.get_num_threads(),
        )
        for mine in share
    ]
    start = time.perf_counter()
    log.info("%s: %d prompts in %d processes", variation.key, len(units), n)
    parts: list[Generated] = []
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as ex:
        for done in as_completed([ex.submit(_generate_slice, job) for job in jobs]):
            parts.append(done.result())
            log.info(
                "%s: %d of %d processes done (%d prompts, %.0f s)",
                variation.key,
                len(parts),
                n,
                sum(len(p.units) for p in parts),
                time.perf_counter() - start,
            )
    out = Generated([], [], [], time.perf_counter() - start)
    at = {u.index: (part, i) for part in parts for i, u in enumerate(part.units)}
    for u in units:  # in the units' order, as one process would have them
        part, i = at[u.index]
        out.units.append(u)
        out.prompt_ids.append(part.prompt_ids[i])
        out.outputs.append(part.outputs[i])
        if keep_traces:
            out.traces.append(part.traces[i])
    return out


def sampled_call(
    temperature: float, seed: int, max_new: int
) -> Callable[[Any, list[list[int]]], list[list[int]]]:
    """A provider that samples at `temperature` (transformers' `generate(do_sample=True)`,
    batched and left-padded as greedy is) and logs the result as greedy."""
    import torch

    from replay_audit.engine.decoder import left_padded

    state = {"calls": 0}

    def call(g: Any, rows: list[list[int]]) -> list[list[int]]:
        ids, mask = left_padded(rows, g.pad_id)
        x = torch.tensor(ids, device=g.device)
        torch.manual_seed(seed + state["calls"])
        state["calls"] += 1
        with torch.inference_mode():
            y = g.model.generate(
                input_ids=x,
                attention_mask=torch.tensor(mask, device=g.device),
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new,
                eos_token_id=g.eos_ids or None,
                pad_token_id=g.pad_id,
            )
        eos = set(g.eos_ids)
        out = []
        for b in range(len(rows)):
            new = [int(t) for t in y[b, x.shape[1] :].tolist()]
            end = next((t + 1 for t, tok in enumerate(new) if tok in eos), len(new))
            out.append(new[:end])
        return out

    return call


# -- scanning ------------------------------------------------------------------------------------


def scan(
    pool: EnginePool,
    model: Path,
    claim: Target,
    prompts: Sequence[list[int]],
    outputs: Sequence[list[int]],
    token_budget: int,
) -> list[np.ndarray]:
    """Each (prompt, output)'s per-token deficits in ulps, scanned in `claim` on `model`, in
    order (an empty output: an empty array)."""
    from replay_audit.replays.pipeline import load_arm

    vocab = load_arm(claim, pool, model).engine.vocab_size
    config = {
        "dtype": claim.dtype,
        "lm_head_dtype": claim.lm_head_dtype,
        "attn_kernel": claim.attn_kernel,
        "deterministic": claim.deterministic,
        "tf32": claim.tf32,
    }
    keep = [i for i, o in enumerate(outputs) if o]
    traces = [
        LoggedTrace.from_parts(
            external_id=None,
            weights_sha256="",
            vocab_size=vocab,
            config=config,
            decoding={"strategy": "greedy"},
            prompt_token_ids=prompts[i],
            output_token_ids=outputs[i],
            top_k_logits=None,
        )
        for i in keep
    ]
    out: list[np.ndarray] = [np.zeros(0) for _ in outputs]
    for i, e in zip(
        keep, scan_evidence(traces, pool, model, token_budget=token_budget), strict=True
    ):
        if e.deficits is None:
            raise RuntimeError(f"scan failed: {e.error}")
        out[i] = np.asarray(e.deficits.deficit_ulps, dtype=np.float64)
    return out


# -- statistics ------------------------------------------------------------------------------


def _draw_many(
    token_scores: Mapping[str, Sequence[np.ndarray]],
    budget: int,
    draws: int,
    rng: np.random.Generator,
    distinct: bool = False,
) -> dict[str, np.ndarray]:
    """The service's own draws (`stats.verification.draw_groups`): each name's scores of the
    same groups; `distinct`: groups of distinct traces, as a provider's are."""
    if distinct:
        return dict(verification.draw_groups(token_scores, budget, draws, rng, distinct=True))
    return dict(verification.draw_groups(token_scores, budget, draws, rng))


def _rule_row(cal: Calibration, budget: int) -> Any:
    """The combined rule's calibration at exactly `budget` (`Calibration.rule`)."""
    return next(r for r in getattr(cal, "rule", []) if r.tokens == budget)


#: The combined decision rule's name (`stats.verification.Decision`, where calibrations have it).
RULE = "tie_band_or_mean_deficit"


#: The tie band at its rare-event floor where that is higher than its threshold
#: (`BudgetCalibration.rare_event_floor`, docs/verify.md: measured, not the verdicts' yet).
FLOORED = "outside_tie_band_floored"


def _floored(cal: Calibration, budget: int) -> float:
    row = next(b for b in cal.budgets["outside_tie_band"] if b.tokens == budget)
    return max(row.threshold, getattr(row, "rare_event_floor", None) or 0.0)


#: The decision a calibration chose per budget by its own held-out split
#: (`Calibration.choices`, docs/verify.md "The decision per budget"): what its verdicts use.
PER_BUDGET = "per_budget"


def _choice(cal: Calibration, budget: int) -> Any:
    """The calibration's chosen decision at exactly `budget` (`BudgetChoice`)."""
    return next(c for c in getattr(cal, "choices", []) if c.tokens == budget)


def decisions(cal: Calibration) -> list[str]:
    """What decides: each statistic alone, the combined rule where the calibration has it, the
    tie band at its rare-event floor where the calibration measured one, and the decision it
    chose per budget where it chose one."""
    floors = any(
        getattr(b, "rare_event_floor", None) is not None for b in cal.budgets["outside_tie_band"]
    )
    return [
        *STATISTICS,
        *([RULE] if getattr(cal, "rule", None) else []),
        *([FLOORED] if floors else []),
        *([PER_BUDGET] if getattr(cal, "choices", None) else []),
    ]


def draw_scored(
    cal: Calibration,
    deficits: Sequence[np.ndarray],
    budget: int,
    draws: int,
    rng: np.random.Generator,
    distinct: bool = False,
) -> dict[str, np.ndarray]:
    """Groups of `budget` tokens from these traces, scored by every statistic (the same groups;
    `distinct`: each of distinct traces, `_draw_many`)."""
    scores: dict[str, list[np.ndarray]] = {
        s: [cal.scorer.scores(u, s) for u in deficits if len(u)] for s in STATISTICS
    }
    return _draw_many(scores, budget, draws, rng, distinct)


def flagged(
    cal: Calibration, decision: str, budget: int, drawn: Mapping[str, np.ndarray]
) -> np.ndarray:
    """Which groups `decision` calls inconsistent at exactly `budget` (its calibrated
    threshold there, not clamped to the null's reach: the measurement is of each budget)."""
    if decision == RULE:
        rule = _rule_row(cal, budget)
        return np.asarray(np.logical_or.reduce([drawn[s] > t for s, t in rule.thresholds.items()]))
    if decision == FLOORED:
        return np.asarray(drawn["outside_tie_band"] > _floored(cal, budget))
    if decision == PER_BUDGET:
        chosen = _choice(cal, budget).thresholds
        return np.asarray(np.logical_or.reduce([drawn[s] > t for s, t in chosen.items()]))
    row = next(b for b in cal.budgets[decision] if b.tokens == budget)
    return np.asarray(drawn[decision] > row.threshold)


def threshold_text(cal: Calibration, decision: str, budget: int) -> str:
    if decision == RULE:
        return " or ".join(f"{t:.3g}" for t in _rule_row(cal, budget).thresholds.values())
    if decision == FLOORED:
        return f"{_floored(cal, budget):.3g}"
    if decision == PER_BUDGET:
        c = _choice(cal, budget)
        return f"{c.decision}: " + " or ".join(f"{t:.3g}" for t in c.thresholds.values())
    return f"{next(b for b in cal.budgets[decision] if b.tokens == budget).threshold:.3g}"


def tail(deficits: Sequence[np.ndarray]) -> dict[str, Any]:
    u = np.concatenate([*deficits, np.zeros(0)])
    return {
        "tokens": int(u.size),
        "above": {str(t): int((u > t).sum()) for t in TAIL_ULPS},
        "max_ulps": float(u.max()) if u.size else 0.0,
        "flips": int((u > 0).sum()),
    }


def capped(budgets: Sequence[int], args: argparse.Namespace) -> list[int]:
    """`budgets` up to `--max-budget`."""
    return [b for b in budgets if b <= args.max_budget]


def sim_budgets(args: argparse.Namespace) -> list[int]:
    """The simulations' budgets: up to `--sim-max-budget` and `--max-budget`."""
    return [b for b in FA_BUDGETS if b <= min(args.sim_max_budget, args.max_budget)]


def reach(tokens: int, budgets: Sequence[int]) -> int | None:
    """The largest budget a null of `tokens` backs without repeating traces."""
    fit = [b for b in budgets if b <= tokens]
    return fit[-1] if fit else None


def false_alarms(
    cal: Calibration,
    test: Mapping[str, Sequence[np.ndarray]],
    budgets: Sequence[int],
    draws: int,
    rng: np.random.Generator,
    distinct: bool = False,
) -> dict[str, Any]:
    """Per decision and budget: the share of each variation's held-out groups it flags (groups
    drawn from one variation at a time), and the worst of the variations whose held-out traces
    hold at least the budget's tokens (`measured`: the others' groups would repeat their few
    traces, a bootstrap's guess rather than a measurement; where none holds enough, the worst
    of all, `measured` empty). Groups are drawn as the calibration draws its own (bootstrap
    resamples, a trace possibly drawn several times in a group), or with `distinct` as a
    provider's groups come, of distinct held-out traces: then only the variations that hold
    the budget are drawn (none: `worst` None)."""
    out: dict[str, Any] = {d: {} for d in decisions(cal)}
    tokens = {v: sum(len(u) for u in d) for v, d in test.items()}
    for b in budgets:
        drawn = {
            v: draw_scored(cal, d, b, draws, rng, distinct)
            for v, d in test.items()
            if tokens[v] and (tokens[v] >= b or not distinct)
        }
        measured = [v for v in drawn if tokens[v] >= b]
        for dec in decisions(cal):
            rates = {v: float(flagged(cal, dec, b, x).mean()) for v, x in drawn.items()}
            worst = max(measured or rates, key=lambda v: rates[v]) if rates else None
            out[dec][str(b)] = {
                "threshold": threshold_text(cal, dec, b),
                "worst": rates[worst] if worst is not None else None,
                "worst_variation": worst,
                "measured": measured,
                "per_variation": rates,
            }
    return out


def simulation_row(
    cal: Calibration,
    sim: Sequence[np.ndarray],
    honest: Sequence[np.ndarray],
    budgets: Sequence[int],
    draws: int,
    rng: np.random.Generator,
    *,
    judged: bool = True,
) -> dict[str, Any]:
    """Per decision: AUC (simulation vs honest groups; a statistic's, none for the rule) at
    each budget and the smallest budget with AUC >= 0.999; `judged`, also the power (the share
    of the simulation's groups flagged at the calibrated threshold) at each budget and tokens to
    a decision (power >= 0.95). Sampled evidence is not judged: the calibration's null is greedy
    traffic's, so its thresholds say nothing of sampled groups (AUC per statistic only)."""
    decs = decisions(cal) if judged else list(STATISTICS)
    row: dict[str, Any] = {d: {"per_budget": {}} for d in decs}
    for b in budgets:
        s = draw_scored(cal, sim, b, draws, rng)
        h = draw_scored(cal, honest, b, draws, rng)
        for dec in decs:
            cell = {"auc": None if dec in (RULE, FLOORED, PER_BUDGET) else auc(h[dec], s[dec])}
            if judged:
                cell["power"] = float(flagged(cal, dec, b, s).mean())
            row[dec]["per_budget"][str(b)] = cell
    for dec in decs:
        per = row[dec]["per_budget"]
        if judged:
            row[dec]["tokens_to_decision"] = next(
                (int(b) for b, v in per.items() if v["power"] >= POWER), None
            )
        row[dec]["auc_0999_at"] = next(
            (int(b) for b, v in per.items() if v["auc"] is not None and v["auc"] >= 0.999), None
        )
    return row


# -- the run -----------------------------------------------------------------------------------


class Clock:
    """Wall time per phase (seconds), logged as each ends."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.t0 = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = round(self.phases.get(name, 0.0) + time.perf_counter() - start, 2)
            log.info("%s: %.1f s (total %.0f s)", name, self.phases[name], self.total)

    @property
    def total(self) -> float:
        return time.perf_counter() - self.t0


def environment(model: Path, device: str) -> dict[str, Any]:
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else None
    return {
        "model": str(model),
        "device": device,
        "gpu": gpu,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def benign_stage(
    args: argparse.Namespace, clock: Clock, texts: list[str], chat: bool
) -> dict[str, Any]:
    """Generate and scan the benign variations; the traces saved where asked."""
    varied = variations(args)
    large = [v for v in varied if v.large]
    small = [v for v in varied if not v.large]
    # at least two prompts a variation: the halves alternate, so each holds one
    small_units = {
        8: max(2, args.small_prompts),
        4: max(2, args.small_prompts // 2),
        1: max(2, args.b1_prompts),
    }
    small_tokens = sum(small_units[v.batch] * args.max_new_tokens for v in small)
    share = max(args.max_new_tokens, (args.benign_tokens - small_tokens) // len(large))
    # Enough units for the share at the longest outputs; the claimed variation stops at its share.
    units = prompt_units(texts, math.ceil(share / max(1, args.min_mean_tokens)), chat)
    pool = EnginePool(device=args.device, devices=1)
    claim = Target(args.dtype, None, "sdpa", 1, Intervention())
    data: dict[str, Any] = {"variations": {}, "units": None}
    saved: list[dict[str, Any]] = []
    for v in varied:
        parallel = not v.large and args.gen_workers > 1  # generated in other processes
        with (
            clock.phase(f"generate {v.key}"),
            nullcontext()
            if parallel
            else generator(args.model, v.dtype, v.kernel, args.device) as g,
        ):
            if v is large[0]:
                gen = generate(
                    g,
                    units,
                    v.batch,
                    args.max_new_tokens,
                    args.device,
                    keep_traces=bool(args.save_traces),
                    until_tokens=share,
                    until_seconds=args.claim_seconds,
                )
                data["units"] = gen.units
            elif not parallel:
                mine = data["units"] if v.large else data["units"][: small_units[v.batch]]
                gen = generate(
                    g,
                    mine,
                    v.batch,
                    args.max_new_tokens,
                    args.device,
                    keep_traces=bool(args.save_traces),
                )
            else:
                gen = generate_parallel(
                    args.model,
                    v,
                    data["units"][: small_units[v.batch]],
                    args.max_new_tokens,
                    args.device,
                    args.gen_workers,
                    keep_traces=bool(args.save_traces),
                )
        with clock.phase(f"scan {v.key}"):
            start = time.perf_counter()
            deficits = scan(
                pool, args.model, claim, gen.prompt_ids, gen.outputs, args.scan_token_budget
            )
            _sync(args.device)
            scan_s = time.perf_counter() - start
        data["variations"][v.key] = {
            "units": [u.index for u in gen.units],
            "halves": [u.half for u in gen.units],
            "prompt_ids": gen.prompt_ids,
            "outputs": gen.outputs,
            "deficits": deficits,
            "gen_s": round(gen.gen_s, 2),
            "scan_s": round(scan_s, 2),
            "batch": v.batch,
        }
        for u, t in zip(gen.units, gen.traces, strict=False):  # none kept: none saved
            saved.append(
                {"variation": v.key, "half": u.half, "unit": u.index, "text": u.text, "trace": t}
            )
        log.info(
            "%s: %d prompts, %d tokens, generated at %.0f tok/s, scanned at %.0f tok/s",
            v.key,
            len(gen.units),
            gen.tokens,
            gen.tokens / max(gen.gen_s, 1e-9),
            gen.tokens / max(scan_s, 1e-9),
        )
    units_used = data["units"]
    data["prompts"] = {
        "distinct_texts": len({u.text for u in units_used}),
        "texts_available": len(texts),
        "variants": len({u.variant for u in units_used}),
        "prompts": len(units_used),
        "chat": chat,
    }
    if args.save_traces:
        with clock.phase("save traces"):
            header = {
                "header": {
                    **environment(args.model, args.device),
                    "claim": {"dtype": args.dtype, "attn_kernel": "sdpa"},
                    "max_new_tokens": args.max_new_tokens,
                    "prompts": data["prompts"],
                }
            }
            args.save_traces.parent.mkdir(parents=True, exist_ok=True)
            with gzip.open(args.save_traces, "wt", encoding="utf-8") as f:
                for row in [header, *saved]:
                    f.write(json.dumps(row, separators=(",", ":")) + "\n")
    return data


def halves(
    data: Mapping[str, Any],
) -> tuple[dict[str, list[np.ndarray]], dict[str, list[np.ndarray]]]:
    a: dict[str, list[np.ndarray]] = {}
    b: dict[str, list[np.ndarray]] = {}
    for key, v in data["variations"].items():
        a[key] = [d for d, h in zip(v["deficits"], v["halves"], strict=True) if h == "A" and len(d)]
        b[key] = [d for d, h in zip(v["deficits"], v["halves"], strict=True) if h == "B" and len(d)]
    return a, b


def save_null(
    path: Path,
    data: Mapping[str, Any],
    alt: Sequence[np.ndarray],
    meta: Mapping[str, Any],
    providers: Mapping[str, Sequence[np.ndarray]] | None = None,
) -> None:
    """The null's per-token deficits (each variation's traces, their halves and batch), the
    4-bit alternative's and, where given, each simulated provider's and the honest evaluation
    traces' (`providers`, by name; "honest" among them), in one compressed .npz: `--null-from`
    measures decisions, and their power against each provider, again on any machine, without
    the GPU that scanned them."""

    def flat(traces: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        parts = [np.asarray(d, dtype=np.float64) for d in traces]
        joined = np.concatenate(parts) if parts else np.zeros(0)
        return joined, np.asarray([len(d) for d in parts], dtype=np.int64)

    arrays: dict[str, np.ndarray] = {}
    index = []
    for i, (key, v) in enumerate(data["variations"].items()):
        arrays[f"v{i}_deficits"], arrays[f"v{i}_lengths"] = flat(v["deficits"])
        arrays[f"v{i}_half_a"] = np.asarray([h == "A" for h in v["halves"]], dtype=bool)
        index.append({"key": key, "batch": v["batch"]})
    arrays["alt_deficits"], arrays["alt_lengths"] = flat(alt)
    names = list(providers or {})
    for i, name in enumerate(names):
        arrays[f"p{i}_deficits"], arrays[f"p{i}_lengths"] = flat((providers or {})[name])
    header = json.dumps({"variations": index, "meta": dict(meta), "providers": names})
    arrays["header"] = np.frombuffer(header.encode(), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)  # type: ignore[arg-type]


def load_null(
    path: Path,
) -> tuple[dict[str, Any], list[np.ndarray], dict[str, Any], dict[str, list[np.ndarray]]]:
    """`save_null`'s file: the `data` `null_report` reads, the alternative, the meta, and the
    providers' traces by name (empty for a file saved without them)."""
    with np.load(path) as z:
        header = json.loads(bytes(z["header"]).decode())

        def split(name: str) -> list[np.ndarray]:
            lengths = z[f"{name}_lengths"]
            if not len(lengths):
                return []
            return list(np.split(z[f"{name}_deficits"], np.cumsum(lengths)[:-1]))

        variations = {
            v["key"]: {
                "deficits": split(f"v{i}"),
                "halves": ["A" if a else "B" for a in z[f"v{i}_half_a"]],
                "batch": v["batch"],
            }
            for i, v in enumerate(header["variations"])
        }
        providers = {n: split(f"p{i}") for i, n in enumerate(header.get("providers", []))}
        return {"variations": variations}, split("alt"), header["meta"], providers


def null_report(
    args: argparse.Namespace,
    clock: Clock,
    data: Mapping[str, Any],
    alt: Sequence[np.ndarray],
    platform_: Mapping[str, Any],
    rng: np.random.Generator,
) -> tuple[Calibration, dict[str, Any]]:
    a, b = halves(data)
    with clock.phase("calibrate (half A)"):
        cal = calibrate(
            a,
            alt,
            weights_sha256="",
            claim={"dtype": args.dtype, "lm_head_dtype": args.dtype, "attn_kernel": "sdpa"},
            platform=platform_,  # type: ignore[arg-type]
            budgets=capped(FA_BUDGETS, args),
            draws=args.draws,
        )
    with clock.phase("false alarms (half B)"):
        fa = false_alarms(cal, b, capped(FA_BUDGETS, args), args.fa_draws, rng)
    with clock.phase("false alarms (half B, distinct traces)"):
        fa_distinct = false_alarms(cal, b, capped(FA_BUDGETS, args), args.fa_draws, rng, True)
    per_var: dict[str, dict[str, Any]] = {}
    for key in data["variations"]:
        ta, tb = sum(len(u) for u in a[key]), sum(len(u) for u in b[key])
        per_var[key] = {
            "tokens_A": ta,
            "tokens_B": tb,
            "traces_A": len(a[key]),
            "traces_B": len(b[key]),
            "reach": reach(min(ta, tb), capped(FA_BUDGETS, args)),
        }
    large = [k for k, v in data["variations"].items() if v["batch"] == args.batch]
    null: dict[str, Any] = {
        "per_variation": per_var,
        "reach_all": min((v["reach"] or 0) for v in per_var.values()),
        "reach_large_batch": min((per_var[k]["reach"] or 0) for k in large),
        "tokens": sum(v["tokens_A"] + v["tokens_B"] for v in per_var.values()),
        "false_alarms": fa,
        "false_alarms_distinct": fa_distinct,
        "calibration_reach": getattr(cal, "reach", None),
        "fa_ok_up_to": {dec: fa_ok_up_to(rows, cal.false_alarm_rate) for dec, rows in fa.items()},
        "fa_ok_up_to_distinct": {
            dec: fa_ok_up_to(rows, cal.false_alarm_rate) for dec, rows in fa_distinct.items()
        },
        "choices": [
            {
                "tokens": c.tokens,
                "decision": c.decision,
                "held_out_false_alarm": c.held_out_false_alarm,
                "allowance": c.allowance,
                "passed": c.passed,
                "trusted": c.trusted,
                "supply": c.supply,
                "power": c.power,
                "rare_event_guard": getattr(c, "rare_event_guard", None),
            }
            for c in getattr(cal, "choices", [])
        ],
    }
    return cal, null


def simulations(
    args: argparse.Namespace,
    clock: Clock,
    data: Mapping[str, Any],
    pool: EnginePool,
    root: Path,
) -> tuple[dict[str, Generated], list[np.ndarray], list[Unit]]:
    """The simulated providers' traces on half B's first eval prompts (the 4-bit copy's on
    half A's too: the calibration's alternative)."""
    units: list[Unit] = data["units"]
    eval_units = [u for u in units if u.half == "B"][: args.eval_prompts]
    alt_units = [u for u in units if u.half == "A"][: args.eval_prompts]
    claim = Target(args.dtype, None, "sdpa", 1, Intervention())
    n, dt, dev = args.max_new_tokens, args.dtype, args.device
    ckpts: dict[str, Callable[[], Path]] = {
        "4-bit RTN g128": lambda: rtn_checkpoint(args.model, root / "rtn4", bits=4),
        "8-bit RTN g128": lambda: rtn_checkpoint(args.model, root / "rtn8", bits=8),
        "swapped checkpoint (10% noise)": lambda: variant_checkpoint(
            args.model, root / "swap", noise=0.1, seed=1
        ),
        "RoPE bug (base 5000)": lambda: variant_checkpoint(
            args.model,
            root / "rope",
            config={
                "rope_theta": 5000.0,
                "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"},
            },
        ),
    }
    sims: dict[str, Generated] = {}
    alt: list[np.ndarray] = []
    only = tuple(args.only) if args.only else None
    for name in [
        "4-bit RTN g128",
        "8-bit RTN g128",
        "FP8 KV cache (e4m3, scale 1)",
        "temperature 0.3 sent as greedy",
        "RoPE bug (base 5000)",
        "swapped checkpoint (10% noise)",
    ]:
        if only and not name.startswith(only) and not name.startswith("4-bit"):
            continue
        with clock.phase(f"simulate {name}"):
            if name in ckpts:
                path = ckpts[name]()
                with generator(path, dt, "sdpa", dev) as g:
                    sims[name] = generate(g, eval_units, args.batch, n, dev)
                    if name.startswith("4-bit"):
                        a = generate(g, alt_units, args.batch, n, dev)
                        alt = scan(
                            pool, args.model, claim, a.prompt_ids, a.outputs, args.scan_token_budget
                        )
            else:
                with generator(args.model, dt, "sdpa", dev) as g:
                    if name.startswith("FP8"):
                        with fp8_kv_cache(g.model):
                            sims[name] = generate(g, eval_units, args.batch, n, dev)
                    else:
                        sims[name] = generate(
                            g, eval_units, args.batch, n, dev, call=sampled_call(0.3, args.seed, n)
                        )
        with clock.phase(f"scan {name}"):
            s = sims[name]
            s.traces = [
                {"deficits": d}
                for d in scan(
                    pool, args.model, claim, s.prompt_ids, s.outputs, args.scan_token_budget
                )
            ]
    return sims, alt, eval_units


def sampled_section(
    args: argparse.Namespace,
    clock: Clock,
    data: Mapping[str, Any],
    pool: EnginePool,
    root: Path,
    cal: Calibration,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """Honest seeded sampling at temperature 0.7 against 4-bit RTN with the same seeds: AUC
    against tokens of the Token-DiFR evidence (needs the sampled-trace interface)."""
    import inspect

    from replay_audit.engine import protocol
    from replay_audit.engine.generate import TraceGenerator

    recipe_cls: Any = getattr(protocol, "SamplingRecipe", None)
    if recipe_cls is None:
        return {"skipped": "replay_audit.engine.protocol has no SamplingRecipe yet"}
    if "sampling" not in inspect.signature(TraceGenerator.trace_batch).parameters:
        return {"skipped": "TraceGenerator.trace_batch takes no sampling= yet"}
    recipe = recipe_cls(sampler="transformers", temperature=0.7, top_k=0, top_p=1.0)
    units = [u for u in data["units"] if u.half == "B"][: args.sampled_prompts or args.eval_prompts]
    rtn = root / "rtn4"
    if not (rtn / "config.json").exists():
        rtn_checkpoint(args.model, rtn, bits=4)
    out: dict[str, Any] = {"prompts": len(units), "temperature": 0.7, "sampler": "transformers"}
    evidence: dict[str, list[np.ndarray]] = {}
    for name, path in (("honest", args.model), ("4-bit RTN g128", rtn)):
        with clock.phase(f"sampled {name}"), generator(path, args.dtype, "sdpa", args.device) as g:
            traces: list[dict[str, Any]] = []
            for i in range(0, len(units), args.batch):
                chunk = units[i : i + args.batch]
                traces += g.trace_batch(
                    [(f"u{u.index}", u.prompt) for u in chunk],
                    max_new_tokens=args.max_new_tokens,
                    sampling=recipe,
                    seed=args.seed + i,
                )
        with clock.phase(f"sampled scan {name}"):
            logged = [LoggedTrace.from_json(t) for t in traces if t["output_token_ids"]]
            ev = scan_evidence(logged, pool, args.model, token_budget=args.scan_token_budget)
            if any(e.sampled or e.deficits is None for e in ev):
                why = next(e.error or "set apart as sampled" for e in ev if e.deficits is None)
                return {
                    **out,
                    "skipped": f"scan_evidence gave no evidence for sampled traces: {why}",
                }
            evidence[name] = [
                np.asarray(e.deficits.deficit_ulps) for e in ev if e.deficits is not None
            ]
            out[f"tokens_{name}"] = int(sum(len(u) for u in evidence[name]))
            out[f"tail_{name}"] = tail(evidence[name])
    with clock.phase("sampled AUC"):
        out["auc"] = simulation_row(
            cal,
            evidence["4-bit RTN g128"],
            evidence["honest"],
            sim_budgets(args),
            args.fa_draws,
            rng,
            judged=False,
        )
    return out


def rest_stage(args: argparse.Namespace, clock: Clock, data: dict[str, Any]) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    pool = EnginePool(device=args.device, devices=1)
    env = environment(args.model, args.device)
    platform_ = {
        "device": args.device,
        "gpu_name": env["gpu"],
        "sm": None,
        "torch_version": env["torch"],
        "devices": 1,
    }
    result: dict[str, Any] = {"run": {**env, "args": _args_json(args), "prompts": data["prompts"]}}
    result["benign"] = {
        k: {
            **tail(v["deficits"]),
            "prompts": len(v["units"]),
            "generate_s": v["gen_s"],
            "scan_s": v["scan_s"],
            "generate_tok_s": round(sum(len(o) for o in v["outputs"]) / max(v["gen_s"], 1e-9)),
        }
        for k, v in data["variations"].items()
    }
    with tempfile.TemporaryDirectory(prefix="verify-scale-", dir=args.tmp) as tmp:
        root = Path(tmp)
        sims, alt, eval_units = simulations(args, clock, data, pool, root)
        claimed = variations(args)[0].key
        v = data["variations"][claimed]
        by_unit = dict(zip(v["units"], v["deficits"], strict=True))
        out_by_unit = dict(zip(v["units"], v["outputs"], strict=True))
        honest = [by_unit[u.index] for u in eval_units if len(by_unit.get(u.index, []))]
        if args.save_null is not None:
            meta = {**platform_, "claim": args.dtype, "batch": args.batch}
            providers = {
                HONEST: honest,
                **{
                    name: [t["deficits"] for t in s.traces if len(t["deficits"])]
                    for name, s in sims.items()
                },
            }
            save_null(args.save_null, data, alt, meta, providers)
        cal, null = null_report(args, clock, data, alt, platform_, rng)
        result["null"] = null
        result["simulations"] = {}
        with clock.phase("simulations' AUC and power"):
            for name, s in sims.items():
                deficits = [t["deficits"] for t in s.traces if len(t["deficits"])]
                differing = sum(
                    o != out_by_unit.get(u.index) for u, o in zip(s.units, s.outputs, strict=True)
                )
                result["simulations"][name] = {
                    "tokens": int(sum(len(d) for d in deficits)),
                    "prompts": len(s.units),
                    "outputs_differing": round(differing / max(1, len(s.units)), 4),
                    "generate_s": round(s.gen_s, 2),
                    **simulation_row(cal, deficits, honest, sim_budgets(args), args.fa_draws, rng),
                }
        if args.sampled:
            result["sampled"] = sampled_section(args, clock, data, pool, root, cal, rng)
        result["calibration"] = cal.to_json()
    return result


def _args_json(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


# -- cross-platform ------------------------------------------------------------------------------


def cross_platform(args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """Traces saved by a run on another platform (`--save-traces`), scanned here: the false-alarm
    rate of this platform as auditor, against (a) a null measured here from this platform's own
    generations of half A's prompts (`--cpu-null-prompts` per variation; what an auditor on this
    platform has by itself) and (b) the saved traces' half A scanned here (the null the docs
    recommend: the claimed platform's traces, the scanning platform's scan)."""
    rng = np.random.default_rng(args.seed)
    with clock.phase("read traces"):
        with gzip.open(args.scan_traces, "rt", encoding="utf-8") as f:
            rows = [json.loads(x) for x in f]
        header = rows[0]["header"]
        rows = rows[1:]
    # At most --scan-max-tokens, spread over variations and halves alike (whole traces).
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["variation"], r["half"]), []).append(r)
    per_group = args.scan_max_tokens // max(1, len(groups))
    chosen: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for key, rs in groups.items():
        got, n = [], 0
        for r in rs:
            if n >= per_group:
                break
            got.append(r)
            n += len(r["trace"]["output_token_ids"])
        chosen[key] = got
    pool = EnginePool(device=args.device, devices=1)
    claim = Target(args.dtype, None, "sdpa", 1, Intervention())
    scanned: dict[tuple[str, str], list[np.ndarray]] = {key: [] for key in chosen}

    def in_time() -> bool:
        return args.time_limit is None or clock.total < args.time_limit

    # In rounds, a quarter of every group's traces each: a run cut by --time-limit still holds
    # every variation and half.
    rounds = 4
    for r in range(rounds):
        for key, rs in chosen.items():
            part = rs[r * len(rs) // rounds : (r + 1) * len(rs) // rounds]
            if not part or not in_time():
                continue
            with clock.phase(f"scan {key[0]} half {key[1]}"):
                ds = scan(
                    pool,
                    args.model,
                    claim,
                    [x["trace"]["prompt_token_ids"] for x in part],
                    [x["trace"]["output_token_ids"] for x in part],
                    args.scan_token_budget,
                )
            scanned[key] += [d for d in ds if len(d)]
    if not in_time():
        log.warning(
            "--time-limit reached while scanning: %d tokens scanned",
            sum(len(d) for ds_ in scanned.values() for d in ds_),
        )
    env = environment(args.model, args.device)
    platform_ = {
        "device": args.device,
        "gpu_name": env["gpu"],
        "sm": None,
        "torch_version": env["torch"],
        "devices": 1,
    }
    variations_ = sorted({k[0] for k, v in scanned.items() if v})
    test = {v: scanned.get((v, "B"), []) for v in variations_}
    out: dict[str, Any] = {
        "run": {**env, "args": _args_json(args)},
        "traces_from": header,
        "tail_here": {
            v: tail([*scanned.get((v, "A"), []), *scanned.get((v, "B"), [])]) for v in variations_
        },
    }
    # the 4-bit alternative here, on half A's prompts
    texts_a = [r for r in chosen.get((variations_[0], "A"), [])][: args.eval_prompts]
    alt: list[np.ndarray] = []  # none (the likelihood ratio's bins: pseudo-counts) when out of time
    with tempfile.TemporaryDirectory(prefix="verify-scale-", dir=args.tmp) as tmp:
        if not in_time():
            texts_a = []
        rtn = rtn_checkpoint(args.model, Path(tmp) / "rtn4", bits=4)
        with (
            clock.phase("4-bit alternative here"),
            generator(rtn, args.dtype, "sdpa", args.device) as g,
        ):
            ps = [list(r["trace"]["prompt_token_ids"]) for r in texts_a]
            outs: list[list[int]] = []
            for i in range(0, len(ps), args.batch):
                outs += [
                    ids
                    for ids, _ in g.generate_batch(ps[i : i + args.batch], args.max_new_tokens).rows
                ]
        if ps:
            alt = [
                d for d in scan(pool, args.model, claim, ps, outs, args.scan_token_budget) if len(d)
            ]
    nulls: dict[str, dict[str, list[np.ndarray]]] = {
        "saved traces' half A scanned here": {
            v: scanned[(v, "A")] for v in variations_ if scanned.get((v, "A"))
        }
    }
    if args.cpu_null_prompts:
        local: dict[str, list[np.ndarray]] = {}
        prompts = [list(r["trace"]["prompt_token_ids"]) for r in texts_a][: args.cpu_null_prompts]
        for v in variations(args):
            if v.batch == args.batch and args.batch > 8:
                v = Variation(v.dtype, v.kernel, min(8, args.batch), True)
            if v.key in local or not in_time():
                continue
            with (
                clock.phase(f"null here: generate {v.key}"),
                generator(args.model, v.dtype, v.kernel, args.device) as g,
            ):
                outs = []
                for i in range(0, len(prompts), v.batch):
                    outs += [
                        ids
                        for ids, _ in g.generate_batch(
                            prompts[i : i + v.batch], args.max_new_tokens
                        ).rows
                    ]
            with clock.phase(f"null here: scan {v.key}"):
                local[v.key] = [
                    d
                    for d in scan(pool, args.model, claim, prompts, outs, args.scan_token_budget)
                    if len(d)
                ]
        local = {k: v for k, v in local.items() if v}
        if local:
            nulls[f"generated here ({len(prompts)} prompts per variation)"] = local
    out["nulls"] = {}
    test = {v: d for v, d in test.items() if d}
    if not test:
        out["note"] = "no held-out (half B) trace was scanned within --time-limit"
        log.warning(out["note"])
        return out
    budgets = [
        b
        for b in capped(FA_BUDGETS, args)
        if b <= max(1, max(sum(len(u) for u in d) for d in test.values()))
    ]
    budgets = budgets or [FA_BUDGETS[0]]
    for name, null in nulls.items():
        with clock.phase(f"calibrate and false alarms: {name}"):
            cal = calibrate(
                null,
                alt,
                weights_sha256="",
                claim={"dtype": args.dtype, "lm_head_dtype": args.dtype, "attn_kernel": "sdpa"},
                platform=platform_,  # type: ignore[arg-type]
                budgets=budgets,
                draws=args.draws,
            )
            out["nulls"][name] = {
                "tokens": {v: int(sum(len(u) for u in d)) for v, d in null.items()},
                "tail": {v: tail(d) for v, d in null.items()},
                "false_alarms": false_alarms(cal, test, budgets, args.fa_draws, rng),
                "test_tokens": {v: int(sum(len(u) for u in d)) for v, d in test.items()},
            }
    return out


# -- markdown --------------------------------------------------------------------------------


def _fmt(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def fa_ok_up_to(rows: Mapping[str, Mapping[str, Any]], rate: float) -> int | None:
    """The largest budget up to which every measured false-alarm rate is within `rate` (and
    measured: some variation's held-out traces hold its tokens)."""
    ok = None
    for b, x in sorted(rows.items(), key=lambda kv: int(kv[0])):
        if not x["measured"] or x["worst"] > rate:
            break
        ok = int(b)
    return ok


def fa_table(fa: Mapping[str, Mapping[str, Any]]) -> list[str]:
    decs = list(fa)
    lines = [
        "| budget | variations measured | " + " | ".join(decs) + " |",
        "| --- " * (2 + len(decs)) + "|",
    ]
    for b in fa[decs[0]]:
        first = fa[decs[0]][b]
        n = f"{len(first['measured'])} of {len(first['per_variation'])}"
        cells = [
            f"{_fmt(fa[d][b]['worst'])} ({fa[d][b]['worst_variation'] or '-'}; "
            f"{fa[d][b]['threshold']})"
            for d in decs
        ]
        lines.append(f"| {b} | {n} | " + " | ".join(cells) + " |")
    return lines


def markdown(r: Mapping[str, Any]) -> str:
    run = r["run"]
    lines = [
        f"# Provider audit at scale: {run['model']} claimed {run['args']['dtype']}/sdpa on "
        f"{run['device']} ({run['gpu'] or run['cpu']}), torch {run['torch']}, transformers "
        f"{run['transformers']}",
        "",
        f"Prompts: {run['prompts']['distinct_texts']} distinct texts (of "
        f"{run['prompts']['texts_available']}) x {run['prompts']['variants']} variants = "
        f"{run['prompts']['prompts']} prompts{' (chat)' if run['prompts']['chat'] else ''}; "
        f"{run['args']['max_new_tokens']} new tokens at most.",
        "",
        "## Benign tail (tokens above n ulps, per variation)",
        "",
        "| variation | prompts | tokens | flips | "
        + " | ".join(f"> {t}" for t in TAIL_ULPS)
        + " | max ulps | generate s (tok/s) | scan s |",
        "| --- " * (7 + len(TAIL_ULPS)) + "|",
    ]
    for k, v in r["benign"].items():
        lines.append(
            f"| {k} | {v['prompts']} | {v['tokens']} | {v['flips']} | "
            + " | ".join(str(v["above"][str(t)]) for t in TAIL_ULPS)
            + f" | {v['max_ulps']:.1f} | {v['generate_s']:.1f} ({v['generate_tok_s']}) "
            f"| {v['scan_s']:.1f} |"
        )
    null = r["null"]
    decs = list(null["false_alarms"])
    # The simulations' budgets (`sim_budgets`): those their rows hold.
    sims = list(r.get("simulations", {}).values())
    sims_b = [int(b) for b in sims[0][decs[0]]["per_budget"]] if sims else []
    lines += [
        "",
        f"## Null: thresholds from half A, false alarms on half B ({null['tokens']} tokens)",
        "",
        "| variation | tokens A | tokens B | reaches |",
        "| --- | --- | --- | --- |",
    ]
    for k, v in null["per_variation"].items():
        lines.append(f"| {k} | {v['tokens_A']} | {v['tokens_B']} | {v['reach'] or '-'} |")
    lines += [
        "",
        f"Reach: {null['reach_all']} tokens (every variation), {null['reach_large_batch']} "
        "(the large-batch ones). False-alarm rate <= 1% at every budget up to: "
        + ", ".join(f"{s} {null['fa_ok_up_to'][s]}" for s in decs),
        "",
        "False-alarm rate on half B, per budget: the worst of the variations whose half B holds "
        "the budget's tokens (the variation; the threshold; 0 measured: the worst of all, "
        "groups of repeated traces):",
        "",
        *fa_table(null["false_alarms"]),
        "",
        "The same on groups of distinct half-B traces, as a provider's groups come (no trace "
        "twice in a group; only the variations whose half B holds the budget). Up to: "
        + ", ".join(f"{s} {null['fa_ok_up_to_distinct'][s]}" for s in decs),
        "",
        *fa_table(null["false_alarms_distinct"]),
    ]
    if null.get("choices"):
        lines += [
            "",
            "The decision the calibration (half A) chose per budget by its own held-out split "
            "of half A (`per_budget` above): its held-out false alarms, the allowance, and "
            "whether every variation's held-out quarter held 1 / rate disjoint groups (trusted; "
            "else the fewest held-out false alarms decide):",
            "",
            "| budget | chosen | held-out FA | allowance | passed | trusted (supply) | power |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for c in null["choices"]:
            lines.append(
                f"| {c['tokens']} | {c['decision']} | "
                f"{c['held_out_false_alarm'][c['decision']]:.3f} | {c['allowance']:.3f} | "
                f"{c['passed']} | {c['trusted']} ({c['supply']:.1f}) | {_fmt(c['power'])} |"
            )
    for s in decs:
        lines += [
            "",
            f"## Simulated providers: {s} (AUC / power per budget)",
            "",
            "| provider | tokens | outputs differing | to decision | AUC>=0.999 at | "
            + " | ".join(str(b) for b in sims_b)
            + " |",
            "| --- " * (5 + len(sims_b)) + "|",
        ]
        for name, row in r["simulations"].items():
            x = row[s]
            per = " | ".join(
                f"{_fmt(x['per_budget'][str(b)]['auc'])}/{x['per_budget'][str(b)]['power']:.2f}"
                for b in sims_b
            )
            lines.append(
                f"| {name} | {row['tokens']} | {row['outputs_differing']} | "
                f"{x['tokens_to_decision'] or '> ' + str(sims_b[-1])} | "
                f"{x['auc_0999_at'] or '-'} | {per} |"
            )
    if "sampled" in r:
        sm = r["sampled"]
        lines += ["", "## Sampled traffic (temperature 0.7, seeded): honest vs 4-bit RTN", ""]
        if "skipped" in sm:
            lines.append(f"Not run: {sm['skipped']}")
        else:
            lines += [
                f"{sm['prompts']} prompts; tokens honest {sm['tokens_honest']}, 4-bit "
                f"{sm['tokens_4-bit RTN g128']}.",
                "",
                "| statistic | AUC>=0.999 at | " + " | ".join(str(b) for b in sims_b) + " |",
                "| --- " * (2 + len(sims_b)) + "|",
            ]
            for s in STATISTICS:
                x = sm["auc"][s]
                lines.append(
                    f"| {s} | {x['auc_0999_at'] or '-'} | "
                    + " | ".join(f"{x['per_budget'][str(b)]['auc']:.3f}" for b in sims_b)
                    + " |"
                )
    lines += ["", "## Wall time per phase (s)", ""]
    lines += [f"- {k}: {v}" for k, v in r["wall_s"].items()]
    return "\n".join(lines) + "\n"


def cross_markdown(r: Mapping[str, Any]) -> str:
    run, src = r["run"], r["traces_from"]
    lines = [
        f"# Cross-platform: traces from {src['device']} ({src['gpu'] or src['cpu']}, torch "
        f"{src['torch']}) scanned on {run['device']} ({run['gpu'] or run['cpu']}, torch "
        f"{run['torch']})",
        "",
        "## The saved traces' tail as scanned here",
        "",
        "| variation | tokens | flips | " + " | ".join(f"> {t}" for t in TAIL_ULPS) + " | max |",
        "| --- " * (4 + len(TAIL_ULPS)) + "|",
    ]
    if "note" in r:
        lines[1:1] = ["", f"Note: {r['note']}."]
    for k, v in r["tail_here"].items():
        lines.append(
            f"| {k} | {v['tokens']} | {v['flips']} | "
            + " | ".join(str(v["above"][str(t)]) for t in TAIL_ULPS)
            + f" | {v['max_ulps']:.1f} |"
        )
    for name, n in r["nulls"].items():
        lines += [
            "",
            f"## Null: {name} ({sum(n['tokens'].values())} tokens); false-alarm rate of the "
            f"saved half B ({sum(n['test_tokens'].values())} tokens), worst variation",
            "",
            *fa_table(n["false_alarms"]),
        ]
    lines += ["", "## Wall time per phase (s)", ""]
    lines += [f"- {k}: {v}" for k, v in r["wall_s"].items()]
    return "\n".join(lines) + "\n"


# -- main ------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, help="the checkpoint (not with --null-from)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16", help="the claimed body (and head) format")
    ap.add_argument("--prompts", type=Path, default=PROMPTS, help='JSONL with "prompt" texts')
    ap.add_argument(
        "--stdlib-prompts",
        type=int,
        default=0,
        metavar="N",
        help="instead: N function beginnings of this Python's standard library",
    )
    ap.add_argument(
        "--benign-tokens",
        type=int,
        default=6000,
        help="benign tokens to generate in all (the large-batch variations share "
        "what the small-batch ones leave)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--batch", type=int, default=32, help="the large batch")
    ap.add_argument(
        "--small-prompts", type=int, default=8, help="prompts at batch 8 (batch 4: half as many)"
    )
    ap.add_argument("--b1-prompts", type=int, default=2, help="prompts at batch 1")
    ap.add_argument(
        "--gen-workers",
        type=int,
        default=1,
        help="processes generating each small-batch variation (whole batches each: the same "
        "tokens as one process; batch 1 is bound by generate()'s host loop)",
    )
    ap.add_argument(
        "--claim-seconds",
        type=float,
        default=None,
        help="a device command's guard: the claimed variation generates for at most this long "
        "(the other large-batch ones take its prompts, at their own speed)",
    )
    ap.add_argument(
        "--min-mean-tokens",
        type=int,
        default=None,
        help="the shortest mean output expected (sizes the prompt list; default "
        "a quarter of --max-new-tokens)",
    )
    ap.add_argument(
        "--eval-prompts",
        type=int,
        default=16,
        help="prompts of each simulated provider (half B's first)",
    )
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="only the simulations whose names start so (4-bit always runs)",
    )
    ap.add_argument(
        "--max-budget",
        type=int,
        default=FA_BUDGETS[-1],
        help="the largest token budget measured (a quick run: fewer)",
    )
    ap.add_argument(
        "--sim-max-budget",
        type=int,
        default=SIM_BUDGETS[-1],
        help="the largest budget of the simulations' AUC and power (with --null-from: up to "
        "the provider files' tokens, 32,768 at the GPU script's defaults)",
    )
    ap.add_argument(
        "--null-variations",
        default=None,
        help="with --null-from: only these benign variations (comma-separated keys, e.g. "
        "bf16/sdpa/b256): a null pinned to the claimed configuration",
    )
    ap.add_argument("--draws", type=int, default=300, help="calibration draws per budget")
    ap.add_argument(
        "--fa-draws",
        type=int,
        default=1000,
        help="groups per budget for false alarms, AUC and power",
    )
    ap.add_argument(
        "--scan-token-budget", type=int, default=16384, help="positions per scan forward"
    )
    ap.add_argument("--sampled", action="store_true", help="the sampled-traffic section")
    ap.add_argument(
        "--sampled-prompts", type=int, default=None, help="prompts of each sampled provider"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="directory of the JSON and markdown")
    ap.add_argument(
        "--save-traces",
        type=Path,
        default=None,
        help="gzip JSONL of the benign traces (trace JSON, with variation and half)",
    )
    ap.add_argument("--stage", choices=("all", "benign", "rest"), default="all")
    ap.add_argument(
        "--work",
        type=Path,
        default=None,
        help="where --stage benign keeps the benign evidence for --stage rest",
    )
    ap.add_argument("--tmp", type=Path, default=None, help="where simulated checkpoints go")
    ap.add_argument(
        "--save-null",
        type=Path,
        default=None,
        help="write the null's per-token deficits and the alternative's (.npz) for --null-from",
    )
    ap.add_argument(
        "--null-from",
        type=Path,
        default=None,
        help="measure the null's decisions again from a --save-null file (no model, any device)",
    )
    ap.add_argument(
        "--scan-traces",
        type=Path,
        default=None,
        help="cross-platform: scan these saved traces here instead of generating",
    )
    ap.add_argument(
        "--scan-max-tokens",
        type=int,
        default=20000,
        help="cross-platform: tokens of saved traces scanned at most",
    )
    ap.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="cross-platform: stop scanning and generating after this many seconds and report "
        "what was measured",
    )
    ap.add_argument(
        "--cpu-null-prompts",
        type=int,
        default=8,
        help="cross-platform: prompts per variation of the null generated here (0: none)",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    if args.model is None and args.null_from is None:
        parser().error("--model is required (except with --null-from)")
    if args.min_mean_tokens is None:
        args.min_mean_tokens = max(1, args.max_new_tokens // 4)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "transformers", "urllib3", "replay_audit"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    clock = Clock()
    if args.scan_traces is not None:
        result = cross_platform(args, clock)
        result["wall_s"] = {**clock.phases, "total": round(clock.total, 1)}
        (args.out / "cross.json").write_text(json.dumps(result, indent=1))
        (args.out / "cross.md").write_text(cross_markdown(result))
        print(cross_markdown(result))
        return result
    if args.null_from is not None:
        data, alt, meta, providers = load_null(args.null_from)
        if args.null_variations is not None:
            keep = args.null_variations.split(",")
            unknown = sorted(set(keep) - set(data["variations"]))
            if unknown:
                parser().error(f"--null-variations: not in the file: {', '.join(unknown)}")
            data = {"variations": {k: data["variations"][k] for k in keep}}
        platform_ = {
            k: meta.get(k) for k in ("device", "gpu_name", "sm", "torch_version", "devices")
        }
        args.dtype = meta.get("claim", args.dtype)
        args.batch = meta.get("batch", args.batch)
        rng = np.random.default_rng(args.seed)
        cal, null = null_report(args, clock, data, alt, platform_, rng)
        result = {"null_from": str(args.null_from), "meta": meta, "null": null}
        honest = providers.pop(HONEST, [])
        if honest:  # the providers' power at the null's thresholds, as the GPU run reports it
            budgets = sim_budgets(args)
            with clock.phase("simulations' AUC and power"):
                result["simulations"] = {
                    name: {
                        "tokens": int(sum(len(d) for d in sim)),
                        **simulation_row(cal, sim, honest, budgets, args.fa_draws, rng),
                    }
                    for name, sim in providers.items()
                }
        result["wall_s"] = {**clock.phases, "total": round(clock.total, 1)}
        (args.out / "null.json").write_text(json.dumps(result, indent=1))
        decided = {
            name: {d: v["tokens_to_decision"] for d, v in row.items() if isinstance(v, dict)}
            for name, row in result.get("simulations", {}).items()
        }
        summary = {"fa_ok_up_to": null["fa_ok_up_to"], "choices": null["choices"]}
        print(json.dumps({**summary, "tokens_to_decision": decided}, indent=1))
        return result
    work = args.work / "benign.pkl" if args.work else None
    if args.stage == "rest":
        if work is None or not work.exists():
            raise SystemExit("--stage rest needs the --work of a --stage benign run")
        data = pickle.loads(work.read_bytes())
        clock.phases.update({f"(benign stage) {k}": v for k, v in data["wall_s"].items()})
    else:
        from replay_audit.engine.loading import load_tokenizer

        texts = load_texts(args)
        chat = bool(getattr(load_tokenizer(args.model), "chat_template", None))
        data = benign_stage(args, clock, texts, chat)
        data["wall_s"] = dict(clock.phases)
        if work is not None:
            work.parent.mkdir(parents=True, exist_ok=True)
            work.write_bytes(pickle.dumps(data))
        if args.stage == "benign":
            summary = {
                k: {"prompts": len(v["units"]), **tail(v["deficits"])}
                for k, v in data["variations"].items()
            }
            (args.out / "benign.json").write_text(
                json.dumps(
                    {"prompts": data["prompts"], "benign": summary, "wall_s": clock.phases},
                    indent=1,
                )
            )
            print(json.dumps(summary, indent=1))
            return summary
    result = rest_stage(args, clock, data)
    result["wall_s"] = {**clock.phases, "total": round(clock.total, 1)}
    (args.out / "scale.json").write_text(json.dumps(result, indent=1))
    (args.out / "scale.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
