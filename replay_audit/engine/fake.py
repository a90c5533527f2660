"""A fake engine for fast tests of code that only needs engine results (the replay pipeline, the
workers, the API's job functions). Torch-free.

The fake is a deterministic "model" given as a Python function: `next_token(context)` returns
the next token and its top-2 margin for a context (prompt ‖ output so far). The decode loop,
the scan and the single-step re-run all derive from it, so they agree with each other unless a
test says otherwise: `step_fn` overrides the from-scratch re-run (to model a flip that needs the
KV cache), `scan_fn` the teacher-forced scan (None: `step_fn`, since a scan has no decode's KV
cache either), and `repair_fn` says what an intervention picks at a gated step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from replay_audit.diff.margin import step_numerics
from replay_audit.diff.pieces import Piece
from replay_audit.engine.batch import (
    plan_scan,
    plan_steps,
    scan_extras,
    step_extras,
)
from replay_audit.engine.protocol import (
    DEFAULT_SCAN_TOKEN_BUDGET,
    BatchLayout,
    DecodeRequest,
    DecodeRun,
    DecodeStop,
    DecodeWindow,
    Environment,
    ExtraValue,
    Intervention,
    LoggedEvidence,
    LogitsProcessors,
    ScanItem,
    ScanRun,
    StepInfo,
    Steps,
    Target,
    decode_each,
    steps_from_numerics,
)
from replay_audit.exceptions import UnsupportedFormat

NextToken = Callable[[tuple[int, ...]], tuple[int, float]]
Repair = Callable[[tuple[int, ...], int], int]
#: The fake's "hidden state" for a context (the vector its head would read): any 1-d floats.
Hidden = Callable[[tuple[int, ...]], Sequence[float]]


def _refuse(processors: LogitsProcessors | None) -> None:
    """The fake model has no logits to process: a trace whose generation ran logits processors
    is refused (never replayed as plain greedy)."""
    if processors is not None and processors.active:
        raise UnsupportedFormat(
            f"the fake engine applies no logits processors ({processors.label()})"
        )


def _default_next_token(context: tuple[int, ...]) -> tuple[int, float]:
    return (sum(context) * 31 + len(context)) % 97, 1.0


@dataclass
class FakeEngine:
    """An `Engine` whose model is `next_token(context) -> (token, margin)`. Top-1 logit is 10.0,
    top-2 is 10.0 - margin on token (token + 1) % vocab_size, then further ids 1 lower each.
    Margins and the gate are decided from those logits in float32, as the torch engine's are."""

    target: Target
    next_token: NextToken = _default_next_token
    vocab_size: int = 97
    max_positions: int | None = None
    step_fn: NextToken | None = None
    repair_fn: Repair | None = None
    #: The model of the teacher-forced scan (None: `step_fn`, else `next_token`).
    scan_fn: NextToken | None = None
    #: Optional text for detokenize: token id → string piece.
    pieces: Callable[[int], str] | None = None
    #: The hidden state of a context (`hidden_states`); by default (token, margin) of the model.
    hidden_fn: Hidden | None = None
    calls: list[str] = field(default_factory=list)
    #: What the last `scan_batch` recorded (its batch shapes), as the torch engine records it.
    _scan_extras: dict[str, ExtraValue] = field(default_factory=dict, init=False, repr=False)
    #: What the last `step_batch` recorded (its batch shapes).
    _step_extras: dict[str, ExtraValue] = field(default_factory=dict, init=False, repr=False)

    def environment(self) -> Environment:
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
            "cudnn_version": None,
            "deterministic": bool(self.target.deterministic),
            "tf32": bool(self.target.tf32),
            "extras": {**self._scan_extras, **self._step_extras},
        }

    def _step(
        self, context: tuple[int, ...], intervention: Intervention, k: int, fn: NextToken
    ) -> Steps:
        """One step of the fake model as one row of `Steps`: its top-k through
        `diff.step_numerics`, as the torch engine's, then `repair_fn` where the gate fired."""
        token, margin = fn(context)
        width = max(k, 2)
        ids = [(token + i) % self.vocab_size for i in range(width)]
        logits = [10.0, 10.0 - margin] + [10.0 - margin - i for i in range(1, width - 1)]
        # The model's ranking as given (top-1 is its token, even where a margin of 0 puts a
        # smaller id second), so sort=False.
        numerics = step_numerics(
            np.asarray([logits], dtype=np.float32),
            [ids],
            head_format=self.target.head_dtype,
            gate=intervention.gate,
            sort=False,
        )
        steps = steps_from_numerics([token], [token], numerics, k)
        if steps.gate_fired[0] and intervention.kind != "none" and self.repair_fn is not None:
            chosen = self.repair_fn(context, token)
            return replace(steps, token_ids=np.asarray([chosen], dtype=np.int64))
        return steps

    def decode(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_ids: Sequence[int] = (),
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        forced_prefix: Sequence[int] = (),
        processors: LogitsProcessors | None = None,
        window: DecodeWindow | None = None,
        layout: BatchLayout | None = None,
    ) -> DecodeRun:
        self.calls.append("decode")
        _refuse(processors)
        iv = intervention or self.target.intervention
        out = list(forced_prefix)
        parts: list[Steps] = []
        stop: DecodeStop = "length"
        differs = window.first_difference(out, None) if window is not None else None
        while len(out) < max_new_tokens:
            if window is not None and window.reached(differs, len(out)):
                stop = "window"
                break
            step = self._step((*prompt_ids, *out), iv, top_k, self.next_token)
            parts.append(step)
            out.append(int(step.token_ids[0]))
            if out[-1] in eos_ids:
                stop = "eos"
                break
            if window is not None:
                differs = window.first_difference(out, differs, len(out) - 1)
        steps = Steps.concat(parts) if parts else Steps.empty(top_k)
        return DecodeRun(out, steps, len(forced_prefix), stop)

    def decode_batch(
        self,
        requests: Sequence[DecodeRequest],
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        processors: LogitsProcessors | None = None,
    ) -> list[DecodeRun]:
        """Each request's `decode`, in order (the fake model has no batch to share); `calls`
        records each decode."""
        return decode_each(self, requests, intervention, top_k, processors)

    def scan(
        self,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        processors: LogitsProcessors | None = None,
    ) -> ScanRun:
        self.calls.append("scan")
        _refuse(processors)
        return self._scan(prompt_ids, output_ids, intervention, top_k)

    def scan_batch(
        self,
        items: Sequence[ScanItem],
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        token_budget: int = DEFAULT_SCAN_TOKEN_BUDGET,
    ) -> list[ScanRun]:
        """Each item's `scan`, in order (the fake model has no batch to vary), with the batch
        shapes the torch engine's plan would use recorded in `environment()["extras"]`."""
        self.calls.append("scan_batch")
        for it in items:
            _refuse(it.processors)
        self._scan_extras = scan_extras(plan_scan(items, token_budget), token_budget)
        return [self._scan(it.prompt_ids, it.output_ids, intervention, top_k) for it in items]

    def _scan(
        self,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        intervention: Intervention | None,
        top_k: int,
    ) -> ScanRun:
        iv = intervention or self.target.intervention
        fn = self.scan_fn or self.step_fn or self.next_token
        parts = [
            self._step((*prompt_ids, *output_ids[:t]), iv, top_k, fn)
            for t in range(len(output_ids))
        ]
        steps = Steps.concat(parts) if parts else Steps.empty(top_k)
        agrees = np.asarray(steps.token_ids == np.asarray(output_ids), dtype=bool)
        return ScanRun(steps, agrees, self._evidence(steps, output_ids))

    def _evidence(self, steps: Steps, output_ids: Sequence[int]) -> LoggedEvidence:
        """The logged tokens' logits and ranks under the fake's logits (`_step`): a token of
        the step's top-k has its listed logit and place; any other sits 1 below the last."""
        logits = np.zeros(len(output_ids), np.float32)
        ranks = np.zeros(len(output_ids), np.int64)
        for t, token in enumerate(output_ids):
            row = steps.top_k_ids[t].tolist()
            place = row.index(token) if token in row else len(row)
            last = float(steps.top_k_logits[t, -1]) - 1.0
            logits[t] = steps.top_k_logits[t, place] if place < len(row) else last
            ranks[t] = place
        return LoggedEvidence(logits, ranks)

    def step(
        self,
        prompt_ids: Sequence[int],
        prefix_ids: Sequence[int],
        intervention: Intervention,
        top_k: int = 5,
        *,
        processors: LogitsProcessors | None = None,
        layout: BatchLayout | None = None,
    ) -> StepInfo:
        self.calls.append("step")
        _refuse(processors)
        fn = self.step_fn or self.next_token
        return StepInfo.from_steps(self._step((*prompt_ids, *prefix_ids), intervention, top_k, fn))

    def step_batch(
        self,
        contexts: Sequence[Sequence[int]],
        intervention: Intervention,
        top_k: int = 5,
        *,
        token_budget: int = DEFAULT_SCAN_TOKEN_BUDGET,
        processors: LogitsProcessors | None = None,
        prompt_lengths: Sequence[int] | None = None,
        layouts: Sequence[BatchLayout | None] | None = None,
    ) -> list[StepInfo]:
        """Each context's `step` (the fake has no batch to vary), with the batch shapes the
        torch engine's plan would use recorded in `environment()["extras"]`."""
        self.calls.append("step_batch")
        _refuse(processors)
        self._step_extras = step_extras(
            plan_steps([len(c) for c in contexts], token_budget), token_budget
        )
        fn = self.step_fn or self.next_token
        return [
            StepInfo.from_steps(self._step(tuple(c), intervention, top_k, fn)) for c in contexts
        ]

    def hidden_states(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int]
    ) -> npt.NDArray[np.float32]:
        """Row t: `hidden_fn` of prompt ‖ output_ids[:t], t = 0..len(output_ids), as the torch
        engine's rows (the hidden state that predicts output step t)."""
        self.calls.append("hidden_states")
        fn = self.hidden_fn or (lambda c: [float(v) for v in self.next_token(c)])
        rows = [fn((*prompt_ids, *output_ids[:t])) for t in range(len(output_ids) + 1)]
        return np.asarray(rows, dtype=np.float32)

    def detokenize(self, ids: Sequence[int]) -> str | None:
        if self.pieces is None:
            return None
        return "".join(self.pieces(i) for i in ids)

    def token_pieces(self, ids: Sequence[int]) -> tuple[Piece, ...] | None:
        if self.pieces is None:
            return None
        return tuple(self.pieces(i) for i in ids)
