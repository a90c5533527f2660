"""Tensor-parallel replay on the CPU: two gloo ranks, each a process, of a tiny random Llama
(4 attention heads, 2 KV heads: TP 2 splits them), loaded with transformers' tp_plan="auto".

Traces logged at TP 2 by `TraceGenerator` (transformers' `generate()` on both ranks) replay
exactly at TP 2; replayed at TP 1 they diverge where the sharded sums round otherwise, and each
divergence is found at its first mismatch and given a category. Every probe runs on both ranks
(their results compared bit for bit), and no rank outlives the process that started it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from replay_audit.engine import EnginePool, Intervention, ScanItem, Target
from replay_audit.exceptions import EngineError, UnsupportedFormat
from replay_audit.replays.domain import LoggedTrace, ReplayOutcome, RunTarget
from replay_audit.replays.pipeline import ReplayItem, ReplayOptions, replay_items
from replay_audit.traces.schemas import TraceCreate
from tests.engine import tp_ops
from tests.engine.conftest import TINY_PROMPTS as PROMPTS

MAX_NEW_TOKENS = 32
CATEGORIES = ("head_reachable", "kv_dependent", "body_dominated")


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"rank processes {pids} outlived their group"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def tp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from replay_audit.engine.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp-tiny-llama"))


@pytest.fixture(scope="module")
def tp2_traces(tp_dir: Path) -> list[TraceCreate]:
    """The prompts generated at TP 2 by two gloo ranks (the group stopped afterwards)."""
    from replay_audit.engine.generate import TraceGenerator

    with TraceGenerator(
        tp_dir, dtype="bf16", attn_kernel="sdpa", device="cpu", threads=1, tp_degree=2
    ) as gen:
        assert gen._group is not None
        pids = gen._group.pids
        traces = [
            gen.trace(text, max_new_tokens=MAX_NEW_TOKENS, external_id=f"p{i}")
            for i, text in enumerate(PROMPTS)
        ]
    _wait_gone(pids)
    return [TraceCreate.model_validate(t) for t in traces]


@pytest.fixture(scope="module")
def tp_pool(tp2_traces: list[TraceCreate]) -> Iterator[EnginePool]:
    """A pool owning two devices (CPU processes). After the traces: one process group at a
    time, and the generator's is gone by then."""
    pool = EnginePool(device="cpu", threads=1, devices=2)
    yield pool
    pool.close()


def _replay(
    traces: list[TraceCreate], target: RunTarget, pool: EnginePool, tp_dir: Path, mode: str
) -> list[ReplayOutcome]:
    items = [ReplayItem(LoggedTrace.from_json(t.model_dump()), target, tp_dir) for t in traces]
    results = replay_items(items, pool, ReplayOptions(mode))  # type: ignore[arg-type]
    for r in results:
        assert isinstance(r, ReplayOutcome), r
    return results  # type: ignore[return-value]


def _first_mismatch(logged: list[int], replay: list[int]) -> int | None:
    t = next((i for i, (a, b) in enumerate(zip(logged, replay, strict=False)) if a != b), None)
    if t is None and len(logged) != len(replay):
        t = min(len(logged), len(replay))
    return t


def test_a_degree_above_the_devices_owned_is_refused_before_anything_loads(
    tmp_path: Path,
) -> None:
    pool = EnginePool(device="cpu", devices=1)
    with pytest.raises(UnsupportedFormat, match="TP 2 needs 2 devices; this process owns 1"):
        pool.get(tmp_path, Target("bf16"), 2)
    assert len(pool) == 0


def test_a_degree_that_does_not_divide_the_heads_is_refused_before_any_rank_starts(
    tp_dir: Path,
) -> None:
    """transformers would load TP 3 of 4 heads, splitting heads across ranks: a computation no
    server runs (vLLM refuses the degree). The pool and the generator refuse it first."""
    from replay_audit.engine.generate import TraceGenerator

    pool = EnginePool(device="cpu", devices=3)
    with pytest.raises(
        UnsupportedFormat, match="TP 3 does not divide the checkpoint's 4 attention"
    ):
        pool.get(tp_dir, Target("bf16"), 3)
    assert len(pool) == 0 and pool._tp is None  # no group was started
    with pytest.raises(UnsupportedFormat, match="TP 3 does not divide"):
        TraceGenerator(tp_dir, device="cpu", tp_degree=3)


@pytest.mark.slow
def test_traces_generated_at_tp2_record_their_degree(tp2_traces: list[TraceCreate]) -> None:
    for tr in tp2_traces:
        assert tr.config.tp_degree == 2 and tr.config.engine.name == "transformers"
        assert tr.config.extras["tp_plan"] == "auto"
        assert tr.config.extras["tp_backend"] == "gloo"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["decode", "scan_then_decode", "scan"])
def test_a_tp2_trace_self_replays_exactly_at_tp2(
    tp2_traces: list[TraceCreate], tp_pool: EnginePool, tp_dir: Path, mode: str
) -> None:
    """Decoded from the prompt, every trace is exact. A scan (one forward over the logged
    path, no KV cache), and a decode from the scan's flag (a prefill of the logged prefix), read
    other sums than the logged decode's cache did: at TP 1 as at TP 2 they may part from it, but
    only at an exact tie of the logged arm."""
    for r in _replay(tp2_traces, RunTarget(None), tp_pool, tp_dir, mode):
        if mode == "decode":
            assert r.first_divergence_step is None, (r.external_id, r.first_divergence_step)
            assert r.exact_match is True and r.category == "agreed"
        else:
            assert r.first_divergence_step is None or r.tie, (r.external_id, r)
        resolved = r.b.resolved
        assert resolved is not None and resolved.tp_degree == 2
        assert resolved.logged_tp_degree == 2 and not resolved.tp_differs
        env = r.b.environment
        assert env is not None and env["tp_degree"] == 2
        assert env["extras"]["tp_backend"] == "gloo" and env["extras"]["tp_plan"] == "auto"
        if mode == "decode":  # what ran: transformers' own generate(), and why
            assert env["extras"]["decoder"] == "generate"
            assert "tensor parallel" in env["extras"]["piecewise_error"]


@pytest.mark.slow
def test_a_tp1_replay_of_tp2_traces_reports_each_divergence_with_its_category(
    tp2_traces: list[TraceCreate], tp_pool: EnginePool, tp_dir: Path
) -> None:
    results = _replay(tp2_traces, RunTarget(Target("bf16"), tp_degree=1), tp_pool, tp_dir, "decode")
    tp1 = tp_pool.get(tp_dir, Target("bf16", attn_kernel="sdpa"), 1)
    exact = [r.exact_match for r in results]
    assert any(exact) and not all(exact), "the prompt set shows TP 2 flipping some outputs"
    for tr, r in zip(tp2_traces, results, strict=True):
        resolved = r.b.resolved
        assert resolved is not None and (resolved.tp_degree, resolved.logged_tp_degree) == (1, 2)
        assert r.b.environment is not None and r.b.environment["tp_degree"] == 1
        replay = list(r.b.output_token_ids or ())
        # What ran at TP 1 is this process's own engine's decode, and t* its first mismatch.
        assert replay == tp1.decode(tr.prompt_token_ids, MAX_NEW_TOKENS, [256]).output_token_ids
        mismatch = _first_mismatch(tr.output_token_ids, replay)
        assert r.first_divergence_step == mismatch
        assert r.exact_match is (mismatch is None)
        if mismatch is None:
            assert r.category == "agreed"
            continue
        assert r.category in CATEGORIES
        assert r.a.margin is not None and r.a.margin.source == "logged_top_k"
        # Arm A's single-step re-run ran the logged configuration: TP 2, on the two ranks.
        assert r.single_step is not None and r.single_step.a is not None


def test_a_decode_window_at_tp2_cuts_the_whole_tp2_decode_after_its_first_difference(
    tp2_traces: list[TraceCreate], tp_pool: EnginePool, tp_dir: Path
) -> None:
    """The window is passed to every rank: against a reference it departs from (the TP-1
    decode of the same prompt), the TP-2 decode stops `tokens` after its first difference, its
    output bitwise the whole TP-2 decode's prefix, and says it was cut."""
    from replay_audit.engine.protocol import DecodeWindow

    tp2 = tp_pool.get(tp_dir, Target("bf16", attn_kernel="sdpa"), 2)
    tp1 = tp_pool.get(tp_dir, Target("bf16", attn_kernel="sdpa"), 1)
    cut = 0
    for tr in tp2_traces:
        prompt = tr.prompt_token_ids
        whole = tp2.decode(prompt, MAX_NEW_TOKENS, [256]).output_token_ids
        reference = tp1.decode(prompt, MAX_NEW_TOKENS, [256]).output_token_ids
        t = _first_mismatch(reference, whole)
        window = DecodeWindow(tuple(reference), 2)
        run = tp2.decode(prompt, MAX_NEW_TOKENS, [256], window=window)
        if t is None or t + 3 > len(whole):  # no difference, or the end comes first
            assert run.output_token_ids == whole and run.stop_reason != "window"
            continue
        assert run.output_token_ids == whole[: t + 3]
        if t + 3 < len(whole):
            cut += 1
            assert run.stop_reason == "window"
    assert cut >= 1, "some TP-2 decodes depart from TP 1 early enough to be cut"


@pytest.mark.slow
def test_every_probe_runs_on_both_ranks_with_nvlink_multicast_off(
    tp2_traces: list[TraceCreate], tp_pool: EnginePool, tp_dir: Path
) -> None:
    from replay_audit.engine.tensor_parallel import NVLS_OFF
    from replay_audit.engine.tp_engine import TensorParallelEngine

    engine = tp_pool.get(tp_dir, Target("bf16", attn_kernel="sdpa"), 2)
    assert isinstance(engine, TensorParallelEngine)
    group = engine.group
    tr = tp2_traces[0]
    prompt, out = tr.prompt_token_ids, tr.output_token_ids
    iv = Intervention("C", tau=0.0)
    # Each probe is checked by the group: both ranks computed the same bits, or it raises.
    assert engine.decode(prompt, MAX_NEW_TOKENS, [256]).output_token_ids == out
    assert bool(engine.scan(prompt, out).agrees.all())
    assert all(bool(s.agrees.all()) for s in engine.scan_batch([ScanItem(prompt, out)] * 3))
    step = engine.step(prompt, out[:3], iv)
    before = engine.environment()
    assert engine.environment() is before  # asked of the ranks once per probe, not per result
    assert step.token == engine.step_batch([prompt + out[:3]], iv)[0].token
    after = engine.environment()  # the ranks' again: the batched re-run's shapes are in it
    assert after is not before and "step_batch_shapes" in after["extras"]
    assert after["tp_degree"] == 2 and after["extras"]["tp_backend"] == "gloo"
    assert engine.hidden_states(prompt, out).shape == (len(out) + 1, 64)
    # A result that differs between the ranks is refused, not taken from rank 0 alone.
    with pytest.raises(EngineError, match="rank 1 computed another result"):
        group.run(tp_ops.rank_of)
    assert group.alive  # the ranks are still in step
    # An operation a rank cannot read (its argument's class lives in a module only this
    # process imported) is refused before any rank runs it: the group goes on.
    with pytest.raises(EngineError, match="rank 0 could not take the operation"):
        group.run(tp_ops.takes, _OnlyHere())
    assert group.alive and group.run(tp_ops.takes, 1) == 0
    assert group.run(tp_ops.environment_of, sorted(NVLS_OFF)) == dict(NVLS_OFF)
    for pid in group.pids:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert {f"{k}={v}".encode() for k, v in NVLS_OFF.items()} <= set(env)


@pytest.mark.slow
def test_intervention_c_recomputes_from_the_whole_lm_head(
    tp2_traces: list[TraceCreate], tp_pool: EnginePool, tp_dir: Path
) -> None:
    """τ = 0: C at every step, from fp32(W_lm) · fp32(h) over the whole vocabulary (every rank
    holds the whole weight for it), h being the ranks' own hidden states."""
    from safetensors.numpy import load_file

    weights = load_file(str(next(tp_dir.glob("*.safetensors"))))
    whole = weights["lm_head.weight"].astype(np.float32)  # float32 checkpoint, bf16 values
    engine = tp_pool.get(tp_dir, Target("bf16", attn_kernel="sdpa"), 2)
    for tr in tp2_traces[:4]:
        prompt, out = tr.prompt_token_ids, tr.output_token_ids
        scan = engine.scan(prompt, out, Intervention("C", tau=0.0))
        assert bool(scan.steps.gate_fired.all())
        h = engine.hidden_states(prompt, out[:-1]).astype(np.float32)
        assert list(scan.steps.token_ids) == list(np.argmax(h @ whole.T, axis=-1))


@pytest.mark.slow
def test_a_rank_failing_alone_breaks_the_group_and_the_pool_starts_another(
    tp2_traces: list[TraceCreate], tp_pool: EnginePool, tp_dir: Path
) -> None:
    from replay_audit.engine.tp_engine import TensorParallelEngine

    target = Target("bf16", attn_kernel="sdpa")
    before = tp_pool.get(tp_dir, target, 2)
    assert isinstance(before, TensorParallelEngine)
    old = before.group
    with pytest.raises(
        EngineError, match=r"rank 1 failed \(RuntimeError: rank 1 alone\) where ranks \[0\] did not"
    ):
        old.run(tp_ops.fail_on_rank_1)
    assert not old.alive
    with pytest.raises(EngineError, match="not usable: rank 1 failed"):
        before.scan(tp2_traces[0].prompt_token_ids, tp2_traces[0].output_token_ids)
    after = tp_pool.get(tp_dir, target, 2)
    assert isinstance(after, TensorParallelEngine) and after.group is not old
    tr = tp2_traces[0]
    assert after.decode(tr.prompt_token_ids, MAX_NEW_TOKENS, [256]).output_token_ids == (
        tr.output_token_ids
    )
    _wait_gone(old.pids)  # the broken group's ranks were stopped
    pids = after.group.pids
    tp_pool.close()
    _wait_gone(pids)
    assert not after.group.alive and len(tp_pool) == 0


@pytest.mark.slow
def test_evicting_the_last_tp_engine_keeps_its_group_for_the_next_tp_job(
    tp2_traces: list[TraceCreate], tp_dir: Path
) -> None:
    """The evicted engine's ranks drop its model, but the group (its processes, its process
    group) stays: the next TP engine loads on the same ranks without starting processes again,
    and decodes exactly; `close()` stops it."""
    from replay_audit.engine.tp_engine import TensorParallelEngine

    pool = EnginePool(device="cpu", threads=1, devices=2, max_engines=1)
    try:
        engine = pool.get(tp_dir, Target("bf16", attn_kernel="sdpa"), 2)
        assert isinstance(engine, TensorParallelEngine)
        pids = engine.group.pids
        pool.get(tp_dir, Target("bf16", attn_kernel="sdpa"), 1)  # the TP-2 engine goes
        assert engine.key not in engine.group.run(tp_ops.keys_of), "its ranks dropped its model"
        assert engine.group.alive and engine.group.pids == pids and len(pool) == 1
        again = pool.get(tp_dir, Target("bf16", attn_kernel="sdpa"), 2)
        assert isinstance(again, TensorParallelEngine) and again.group is engine.group
        tr = tp2_traces[0]
        assert again.decode(tr.prompt_token_ids, MAX_NEW_TOKENS, [256]).output_token_ids == (
            tr.output_token_ids
        )
    finally:
        pool.close()
    _wait_gone(pids)


@pytest.mark.slow
def test_a_pool_changes_its_tp_degree_on_new_rank_processes(
    tmp_path: Path, tp2_traces: list[TraceCreate], tp_dir: Path
) -> None:
    """A worker owning three devices takes a TP-2 job, a TP-3 job, then TP 2 again. Each change
    stops the group and starts another of new processes; this process is in no process group
    at any time (a second NCCL group in one process segfaulted on 2x H200), every rank is in
    its group's, and TP 2 decodes exactly again after the change."""
    import torch.distributed as dist

    from replay_audit.engine.testing import make_tiny_checkpoint
    from replay_audit.engine.tp_engine import TensorParallelEngine

    # Head counts, width, MLP and vocabulary divisible by 2 and by 3.
    tp3_dir = make_tiny_checkpoint(
        tmp_path / "tp3",
        vocab_size=288,
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=6,
    )
    target = Target("bf16", attn_kernel="sdpa")
    tr = tp2_traces[0]
    pool = EnginePool(device="cpu", threads=1, devices=3)
    groups: list[tuple[int, list[int]]] = []
    try:
        for model_dir, degree in ((tp_dir, 2), (tp3_dir, 3), (tp_dir, 2)):
            engine = pool.get(model_dir, target, degree)
            assert isinstance(engine, TensorParallelEngine) and engine.group.degree == degree
            ranks = engine.group.run(tp_ops.in_process_group)
            assert ranks == (True, degree)  # rank 0's; every rank's digest matched it
            assert not dist.is_initialized(), "the driving process joined no process group"
            out = engine.decode(tr.prompt_token_ids, MAX_NEW_TOKENS, [256]).output_token_ids
            if model_dir == tp_dir:
                assert out == tr.output_token_ids
            groups.append((degree, engine.group.pids))
            assert len(engine.group.pids) == degree
            assert len(pool) == 1, "the other degree's engines went with its group"
        for _, pids in groups[:-1]:
            _wait_gone(pids)  # each change stopped the group before
        assert not set(groups[0][1]) & set(groups[2][1]), "TP 2 again: new processes"
    finally:
        pool.close()
    _wait_gone(groups[-1][1])


@pytest.mark.slow
def test_the_ranks_die_with_the_process_that_started_them(tmp_path: Path) -> None:
    """SIGKILL leaves no cleanup to run: the ranks go by PR_SET_PDEATHSIG (and their control
    socket closing), not by the parent's goodwill."""
    script = (
        "from replay_audit.engine.tensor_parallel import TpGroup\n"
        "g = TpGroup(2, device='cpu', threads=1)\n"
        "print(*g.pids, flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert pids and all(_alive(p) for p in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    _wait_gone(pids, timeout_s=30)


class _OnlyHere:
    """Pickled by reference to this module, which pytest imported under a name no rank can."""
