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


#: Each weights file's digest, by (path, inode, size, modification time): a checkpoint is
#: read once a process however many engines, generators and workers' lookups hash it (a
#: verification's null builds a generator per benign variation), and again once a file changes.
_digests: dict[tuple[str, int, int, int], str] = {}
_digests_lock = threading.Lock()


def _cached_file_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    with _digests_lock:
        digest = _digests.get(key)
    if digest is None:
        digest = file_sha256(path)
        with _digests_lock:
            _digests[key] = digest
    return digest


def weights_sha256(model_dir: str | Path) -> str:
    """The checkpoint's `weights_sha256` (module docstring: the rule); a file unchanged since
    this process last hashed it is not read again. Thread-safe."""
    files = safetensors_files(model_dir)
    manifest = "".join(f"{_cached_file_sha256(p)}  {p.name}\n" for p in files)
    return hashlib.sha256(manifest.encode("utf-8")).hexdigest()
