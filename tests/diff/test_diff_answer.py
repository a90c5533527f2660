"""Answer extraction and semantic agreement."""

from __future__ import annotations

import pytest

from replay_audit.diff import (
    extract_gsm8k,
    extractor_names,
    get_extractor,
    normalise_number,
    register_extractor,
    semantic_agreement,
)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so she pays 3 + 4 = 7 dollars.\n#### 7", "7"),
        ("#### 1,200", "1200"),
        ("The answer is $1,234.50 in total", "1234.5"),
        ("first 12 then 18.0", "18"),
        ("#### 42 and then 99 more", "42"),  # the number after the marker wins
        ("answer: -3", "-3"),
        ("no number here", None),
        ("#### \n none after the marker, but 5 before? no: 5 is after", "5"),
        ("", None),
    ],
)
def test_gsm8k(text: str, answer: str | None) -> None:
    assert extract_gsm8k(text) == answer


def test_normalise_number() -> None:
    assert normalise_number("7.0") == "7"
    assert normalise_number("-0.00") == "0"
    assert normalise_number("$3,000") == "3000"
    assert normalise_number("0.50") == "0.5"


def test_semantic_agreement_and_reference() -> None:
    s = semantic_agreement("... #### 18", "different reasoning, 18.0", reference_answer="18")
    assert s.agree and s.answer_a == "18" and s.correct_b and s.correct_a
    s = semantic_agreement("#### 18", "#### 19", reference_answer="#### 19")
    assert not s.agree and s.correct_a is False and s.correct_b is True
    # Neither arm has an answer: the answers do not differ (issue 9: SAR counted these as
    # disagreements, so SAR came out below EAR); counted apart as neither_answered.
    s = semantic_agreement("nothing", "nothing either")
    assert s.agree and s.neither_answered and s.answer_a is None and s.correct_a is None
    s = semantic_agreement("#### 3", "nothing")
    assert not s.agree and not s.neither_answered
    assert s.to_dict()["answer_a"] == "3" and s.to_dict()["answer_b"] is None
    assert s.to_dict()["extractor"] == "gsm8k"


def test_extractors_are_pluggable() -> None:
    @register_extractor("last-word")
    def last_word(text: str) -> str | None:
        words = text.split()
        return words[-1].lower() if words else None

    assert "last-word" in extractor_names() and get_extractor("last-word") is last_word
    assert semantic_agreement("it is Paris", "maybe paris", "last-word").agree
    assert semantic_agreement("a b", "a c", last_word).extractor == "last_word"
    with pytest.raises(KeyError, match="unknown answer extractor"):
        get_extractor("nope")
