"""weights_sha256 against the documented rule, computed independently here."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

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
