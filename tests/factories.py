"""Test data with keyword overrides.

    make_trace()                                   # a valid trace, distinct from every other
    make_trace(seed=7)                             # the same content each time (idempotency)
    make_trace(config={"dtype": "fp16"})           # dict overrides merge into the default
    make_trace(n_output=300, top_k=None)           # shape knobs
    make_batch(3, tags=["nightly"])                # a list of distinct traces

Everything returned is plain JSON-ready dicts (what a client would POST).
"""

from __future__ import annotations

import copy
import itertools
import random
from typing import Any

import numpy as np

_counter = itertools.count(1)

DEFAULT_VOCAB = 1000
DEFAULT_WEIGHTS_SHA256 = "ab" * 32


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `overrides` into a copy of `base` (dict values merge, anything else replaces;
    an override of None replaces too, so `top_k=None` removes the top-k)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def make_config(**overrides: Any) -> dict[str, Any]:
    """A numerical configuration (bf16 body and head, eager attention on an SM 8.6 GPU)."""
    base: dict[str, Any] = {
        "dtype": "bf16",
        "lm_head_dtype": "bf16",
        "device": "cuda",
        "gpu": {"name": "NVIDIA RTX A6000", "sm": "8.6"},
        "attn_kernel": "eager",
        "batch_size": 1,
        "engine": {"name": "transformers", "version": "4.45.0"},
        "torch_version": "2.4.0",
        "deterministic": True,
        "tf32": False,
    }
    return _merge(base, overrides)


def make_top_k(
    output_token_ids: list[int], k: int = 2, *, vocab: int = DEFAULT_VOCAB, seed: int = 0
) -> dict[str, Any]:
    """Per-step top-k consistent with the output (rank 0 is the emitted token), logits sorted
    descending and exactly representable in float32 (as a real bf16/fp32 arm would log)."""
    rng = random.Random(seed)
    ids: list[list[int]] = []
    logits: list[list[float]] = []
    for token in output_token_ids:
        others = [t for t in rng.sample(range(vocab), k + 1) if t != token][: k - 1]
        ids.append([token, *others])
        top = rng.uniform(5.0, 20.0)
        gaps = sorted(rng.uniform(0.0, 3.0) for _ in range(k - 1))
        row = np.array([top] + [top - g for g in gaps], dtype=np.float32)
        logits.append([float(x) for x in row])
    return {"ids": ids, "logits": logits}


def make_trace(
    *,
    seed: int | None = None,
    n_prompt: int = 8,
    n_output: int = 6,
    top_k: int | dict[str, Any] | None = 2,
    vocab: int = DEFAULT_VOCAB,
    **overrides: Any,
) -> dict[str, Any]:
    """A valid `TraceCreate` body. Distinct content per call unless `seed` is given; `top_k`
    is k (None for no top-k, or an explicit {"ids", "logits"}); any other keyword overrides
    (deep-merged) the field of that name."""
    if seed is None:
        seed = next(_counter) + 1_000_000
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(n_prompt)]
    output = [rng.randrange(vocab) for _ in range(n_output)]
    trace: dict[str, Any] = {
        "model": {
            "name": "tiny-llama",
            "revision": "main",
            "weights_sha256": DEFAULT_WEIGHTS_SHA256,
            "vocab_size": vocab,
        },
        "config": make_config(),
        "decoding": {
            "strategy": "greedy",
            "max_new_tokens": n_output,
            "eos_token_ids": [2],
            "stop_reason": "length",
        },
        "prompt_token_ids": prompt,
        "output_token_ids": output,
        "prompt_text": f"prompt {seed}",
        "output_text": f"output {seed}",
        "tags": ["test"],
        "reference_answer": "42",
    }
    if isinstance(top_k, int):
        trace["top_k"] = make_top_k(output, top_k, vocab=vocab, seed=seed)
    elif isinstance(top_k, dict):
        trace["top_k"] = top_k
    return _merge(trace, overrides)


def make_batch(n: int, **overrides: Any) -> list[dict[str, Any]]:
    """`n` distinct traces, each with the same `overrides`."""
    return [make_trace(**overrides) for _ in range(n)]
