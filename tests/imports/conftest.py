"""Fixtures of the import tests: logged responses as the servers return them, and contexts."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from replay_audit.imports.schemas import ImportContext

FIXTURES = Path(__file__).parent / "fixtures"
WEIGHTS = "cd" * 32


def load_fixture(name: str) -> dict[str, Any]:
    """A fresh copy of a fixture response (tests may edit it)."""
    return copy.deepcopy(json.loads((FIXTURES / name).read_text()))


def make_context(**overrides: Any) -> ImportContext:
    """A context with the fields every import needs (bf16, a model) and raw logprobs."""
    values: dict[str, Any] = {
        "model": {"name": "tiny-llama", "weights_sha256": WEIGHTS, "vocab_size": 32000},
        "dtype": "bf16",
        "logprobs_mode": "raw_logprobs",
    }
    values.update(overrides)
    return ImportContext.model_validate(values)


@pytest.fixture
def context() -> ImportContext:
    return make_context()
