"""weights_sha256 against the documented rule, computed independently here; each weights file
is read once a process while it is unchanged."""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from pathlib import Path

import pytest

from replay_audit.engine import hashing
from replay_audit.engine.hashing import NoWeightsError, weights_sha256


def test_matches_the_documented_rule(tmp_path: Path) -> None:
    files = {
        "model-00002-of-00002.safetensors": b"second shard",
        "model-00001-of-00002.safetensors": b"first shard" * 100_000,  # > one read chunk
        "Z.safetensors": b"upper case sorts before lower case in code-point order",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "config.json").write_text("{}")  # not weights: ignored
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.safetensors").write_bytes(b"not directly in the dir: ignored")
    lines = "".join(f"{hashlib.sha256(files[n]).hexdigest()}  {n}\n" for n in sorted(files))
    assert sorted(files)[0] == "Z.safetensors"
    assert weights_sha256(tmp_path) == hashlib.sha256(lines.encode()).hexdigest()


def test_worked_example_from_the_docs(tmp_path: Path) -> None:
    # docs/weights-sha256.md: two files holding the ASCII text "a" and "b"
    (tmp_path / "b.safetensors").write_bytes(b"b")
    (tmp_path / "a.safetensors").write_bytes(b"a")
    assert weights_sha256(tmp_path) == (
        "6741e84d570578177e1536a0563070d2da8466ffa87a54e2afc488b7c4076d7b"
    )


def test_a_directory_without_weights_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(NoWeightsError, match=r"no \*\.safetensors"):
        weights_sha256(tmp_path)
    with pytest.raises(NoWeightsError, match="not a directory"):
        weights_sha256(tmp_path / "missing")


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The weights files `hashing` reads from now on, by name."""
    reads: Counter[str] = Counter()
    read = hashing.file_sha256

    def counted(path: Path) -> str:
        reads[path.name] += 1
        return read(path)

    monkeypatch.setattr(hashing, "file_sha256", counted)
    return reads


def test_a_file_is_read_once_until_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _count_reads(monkeypatch)
    (tmp_path / "a.safetensors").write_bytes(b"a")
    (tmp_path / "b.safetensors").write_bytes(b"b")
    first = weights_sha256(tmp_path)
    assert weights_sha256(tmp_path) == first
    assert reads == {"a.safetensors": 1, "b.safetensors": 1}
    # Rewritten in place with as many bytes (a modification time of its own): read again.
    b = tmp_path / "b.safetensors"
    mtime = b.stat().st_mtime_ns
    b.write_bytes(b"c")
    os.utime(b, ns=(mtime + 1_000_000, mtime + 1_000_000))
    changed = weights_sha256(tmp_path)
    assert changed != first
    assert reads == {"a.safetensors": 1, "b.safetensors": 2}
    # Replaced by another file (a new inode), even with the old size and time: read again.
    replacement = tmp_path / "new"
    replacement.write_bytes(b"b")
    os.utime(replacement, ns=(mtime + 1_000_000, mtime + 1_000_000))
    replacement.replace(b)
    assert weights_sha256(tmp_path) == first
    assert reads == {"a.safetensors": 1, "b.safetensors": 3}


def test_generators_of_one_checkpoint_hash_its_weights_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verification's null builds a `TraceGenerator` per benign variation: the checkpoint's
    weights are read for the first one only, and again once they change."""
    from replay_audit.engine.generate import TraceGenerator
    from replay_audit.engine.testing import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "tiny")
    reads = _count_reads(monkeypatch)
    shas = {TraceGenerator(model, device="cpu").weights_sha256 for _ in range(2)}
    assert shas == {weights_sha256(model)}
    (weights,) = model.glob("*.safetensors")
    assert reads == {weights.name: 1}
    data = bytearray(weights.read_bytes())  # one weight's last byte changed: read again
    data[-1] ^= 1
    mtime = weights.stat().st_mtime_ns
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(mtime + 1_000_000, mtime + 1_000_000))
    assert TraceGenerator(model, device="cpu").weights_sha256 != shas.pop()
    assert reads == {weights.name: 2}
