"""What this machine can run, for the screening's "not available here" list. Imports torch:
only workers and the CLI call it."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from replay_audit.engine.loading import resolve_device
from replay_audit.engine.numerics import fp8_supported
from replay_audit.formats import CPU_SDPA_BACKENDS, SDPA_BACKENDS, BodyDType, Device


@dataclass(frozen=True)
class PlatformFacts:
    """The device a screening runs on and what it supports (plain values, no torch types)."""

    device: Device
    gpu_name: str | None
    sm: str | None
    #: Why an FP8-E4M3 lm_head cannot run here (None: it can).
    fp8_unavailable: str | None
    flash_attn_installed: bool
    torch_version: str
    #: CUDA GPUs this process sees (0 on the CPU): what a tensor-parallel group may span.
    cuda_devices: int = 0


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
        cuda_devices=torch.cuda.device_count() if dev.type == "cuda" else 0,
    )


@dataclass(frozen=True)
class AttentionShape:
    """What an SDPA backend is asked to accept: the model's heads and the compute dtype."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: BodyDType
    #: Whether the model's attention gets an explicit mask (the compiled path's static cache,
    #: batch emulation with padding) besides the piecewise path's mask-free calls at batch 1.
    masked: bool = False


def sdpa_refusal(backend: str, shape: AttentionShape, device: str | None = None) -> str | None:
    """Why torch's SDPA limited to `backend` refuses the calls transformers' `sdpa` attention
    makes for `shape` on `device` (None: it accepts them all).

    The calls mirror `transformers.integrations.sdpa_attention.sdpa_attention_forward` (5.x):
    a grouped-query model (kv_heads < heads) with no mask and head_dim <= 256 passes
    `enable_gqa=True`; with a mask its prefill repeats the kv heads and its single-token decode
    packs the query heads per kv head; `is_causal` is True only for a mask-free prefill; the
    scale is head_dim**-0.5. Each call runs on tiny tensors under `sdpa_kernel(backend)`; the
    reason is torch's own (the UserWarnings it emits when a backend turns the inputs down).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from replay_audit.engine.loading import TORCH_DTYPES

    if backend not in SDPA_BACKENDS:
        return f"unknown SDPA backend {backend!r}"
    dev = resolve_device(device)
    if dev.type != "cuda" and backend not in CPU_SDPA_BACKENDS:
        return (
            f"the SDPA {backend} backend is a CUDA kernel (torch's SDPA has only"
            f" {' and '.join(CPU_SDPA_BACKENDS)} on a {dev.type})"
        )
    dtype = TORCH_DTYPES[shape.dtype]
    kernel = getattr(SDPBackend, SDPA_BACKENDS[backend].torch_backend)
    for case, call in _attention_calls(shape, dev, dtype):
        why = _refusal(kernel, sdpa_kernel, call)
        if why is not None:
            return (
                f"torch's SDPA {backend} backend refuses the {case} ({shape.dtype},"
                f" {shape.heads} heads, {shape.kv_heads} kv heads, head_dim {shape.head_dim}):"
                f" {why}"
            )[:600]
    return None


_Call = tuple[str, Callable[[], object]]


def _attention_calls(shape: AttentionShape, dev: torch.device, dtype: torch.dtype) -> list[_Call]:
    """(what, call) of each SDPA call transformers' sdpa attention makes for `shape`."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    h, kv, d = shape.heads, shape.kv_heads, shape.head_dim
    groups = max(1, h // kv)
    prompt, context = 4, 6  # a prefill of 4 tokens; a decode step over 6 cached positions
    scale = d**-0.5

    def t(heads: int, length: int) -> torch.Tensor:
        return torch.randn(1, heads, length, d, device=dev, dtype=dtype)

    gqa = groups > 1 and d <= 256  # transformers' use_gqa_in_sdpa, mask-free

    def prefill() -> object:
        if groups > 1 and not gqa:  # repeat_kv
            return sdpa(t(h, prompt), t(h, prompt), t(h, prompt), scale=scale, is_causal=True)
        return sdpa(
            t(h, prompt), t(kv, prompt), t(kv, prompt), scale=scale, is_causal=True, enable_gqa=gqa
        )

    def decode() -> object:
        if groups > 1 and not gqa:  # pack_gqa: the query heads of a kv head become its rows
            return sdpa(t(kv, groups), t(kv, context), t(kv, context), scale=scale)
        return sdpa(t(h, 1), t(kv, context), t(kv, context), scale=scale, enable_gqa=gqa)

    calls: list[_Call] = [("mask-free prefill", prefill), ("mask-free decode step", decode)]
    if shape.masked:

        def masked_prefill() -> object:
            mask = torch.ones(prompt, context, device=dev, dtype=torch.bool).tril(context - prompt)
            return sdpa(
                t(h, prompt), t(h, context), t(h, context), attn_mask=mask[None, None], scale=scale
            )

        def masked_decode() -> object:
            mask = torch.ones(1, 1, 1, context, device=dev, dtype=torch.bool)
            if groups > 1:
                return sdpa(
                    t(kv, groups), t(kv, context), t(kv, context), attn_mask=mask, scale=scale
                )
            return sdpa(t(h, 1), t(h, context), t(h, context), attn_mask=mask, scale=scale)

        calls += [("masked prefill", masked_prefill), ("masked decode step", masked_decode)]
    return calls


def _refusal(kernel: Any, sdpa_kernel: Any, call: Callable[[], object]) -> str | None:
    """torch's reasons (its UserWarnings, else the error) when `call` fails under `kernel`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(kernel):
                call()
        except (RuntimeError, NotImplementedError, ValueError) as e:
            reasons = [_plain(str(w.message)) for w in caught]
            reasons = [r for r in reasons if r and not r.endswith("not used because:")]
            return "; ".join(dict.fromkeys(reasons)) or f"{type(e).__name__}: {e}"
    return None


def _plain(message: str) -> str:
    """A torch warning without its "(Triggered internally at ...)" source location."""
    return message.split(" (Triggered internally at")[0].strip()
