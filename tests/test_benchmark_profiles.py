"""The benchmarks' own profile readers (issue 24), which run for real only on a lent GPU: how
`benchmarks/_scan_profile.py` attributes a chrome trace's kernels to classes, and how
`benchmarks/_stack_sampler.py` puts a sampled stack in a phase. Synthetic inputs, no GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks._scan_profile import analyse_trace, flops
from benchmarks._stack_sampler import _phase, summarise


def _event(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: Any) -> dict:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": ts,
        "dur": dur,
        "pid": 1,
        "tid": tid,
        "args": args,
    }


def test_kernels_take_the_class_of_their_launch() -> None:
    host = [
        _event("user_annotation", "scan.batch", 0, 1000),
        _event("user_annotation", "scan.forward", 10, 900),
        _event("user_annotation", "scan.body", 20, 300),
        _event("cpu_op", "aten::mm", 30, 10),
        _event("cuda_runtime", "cudaLaunchKernel", 32, 2, correlation=1),
        _event("cpu_op", "aten::mul", 50, 10),
        _event("cuda_runtime", "cudaLaunchKernel", 52, 2, correlation=2),
        _event("cpu_op", "aten::_scaled_dot_product_flash_attention", 60, 10),
        _event("cuda_runtime", "cudaLaunchKernel", 62, 2, correlation=3),
        _event("cpu_op", "aten::_to_copy", 70, 10),
        _event("cpu_op", "aten::copy_", 71, 5),
        _event("cuda_runtime", "cudaLaunchKernel", 72, 2, correlation=4),
        _event("user_annotation", "scan.steps", 400, 500),
        _event("user_annotation", "scan.lm_head", 410, 50),
        _event("cpu_op", "aten::mm", 412, 10),
        _event("cuda_driver", "cuLaunchKernelEx", 413, 2, correlation=5),
        _event("cpu_op", "aten::topk", 500, 10),
        _event("cuda_runtime", "cudaLaunchKernel", 501, 2, correlation=6),
    ]
    kernels = [
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 100, 50),
        ("vectorized_elementwise_kernel<mul>", 150, 10),
        ("pytorch_flash::flash_fwd_kernel", 160, 20),
        ("direct_copy_kernel_cuda", 180, 5),
        ("nvjet_tst_128x256", 450, 30),
        ("gatherTopK", 480, 10),
    ]
    device = [
        _event("kernel", name, ts, dur, tid=7, correlation=i)
        for i, (name, ts, dur) in enumerate(kernels, start=1)
    ]
    out = analyse_trace([*host, *device])
    assert out["source"] == "device kernels"
    assert out["time_us"] == {
        "body GEMM": 50.0,
        "lm_head GEMM": 30.0,
        "attention": 20.0,
        "norm/elementwise/RoPE": 10.0,
        "copies/casts": 5.0,
        "other": 10.0,
    }
    assert out["device_events_without_launch"] == 0
    assert out["busy_us"] == 125.0  # the union of the kernels' intervals
    assert out["top"][0]["name"].startswith("sm90_xmma_gemm")


def test_cpu_ops_self_time_when_there_are_no_kernels() -> None:
    events = [
        _event("user_annotation", "scan.body", 0, 100),
        _event("cpu_op", "aten::linear", 10, 50),
        _event("cpu_op", "aten::mm", 20, 30),
        _event("cpu_op", "aten::mul", 70, 10),
    ]
    out = analyse_trace(events)
    assert out["source"] == "cpu ops (self time)"
    # linear's own 20 us (50 less mm's 30) and mm's 30 are GEMM time; mul is elementwise.
    assert out["time_us"]["body GEMM"] == 50.0
    assert out["time_us"]["norm/elementwise/RoPE"] == 10.0


def test_flops_count_padding_as_executed_only() -> None:
    shape = {
        "hidden": 8,
        "intermediate": 16,
        "layers": 2,
        "heads": 2,
        "kv_heads": 1,
        "head_dim": 4,
        "vocab": 32,
    }
    f = flops(shape, [(7, 8, 4)])
    per_token = 2 * 2 * (8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16)
    assert f["body_gemm_executed"] == 8 * per_token
    assert f["body_gemm_useful"] == 7 * per_token
    assert f["attention_useful"] == 2 * 2 * 2 * 8 * 7 * 8 / 2
    assert f["lm_head"] == 2 * 8 * 32 * 4


def test_a_sample_is_in_the_phase_of_its_innermost_marked_frame(tmp_path: Path) -> None:
    job = ["rq.worker:Worker.work", "replay_audit.replays.tasks:run_replay_job"]
    scan = [
        *job,
        "replay_audit.replays.tasks:_scan_all",
        "replay_audit.replays.pipeline:scan_items",
        "replay_audit.engine.torch_engine:TorchEngine.scan_batch",
        "replay_audit.engine.decoder:Body.forward_rows",
        "torch.nn.modules.module:_call_impl",
    ]
    decode = [
        *job,
        "replay_audit.replays.pipeline:_run_arms",
        "replay_audit.engine.torch_engine:TorchEngine.decode",
        "replay_audit.engine.piecewise:PiecewiseDecoder.step",
    ]
    write = [
        *job,
        "replay_audit.replays.repository:insert_results_of",
        "sqlalchemy.orm.session:Session.execute",
    ]
    idle = ["rq.worker:Worker.work", "rq.worker:Worker.dequeue_job_and_maintain_ttl"]
    assert _phase(scan) == "batched scan"
    assert _phase(decode) == "decode"
    assert _phase(write) == "database: write"
    assert _phase(idle) == "idle (waiting for a job)"

    stacks = [scan, decode, idle]
    samples = [
        [10.0, "MainThread", 0],
        [11.0, "MainThread", 1],
        [12.0, "MainThread", 1],
        [13.0, "MainThread", 2],
        [11.0, "other", 2],
    ]
    path = tmp_path / "samples.json"
    path.write_text(json.dumps({"interval_s": 0.02, "stacks": stacks, "samples": samples}))
    out = summarise(path, {"all": (0.0, 100.0), "late": (12.5, 100.0)})
    assert out["thread"] == "MainThread"
    assert out["windows"]["all"]["phases"] == {
        "decode": 0.5,
        "batched scan": 0.25,
        "idle (waiting for a job)": 0.25,
    }
    assert out["windows"]["late"]["samples"] == 1
