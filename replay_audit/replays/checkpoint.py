"""Finding a trace's checkpoint by `weights_sha256` in `REPLAY_AUDIT_MODEL_DIRS`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from replay_audit.engine.pool import EnginePool


def candidate_dirs(model_dirs: Sequence[Path]) -> Iterator[Path]:
    """Each listed directory that holds `*.safetensors` itself, else each of its immediate
    subdirectories that does (so `/models` can hold one checkpoint per subdirectory)."""
    for root in model_dirs:
        if not root.is_dir():
            continue
        if any(root.glob("*.safetensors")):
            yield root
            continue
        for sub in sorted(p for p in root.iterdir() if p.is_dir()):
            if any(sub.glob("*.safetensors")):
                yield sub


class ModelNotFound(LookupError):
    pass


def find_checkpoint(weights_sha256: str, model_dirs: Sequence[Path], pool: EnginePool) -> Path:
    """The checkpoint directory whose weights hash is `weights_sha256`.

    Hashes are cached by the pool while a checkpoint's files keep name, size and mtime, so only
    the first lookup reads the weights. Raises `ModelNotFound` naming the directories searched.
    """
    for d in candidate_dirs(model_dirs):
        if pool.weights_sha256(d) == weights_sha256:
            return d
    searched = ", ".join(str(p) for p in model_dirs) or "(none)"
    raise ModelNotFound(
        f"no checkpoint with weights_sha256 {weights_sha256} in REPLAY_AUDIT_MODEL_DIRS "
        f"({searched})"
    )
