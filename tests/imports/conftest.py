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


#: A chat template in the shape of Zephyr's (HuggingFaceH4/zephyr-7b-beta): role tags, each
#: turn closed by the eos token, the generation prompt `<|assistant|>`.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_chat_checkpoint(directory: Path) -> Path:
    """A copy of the bundled checkpoint whose tokenizer has `CHAT_TEMPLATE`, saved by
    transformers' `save_pretrained` (so stored as transformers stores a chat template)."""
    import shutil

    from transformers import AutoTokenizer

    from replay_audit.config import BUNDLED_MODEL_DIR

    shutil.copytree(BUNDLED_MODEL_DIR, directory)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_checkpoint(tmp_path_factory.mktemp("chat") / "tiny-llama-chat")
