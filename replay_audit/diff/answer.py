"""Final-answer extraction and semantic agreement. Pure: stdlib only.

Extractors are registered by name, so a benchmark's own rule can be plugged in:

    @register_extractor("mcq")
    def extract_choice(text: str) -> str | None: ...

`gsm8k` is built in: the number after the last `####` marker, else the last number in the text,
normalised (commas and a leading `$` removed, trailing zeros after the decimal point dropped, so
"1,200.0" → "1200" and "3.50" → "3.5").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from replay_audit.json_value import JsonObject

Extractor = Callable[[str], "str | None"]

_EXTRACTORS: dict[str, Extractor] = {}
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def register_extractor(name: str) -> Callable[[Extractor], Extractor]:
    """Register an answer extractor under `name` (a decorator)."""

    def add(fn: Extractor) -> Extractor:
        _EXTRACTORS[name] = fn
        return fn

    return add


def get_extractor(name: str) -> Extractor:
    """The extractor registered as `name`; KeyError naming the known ones otherwise."""
    try:
        return _EXTRACTORS[name]
    except KeyError:
        known = ", ".join(sorted(_EXTRACTORS))
        raise KeyError(f"unknown answer extractor {name!r}; known: {known}") from None


def extractor_names() -> list[str]:
    return sorted(_EXTRACTORS)


def normalise_number(raw: str) -> str:
    """'$1,200.50' → '1200.5'; '7.0' → '7'; '-0' → '0'."""
    s = raw.replace(",", "").replace("$", "")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    if s in ("-0", "-", ""):
        s = "0"
    return s


@register_extractor("gsm8k")
def extract_gsm8k(text: str) -> str | None:
    """GSM8K's final answer: the number after the last '####', else the last number in text."""
    marker = text.rfind("####")
    if marker >= 0:
        m = _NUMBER.search(text, marker + 4)
        if m is not None:
            return normalise_number(m.group(0))
    numbers = _NUMBER.findall(text)
    return normalise_number(numbers[-1]) if numbers else None


@dataclass(frozen=True)
class SemanticAgreement:
    """The final answers extracted from arm A's and arm B's texts, and whether they agree."""

    extractor: str
    answer_a: str | None
    answer_b: str | None
    #: Whether each arm's answer equals the trace's reference answer (None without one).
    correct_a: bool | None = None
    correct_b: bool | None = None

    @property
    def agree(self) -> bool:
        """The arms give the same answer; neither giving one is agreement too (the texts do not
        differ in their answer), counted apart as `neither_answered`."""
        return self.answer_a == self.answer_b

    @property
    def neither_answered(self) -> bool:
        return self.answer_a is None and self.answer_b is None

    def to_dict(self) -> JsonObject:
        """The stored JSON (`detail.semantic`, the API's `semantic`)."""
        return {
            "extractor": self.extractor,
            "answer_a": self.answer_a,
            "answer_b": self.answer_b,
            "agree": self.agree,
            "neither_answered": self.neither_answered,
            "correct_a": self.correct_a,
            "correct_b": self.correct_b,
        }


def semantic_agreement(
    text_a: str,
    text_b: str,
    extractor: str | Extractor = "gsm8k",
    *,
    reference_answer: str | None = None,
) -> SemanticAgreement:
    """Extract each arm's final answer and say whether they agree (and match the reference
    answer, normalised by the same extractor, when one is given)."""
    name = extractor if isinstance(extractor, str) else getattr(extractor, "__name__", "custom")
    fn = get_extractor(extractor) if isinstance(extractor, str) else extractor
    a, b = fn(text_a), fn(text_b)
    ref = fn(reference_answer) if reference_answer is not None else None
    return SemanticAgreement(
        extractor=name,
        answer_a=a,
        answer_b=b,
        correct_a=None if ref is None else a == ref,
        correct_b=None if ref is None else b == ref,
    )
