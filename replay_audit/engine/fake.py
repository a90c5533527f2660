"""A fake engine for fast tests of code that only needs engine results (the replayer, the
workers, the API's job functions). Torch-free.

The fake is a deterministic "model" given as a Python function: `next_token(context)` returns
the next token and its top-2 margin for a context (prompt ‖ output so far). The decode loop,
the scan and the single-step re-run all derive from it, so they agree with each other unless a
test says otherwise: `step_fn` overrides the from-scratch re-run (to model a flip that needs the
KV cache), and `repair_fn` says what an intervention picks at a gated step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replay_audit.engine.protocol import (
    DecodeRun,
    Intervention,
    ScanRun,
    StepInfo,
    Target,
    steps_from_rows,
)

NextToken = Callable[[tuple[int, ...]], tuple[int, float]]
Repair = Callable[[tuple[int, ...], int], int]


def _default_next_token(context: tuple[int, ...]) -> tuple[int, float]:
    return (sum(context) * 31 + len(context)) % 97, 1.0


@dataclass
class FakeEngine:
    """An `Engine` whose model is `next_token(context) -> (token, margin)`. Top-1 logit is 10.0,
    top-2 is 10.0 - margin on token (token + 1) % vocab_size, then further ids 1 lower each."""

    target: Target
    next_token: NextToken = _default_next_token
    vocab_size: int = 97
    step_fn: NextToken | None = None
    repair_fn: Repair | None = None
    #: Optional text for detokenize: token id → string piece.
    pieces: Callable[[int], str] | None = None
    calls: list[str] = field(default_factory=list)

    def environment(self) -> dict[str, Any]:
        return {
            "dtype": self.target.dtype,
            "lm_head_dtype": self.target.head_dtype,
            "weight_dtype": self.target.dtype,
            "device": "cpu",
            "gpu": None,
            "attn_kernel": self.target.attn_kernel or "sdpa",
            "batch_size": self.target.batch_size,
            "tp_degree": 1,
            "engine": {"name": "fake", "version": None},
            "torch_version": None,
            "cuda_version": None,
            "cublas_version": None,
            "deterministic": True,
            "tf32": False,
            "extras": {},
        }

    def _row(
        self, context: tuple[int, ...], intervention: Intervention, k: int, fn: NextToken
    ) -> tuple[int, int, list[int], list[float], bool]:
        token, margin = fn(context)
        ids = [(token + i) % self.vocab_size for i in range(max(k, 2))]
        logits = [10.0, 10.0 - margin] + [10.0 - margin - i for i in range(1, max(k, 2) - 1)]
        fired = intervention.gate.fires(margin, 10.0, self.target.head_dtype)
        chosen = token
        if fired and intervention.kind != "none" and self.repair_fn is not None:
            chosen = self.repair_fn(context, token)
        return chosen, token, ids, logits, fired

    def decode(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_ids: Sequence[int] = (),
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        forced_prefix: Sequence[int] = (),
    ) -> DecodeRun:
        self.calls.append("decode")
        iv = intervention or self.target.intervention
        out = list(forced_prefix)
        rows = []
        stop: Any = "length"
        while len(out) < max_new_tokens:
            row = self._row((*prompt_ids, *out), iv, top_k, self.next_token)
            rows.append(row)
            out.append(row[0])
            if row[0] in eos_ids:
                stop = "eos"
                break
        steps = steps_from_rows(rows, self.target.head_dtype, top_k)
        return DecodeRun(out, steps, len(forced_prefix), stop)

    def scan(
        self,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        intervention: Intervention | None = None,
        top_k: int = 5,
    ) -> ScanRun:
        self.calls.append("scan")
        iv = intervention or self.target.intervention
        rows = [
            self._row((*prompt_ids, *output_ids[:t]), iv, top_k, self.next_token)
            for t in range(len(output_ids))
        ]
        steps = steps_from_rows(rows, self.target.head_dtype, top_k)
        return ScanRun(steps, np.asarray(steps.token_ids == np.asarray(output_ids), dtype=bool))

    def step(
        self, prompt_ids: Sequence[int], prefix_ids: Sequence[int], top_k: int = 5
    ) -> StepInfo:
        self.calls.append("step")
        fn = self.step_fn or self.next_token
        token, _, ids, logits, _ = self._row((*prompt_ids, *prefix_ids), Intervention(), top_k, fn)
        steps = steps_from_rows([(token, token, ids, logits, False)], self.target.head_dtype, top_k)
        return StepInfo(token, steps.top_k_ids[0], steps.top_k_logits[0], steps.margin_at(0))

    def detokenize(self, ids: Sequence[int]) -> str | None:
        if self.pieces is None:
            return None
        return "".join(self.pieces(i) for i in ids)
