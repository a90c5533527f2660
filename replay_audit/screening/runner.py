"""Running a screening: each configuration loaded once, every prompt decoded once per run, the
divergent prompts of each comparison probed while both arms' engines are loaded, everything
stored as it is produced (so a stopped screening resumes where it was). Torch-free: engines
come from a `Backend` through the `Engine` protocol (the torch backend is
`screening/worker.py`; tests pass fakes).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import numpy as np

from replay_audit.engine.protocol import Engine, HiddenStates
from replay_audit.exceptions import EngineError, ReplayAuditError, UnsupportedFormat
from replay_audit.screening.outputs import (
    Probe,
    PromptDecode,
    RunOutput,
    ScreenPrompt,
    first_divergence_of,
    hidden_gap,
)
from replay_audit.screening.plan import ComparisonSpec, Run, ScreenConfig, SweepPlan

#: What an engine raises when a configuration loads but cannot run (a kernel with no
#: implementation for these shapes or dtypes, out of memory): that knob value fails, the
#: screening goes on.
ENGINE_FAILURES: Final = (RuntimeError, ValueError, MemoryError, EngineError)

#: progress(done, total, what): called after each unit of work (a decode or a probe).
Progress = Callable[[int, int, str], None]


class Backend(Protocol):
    """Where a screening's engines come from."""

    def load(self, config: ScreenConfig) -> Engine:
        """The checkpoint in `config` (raises `UnsupportedFormat` where it cannot run here)."""
        ...

    def activate(self, config: ScreenConfig) -> None:
        """Set the process-wide numerical flags of `config` (deterministic, TF32) before its
        engine is used: another configuration's load may have changed them."""
        ...

    def eos_ids(self) -> list[int]: ...


class Store(Protocol):
    """Where a screening keeps what it has produced, as JSON objects by key."""

    def get(self, key: str) -> dict[str, Any] | None: ...

    def put(self, key: str, value: dict[str, Any]) -> None: ...


class DirectoryStore:
    """A `Store` in a directory: one JSON file per key (written whole, then renamed)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / (key.replace("/", "__").replace(":", "--") + ".json")

    def get(self, key: str) -> dict[str, Any] | None:
        p = self._path(key)
        if not p.is_file():
            return None
        try:
            value = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return None  # a file cut short by a kill: produce it again
        return value if isinstance(value, dict) else None

    def put(self, key: str, value: dict[str, Any]) -> None:
        p = self._path(key)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(value, allow_nan=False), encoding="utf-8")
        tmp.replace(p)


class MemoryStore:
    """A `Store` in a dict (tests, and the service's job before it writes its row)."""

    def __init__(self, values: dict[str, dict[str, Any]] | None = None) -> None:
        self.values: dict[str, dict[str, Any]] = dict(values or {})

    def get(self, key: str) -> dict[str, Any] | None:
        return self.values.get(key)

    def put(self, key: str, value: dict[str, Any]) -> None:
        self.values[key] = value


class ScreenOutputs:
    """What a screening produced: run outputs by run key, probes by comparison name, the
    configurations that could not be loaded here (key → reason: not available) and those that
    loaded but failed to run (key → error: failed)."""

    def __init__(self) -> None:
        self.runs: dict[str, RunOutput] = {}
        self.probes: dict[str, dict[int, Probe]] = {}
        self.unavailable: dict[str, str] = {}
        self.failed: dict[str, str] = {}


def _run_key(run: Run) -> str:
    return f"run/{run.key}"


def _probe_key(spec: ComparisonSpec) -> str:
    return f"probe/{spec.name}"


def load_outputs(plan: SweepPlan, store: Store) -> ScreenOutputs:
    """Whatever the store holds for `plan` (runs, probes, unavailable configurations)."""
    out = ScreenOutputs()
    for run in plan.runs():
        d = store.get(_run_key(run))
        if d is not None:
            out.runs[run.key] = RunOutput.from_json(d)
    for spec in plan.comparisons():
        d = store.get(_probe_key(spec))
        if d is not None:
            out.probes[spec.name] = {int(k): Probe.from_json(v) for k, v in d["probes"].items()}
    u = store.get("unavailable")
    if u is not None:
        out.unavailable = {str(k): str(v) for k, v in u.items()}
    f = store.get("failed")
    if f is not None:
        out.failed = {str(k): str(v) for k, v in f.items()}
    return out


def decode_run(
    engine: Engine,
    plan: SweepPlan,
    run: Run,
    prompts: Sequence[ScreenPrompt],
    eos: Sequence[int],
    tick: Callable[[str], None],
) -> RunOutput:
    """Every prompt decoded once in `run`."""
    iv = plan.intervention(run.intervention)
    decodes = []
    for p in prompts:
        r = engine.decode(list(p.token_ids), plan.max_new_tokens, eos, iv, plan.top_k)
        s = r.steps
        decodes.append(
            PromptDecode(
                output_ids=tuple(int(x) for x in r.output_token_ids),
                margins=np.asarray(s.margins, dtype=np.float64),
                margins_ulps=np.asarray(s.margins_ulps, dtype=np.float64),
                top1=np.asarray(s.top_k_logits[:, 0], dtype=np.float64),
                gate_fired=np.asarray(s.gate_fired, dtype=bool),
            )
        )
        tick(f"decode {run.key}")
    # The engine's numerical environment, and every knob of the screening's configuration
    # (some, such as the SDPA backend, are process settings the engine does not report).
    environment = {**engine.environment(), "screening_config": run.config.to_json()}
    return RunOutput(run.key, environment, tuple(decodes))


def probe_comparison(
    spec: ComparisonSpec,
    engine_a: Engine,
    engine_b: Engine,
    out_a: RunOutput,
    out_b: RunOutput,
    prompts: Sequence[ScreenPrompt],
    top_k: int,
    activate: Callable[[ScreenConfig], None] = lambda _: None,
) -> dict[int, Probe]:
    """Each divergent prompt's single-step re-run at t* in both configurations and the
    hidden-state gap along the shared prefix y<t* (from-scratch forwards, no decode).
    `activate(config)` runs before each engine's forwards (its process-wide flags)."""
    probes: dict[int, Probe] = {}
    for i, p in enumerate(prompts):
        da, db = out_a.decodes[i], out_b.decodes[i]
        t = first_divergence_of(da.output_ids, db.output_ids)
        if t is None:
            continue
        prompt = list(p.token_ids)
        prefix = list(da.output_ids[:t])
        activate(spec.a.config)
        ra = engine_a.step(prompt, prefix, top_k)
        h_a = engine_a.hidden_states(prompt, prefix) if isinstance(engine_a, HiddenStates) else None
        activate(spec.b.config)
        rb = engine_b.step(prompt, prefix, top_k)
        h_b = engine_b.hidden_states(prompt, prefix) if isinstance(engine_b, HiddenStates) else None
        gated = tuple(
            s
            for s in range(t + 1)
            if (s < len(da) and bool(da.gate_fired[s])) or (s < len(db) and bool(db.gate_fired[s]))
        )
        dh_t: float | None = None
        dh_gated: tuple[float, ...] = ()
        if h_a is not None and h_b is not None:
            gap = hidden_gap(h_a, h_b)
            dh_t = float(gap[t])
            dh_gated = tuple(float(gap[s]) for s in gated)
        probes[i] = Probe(i, t, ra.token, rb.token, dh_t, gated, dh_gated)
    return probes


def run_screening(
    plan: SweepPlan,
    prompts: Sequence[ScreenPrompt],
    backend: Backend,
    store: Store,
    *,
    progress: Progress | None = None,
) -> ScreenOutputs:
    """Produce (or resume) every run and probe of `plan`, storing each as it is done.

    The anchors (arm A of some comparison: the reference, the pair's arm A) are decoded first
    and stay loaded; every other configuration is then loaded once, decoded, its comparisons
    probed against the loaded anchor, and unloaded. A
    configuration whose load raises `UnsupportedFormat` is recorded as unavailable (with the
    reason), not failed."""
    fingerprint = plan.fingerprint([p.token_ids for p in prompts])
    meta = store.get("plan")
    if meta is not None and meta.get("fingerprint") != fingerprint:
        raise ReplayAuditError(
            "the output directory holds a screening of another plan or prompt set; "
            "use another --out or remove it"
        )
    store.put("plan", {"fingerprint": fingerprint})
    out = load_outputs(plan, store)
    runs = plan.runs()
    specs = plan.comparisons()
    anchors = {s.a.config.key for s in specs}
    todo_runs = [
        r
        for r in runs
        if r.key not in out.runs
        and r.config.key not in out.unavailable
        and r.config.key not in out.failed
    ]
    todo_specs = [s for s in specs if s.name not in out.probes]
    total = len(todo_runs) * len(prompts) + len(todo_specs)
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, what)

    engines: dict[str, Engine] = {}

    def engine_of(config: ScreenConfig) -> Engine | None:
        if config.key in out.unavailable or config.key in out.failed:
            return None
        if config.key not in engines:
            try:
                engines[config.key] = backend.load(config)
            except UnsupportedFormat as e:
                out.unavailable[config.key] = e.message
                store.put("unavailable", dict(out.unavailable))
                return None
        backend.activate(config)
        return engines[config.key]

    eos = backend.eos_ids()

    def fail(config: ScreenConfig, exc: BaseException) -> None:
        out.failed[config.key] = f"{type(exc).__name__}: {exc}"[:500]
        store.put("failed", dict(out.failed))
        engines.pop(config.key, None)

    def decode_config(config: ScreenConfig) -> None:
        for run in (r for r in runs if r.config.key == config.key):
            if run.key in out.runs:
                continue
            engine = engine_of(config)
            if engine is None:
                return
            try:
                out.runs[run.key] = decode_run(engine, plan, run, prompts, eos, tick)
            except ENGINE_FAILURES as e:  # this configuration fails here: say why, go on
                fail(config, e)
                return
            store.put(_run_key(run), out.runs[run.key].to_json())

    def probe_specs(pending: list[ComparisonSpec]) -> None:
        for spec in pending:
            if spec.name in out.probes:
                continue
            oa, ob = out.runs.get(spec.a.key), out.runs.get(spec.b.key)
            ea = engine_of(spec.a.config) if oa is not None and ob is not None else None
            eb = engine_of(spec.b.config) if ea is not None else None
            if ea is None or eb is None or oa is None or ob is None:
                tick(f"skip {spec.name}")
                continue
            # Each engine steps under its own flags.
            try:
                probes = probe_comparison(
                    spec, ea, eb, oa, ob, prompts, plan.top_k, activate=backend.activate
                )
            except ENGINE_FAILURES as e:
                fail(spec.b.config, e)
                continue
            out.probes[spec.name] = probes
            store.put(
                _probe_key(spec), {"probes": {str(k): v.to_json() for k, v in probes.items()}}
            )
            tick(f"probe {spec.name}")

    # The anchors first (decoded, then kept loaded), then every comparison between anchors;
    # then each other configuration: decoded, its comparisons probed, unloaded.
    configs = plan.configs()
    for config in (c for c in configs if c.key in anchors):
        decode_config(config)
    probe_specs([s for s in specs if s.b.config.key in anchors])
    for config in (c for c in configs if c.key not in anchors):
        decode_config(config)
        probe_specs([s for s in specs if s.b.config.key == config.key])
        engines.pop(config.key, None)
    return out
