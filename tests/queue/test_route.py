"""Routing vocabulary: GPU kinds, queue names of routes and what a worker serves."""

from __future__ import annotations

import pytest

from replay_audit.queue.route import LiveWorker, Route, WorkerKind, gpu_kind, worker_routes
from replay_audit.queue.runner import InProcessRunner, JobSpec, served_queues


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
        ("AMD Instinct MI300X", "instinct-mi300x"),
        ("a10g", "a10g"),  # a kind is its own kind
    ],
)
def test_a_gpu_names_its_kind(name: str, kind: str) -> None:
    assert gpu_kind(name) == kind
    assert gpu_kind(kind) == kind


@pytest.mark.parametrize("name", ["", "  ", "cpu", "any", "tp2", "///"])
def test_a_name_that_names_no_kind_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="names no GPU kind"):
        gpu_kind(name)


@pytest.mark.parametrize(
    ("route", "queue"),
    [
        (Route(), "gpu"),
        (Route("gpu", "a10g"), "gpu:a10g"),
        (Route("gpu", "a10g", 2), "gpu:a10g:tp2"),
        (Route("gpu", None, 4), "gpu:tp4"),
        (Route("cpu"), "cpu"),
        (Route("cpu", None, 2), "cpu:tp2"),
    ],
)
def test_a_route_names_its_queue_and_reads_back_from_it(route: Route, queue: str) -> None:
    assert route.queue == queue
    assert Route.parse(queue) == route


@pytest.mark.parametrize(
    "queue", ["gpu-long", "cpu-long", "audit", "gpu:tp1", "gpu:a10g:l4", "cpu:a10g", "gpu:tp2:a"]
)
def test_a_queue_no_route_names_parses_to_none(queue: str) -> None:
    assert Route.parse(queue) is None


def test_a_kind_must_be_a_kind_of_the_gpu_queue() -> None:
    with pytest.raises(ValueError):
        Route("cpu", "a10g")
    with pytest.raises(ValueError):
        Route("gpu", "NVIDIA A10G")  # a name, not its kind
    with pytest.raises(ValueError):
        Route("gpu", None, 0)


def test_a_gpu_worker_serves_its_kind_first_then_any_gpu_then_the_long_queue() -> None:
    a10g = WorkerKind.gpu("NVIDIA A10G", "8.6")
    assert served_queues(["gpu"], a10g) == ["gpu:a10g", "gpu", "gpu-long"]
    two = WorkerKind.gpu("NVIDIA A10G", "8.6", devices=2)
    assert served_queues(["gpu"], two) == ["gpu:a10g", "gpu:a10g:tp2", "gpu", "gpu:tp2", "gpu-long"]
    # A CPU worker serving gpu (a CPU-only test deployment) takes any-GPU jobs, no kind's.
    assert served_queues(["gpu"], WorkerKind.cpu()) == ["gpu", "gpu-long"]
    assert served_queues(["cpu", "gpu"], a10g) == ["cpu", "gpu:a10g", "gpu", "cpu-long", "gpu-long"]
    # A long queue named: exactly the queues named.
    assert served_queues(["gpu-long"], a10g) == ["gpu-long"]
    assert [r.queue for r in worker_routes("cpu", a10g)] == ["cpu"]


def test_an_announcement_round_trips_and_a_bare_kind_reads_as_one_device() -> None:
    k = WorkerKind.gpu("NVIDIA H100 80GB HBM3", "9.0", devices=2)
    assert WorkerKind.from_json(k.to_json()) == k
    assert k.describe() == "h100-80gb-hbm3 (NVIDIA H100 80GB HBM3, sm 9.0), 2 devices"
    assert WorkerKind.from_json("NVIDIA A10G") == WorkerKind("NVIDIA A10G")
    assert WorkerKind.from_json('{"kind": "l4", "devices": -3}').devices == 1


def test_a_live_worker_serves_its_queues_and_the_in_process_runner_every_route_of_tp_1() -> None:
    w = LiveWorker(WorkerKind.gpu("NVIDIA A10G", "8.6"), frozenset({"gpu:a10g", "gpu"}))
    assert w.serves("gpu:a10g") and w.serves("gpu")
    assert not w.serves("gpu:l4") and not w.serves("gpu:a10g:tp2")
    runner = InProcessRunner()
    here = runner.worker()
    assert here.serves("gpu:l4") and here.serves("cpu") and here.serves("gpu-long")
    assert not here.serves("gpu:l4:tp2") and not here.serves("cpu:tp2")


def test_the_in_process_runner_holds_a_job_it_cannot_serve_without_running_it() -> None:
    runner = InProcessRunner()
    try:
        spec = JobSpec("builtins.print", ("never",), "held-1", queue="gpu:a10g:tp2")
        runner.enqueue(spec)
        assert runner.is_queued("held-1")  # held: the reconciler leaves it be
        assert runner.join(timeout_s=1)  # and nothing waits on it
        assert runner.is_queued("held-1")
    finally:
        runner.stop(5)
    assert not runner.is_queued("held-1")
