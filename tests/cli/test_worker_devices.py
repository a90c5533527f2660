"""`replay-audit worker --devices N`: what a worker announces is what it can run. Its GPUs are
cuda:0..N-1 of one kind, or N processes on the CPU of a host without CUDA, and accelerate is
there for transformers' tensor-parallel loading. (The GPUs here are torch.cuda's answers,
replaced: this machine has none.)"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import pytest
import typer

from replay_audit.cli.worker import _worker_kind
from replay_audit.queue.route import WorkerKind
from replay_audit.queue.runner import served_queues


def _gpus(monkeypatch: pytest.MonkeyPatch, names: list[str]) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(names))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: names[i])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 6))


def test_a_cpu_worker_of_two_processes_announces_them_and_serves_the_tp2_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _gpus(monkeypatch, [])
    kind, cuda = _worker_kind("cpu", 2)
    assert (kind, cuda) == (WorkerKind("cpu", devices=2), None)
    assert _worker_kind(None, 2)[0] == kind
    assert served_queues(["cpu"], kind) == ["cpu", "cpu:tp2", "cpu-long"]


def test_a_gpu_worker_owns_cuda_0_to_n_of_one_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, ["NVIDIA A10G", "NVIDIA A10G"])
    kind, cuda = _worker_kind(None, 2)
    assert kind == WorkerKind.gpu("NVIDIA A10G", "8.6", 2) and cuda == "cuda:0"
    assert "gpu:a10g:tp2" in served_queues(["gpu"], kind)
    with pytest.raises(typer.BadParameter, match=re.escape("owns cuda:0..1")):
        _worker_kind("cuda:1", 2)
    with pytest.raises(typer.BadParameter, match="sees 2 GPUs"):
        _worker_kind(None, 3)


def test_a_worker_of_several_kinds_or_cpu_ranks_beside_a_gpu_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _gpus(monkeypatch, ["NVIDIA A10G", "NVIDIA L4"])
    with pytest.raises(typer.BadParameter, match="of one kind"):
        _worker_kind(None, 2)
    with pytest.raises(typer.BadParameter, match="host without CUDA"):
        _worker_kind("cpu", 2)
    assert _worker_kind("cpu", 1)[0] == WorkerKind("cpu")  # one CPU device: as before


def test_more_than_one_device_needs_accelerate(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, [])
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "accelerate" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(typer.BadParameter, match="accelerate"):
        _worker_kind("cpu", 2)
    assert _worker_kind("cpu", 1)[0].devices == 1
