"""Where a job may run, and what a worker says it is: the vocabulary of routing by GPU kind and
tensor-parallel degree. Pure (stdlib): the API, the workers and the tests share it.

A worker announces its `WorkerKind` (GPU name, compute capability, how many devices it owns)
in Redis when it starts (`queue.state.announce_worker`) and serves the queues of its kind
(`served_queues`). A job is enqueued on the queue of its `Route`; what decides the route (a
trace's logged GPU and TP degree, a target's override) is the domain's rule
(`replays.service`), not this module's.

Queue names (RQ takes any name without a comma; the deployment's `REPLAY_AUDIT_QUEUE_PREFIX`
goes before each):

    gpu                 any GPU worker (TP 1)
    gpu:<kind>          GPU workers of kind <kind> (TP 1)
    gpu:<kind>:tp<k>    workers of kind <kind> owning k devices or more (TP k)
    gpu:tp<k>           any GPU worker owning k devices or more
    cpu, cpu:tp<k>      CPU workers (no kind)
    gpu-long, cpu-long  screenings and verifications (`runner.LONG_SUFFIX`)

A kind is the GPU's name in lower case without the vendor, every run of other characters than
letters and digits one `-`: `NVIDIA H100 80GB HBM3` -> `h100-80gb-hbm3`, `NVIDIA A10G` ->
`a10g` (`gpu_kind`). A CPU worker's kind is `cpu`.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from replay_audit.words import counted

#: The device queues, whose names a route builds on.
DeviceQueue = Literal["gpu", "cpu"]
DEVICE_QUEUES: Final[tuple[DeviceQueue, ...]] = ("gpu", "cpu")
#: The kind of a CPU worker (and of a worker that announced nothing: `queue.state`).
CPU_KIND: Final = "cpu"
#: What a target names to take any GPU kind (the `gpu` queue).
ANY_KIND: Final = "any"
#: Longest kind (a queue name of 64 characters holds `gpu:<kind>:tp<k>`, k up to 1024).
MAX_KIND_LENGTH: Final = 48
#: Largest tensor-parallel degree a route names.
MAX_TP_DEGREE: Final = 1024

_VENDOR = re.compile(r"^(nvidia|amd|intel)\s+", re.IGNORECASE)
_OTHER = re.compile(r"[^a-z0-9]+")
_TP = re.compile(r"^tp([1-9][0-9]*)$")


def gpu_kind(gpu_name: str) -> str:
    """The kind of a GPU named `gpu_name` (a kind is its own kind: `a10g` -> `a10g`);
    `ValueError` when nothing of the name is left."""
    slug = _OTHER.sub("-", _VENDOR.sub("", gpu_name.strip()).lower()).strip("-")
    if not slug or _TP.match(slug) or slug in (CPU_KIND, ANY_KIND):
        raise ValueError(f"{gpu_name!r} names no GPU kind")
    return slug[:MAX_KIND_LENGTH].rstrip("-")


@dataclass(frozen=True)
class WorkerKind:
    """What a worker announces: its kind (`cpu` or the GPU's `gpu_kind`), the GPU's name and
    compute capability (None on a CPU), and how many devices it owns (the TP degree it can
    serve)."""

    kind: str
    gpu_name: str | None = None
    sm: str | None = None
    devices: int = 1

    @classmethod
    def cpu(cls) -> WorkerKind:
        return cls(CPU_KIND)

    @classmethod
    def gpu(cls, name: str, sm: str | None, devices: int = 1) -> WorkerKind:
        return cls(gpu_kind(name), name, sm, devices)

    @property
    def is_gpu(self) -> bool:
        return self.kind != CPU_KIND

    def describe(self) -> str:
        """`a10g (NVIDIA A10G, sm 8.6), 1 device`, `cpu, 1 device`."""
        gpu = f" ({self.gpu_name}, sm {self.sm or '?'})" if self.gpu_name else ""
        return f"{self.kind}{gpu}, {counted(self.devices, 'device')}"

    def to_json(self) -> str:
        return json.dumps(
            {"kind": self.kind, "gpu": self.gpu_name, "sm": self.sm, "devices": self.devices}
        )

    @classmethod
    def from_json(cls, text: str) -> WorkerKind:
        """The inverse of `to_json`; a bare kind (a worker of a release before the
        announcement) is that kind owning one device."""
        try:
            d = json.loads(text)
        except ValueError:
            d = None
        if not isinstance(d, dict):
            return cls(text or CPU_KIND)
        devices = d.get("devices")
        return cls(
            str(d.get("kind") or CPU_KIND),
            d.get("gpu") if isinstance(d.get("gpu"), str) else None,
            d.get("sm") if isinstance(d.get("sm"), str) else None,
            devices if isinstance(devices, int) and devices >= 1 else 1,
        )


@dataclass(frozen=True)
class Route:
    """Which workers may take a job: a device queue, a GPU kind (None: any) and the
    tensor-parallel degree it runs at (a worker must own that many devices)."""

    device: DeviceQueue = "gpu"
    kind: str | None = None
    tp_degree: int = 1

    def __post_init__(self) -> None:
        if self.device not in DEVICE_QUEUES:
            raise ValueError(f"a route's device queue is one of {DEVICE_QUEUES}")
        if self.kind is not None and (self.device != "gpu" or gpu_kind(self.kind) != self.kind):
            raise ValueError(f"{self.kind!r} is not a GPU kind of the gpu queue")
        if not 1 <= self.tp_degree <= MAX_TP_DEGREE:
            raise ValueError(f"a TP degree is 1 to {MAX_TP_DEGREE}")

    @property
    def queue(self) -> str:
        """The queue's name (module docstring)."""
        parts = [self.device, self.kind, f"tp{self.tp_degree}" if self.tp_degree > 1 else None]
        return ":".join(p for p in parts if p)

    @classmethod
    def parse(cls, queue: str) -> Route | None:
        """The route of a queue named `queue`; None for a queue no route names (`gpu-long`)."""
        device, *rest = queue.split(":")
        if device not in DEVICE_QUEUES or len(rest) > 2:
            return None
        kind, tp = None, 1
        for part in rest:
            m = _TP.match(part)
            if m:
                tp = int(m.group(1))
            elif kind is None and tp == 1:
                kind = part
            else:
                return None
        try:
            route = cls(device, kind, tp)
        except ValueError:
            return None
        return route if route.queue == queue else None

    def describe(self) -> str:
        """`a GPU worker of kind a10g owning 2 devices or more`, `a CPU worker`."""
        who = "a CPU worker" if self.device == "cpu" else "a GPU worker"
        if self.kind is not None:
            who += f" of kind {self.kind}"
        if self.tp_degree > 1:
            who += f" owning {self.tp_degree} devices or more (TP {self.tp_degree})"
        return who


def worker_routes(device: DeviceQueue, worker: WorkerKind) -> list[Route]:
    """The routes a worker serving device queue `device` takes, in the order it serves them:
    its own kind's first (TP 1, then each degree up to its devices), then any kind's."""
    kinds = [worker.kind, None] if device == "gpu" and worker.is_gpu else [None]
    return [Route(device, k, tp) for k in kinds for tp in range(1, worker.devices + 1)]


@dataclass(frozen=True)
class LiveWorker:
    """A live worker as the queue sees it: what it announced and the queues it serves (None:
    every route of a TP degree it can serve, as the in-process runner takes them all)."""

    kind: WorkerKind
    queues: frozenset[str] | None

    def serves(self, queue: str) -> bool:
        if self.queues is not None:
            return queue in self.queues
        route = Route.parse(queue)
        return route is None or route.tp_degree <= self.kind.devices


def live_kinds(workers: Sequence[LiveWorker]) -> str:
    """`a10g (NVIDIA A10G, sm 8.6), 1 device x2; cpu, 1 device x1`, or `none`."""
    counts = Counter(w.kind for w in workers)  # in order of first appearance
    return "; ".join(f"{k.describe()} x{n}" for k, n in counts.items()) or "none"
