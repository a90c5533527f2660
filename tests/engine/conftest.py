"""Fixtures for engine tests: a tiny random checkpoint (fast), the committed small model (real),
engines per format, and fixed prompt sets."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from replay_audit.config import BUNDLED_MODEL_DIR
from replay_audit.engine import EnginePool, Target
from replay_audit.engine.protocol import Engine

#: Short prompts of the tiny random checkpoint's tests (its byte tokenizer takes any text).
TINY_PROMPTS = [
    "The quick brown fox",
    "def main():",
    "import os\nimport sys\n",
    "Once upon a time",
    "for i in range(10):",
    "class Foo(object):",
    "1 + 1 = ",
    "SELECT * FROM",
    "Hello, world",
    "# Copyright",
    "return self.",
    "if __name__ ==",
]


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The CI machine has 2 cores shared with other jobs: torch's default thread pool then
    oversubscribes and a 2 ms decode step takes 50 ms."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from replay_audit.engine.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def real_dir() -> Path:
    """The committed small model (trained by scripts/train_tiny_model.py)."""
    assert any(BUNDLED_MODEL_DIR.glob("*.safetensors")), f"no checkpoint in {BUNDLED_MODEL_DIR}"
    return BUNDLED_MODEL_DIR


@pytest.fixture(scope="session")
def pool() -> EnginePool:
    return EnginePool(device="cpu")


@pytest.fixture(scope="session")
def tiny_engine(pool: EnginePool, tiny_dir: Path) -> Callable[..., Engine]:
    def get(dtype: str, **kw: object) -> Engine:
        return pool.get(tiny_dir, Target(dtype, **kw))  # type: ignore[arg-type]

    return get


@pytest.fixture(scope="session")
def tiny_prompts() -> list[list[int]]:
    """24 fixed random byte prompts of 4 to 20 tokens."""
    rng = random.Random(1234)
    return [[rng.randrange(256) for _ in range(rng.randrange(4, 21))] for _ in range(24)]


@pytest.fixture(scope="session")
def real_prompts(real_dir: Path) -> list[tuple[str, str]]:
    """(id, text) of the committed prompt set."""
    path = BUNDLED_MODEL_DIR.parent / "prompts.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(str(r["id"]), str(r["prompt"])) for r in rows]
