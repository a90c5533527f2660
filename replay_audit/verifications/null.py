"""The benign null of a checkpoint on this scanning platform: traces generated from the
checkpoint under benign numerical variations (formats, attention kernels, batch sizes, TP 2
where two CUDA GPUs are owned: the screening sweep's configurations, loaded and run by its torch
backend on the caller's engine pool), scanned in the claimed
configuration here, and calibrated (`stats.verification.calibrate`) against the alternative a
decision must detect: a 4-bit RTN (group 128) copy of the checkpoint. Workers and the CLI only
(the torch backend loads engines)."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Final

import numpy as np

from replay_audit.engine.pool import EnginePool
from replay_audit.engine.protocol import Target
from replay_audit.replays.domain import LoggedTrace
from replay_audit.screenings.sweep.outputs import ScreenPrompt
from replay_audit.screenings.sweep.plan import Platform, ScreenConfig, unavailable_reason
from replay_audit.screenings.sweep.worker import TorchBackend
from replay_audit.stats.verification import (
    BUDGETS,
    DEFAULT_FALSE_ALARM_RATE,
    DRAWS,
    Calibration,
    PlatformKey,
    calibrate,
)
from replay_audit.verifications.domain import claim_key
from replay_audit.verifications.scan import claim_engine, deficit_arrays, scan_evidence

log = logging.getLogger(__name__)

#: The benign variations generated everywhere; a CUDA device adds `CUDA_VARIATIONS`.
BENIGN_VARIATIONS: Final = (
    ScreenConfig("bf16"),
    ScreenConfig("fp16"),
    ScreenConfig("fp32"),
    ScreenConfig("bf16", attn_kernel="eager"),
    ScreenConfig("fp16", attn_kernel="eager"),
    ScreenConfig("bf16", batch_size=4),
)
CUDA_VARIATIONS: Final = (ScreenConfig("bf16", batch_size=8), ScreenConfig("fp16", batch_size=8))
#: The tensor-parallel variation: a CUDA variation where the pool owns two GPUs (on its TP group);
#: elsewhere the calibration's notes say TP was not covered.
TP_VARIATION: Final = ScreenConfig("bf16", tp_degree=2)


def platform_key(platform: Platform, torch_version: str | None) -> PlatformKey:
    """What names the scanning platform a null belongs to (the CUDA GPUs owned with it: they
    decide whether the null holds TP 2)."""
    return PlatformKey(
        device=platform.device,
        gpu_name=platform.gpu_name,
        sm=platform.sm,
        torch_version=torch_version,
        devices=platform.devices if platform.device == "cuda" else 1,
    )


def generate(
    backend: TorchBackend,
    config: ScreenConfig,
    prompts: Sequence[ScreenPrompt],
    max_new: int,
    model_dir: Path | None = None,
) -> list[tuple[list[int], list[int]]]:
    """Greedy generations (prompt, output) of `prompts` in `config` (on `model_dir`, else the
    backend's checkpoint)."""
    if model_dir is not None:
        backend = TorchBackend(model_dir, backend.device)
    backend.activate(config)
    engine = backend.load(config)
    eos = backend.eos_ids()
    return [
        (list(p.token_ids), engine.decode(p.token_ids, max_new, eos).output_token_ids)
        for p in prompts
    ]


def _scan(
    pairs: Sequence[tuple[list[int], list[int]]], claim: Target, pool: EnginePool, model_dir: Path
) -> list[np.ndarray]:
    traces = [
        LoggedTrace.from_parts(
            external_id=None,
            weights_sha256="",
            vocab_size=0,
            config={
                "dtype": claim.dtype,
                "lm_head_dtype": claim.lm_head_dtype,
                "attn_kernel": claim.attn_kernel,
            },
            decoding={"strategy": "greedy"},
            prompt_token_ids=p,
            output_token_ids=o,
            top_k_logits=None,
        )
        for p, o in pairs
        if o
    ]
    return deficit_arrays(scan_evidence(traces, pool, model_dir))


def benign_null(
    model_dir: Path,
    claim: Target,
    prompts: Sequence[ScreenPrompt],
    *,
    pool: EnginePool,
    device: str | None = None,
    max_new_tokens: int = 64,
    variations: Sequence[ScreenConfig] | None = None,
    false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE,
    budgets: Sequence[int] = BUDGETS,
    draws: int = DRAWS,
) -> Calibration:
    """The calibration of `claim` on `model_dir` on this platform: each benign variation that
    runs here generates `prompts`, every generation is scanned in `claim`, and a 4-bit RTN
    copy's generations in `claim` are the alternative."""
    from replay_audit.engine.testing import rtn_checkpoint

    backend = TorchBackend(model_dir, device, pool=pool)
    platform = backend.platform()
    chosen = list(variations or BENIGN_VARIATIONS)
    if variations is None:
        chosen += [*(CUDA_VARIATIONS if platform.device == "cuda" else ()), TP_VARIATION]
    notes: list[str] = []
    null: dict[str, list[np.ndarray]] = {}
    for config in chosen:
        why = unavailable_reason(config, platform)
        if why is not None:
            tp = f" (TP {config.tp_degree} not covered)" if config.tp_degree > 1 else ""
            notes.append(f"benign variation {config.key} not run here{tp}: {why}")
            continue
        start = time.perf_counter()
        pairs = generate(backend, config, prompts, max_new_tokens)
        generated = time.perf_counter()
        null[config.key] = _scan(pairs, claim, pool, model_dir)
        log.info(
            "benign null: %s, %d prompts generated in %.1f s, scanned in %.1f s",
            config.key,
            len(pairs),
            generated - start,
            time.perf_counter() - generated,
        )
    claimed = ScreenConfig(
        claim.dtype,  # type: ignore[arg-type]
        attn_kernel=claim.attn_kernel or "sdpa",
    )
    with tempfile.TemporaryDirectory(prefix="rtn4-") as tmp:
        rtn = rtn_checkpoint(model_dir, Path(tmp), bits=4, group_size=128)
        alt = _scan(
            generate(backend, claimed, prompts, max_new_tokens, rtn), claim, pool, model_dir
        )
    engine = claim_engine(pool, model_dir, claim)
    env = engine.environment()
    cal = calibrate(
        null,
        alt,
        weights_sha256=pool.weights_sha256(model_dir),
        claim=claim_key(claim),
        platform=platform_key(platform, env["torch_version"]),
        false_alarm_rate=false_alarm_rate,
        budgets=budgets,
        draws=draws,
    )
    notes.append(
        f"null measured on {platform.device}"
        + (f" ({platform.gpu_name})" if platform.gpu_name else "")
        + f" from {len(prompts)} prompts x {len(null)} benign variations"
    )
    return replace(cal, notes=notes, null_prompts=len(prompts), null_max_new_tokens=max_new_tokens)
