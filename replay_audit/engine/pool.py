"""Loaded engines, kept per process: a worker loads each (checkpoint, format, TP degree) once.

Torch-free: the loader (by default `load_engine`, here, re-exported as
`replay_audit.engine.load_engine`) imports torch the first time an engine is actually built.
An engine at TP k > 1 runs on the pool's one `tensor_parallel.TpGroup`, started on first use
and kept until it needs another degree, breaks, or the pool is cleared or closed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Unpack, runtime_checkable

from replay_audit.engine.hashing import weights_sha256
from replay_audit.engine.protocol import Engine, LoadOptions, Target
from replay_audit.exceptions import UnsupportedFormat
from replay_audit.formats import CacheKind

__all__ = ["Closeable", "EnginePool", "LoadOptions", "Loader", "load_engine"]

if TYPE_CHECKING:
    from replay_audit.engine.tensor_parallel import TpGroup

#: (checkpoint directory, target, TP degree) -> the engine: what a pool loads with (tests give
#: fakes; by default `load_engine`).
Loader = Callable[[Path, Target, int], Engine]
#: (checkpoint directory, `Target.format_key()`, TP degree).
_PoolKey = tuple[str, Target, int]


@runtime_checkable
class Closeable(Protocol):
    """An engine that holds more than memory (a tensor-parallel engine's ranks' models)."""

    def close(self) -> None: ...


class EnginePool:
    """Engines keyed by (checkpoint directory, `Target.format_key()`, TP degree), built on first
    use (`loader`, else `load_engine`). Thread-safe: the in-process job runner calls it from
    threads.

    `max_engines` bounds how many stay loaded (least recently used goes first). `threads` and
    `leave_free` set torch's CPU threads in each thread that takes an engine. `devices`: the
    highest TP degree it loads at. A TP group is started from the thread that first asks for
    one, and its ranks die with it: ask from a thread that lives as long as the pool, as a
    worker's main thread does.
    """

    def __init__(
        self,
        loader: Loader | None = None,
        *,
        max_engines: int | None = None,
        device: str | None = None,
        cache: CacheKind | None = None,
        max_cache_len: int = 4096,
        threads: int | None = None,
        leave_free: int = 0,
        on_load: Callable[[], object] | None = None,
        devices: int = 1,
    ) -> None:
        if devices < 1:
            raise ValueError("a pool owns at least one device")
        self._loader = loader
        self.devices = devices
        self._device = device
        self._tp: TpGroup | None = None
        self._on_load = on_load
        self._threads = threads
        self._leave_free = leave_free
        self._options = LoadOptions(device=device, cache=cache, max_cache_len=max_cache_len)
        self._max = max_engines
        self._engines: OrderedDict[_PoolKey, Engine] = OrderedDict()
        self._dirs: dict[str, Path] = {}
        self._lock = threading.RLock()

    def get(self, model_dir: str | Path, target: Target, tp_degree: int = 1) -> Engine:
        """The engine, loaded once. `UnsupportedFormat` for a degree above `devices`."""
        if tp_degree > self.devices:
            raise UnsupportedFormat(
                f"TP {tp_degree} needs {tp_degree} devices; this process owns {self.devices}",
                field="tp_degree",
            )
        d = self._directory(model_dir)
        key: _PoolKey = (str(d), target.format_key(), tp_degree)
        if self._loader is None and (self._threads is not None or self._leave_free):
            from replay_audit.engine.loading import set_torch_threads

            set_torch_threads(self._threads, leave_free=self._leave_free)  # for this thread
        with self._lock:
            if self._tp is not None and not self._tp.alive:
                self._drop_tp()  # a broken group's engines cannot run: load them again
            engine = self._engines.get(key)
            if engine is None:
                engine = self._load(d, target, tp_degree)
                self._engines[key] = engine
                if self._max is not None:
                    # An evicted TP engine's ranks drop its model; the group itself stays for
                    # the next TP job (starting k ranks costs an import of torch each).
                    while len(self._engines) > self._max:
                        _close(self._engines.popitem(last=False)[1])
            self._engines.move_to_end(key)
            return engine

    def _directory(self, model_dir: str | Path) -> Path:
        """`model_dir` resolved once per spelling: a job asks per trace and per arm, and resolving
        (a stat per path component) was 6% of a GPU worker's scan-only audit on the H200."""
        name = str(model_dir)
        d = self._dirs.get(name)
        if d is None:
            d = self._dirs[name] = Path(name).resolve()
        return d

    def _load(self, d: Path, target: Target, tp_degree: int) -> Engine:
        if self._loader is not None:
            engine = self._loader(d, target, tp_degree)
        elif tp_degree > 1:
            from replay_audit.engine.tensor_parallel import check_shards

            check_shards(d, tp_degree)  # before the group of another degree is stopped
            engine = load_engine(d, target, tp=self._tp_group(tp_degree), **self._options)
        else:
            engine = load_engine(d, target, **self._options)
        if self._on_load is not None:
            self._on_load()  # a worker counts its loads (replay_audit_model_loads_total)
        return engine

    def _tp_group(self, degree: int) -> TpGroup:
        """The pool's group of `degree` ranks; one of another degree is stopped first, with its
        engines (the groups would share the pool's devices)."""
        from replay_audit.engine.tensor_parallel import TpGroup

        if self._tp is not None and self._tp.degree != degree:
            self._drop_tp()
        if self._tp is None:
            self._tp = TpGroup(degree, device=self._device, threads=self._threads)
        return self._tp

    def _drop_tp(self) -> None:
        """Drop the engines of the tensor-parallel group and stop it."""
        if self._tp is None:
            return
        for key in [k for k in self._engines if k[2] > 1]:
            _close(self._engines.pop(key))
        self._tp.close()
        self._tp = None

    def weights_sha256(self, model_dir: str | Path) -> str:
        """`weights_sha256` of the checkpoint (each file read once while unchanged)."""
        return weights_sha256(model_dir)

    def __len__(self) -> int:
        return len(self._engines)

    def clear(self) -> None:
        """Drop every engine, and stop the tensor-parallel group if there is one."""
        with self._lock:
            self._drop_tp()
            for engine in self._engines.values():
                _close(engine)
            self._engines.clear()

    def close(self) -> None:
        """`clear`: what a worker calls when it exits, so no rank outlives it."""
        self.clear()


def _close(engine: Engine) -> None:
    if isinstance(engine, Closeable):
        engine.close()


def load_engine(
    model_dir: str | Path,
    target: Target,
    *,
    tp: TpGroup | None = None,
    **options: Unpack[LoadOptions],
) -> Engine:
    """Load a local Hugging Face checkpoint (no network) in `target`'s format, on each rank of
    `tp` where given; torch is imported only now."""
    if tp is not None:
        from replay_audit.engine.tp_engine import TensorParallelEngine

        return TensorParallelEngine.load(tp, Path(model_dir), target, **options)
    from replay_audit.engine.torch_engine import TorchEngine

    return TorchEngine.load(Path(model_dir), target, **options)
