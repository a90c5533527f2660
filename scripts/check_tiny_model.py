"""Acceptance check of the tiny Llama: does it behave like a real LM for cross-precision replay?

Loads the checkpoint on the CPU with eager attention and measures, over the fixed prompt set:

- held-out loss in fp32 (the train script's held-out stdlib files) against uniform ln(4096);
- greedy ``generate()`` in bf16 and in fp16: the fraction of prompts whose outputs are
  token-identical (both agreement and divergence must occur), and the first divergence steps;
- bf16 run twice: identical tokens (self-replay is exact);
- ``generate()`` against a plain KV-cache greedy loop, in each format: identical tokens;
- top-2 margins along the fp32 greedy path (peaked distributions with occasional close calls) and
  the share of exact ties in the bf16/fp16 logits along their own paths;
- milliseconds per decode step (plain loop, batch 1, median) and per generated token
  (``generate()``, mean, prefill included).

Usage (from the repository root)::

    .venv/bin/python scripts/check_tiny_model.py [--model DIR] [--prompts FILE] [--json-out FILE]

It exits non-zero when an acceptance property fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

# The sibling training script defines the corpus split and the held-out loss.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny_model as training

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CLOSE_CALL = 0.05  # a top-2 margin below this (fp32 logits) counts as a close call
AGREEMENT_RANGE = (0.25, 0.85)


def load_model(model_dir: Path, dtype: str) -> Any:
    """The checkpoint on the CPU in the given format, eager attention, eval mode."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=DTYPES[dtype], attn_implementation="eager", local_files_only=True
    )
    return model.eval()  # type: ignore[no-untyped-call]


def load_prompts(path: Path) -> list[dict[str, str]]:
    """The prompt set: one ``{"id", "prompt"}`` object per line."""
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@torch.no_grad()
def generate_greedy(
    model: Any, input_ids: torch.Tensor, max_new_tokens: int
) -> tuple[list[int], list[torch.Tensor], float]:
    """transformers' greedy ``generate()``: new token ids, per-step raw logits, seconds."""
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    seconds = time.perf_counter() - t0
    new_tokens = out.sequences[0, input_ids.shape[1] :].tolist()
    return new_tokens, [step[0] for step in out.logits], seconds


@torch.no_grad()
def plain_greedy_loop(
    model: Any, input_ids: torch.Tensor, max_new_tokens: int, eos_id: int
) -> tuple[list[int], list[float]]:
    """A plain KV-cache greedy loop: new token ids and the seconds of each decode step."""
    out = model(input_ids=input_ids, use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1]
    tokens: list[int] = []
    step_seconds: list[float] = []
    while True:
        token = int(torch.argmax(logits))
        tokens.append(token)
        if token == eos_id or len(tokens) == max_new_tokens:
            break
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
        step_seconds.append(time.perf_counter() - t0)
    return tokens, step_seconds


def top2_margin(logits: torch.Tensor) -> float:
    """Top-1 minus top-2 logit, computed in float32 from the native values."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where two token sequences differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def quantiles(values: list[float]) -> dict[str, float]:
    """Median and a few quantiles, rounded for the report."""
    ordered = sorted(values)

    def q(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))], 4)

    return {"p05": q(0.05), "p25": q(0.25), "median": q(0.5), "p75": q(0.75), "p95": q(0.95)}


def held_out_loss(model_dir: Path, model: Any) -> float:
    """Mean next-token loss (nats) of the model on the train script's held-out files."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    corpus = training.load_corpus()
    windows = training.eval_windows(training.token_stream(tokenizer, corpus.held_out))
    return training.mean_loss(model, windows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Acceptance check of the tiny Llama.")
    parser.add_argument("--model", type=Path, default=training.DEFAULT_OUT)
    parser.add_argument("--prompts", type=Path, default=training.DEFAULT_PROMPTS_OUT)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    prompts = load_prompts(args.prompts)
    encoded = [tokenizer(p["prompt"], return_tensors="pt").input_ids for p in prompts]
    if any(int(ids[0, 0]) != tokenizer.bos_token_id for ids in encoded):
        raise SystemExit("the tokenizer did not prepend <s>")
    prompt_lengths = [ids.shape[1] - 1 for ids in encoded]
    eos_id = int(tokenizer.eos_token_id)

    models = {name: load_model(args.model, name) for name in DTYPES}
    n_params = sum(p.numel() for p in models["fp32"].parameters())
    loss = held_out_loss(args.model, models["fp32"])

    outputs: dict[str, list[list[int]]] = {name: [] for name in DTYPES}
    margins: dict[str, list[float]] = {name: [] for name in DTYPES}
    seconds: dict[str, float] = dict.fromkeys(DTYPES, 0.0)
    rerun_bf16: list[list[int]] = []
    loop_outputs: dict[str, list[list[int]]] = {name: [] for name in DTYPES}
    step_seconds: dict[str, list[float]] = {name: [] for name in DTYPES}
    for ids in encoded:
        for name, model in models.items():
            tokens, logits, secs = generate_greedy(model, ids, args.max_new_tokens)
            outputs[name].append(tokens)
            margins[name].extend(top2_margin(step) for step in logits)
            seconds[name] += secs
            tokens, steps = plain_greedy_loop(model, ids, args.max_new_tokens, eos_id)
            loop_outputs[name].append(tokens)
            step_seconds[name].extend(steps)
        rerun_bf16.append(generate_greedy(models["bf16"], ids, args.max_new_tokens)[0])

    n = len(prompts)
    divergence = [
        first_divergence(a, b) for a, b in zip(outputs["bf16"], outputs["fp16"], strict=True)
    ]
    t_stars = [t for t in divergence if t is not None]
    agreement = sum(t is None for t in divergence) / n
    bf16_fp32 = sum(a == b for a, b in zip(outputs["bf16"], outputs["fp32"], strict=True)) / n
    fp16_fp32 = sum(a == b for a, b in zip(outputs["fp16"], outputs["fp32"], strict=True)) / n
    self_replay = all(a == b for a, b in zip(outputs["bf16"], rerun_bf16, strict=True))
    loop_equal = {name: outputs[name] == loop_outputs[name] for name in DTYPES}
    n_new = {name: sum(len(t) for t in outs) for name, outs in outputs.items()}
    fp32_margins = margins["fp32"]

    report: dict[str, Any] = {
        "model": str(args.model),
        "torch": torch.__version__,
        "threads": args.threads,
        "parameters": n_params,
        "prompts": n,
        "prompt_tokens": {"min": min(prompt_lengths), "max": max(prompt_lengths)},
        "max_new_tokens": args.max_new_tokens,
        "held_out_loss_fp32": round(loss, 4),
        "uniform_loss": round(math.log(training.VOCAB_SIZE), 4),
        "bf16_fp16_agreement": round(agreement, 4),
        "bf16_fp16_identical_prompts": n - len(t_stars),
        "first_divergence_steps": sorted(t_stars),
        "bf16_fp32_agreement": round(bf16_fp32, 4),
        "fp16_fp32_agreement": round(fp16_fp32, 4),
        "bf16_self_replay_exact": self_replay,
        "generate_equals_plain_loop": loop_equal,
        "ended_with_eos": {
            name: sum(o[-1] == eos_id for o in outs) for name, outs in outputs.items()
        },
        "fp32_margin": {
            **quantiles(fp32_margins),
            "steps": len(fp32_margins),
            f"fraction_below_{CLOSE_CALL}": round(
                sum(m < CLOSE_CALL for m in fp32_margins) / len(fp32_margins), 4
            ),
        },
        "native_margin_zero_fraction": {
            name: round(sum(m == 0.0 for m in margins[name]) / len(margins[name]), 4)
            for name in ("bf16", "fp16")
        },
        # The median: other processes share the cores, and a mean would measure them too.
        "median_ms_per_decode_step_plain_loop": {
            name: round(1000 * statistics.median(step_seconds[name]), 3) for name in DTYPES
        },
        "ms_per_generated_token_generate": {
            name: round(1000 * seconds[name] / n_new[name], 3) for name in DTYPES
        },
    }
    print(json.dumps(report, indent=2))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

    failures = []
    if not loss < math.log(training.VOCAB_SIZE) - 3:
        failures.append(f"held-out loss {loss:.3f} is not far below uniform")
    if not AGREEMENT_RANGE[0] <= agreement <= AGREEMENT_RANGE[1]:
        failures.append(f"bf16/fp16 agreement {agreement:.2f} outside {AGREEMENT_RANGE}")
    if not self_replay:
        failures.append("bf16 self-replay is not exact")
    for name, equal in loop_equal.items():
        if not equal:
            failures.append(f"generate() and the plain KV-cache loop disagree in {name}")
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
