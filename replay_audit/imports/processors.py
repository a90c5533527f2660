"""The logits processors of a logged request, read from its sampling parameters: those a replay
applies (`decoding.logits_processors`: repetition penalty, no-repeat n-grams, min tokens, logit
bias, bad words, which transformers' own processors run) and those it does not (frequency and
presence penalties, allowed token ids, custom processors, guided decoding...), which make a
greedy request unreplayable (`other`). Pure.

The names in `PROCESSOR_FIELDS` are checked against vLLM's `SamplingParams` and its
OpenAI-compatible requests, SGLang's `sampling_params`, and transformers' `generate()` keywords
as lm-eval passes them. vLLM clamps a `logit_bias` to [-100, 100]
(`SamplingParams.from_optional`, as OpenAI's API documents it): the clamped value is what ran.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from replay_audit.json_value import JsonObject, JsonValue

#: Request fields that process the logits, with the value that leaves them off.
PROCESSOR_FIELDS: Final[dict[str, JsonValue]] = {
    "repetition_penalty": 1,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "min_tokens": 0,
    "min_new_tokens": 0,
    "bad_words": None,
    "bad_words_ids": None,
    "no_repeat_ngram_size": 0,
    "allowed_token_ids": None,
    "logits_processors": None,
    "response_format": {"type": "text"},
    "structured_outputs": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    # transformers' generate() keywords (lm-eval passes its gen_kwargs through).
    "sequence_bias": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "encoder_repetition_penalty": 1,
    "encoder_no_repeat_ngram_size": 0,
    "min_length": 0,
}
#: OpenAI's and vLLM's range of a logit bias.
MAX_LOGIT_BIAS: Final = 100.0


@dataclass(frozen=True)
class RequestProcessors:
    """A request's logits processors: `replayed` those a replay applies, as the trace's
    `decoding.logits_processors` (None: none), `not_replayed` the others by name, with their
    values as JSON (cut at 200 characters)."""

    replayed: JsonObject | None = None
    not_replayed: dict[str, str] = field(default_factory=dict)

    def named(self) -> str:
        """`frequency_penalty=0.5,presence_penalty=1`: the processors a replay does not apply."""
        return ",".join(f"{k}={v}" for k, v in self.not_replayed.items())


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _token_id(value: Any) -> int | None:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return _count(value)


def _replayed_value(name: str, value: Any, *, clamp_logit_bias: bool) -> JsonValue:
    """`value` as `decoding.logits_processors` holds it, or None where a replay cannot apply it
    (an unknown name, or a value of a shape the engine would not have taken)."""
    if name == "repetition_penalty":
        p = _number(value)
        return p if p is not None and p > 0 else None
    if name in ("no_repeat_ngram_size", "min_new_tokens"):
        return _count(value)
    if name == "logit_bias" and isinstance(value, Mapping):
        bias: JsonObject = {}
        for key, b in value.items():
            tid, number = _token_id(key), _number(b)
            if tid is None or number is None:
                return None
            if clamp_logit_bias:
                number = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, number))
            bias[str(tid)] = number
        return bias
    if name == "bad_words" and isinstance(value, list):
        ok = all(isinstance(w, str) and w.strip() for w in value)
        return [str(w) for w in value] if ok else None
    if name == "bad_words_ids" and isinstance(value, list):
        words = [[_token_id(t) for t in w] if isinstance(w, list) and w else None for w in value]
        if any(w is None or None in w for w in words):
            return None
        return [[t for t in w if t is not None] for w in words if w is not None]
    return None


def read_processors(
    params: Mapping[str, Any], *, clamp_logit_bias: bool = True
) -> RequestProcessors:
    """The logits processors `params` (a request, SGLang's `sampling_params`, generate()'s
    keywords) turn on: a field set to anything but its off value. vLLM's `min_tokens` and
    SGLang's `min_new_tokens` are one processor (`min_new_tokens`); given both with different
    values, neither is replayed."""
    on = {
        key: params[key]
        for key, off in PROCESSOR_FIELDS.items()
        if params.get(key) not in (None, off, {}, [], "")
    }
    replayed: JsonObject = {}
    not_replayed: dict[str, str] = {}
    mins = {json.dumps(on[k]) for k in ("min_tokens", "min_new_tokens") if k in on}
    for key, value in on.items():
        name = "min_new_tokens" if key == "min_tokens" else key
        shown = json.dumps(value, sort_keys=True, separators=(",", ":"))[:200]
        v = _replayed_value(name, value, clamp_logit_bias=clamp_logit_bias)
        if v is None or (name == "min_new_tokens" and len(mins) > 1):
            not_replayed[key] = shown
        else:
            replayed[name] = v
    return RequestProcessors(replayed or None, not_replayed)
