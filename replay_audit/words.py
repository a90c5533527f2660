"""Counts in messages (the CLI's, log lines, a run's pending reason, report text) read as
English: "1 trace", "2 traces" (issue 20: "wrote 1 traces", "1 items failed")."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun in the number `n` asks for: `counted(1, "trace")` is "1 trace"."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"
