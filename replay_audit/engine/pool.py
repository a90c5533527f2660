"""Loaded engines, kept per process: a worker loads each (checkpoint, format) once.

Torch-free: the loader (by default `load_engine`, here, re-exported as
`replay_audit.engine.load_engine`) imports torch the first time an engine is actually built.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict, Unpack

from replay_audit.engine.hashing import HashCache
from replay_audit.engine.protocol import Engine, Target
from replay_audit.formats import CacheKind

Loader = Callable[[Path, Target], Engine]
_PoolKey = tuple[str, tuple[str, str, str | None, int]]


class EnginePool:
    """Engines keyed by (checkpoint directory, `Target.format_key()`), built on first use.

    Without a `loader`, engines come from `load_engine` with `device`, `cache` and
    `max_cache_len`. `max_engines` bounds how many stay loaded (least recently used goes
    first); None keeps all. `threads` and `leave_free` set torch's CPU threads in each thread
    that takes an engine (`engine.loading.set_torch_threads`: None and 0 leave torch's default).
    `on_load` is called after each engine is loaded. Thread-safe: the in-process job runner
    calls it from threads.
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
    ) -> None:
        self._loader = loader
        self._on_load = on_load
        self._threads = threads
        self._leave_free = leave_free
        self._options = LoadOptions(device=device, cache=cache, max_cache_len=max_cache_len)
        self._max = max_engines
        self._engines: OrderedDict[_PoolKey, Engine] = OrderedDict()
        self._hashes = HashCache()
        self._lock = threading.RLock()

    def get(self, model_dir: str | Path, target: Target) -> Engine:
        """The engine for this checkpoint in this numerical configuration (loaded once)."""
        d = Path(model_dir).resolve()
        key: _PoolKey = (str(d), target.format_key())
        if self._loader is None and (self._threads is not None or self._leave_free):
            from replay_audit.engine.loading import set_torch_threads

            set_torch_threads(self._threads, leave_free=self._leave_free)  # for this thread
        with self._lock:
            engine = self._engines.get(key)
            if engine is None:
                engine = self._load(d, target)
                self._engines[key] = engine
                if self._max is not None:
                    while len(self._engines) > self._max:
                        self._engines.popitem(last=False)
            self._engines.move_to_end(key)
            return engine

    def _load(self, d: Path, target: Target) -> Engine:
        if self._loader is not None:
            engine = self._loader(d, target)
        else:
            engine = load_engine(d, target, **self._options)
        if self._on_load is not None:
            self._on_load()  # a worker counts its loads (replay_audit_model_loads_total)
        return engine

    def weights_sha256(self, model_dir: str | Path) -> str:
        """`weights_sha256` of the checkpoint (`HashCache`)."""
        return self._hashes.weights_sha256(model_dir)

    def __len__(self) -> int:
        return len(self._engines)

    def clear(self) -> None:
        with self._lock:
            self._engines.clear()


class LoadOptions(TypedDict, total=False):
    """`TorchEngine.load`'s options. `device` None picks CUDA when available, else the CPU.
    `deterministic` and `tf32` are process-wide torch flags the engine sets explicitly and
    reports in `environment()`. `cache`, the decode path (`formats.CacheKind`): "piecewise"
    (None) is bitwise equal to `generate()`; "compiled" preallocates the KV cache for up to
    `max_cache_len` tokens and captures the step: faster, not bitwise equal. `weight_dtype`:
    the storage dtype when it differs from `target.dtype` (the storage-vs-compute ablation).
    `fp8_linear`: every linear layer of the body in FP8-E4M3 (CUDA, SM >= 8.9)."""

    device: str | None
    deterministic: bool
    tf32: bool
    cache: CacheKind | None
    max_cache_len: int
    weight_dtype: str | None
    fp8_linear: bool


def load_engine(model_dir: str | Path, target: Target, **options: Unpack[LoadOptions]) -> Engine:
    """Load a local Hugging Face checkpoint (no network) in `target`'s format as a torch engine
    (`TorchEngine.load`, imported only now)."""
    from replay_audit.engine.torch_engine import TorchEngine

    return TorchEngine.load(Path(model_dir), target, **options)
