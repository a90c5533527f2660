"""A trace's logits processors on the device: transformers' own `LogitsProcessor` classes, in
`generate()`'s order (`GenerationMixin._get_logits_processor`: sequence bias, repetition
penalty, no-repeat n-grams, bad words, min new tokens), applied to each step's float32 native
logits exactly as `generate()` applies them (`next_token_logits.to(float32)`, then the list).

vLLM applies the same processors in another order (bad words, then min_tokens and logit_bias,
then penalties: `vllm/v1/sample/sampler.py`), but the only pair whose order can change a value
is logit_bias then repetition_penalty, and both libraries add the bias first; the others set
logits to -inf, which every processor keeps at -inf. vLLM's `bad_words` are texts: encoded here
as vLLM's `SamplingParams.update_from_tokenizer` encodes them, and matched against the output
tokens only (`vllm/v1/sample/ops/bad_words.py`), where transformers' `bad_words_ids` are matched
against prompt and output.

A probe (a decode step, a scan's steps, single-step re-runs) processes its rows one at a time:
row r sees its own context (prompt ‖ output so far) as `input_ids`, a view of one sequence on the
device (`StepProcessing`). Only traces whose generation ran processors pay for it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from replay_audit.engine.protocol import LogitsProcessors
from replay_audit.exceptions import UnsupportedFormat


def vllm_bad_words_ids(words: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """vLLM's ids of its `bad_words` texts (`SamplingParams.update_from_tokenizer`): each word
    stripped of leading spaces, encoded without special tokens as it is and with one leading
    space, the second kept only where it starts with another token and has as many tokens."""
    out: list[list[int]] = []
    for word in words:
        if not word.lstrip():
            continue  # vLLM fails the request: nothing was generated with it
        for add_prefix_space in (False, True):
            prompt = (" " if add_prefix_space else "") + word.lstrip()
            ids = [int(i) for i in tokenizer.encode(prompt, add_special_tokens=False)]
            if not ids:
                continue
            if not add_prefix_space or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return out


@dataclass(frozen=True, eq=False)
class Processing:
    """A trace's processors, built for one prompt length: `whole` over prompt ‖ output (what
    transformers' processors read), `output_only` over the output alone (vLLM's bad words)."""

    whole: Any
    output_only: Any
    prompt_length: int

    def __call__(self, context: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The processed logits (1, V) of float32 `scores` (1, V) after `context` (1, n)."""
        out = self.whole(context, scores) if self.whole else scores
        if self.output_only:
            out = self.output_only(context[:, self.prompt_length :], out)
        return out


def build(
    spec: LogitsProcessors, prompt_length: int, tokenizer: Any, vocab_size: int
) -> Processing:
    """`spec`'s transformers processors for a trace whose prompt has `prompt_length` tokens.
    `UnsupportedFormat` where a processor cannot run here: an id outside the vocabulary, vLLM's
    bad words without a tokenizer."""
    from transformers import (
        LogitsProcessorList,
        MinNewTokensLengthLogitsProcessor,
        NoBadWordsLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    ids = [t for t, _ in spec.logit_bias] + [t for w in spec.bad_words_ids for t in w]
    if any(not 0 <= t < vocab_size for t in ids):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise UnsupportedFormat(f"logits processors: token id {bad} outside the vocabulary")
    whole: Any = LogitsProcessorList()
    if spec.logit_bias:
        whole.append(SequenceBiasLogitsProcessor([[[t], float(b)] for t, b in spec.logit_bias]))
    if spec.repetition_penalty not in (None, 1.0):
        whole.append(RepetitionPenaltyLogitsProcessor(float(spec.repetition_penalty or 1.0)))
    if spec.no_repeat_ngram_size:
        whole.append(NoRepeatNGramLogitsProcessor(int(spec.no_repeat_ngram_size)))
    eos = [int(t) for t in spec.eos_token_ids]
    # generate() exempts a one-token bad word that is an eos id (NoBadWordsLogitsProcessor
    # filters it, and refuses a list left empty).
    bad_ids = [list(w) for w in spec.bad_words_ids if not (len(w) == 1 and w[0] in eos)]
    if bad_ids:
        whole.append(NoBadWordsLogitsProcessor(bad_ids, eos or None))
    if spec.min_new_tokens and eos:
        whole.append(MinNewTokensLengthLogitsProcessor(prompt_length, spec.min_new_tokens, eos))
    output_only: Any = LogitsProcessorList()
    if spec.bad_words:
        if tokenizer is None:
            raise UnsupportedFormat("logits processors: bad_words needs the checkpoint's tokenizer")
        words = vllm_bad_words_ids(spec.bad_words, tokenizer)
        if any(t >= vocab_size for w in words for t in w):
            raise UnsupportedFormat("logits processors: a bad word encodes outside the vocabulary")
        if words:
            output_only.append(NoBadWordsLogitsProcessor(words, None))
    return Processing(whole, output_only, prompt_length)


@dataclass(frozen=True, eq=False)
class Span:
    """Steps `start`..`stop` of a probe's rows, of one trace: row `start + i` is its output step
    `first_step + i`, after `sequence[:, :prompt_length + first_step + i]`."""

    start: int
    stop: int
    processing: Processing
    sequence: torch.Tensor
    first_step: int = 0


class StepProcessing:
    """The processors of a probe's rows (`numerics.Process`): each row processed alone with its
    own context; rows of no span (traces without processors) pass unchanged."""

    def __init__(self, spans: Sequence[Span]) -> None:
        self.spans = sorted(spans, key=lambda s: s.start)
        self._starts = [s.start for s in self.spans]

    def _row(self, r: int, scores: torch.Tensor) -> torch.Tensor:
        i = bisect.bisect_right(self._starts, r) - 1
        if i < 0 or r >= self.spans[i].stop:
            return scores
        span = self.spans[i]
        n = span.processing.prompt_length + span.first_step + (r - span.start)
        return span.processing(span.sequence[:, :n], scores)

    def __call__(
        self, scores: torch.Tensor, rows: npt.NDArray[np.int64] | None = None
    ) -> torch.Tensor:
        """The processed logits (G, V) of rows `rows` (None: rows 0..G-1) from `scores` (G, V)."""
        which = range(scores.shape[0]) if rows is None else rows.tolist()
        return torch.cat([self._row(int(r), scores[i : i + 1]) for i, r in enumerate(which)])


def sequence_tensor(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """A token sequence (1, n) on the device, the contexts' common storage."""
    return torch.tensor([list(ids)], dtype=torch.long, device=device)
