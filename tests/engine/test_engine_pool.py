"""The engine pool: one engine per (checkpoint directory, format, TP degree), whatever path
spelling reaches the directory, and a directory resolved once per spelling (a job asks per
trace and per arm)."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay_audit.engine import EnginePool, FakeEngine, Target


def test_spellings_of_one_directory_share_an_engine_and_resolve_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = tmp_path / "ckpt"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    loads: list[Path] = []
    where = real.resolve()

    def loader(d: Path, target: Target, _tp: int = 1) -> FakeEngine:
        loads.append(d)
        return FakeEngine(target)

    resolved: list[Path] = []
    original = Path.resolve

    def counting(self: Path, strict: bool = False) -> Path:
        resolved.append(self)
        return original(self, strict)

    monkeypatch.setattr(Path, "resolve", counting)
    pool = EnginePool(loader=loader)
    engines = {id(pool.get(p, Target("fp16"))) for p in (real, link, str(link), real, link) * 3}
    assert len(engines) == 1 and loads == [where]
    assert sorted(map(str, resolved)) == sorted([str(real), str(link)])
    assert pool.get(link, Target("bf16")) is not pool.get(real, Target("fp16"))
    assert len(loads) == 2
