"""`weights_sha256`: the identity of a checkpoint's weights. Stdlib only.

The rule (docs/weights-sha256.md; any language can compute it): take every `*.safetensors`
file directly in the checkpoint directory (not in subdirectories), sorted by file name in
code-point order; hash each file with SHA-256; then hash, with SHA-256, the UTF-8 text made of one
line per file, `"<hex digest>  <file name>\\n"` (two spaces: the format of `sha256sum`). The hex
digest of that is the checkpoint's `weights_sha256`. So `sha256sum *.safetensors | sha256sum`
computes it in a shell whose collation is `C` (`LC_ALL=C`).
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from replay_audit.exceptions import BadRequest

_CHUNK = 1 << 20


class NoWeightsError(BadRequest):
    """The directory holds no `*.safetensors` file."""


def file_sha256(path: Path) -> str:
    """SHA-256 of one file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The `*.safetensors` files directly in `model_dir`, sorted by name (code-point order)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise NoWeightsError(f"{d} is not a directory")
    files = sorted(
        (p for p in d.iterdir() if p.suffix == ".safetensors" and p.is_file()), key=lambda p: p.name
    )
    if not files:
        raise NoWeightsError(f"{d} holds no *.safetensors file: cannot compute weights_sha256")
    return files


def weights_sha256(model_dir: str | Path) -> str:
    """The checkpoint's `weights_sha256` (module docstring: the rule)."""
    manifest = "".join(f"{file_sha256(p)}  {p.name}\n" for p in safetensors_files(model_dir))
    return hashlib.sha256(manifest.encode("utf-8")).hexdigest()


class HashCache:
    """`weights_sha256` of checkpoints, each cached while its files keep name, size and
    modification time (only the first lookup reads the weights). Thread-safe."""

    def __init__(self) -> None:
        self._hashes: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}
        self._lock = threading.Lock()

    def weights_sha256(self, model_dir: str | Path) -> str:
        d = Path(model_dir).resolve()
        stamp = tuple(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in safetensors_files(d)
        )
        with self._lock:
            key = (str(d), stamp)
            if key not in self._hashes:
                self._hashes[key] = weights_sha256(d)
            return self._hashes[key]
