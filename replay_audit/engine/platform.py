"""What this machine can run, for the screening's "not available here" list. Imports torch:
only workers and the CLI call it."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from replay_audit.engine.loading import resolve_device
from replay_audit.engine.numerics import fp8_supported


@dataclass(frozen=True)
class PlatformFacts:
    """The device a screening runs on and what it supports (plain values, no torch types)."""

    device: str  # "cpu" or "cuda"
    gpu_name: str | None
    sm: str | None
    #: Why an FP8-E4M3 lm_head cannot run here (None: it can).
    fp8_unavailable: str | None
    flash_attn_installed: bool
    torch_version: str


def probe_platform(device: str | None = None) -> PlatformFacts:
    """The facts of `device` (None: CUDA when available, else the CPU)."""
    dev = resolve_device(device)
    gpu = sm = None
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(idx)
        gpu, sm = torch.cuda.get_device_name(idx), f"{major}.{minor}"
    ok, why = fp8_supported(dev)
    return PlatformFacts(
        device="cuda" if dev.type == "cuda" else "cpu",
        gpu_name=gpu,
        sm=sm,
        fp8_unavailable=None if ok else why,
        flash_attn_installed=importlib.util.find_spec("flash_attn") is not None,
        torch_version=torch.__version__,
    )
