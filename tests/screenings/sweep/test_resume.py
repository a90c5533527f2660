"""A stopped screening resumes prompt by prompt: within a run it continues at the first prompt not
yet decoded (each prompt's decode is stored as soon as it is made), and the report is the one an
uninterrupted screening gives. The same for the `--out` directory (the CLI) and memory."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from replay_audit.engine.fake import FakeEngine
from replay_audit.screenings.sweep.analysis import build_report
from replay_audit.screenings.sweep.plan import Platform, ScreenConfig, SweepPlan, build_plan
from replay_audit.screenings.sweep.report import ScreeningReport
from replay_audit.screenings.sweep.runner import DirectoryStore, MemoryStore, Store
from tests.screenings.sweep.fake_screen import N_PROMPTS, STEPS, FakeBackend, prompts

KNOBS = ("body_dtype", "batch_size")
FP16 = ScreenConfig("fp16")
STOP_AT = 7  # the prompt whose decode is interrupted


class Stopped(KeyboardInterrupt):
    """Ctrl-C (or a worker's SIGTERM) while a prompt decodes."""


@dataclass
class CountingBackend(FakeBackend):
    """Counts each (configuration, prompt) decode; with `stop`, interrupts the decode of prompt
    `stop[1]` in configuration `stop[0]` (before it produces anything)."""

    stop: tuple[str, int] | None = None
    decoded: Counter[tuple[str, tuple[int, ...]]] = field(default_factory=Counter)

    def load(self, config: ScreenConfig) -> FakeEngine:
        engine = super().load(config)
        inner = engine.decode

        def decode(prompt: list[int], *args: Any, **kwargs: Any) -> Any:
            if self.stop is not None and self.stop == (config.key, prompt[0]):
                raise Stopped
            self.decoded[(config.key, tuple(prompt))] += 1
            return inner(prompt, *args, **kwargs)

        engine.decode = decode  # type: ignore[method-assign]
        return engine


def _plan() -> SweepPlan:
    return build_plan(
        Platform(device="cpu", fp8_unavailable="no fp8 on a cpu"),
        reference=ScreenConfig("fp32"),
        knobs=KNOBS,
        max_new_tokens=STEPS,
    )


def _report(backend: FakeBackend, store: Store) -> ScreeningReport:
    plan = _plan()
    out = backend.run(plan, prompts(), store)
    return build_report(plan, prompts(), out, model="fake", weights_sha256=None)


@pytest.mark.parametrize("kind", ["memory", "directory"])
def test_an_interrupted_run_resumes_at_its_first_undecoded_prompt(
    kind: str, tmp_path: Path
) -> None:
    store: Store = MemoryStore() if kind == "memory" else DirectoryStore(tmp_path / "state")
    first = CountingBackend(stop=(FP16.key, STOP_AT))
    with pytest.raises(Stopped):
        _report(first, store)
    # fp16 is the pair's arm B (decoded after the anchors): prompts 0..6 of its first run were
    # decoded before the stop, the rest not.
    fp16_first = {p for (k, p), _ in first.decoded.items() if k == FP16.key}
    assert {p[0] for p in fp16_first} == set(range(STOP_AT))

    again = CountingBackend()
    resumed = _report(again, store)
    fp16_again = {p[0] for (k, p), _ in again.decoded.items() if k == FP16.key}
    # The interrupted run (fp16, no intervention) continued at prompt 7; its +C run, not begun
    # at the stop, decodes every prompt: so prompts < 7 were decoded once more (for +C) and
    # prompts >= 7 twice (the rest of the first run, then +C).
    assert fp16_again == set(range(N_PROMPTS))
    for i in range(N_PROMPTS):
        n = again.decoded[(FP16.key, prompts()[i].token_ids)]
        assert n == (1 if i < STOP_AT else 2), (i, n)
    # Runs finished before the stop (the anchors fp32 and bf16, and bf16+C) decode nothing.
    for key in (ScreenConfig("fp32").key, ScreenConfig("bf16").key):
        assert not any(k == key for k, _ in again.decoded)
    # Every (configuration, prompt) decode of the uninterrupted screening, over both passes,
    # happened exactly as often as in one uninterrupted pass.
    plain = CountingBackend()
    uninterrupted = _report(plain, MemoryStore())
    assert first.decoded + again.decoded == plain.decoded
    assert resumed == uninterrupted


def test_a_finished_screening_decodes_nothing_when_run_again(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "state")
    report = _report(CountingBackend(), store)
    again = CountingBackend()
    assert _report(again, store) == report
    assert not again.decoded and again.loads == []
