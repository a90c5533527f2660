"""The replay engine: one checkpoint in one numerical configuration, behind a protocol.

Importing this package does not import torch. `load_engine` builds the real (torch) engine;
`FakeEngine` stands in for it in tests of code that only needs results.
"""

from __future__ import annotations

from pathlib import Path

from replay_audit.engine.fake import FakeEngine
from replay_audit.engine.hashing import weights_sha256
from replay_audit.engine.pool import EnginePool
from replay_audit.engine.protocol import (
    DecodeRun,
    Engine,
    Environment,
    Intervention,
    ScanItem,
    ScanRun,
    StepInfo,
    Steps,
    Target,
)
from replay_audit.formats import CacheKind


def load_engine(
    model_dir: str | Path,
    target: Target,
    *,
    device: str | None = None,
    deterministic: bool = True,
    tf32: bool = False,
    cache: CacheKind | None = None,
    max_cache_len: int = 4096,
    weight_dtype: str | None = None,
    fp8_linear: bool = False,
) -> Engine:
    """Load a local Hugging Face checkpoint (no network) in `target`'s format as a torch engine.

    `device` None picks CUDA when available, else the CPU. The deterministic-algorithms and TF32
    flags are process-wide torch settings: the engine sets them explicitly here and reports them
    in `environment()`. `cache`, the decode path (`formats.CacheKind`): "piecewise" (None: the
    default) grows the KV cache as transformers' `generate()` does, with the rest of each step
    in CUDA graphs, bitwise equal to it; "compiled" preallocates it for up to `max_cache_len`
    tokens (longer decodes take the piecewise path) and compiles and captures the step: faster,
    not bitwise equal. `weight_dtype`: the dtype the weights are stored in when it differs from
    `target.dtype`, the compute dtype (loaded in the one, cast to the other: the
    storage-vs-compute ablation). `fp8_linear`: every linear layer of the body in FP8-E4M3 (the
    paper's end-to-end FP8 boundary case; CUDA, SM >= 8.9).
    """
    from replay_audit.engine.torch_engine import TorchEngine

    return TorchEngine.load(
        Path(model_dir),
        target,
        device=device,
        deterministic=deterministic,
        tf32=tf32,
        cache=cache,
        max_cache_len=max_cache_len,
        weight_dtype=weight_dtype,
        fp8_linear=fp8_linear,
    )


__all__ = [
    "DecodeRun",
    "Engine",
    "EnginePool",
    "Environment",
    "FakeEngine",
    "Intervention",
    "ScanItem",
    "ScanRun",
    "StepInfo",
    "Steps",
    "Target",
    "load_engine",
    "weights_sha256",
]
