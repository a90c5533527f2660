"""A small sampling profiler for a Python process the benchmarks start (no py-spy on the lent
GPU machines): runs a module as `python -m` would, with a thread that records every other
thread's Python stack every 1/--hz seconds (wall clock: a thread waiting on the GPU, a socket
or a lock is sampled where it waits), and writes the samples to --out every 30 s and at exit.

    python benchmarks/_stack_sampler.py --out worker_profile.json --hz 50 -- \\
        -m replay_audit worker --queue gpu --device cuda

The file holds `stacks` (each a list of "module:qualified function" frames, outermost first)
and `samples` ([time.time(), thread name, stack index]); `summarise` reads it back, for a time
window, into the share of one thread's samples under each phase (`PHASES`: the first frame,
innermost first, that names one) and the functions with the most samples (inclusive, and self).
Sampling takes the GIL for a moment each time: at 50 Hz the overhead is small (measured by the
benchmarks' own job log lines with and without it, where they give it).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

#: Phases of a replay worker's time, by the frames that mark them (module prefix, with
#: `replay_audit.` left off; qualified function name prefix). A sample is in the phase of its
#: innermost frame that marks one: a forward inside a decode is `decode`, SQLAlchemy inside the
#: writing of results `database: write`; then, where none does, of the innermost that marks one
#: of `FALLBACK`: a thread waiting for its next job (RQ's dequeue, the in-process runner's
#: queue) is `idle`.
PHASES: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("database", (("sqlalchemy", ""), ("psycopg", ""), ("sqlite3", ""))),
    ("imports (first use)", (("importlib", ""),)),
    ("model load", (("engine.loading", "load_model"), ("engine.torch_engine", "TorchEngine.load"))),
    ("engine and checkpoint lookup", (("engine.pool", ""), ("worker.checkpoint", ""))),
    ("batched scan", (("engine.torch_engine", "TorchEngine.scan_batch"),)),
    (
        "decode",
        (
            ("engine.torch_engine", "TorchEngine.decode"),
            ("engine.piecewise", ""),
            ("engine.decoder", "DynamicDecoder"),
            ("engine.decoder", "CompiledDecoder"),
        ),
    ),
    (
        "re-runs at t*",
        (("engine.torch_engine", "TorchEngine.step"), ("replays.pipeline", "_rerun_all")),
    ),
    (
        "results and statistics",
        (("replays.results", ""), ("replays.statistics", ""), ("stats", "")),
    ),
)
#: Looked for only where no frame of the stack marks one of `PHASES`.
FALLBACK: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("replay (other)", (("replays.", ""), ("engine.", ""), ("diff", ""))),
    ("idle (waiting for a job)", (("rq.", ""), ("redis", ""), ("queue.runner", ""))),
)
#: Functions that write (a `database` sample under one of them is a write, else a read).
WRITES = ("insert_results_of", "touch_job", "finish_job", "release_job", "fail_job")


def _frame_name(frame: FrameType) -> str:
    code = frame.f_code
    module = frame.f_globals.get("__name__", "?")
    qual = getattr(code, "co_qualname", code.co_name)
    return f"{module}:{qual}"


def _stack(frame: FrameType | None, limit: int = 120) -> tuple[str, ...]:
    names: list[str] = []
    while frame is not None and len(names) < limit:
        names.append(_frame_name(frame))
        frame = frame.f_back
    return tuple(reversed(names))


class Sampler(threading.Thread):
    def __init__(self, out: Path, hz: float) -> None:
        super().__init__(name="stack-sampler", daemon=True)
        self.out, self.interval = out, 1.0 / hz
        self.stacks: dict[tuple[str, ...], int] = {}
        self.samples: list[tuple[float, str, int]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def run(self) -> None:
        me = threading.get_ident()
        last_dump = time.monotonic()
        while not self.stop.wait(self.interval):
            now = time.time()
            names = {t.ident: t.name for t in threading.enumerate()}
            with self.lock:
                for ident, frame in sys._current_frames().items():
                    if ident == me:
                        continue
                    st = _stack(frame)
                    idx = self.stacks.setdefault(st, len(self.stacks))
                    self.samples.append((now, names.get(ident, str(ident)), idx))
            if time.monotonic() - last_dump > 30:
                self.dump()
                last_dump = time.monotonic()

    def dump(self) -> None:
        with self.lock:
            body = {
                "pid": os.getpid(),
                "interval_s": self.interval,
                "stacks": [list(s) for s, _ in sorted(self.stacks.items(), key=lambda kv: kv[1])],
                "samples": list(self.samples),
            }
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        tmp.replace(self.out)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: _stack_sampler.py --out FILE [--hz N] -- -m MODULE [ARGS...]")
    cut = argv.index("--")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hz", type=float, default=50.0)
    args = ap.parse_args(argv[:cut])
    rest = argv[cut + 1 :]
    if len(rest) < 2 or rest[0] != "-m":
        raise SystemExit("after --: -m MODULE [ARGS...]")
    sampler = Sampler(args.out, args.hz)
    sampler.start()
    sys.argv = [rest[1], *rest[2:]]
    try:
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    finally:
        sampler.stop.set()
        sampler.dump()


# -- reading it back ---------------------------------------------------------------------------


def _phase(stack: Sequence[str]) -> str:
    for phases in (PHASES, FALLBACK):
        for frame in reversed(stack):
            module, _, qual = frame.partition(":")
            module = module.removeprefix("replay_audit.")
            for phase, marks in phases:
                if any(module.startswith(m) and qual.startswith(f) for m, f in marks):
                    if phase == "database":
                        writes = any(f.rpartition(":")[2].endswith(WRITES) for f in stack)
                        return "database: write" if writes else "database: read"
                    return phase
    return "other"


def summarise(path: Path, windows: dict[str, tuple[float, float]], top: int = 25) -> dict[str, Any]:
    """Per window (name -> [start, end] in time.time()), the job thread's samples by phase and
    its functions with the most samples. The job thread: the one with the most samples inside
    `replays.tasks:run_replay_job` over the whole file (RQ's worker: MainThread; the in-process
    runner: its own thread)."""
    body = json.loads(path.read_text())
    stacks = [tuple(s) for s in body["stacks"]]
    interval = float(body["interval_s"])
    in_job = Counter(
        name
        for _, name, idx in body["samples"]
        if any(f.endswith(":run_replay_job") for f in stacks[idx])
    )
    if not in_job:
        return {"error": "no sample inside a replay job", "samples": len(body["samples"])}
    thread = in_job.most_common(1)[0][0]
    mine = [(t, idx) for t, name, idx in body["samples"] if name == thread]
    out: dict[str, Any] = {"thread": thread, "interval_s": interval, "windows": {}}
    for label, (start, end) in windows.items():
        chosen = [idx for t, idx in mine if start <= t <= end]
        if not chosen:
            out["windows"][label] = {"samples": 0}
            continue
        n = len(chosen)
        phases = Counter(_phase(stacks[i]) for i in chosen)
        inclusive: Counter[str] = Counter()
        own: Counter[str] = Counter()
        for i in chosen:
            st = stacks[i]
            inclusive.update({f for f in st if f.startswith("replay_audit.")})
            if st:
                own[st[-1]] += 1
        out["windows"][label] = {
            "samples": n,
            "seconds_sampled": round(n * interval, 1),
            "phases": {p: round(c / n, 4) for p, c in phases.most_common()},
            # The project's own functions (the threads' and runners' frames above them say
            # nothing), then the innermost frames whatever their module.
            "inclusive": [[f, round(c / n, 4)] for f, c in inclusive.most_common(top)],
            "self": [[f, round(c / n, 4)] for f, c in own.most_common(top)],
        }
    return out


if __name__ == "__main__":
    main()
