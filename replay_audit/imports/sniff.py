"""The import format a logged item looks like, by a field only that source writes (names as
in each source module's docstring), so that an item refused under one `--format` can name the
right one. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from replay_audit.formats import ImportFormat

#: What each format's items are, as an error names them.
_WHAT: Final[dict[ImportFormat, str]] = {
    "openai": "an OpenAI-compatible (vLLM) response",
    "sglang": "an SGLang /generate answer",
    "hf": "a transformers generate() output",
    "lm-eval": "an lm-eval --log_samples sample",
}


def sniff_format(item: Any) -> ImportFormat | None:
    """The format `item` (bare or `{"request", "response"}`) looks like, or None."""
    body = item
    if isinstance(item, Mapping) and "response" in item and set(item) <= {"request", "response"}:
        body = item["response"]
    if isinstance(body, list) and body:  # SGLang's answer to a batch request
        body = body[0]
    if not isinstance(body, Mapping):
        return None
    if "meta_info" in body:
        return "sglang"
    if "choices" in body or ("outputs" in body and "request_id" in body):
        return "openai"
    if {"doc_id", "arguments", "resps"} <= body.keys():
        return "lm-eval"
    if "sequences" in body:
        return "hf"
    return None


def format_hint(item: Any, fmt: str, flag: str = "--format ") -> str:
    """` (this looks like an SGLang /generate answer: use --format sglang)` for an item that
    looks like another format than `fmt`, else ``."""
    found = sniff_format(item)
    if found is None or found == fmt:
        return ""
    return f" (this looks like {_WHAT[found]}: use {flag}{found})"
