"""Running a screening: each configuration's arm resolved once (`replays.pipeline.load_arm`,
as every replay's), every prompt decoded once per run, each comparison's divergent prompts
probed while both arms are loaded, everything stored as it is produced (`outputs`). Torch-free:
engines come from an `EnginePool` (tests give one a fake loader, the one engine seam), and every
probe goes through the arm (`pipeline.Arm`): its whole computation, intervention included.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Protocol

import numpy as np

from replay_audit.diff import first_divergence
from replay_audit.engine.pool import EnginePool
from replay_audit.engine.protocol import HiddenStates
from replay_audit.exceptions import EngineError, ReplayAuditError, UnsupportedFormat
from replay_audit.json_value import JsonObject, as_int, as_object
from replay_audit.replays.pipeline import Arm, load_arm
from replay_audit.screenings.sweep.outputs import (
    Probe,
    PromptDecode,
    RunOutput,
    ScreenOutputs,
    ScreenPrompt,
    hidden_gap,
)
from replay_audit.screenings.sweep.plan import ComparisonSpec, Run, ScreenConfig, SweepPlan

#: What an engine raises when a configuration loads but cannot run (a kernel with no
#: implementation for these shapes or dtypes, out of memory): that knob value fails, the
#: screening goes on.
ENGINE_FAILURES: Final = (RuntimeError, ValueError, MemoryError, EngineError)

#: progress(done, total, what): called after each unit of work (a decode or a probe).
Progress = Callable[[int, int, str], None]


class Store(Protocol):
    """Where a screening keeps what it has produced, as JSON objects by key."""

    def get(self, key: str) -> JsonObject | None: ...

    def put(self, key: str, value: JsonObject) -> None: ...

    def scan(self, prefix: str) -> list[JsonObject]:
        """Every stored value whose key starts with `prefix` (in no particular order)."""
        ...


class DirectoryStore:
    """A `Store` in a directory: one JSON file per key (written whole, then renamed)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / (key.replace("/", "__").replace(":", "--") + ".json")

    def get(self, key: str) -> JsonObject | None:
        p = self._path(key)
        return self.get_file(p) if p.is_file() else None

    def put(self, key: str, value: JsonObject) -> None:
        p = self._path(key)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(value, allow_nan=False), encoding="utf-8")
        tmp.replace(p)

    def scan(self, prefix: str) -> list[JsonObject]:
        # File names encode keys lossily ("/" and "__" alike): callers check what they read.
        stem = self._path(prefix).name.removesuffix(".json")
        files = self.root.glob(f"{glob.escape(stem)}*.json")
        return [v for p in files if (v := self.get_file(p)) is not None]

    @staticmethod
    def get_file(p: Path) -> JsonObject | None:
        try:
            value = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return None  # a file cut short by a kill: produce it again
        return value if isinstance(value, dict) else None


class MemoryStore:
    """A `Store` in a dict (tests, and the service's job before it writes its row)."""

    def __init__(self, values: dict[str, JsonObject] | None = None) -> None:
        self.values: dict[str, JsonObject] = dict(values or {})

    def get(self, key: str) -> JsonObject | None:
        return self.values.get(key)

    def put(self, key: str, value: JsonObject) -> None:
        self.values[key] = value

    def scan(self, prefix: str) -> list[JsonObject]:
        return [v for k, v in self.values.items() if k.startswith(prefix)]


def _run_key(run: Run) -> str:
    """A finished run: its environment and prompt count (its decodes are stored per prompt)."""
    return f"run/{run.key}"


def _decode_prefix(run: Run) -> str:
    return f"decode/{run.key}/"


def stored_decodes(store: Store, run: Run) -> dict[int, PromptDecode]:
    """The prompts of `run` already decoded, by prompt index."""
    out: dict[int, PromptDecode] = {}
    for v in store.scan(_decode_prefix(run)):
        if v.get("run_key") == run.key:  # a directory's file names may match another run's
            out[as_int(v["prompt"])] = PromptDecode.from_json(as_object(v["decode"]))
    return out


def _stored_run(store: Store, run: Run, n_prompts: int) -> RunOutput | None:
    d = store.get(_run_key(run))
    if d is None:
        return None
    decodes = stored_decodes(store, run)
    if sorted(decodes) != list(range(n_prompts)):
        return None
    decoded = tuple(decodes[i] for i in range(n_prompts))
    return RunOutput(run.key, as_object(d["environment"]), decoded)


def _probe_key(spec: ComparisonSpec) -> str:
    return f"probe/{spec.name}"


def load_outputs(plan: SweepPlan, store: Store, n_prompts: int) -> ScreenOutputs:
    """Whatever the store holds for `plan` (finished runs, probes, unavailable
    configurations); a run stopped part-way is not among `runs` (see `stored_decodes`)."""
    out = ScreenOutputs()
    for run in plan.runs():
        if (r := _stored_run(store, run, n_prompts)) is not None:
            out.runs[run.key] = r
    for spec in plan.comparisons():
        if (d := store.get(_probe_key(spec))) is not None:
            probes = as_object(d["probes"]).items()
            out.probes[spec.name] = {int(k): Probe.from_json(as_object(v)) for k, v in probes}
    out.unavailable = {str(k): str(v) for k, v in (store.get("unavailable") or {}).items()}
    out.failed = {str(k): str(v) for k, v in (store.get("failed") or {}).items()}
    return out


def decode_run(
    arm: Arm,
    plan: SweepPlan,
    run: Run,
    prompts: Sequence[ScreenPrompt],
    eos: Sequence[int],
    tick: Callable[[str], None],
    *,
    done: dict[int, PromptDecode] | None = None,
    save: Callable[[int, PromptDecode], None] = lambda i, d: None,
) -> RunOutput:
    """Every prompt decoded once in `run`'s arm: those in `done` (by index) are taken as they
    are, each other one is decoded and handed to `save` at once."""
    decodes = []
    for i, p in enumerate(prompts):
        if done is not None and i in done:
            decodes.append(done[i])
            continue
        r = arm.decode(list(p.token_ids), plan.max_new_tokens, eos, plan.top_k)
        s = r.steps
        d = PromptDecode(
            output_ids=tuple(int(x) for x in r.output_token_ids),
            margins=np.asarray(s.margins, dtype=np.float64),
            margins_ulps=np.asarray(s.margins_ulps, dtype=np.float64),
            top1=np.asarray(s.top_k_logits[:, 0], dtype=np.float64),
            gate_fired=np.asarray(s.gate_fired, dtype=bool),
        )
        save(i, d)
        decodes.append(d)
        tick(f"decode {run.key}")
    # Taken through JSON here, so a fresh output is what a resumed screening reads.
    ran = arm.engine.environment()
    recorded = {
        **ran,
        "screening_config": run.config.to_json(),
        "resolved": arm.resolved.ran(ran).to_json(),
    }
    environment: JsonObject = json.loads(json.dumps(recorded))
    return RunOutput(run.key, environment, tuple(decodes))


def probe_comparison(
    arm_a: Arm,
    arm_b: Arm,
    out_a: RunOutput,
    out_b: RunOutput,
    prompts: Sequence[ScreenPrompt],
    top_k: int,
) -> dict[int, Probe]:
    """Each divergent prompt's single-step re-run at t* in both arms (each with its whole
    computation, its run's intervention included), and the hidden-state gap along the shared
    prefix y<t* (from-scratch forwards, no decode)."""
    probes: dict[int, Probe] = {}
    for i, p in enumerate(prompts):
        da, db = out_a.decodes[i], out_b.decodes[i]
        t = first_divergence(da.output_ids, db.output_ids)
        if t is None:
            continue
        prompt = list(p.token_ids)
        prefix = list(da.output_ids[:t])
        ra = arm_a.step(prompt, prefix, top_k, arm_a.layout)
        rb = arm_b.step(prompt, prefix, top_k, arm_b.layout)
        h_a = _hidden(arm_a, prompt, prefix)
        h_b = _hidden(arm_b, prompt, prefix)
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


def _hidden(arm: Arm, prompt: list[int], prefix: list[int]) -> np.ndarray | None:
    engine = arm.engine
    return engine.hidden_states(prompt, prefix) if isinstance(engine, HiddenStates) else None


def run_screening(
    plan: SweepPlan,
    prompts: Sequence[ScreenPrompt],
    pool: EnginePool,
    model_dir: Path,
    eos: Sequence[int],
    store: Store,
    *,
    progress: Progress | None = None,
    worker_kind: str | None = None,
) -> ScreenOutputs:
    """Produce (or resume) every run and probe of `plan` on the checkpoint in `model_dir`,
    storing each as it is done. A configuration whose load raises `UnsupportedFormat` is
    recorded as unavailable (with the reason), not failed."""
    fingerprint = plan.fingerprint([p.token_ids for p in prompts])
    meta = store.get("plan")
    if meta is not None and meta.get("fingerprint") != fingerprint:
        raise ReplayAuditError(
            "the output directory holds a screening of another plan or prompt set; "
            "use another --out or remove it"
        )
    store.put("plan", {"fingerprint": fingerprint})
    out = load_outputs(plan, store, len(prompts))
    runs = plan.runs()
    specs = plan.comparisons()
    anchors = {s.a.config.key for s in specs}
    partial = {
        r.key: stored_decodes(store, r)
        for r in runs
        if r.key not in out.runs
        and r.config.key not in out.unavailable
        and r.config.key not in out.failed
    }
    todo_specs = [s for s in specs if s.name not in out.probes]
    total = sum(len(prompts) - len(d) for d in partial.values()) + len(todo_specs)
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, what)

    arms: dict[str, Arm] = {}

    def runs_of(config: ScreenConfig) -> list[Run]:
        return [r for r in runs if r.config.key == config.key]

    def arm_of(run: Run) -> Arm | None:
        config = run.config
        if config.key in out.unavailable or config.key in out.failed:
            return None
        if run.key not in arms:
            target = config.target(plan.intervention(run.intervention))
            try:
                arms[run.key] = load_arm(
                    target, pool, model_dir, tp_degree=config.tp_degree, worker_kind=worker_kind
                )
            except UnsupportedFormat as e:
                out.unavailable[config.key] = e.message
                store.put("unavailable", dict(out.unavailable))
                return None
        return arms[run.key]

    def fail(config: ScreenConfig, exc: BaseException) -> None:
        out.failed[config.key] = f"{type(exc).__name__}: {exc}"[:500]
        store.put("failed", dict(out.failed))
        for run in runs_of(config):
            arms.pop(run.key, None)

    def decode_config(config: ScreenConfig) -> None:
        for run in (r for r in runs_of(config) if r.key not in out.runs):
            try:
                arm = arm_of(run)
            except ENGINE_FAILURES as e:  # it loads here, but fails (a kernel, memory)
                fail(config, e)
                return
            if arm is None:
                return

            def save(i: int, d: PromptDecode, run: Run = run) -> None:
                value: JsonObject = {"run_key": run.key, "prompt": i, "decode": d.to_json()}
                store.put(f"{_decode_prefix(run)}{i}", value)

            try:
                result = decode_run(
                    arm, plan, run, prompts, eos, tick, done=partial.get(run.key), save=save
                )
            except ENGINE_FAILURES as e:  # this configuration fails here: say why, go on
                fail(config, e)
                return
            out.runs[run.key] = result
            store.put(
                _run_key(run),
                {"run_key": run.key, "environment": result.environment, "prompts": len(prompts)},
            )

    def probe_specs(pending: list[ComparisonSpec]) -> None:
        for spec in pending:
            if spec.name in out.probes:
                continue
            oa, ob = out.runs.get(spec.a.key), out.runs.get(spec.b.key)
            try:
                ea = arm_of(spec.a) if oa is not None and ob is not None else None
                eb = arm_of(spec.b) if ea is not None else None
            except ENGINE_FAILURES as e:
                fail(spec.b.config, e)
                continue
            if ea is None or eb is None or oa is None or ob is None:
                tick(f"skip {spec.name}")
                continue
            try:
                probes = probe_comparison(ea, eb, oa, ob, prompts, plan.top_k)
            except ENGINE_FAILURES as e:
                fail(spec.b.config, e)
                continue
            out.probes[spec.name] = probes
            store.put(
                _probe_key(spec), {"probes": {str(k): v.to_json() for k, v in probes.items()}}
            )
            tick(f"probe {spec.name}")

    # The anchors (arm A of some comparison) stay loaded; every other configuration is loaded
    # once, decoded, probed against them, and let go (the pool keeps what it is sized for).
    configs = plan.configs()
    for config in (c for c in configs if c.key in anchors):
        decode_config(config)
    probe_specs([s for s in specs if s.b.config.key in anchors])
    for config in (c for c in configs if c.key not in anchors):
        decode_config(config)
        probe_specs([s for s in specs if s.b.config.key == config.key])
        for run in runs_of(config):
            arms.pop(run.key, None)
    return out
