"""A fake-engine screening whose knob effects are known by construction (shared by the tests).

Prompts are (id, 50, 60); output step t of prompt p is decided by `base` unless the
configuration says otherwise:

    fp16 body     prompts in HEAD flip at step 3 with a tiny margin (the gate fires; the
                  single-step re-run flips too: head_reachable; C picks the base token back),
                  prompts in KV flip at step 4 with a tiny margin but the from-scratch re-run
                  does not (kv_dependent; C keeps the flip), prompts in BODY flip at step 2
                  with a margin of 1 (the gate does not fire: body_dominated)
    batch 8       prompts in BATCH flip at step 1 with a margin of 1
    everything else is the base model (identical to the reference)

The base model's margin is tiny at step 0 of even prompts, 1 elsewhere, so each run's trigger
density is 1/T on even prompts and 0 on odd ones (CV(TD) = 1 exactly). Hidden states: (1, 0)
in every configuration but fp16, whose are (1, 0.01): Δh = 0.01 everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replay_audit.engine.fake import FakeEngine
from replay_audit.engine.pool import EnginePool
from replay_audit.engine.protocol import Target
from replay_audit.exceptions import UnsupportedFormat
from replay_audit.screenings.sweep.outputs import ScreenOutputs, ScreenPrompt
from replay_audit.screenings.sweep.plan import ScreenConfig, SweepPlan
from replay_audit.screenings.sweep.runner import Store, run_screening

PROMPT_LEN = 3
TINY = 1e-4
N_PROMPTS = 20
HEAD = frozenset(range(1, 9))
BODY = frozenset({9, 10})
KV = frozenset({11})
BATCH = frozenset({2, 3, 4})
STEPS = 6


def prompts(n: int = N_PROMPTS) -> list[ScreenPrompt]:
    return [ScreenPrompt(f"p{i}", (i, 50, 60)) for i in range(n)]


def base(context: tuple[int, ...]) -> tuple[int, float]:
    t = len(context) - PROMPT_LEN
    token = (sum(context) * 31 + len(context)) % 97
    margin = TINY if t == 0 and context[0] % 2 == 0 else 1.0
    return token, margin


def _flip(token: int) -> int:
    return (token + 1) % 97


#: The checkpoint directory the fake engines stand for (the pool keys its engines by it).
FAKE_DIR = Path("/fake-screening-model")


@dataclass
class FakeBackend:
    """Engines by configuration, as described above, loaded by an engine pool through the
    replay pipeline as the torch ones are (`pool()`: the one engine seam); records loads."""

    head: frozenset[int] = HEAD
    body: frozenset[int] = BODY
    kv: frozenset[int] = KV
    batch: frozenset[int] = BATCH
    unsupported: dict[str, str] = field(default_factory=dict)
    #: Configurations that load but whose every decode raises RuntimeError(message).
    broken: dict[str, str] = field(default_factory=dict)
    #: What the backend's availability probe says, by configuration key (absent: it runs).
    refuses: dict[str, str] = field(default_factory=dict)
    loads: list[str] = field(default_factory=list)
    probed: list[str] = field(default_factory=list)
    _pool: EnginePool | None = field(default=None, init=False, repr=False)

    def loader(self, model_dir: Path, target: Target, tp_degree: int = 1) -> FakeEngine:
        """The pool's loader: the configuration whose target the pipeline asks for."""
        return self.load(ScreenConfig.of_target(target, tp_degree))

    def pool(self) -> EnginePool:
        """The pool of this backend's engines (one per backend: its engines stay loaded)."""
        if self._pool is None:
            self._pool = EnginePool(loader=self.loader, devices=8)
        return self._pool

    def run(
        self, plan: SweepPlan, prompts: list[ScreenPrompt], store: Store, **kw: Any
    ) -> ScreenOutputs:
        """`run_screening` of `plan` with this backend's engines."""
        return run_screening(plan, prompts, self.pool(), FAKE_DIR, self.eos_ids(), store, **kw)

    def load(self, config: ScreenConfig) -> FakeEngine:
        if config.key in self.unsupported:
            raise UnsupportedFormat(self.unsupported[config.key])
        self.loads.append(config.key)
        target = config.target()
        if config.key in self.broken:
            message = self.broken[config.key]

            def no_kernel(context: tuple[int, ...]) -> tuple[int, float]:
                raise RuntimeError(message)

            return FakeEngine(target, next_token=no_kernel)
        if config.dtype == "fp16":
            return self._fp16(config)
        if config.batch_size == 8:

            def batched(context: tuple[int, ...]) -> tuple[int, float]:
                token, margin = base(context)
                if context[0] in self.batch and len(context) - PROMPT_LEN == 1:
                    return _flip(token), 1.0
                return token, margin

            return FakeEngine(target, next_token=batched, hidden_fn=lambda c: [1.0, 0.0])
        return FakeEngine(
            target,
            next_token=base,
            repair_fn=lambda c, tok: base(c)[0],
            hidden_fn=lambda c: [1.0, 0.0],
        )

    def _fp16(self, config: ScreenConfig) -> FakeEngine:
        def flips(context: tuple[int, ...]) -> tuple[int, float] | None:
            p, t = context[0], len(context) - PROMPT_LEN
            token = base(context)[0]
            if p in self.head and t == 3:
                return _flip(token), TINY
            if p in self.kv and t == 4:
                return _flip(token), TINY
            if p in self.body and t == 2:
                return _flip(token), 1.0
            return None

        def decode(context: tuple[int, ...]) -> tuple[int, float]:
            return flips(context) or base(context)

        def scratch(context: tuple[int, ...]) -> tuple[int, float]:
            f = flips(context)
            if f is not None and context[0] in self.kv:
                return base(context)[0], TINY  # the from-scratch re-run does not flip
            return f or base(context)

        def repair(context: tuple[int, ...], token: int) -> int:
            if context[0] in self.kv:
                return token  # C keeps a KV-dependent flip
            return base(context)[0]

        return FakeEngine(
            config.target(),
            next_token=decode,
            step_fn=scratch,
            repair_fn=repair,
            hidden_fn=lambda c: [1.0, 0.01],
        )

    def availability(self, config: ScreenConfig) -> str | None:
        self.probed.append(config.key)
        return self.refuses.get(config.key)

    def eos_ids(self) -> list[int]:
        return []
