"""The benign null of a checkpoint on this scanning platform: traces generated from the
checkpoint under benign numerical variations (formats, attention kernels, batch sizes, TP 2
where two CUDA GPUs are owned: the screening sweep's configurations, each an arm of the replay
pipeline (`load_arm`) on the caller's engine pool), scanned in the claimed configuration here,
and calibrated (`stats.verification.calibrate`) against the alternative a decision must
detect: a 4-bit RTN (group 128) copy of the checkpoint. Workers and the CLI only (the pool
loads torch engines)."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Final

import numpy as np

from replay_audit.engine.pool import EnginePool
from replay_audit.engine.protocol import Target
from replay_audit.replays.domain import LoggedTrace
from replay_audit.replays.pipeline import load_arm
from replay_audit.screenings.sweep.outputs import ScreenPrompt
from replay_audit.screenings.sweep.plan import Platform, ScreenConfig, unavailable_reason
from replay_audit.screenings.sweep.worker import TorchFacts
from replay_audit.stats.verification import (
    BUDGETS,
    DEFAULT_FALSE_ALARM_RATE,
    DRAWS,
    Calibration,
    PlatformKey,
    calibrate,
)
from replay_audit.verifications.domain import claim_key
from replay_audit.verifications.scan import deficit_arrays, scan_evidence

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
    config: ScreenConfig,
    prompts: Sequence[ScreenPrompt],
    max_new: int,
    pool: EnginePool,
    model_dir: Path,
    eos: Sequence[int],
) -> list[tuple[list[int], list[int]]]:
    """Greedy generations (prompt, output) of `prompts` in `config`'s arm on `model_dir`."""
    arm = load_arm(config.target(), pool, model_dir, tp_degree=config.tp_degree)
    return [
        (list(p.token_ids), arm.decode(p.token_ids, max_new, eos, 2).output_token_ids)
        for p in prompts
    ]


def _scan(
    pairs: Sequence[tuple[list[int], list[int]]], claim: Target, pool: EnginePool, model_dir: Path
) -> list[np.ndarray]:
    vocab = load_arm(claim, pool, model_dir).engine.vocab_size
    traces = [
        LoggedTrace.from_parts(
            external_id=None,
            weights_sha256="",
            vocab_size=vocab,
            config={
                "dtype": claim.dtype,
                "lm_head_dtype": claim.lm_head_dtype,
                "attn_kernel": claim.attn_kernel,
                "deterministic": claim.deterministic,
                "tf32": claim.tf32,
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
    progress: Callable[[str, int, int], None] | None = None,
) -> Calibration:
    """The calibration of `claim` on `model_dir` on this platform (the module docstring says
    how); a benign variation that cannot run here is named in its notes. `progress(what,
    done, total)` after each variation and the 4-bit alternative."""
    from replay_audit.engine.testing import rtn_checkpoint

    facts = TorchFacts(model_dir, device, devices=pool.devices)
    platform = facts.platform()
    eos = facts.eos_ids()
    chosen = list(variations or BENIGN_VARIATIONS)
    if variations is None:
        chosen += [*(CUDA_VARIATIONS if platform.device == "cuda" else ()), TP_VARIATION]
    notes: list[str] = []
    null: dict[str, list[np.ndarray]] = {}
    for done, config in enumerate(chosen):
        if progress is not None:
            progress(config.key, done, len(chosen) + 1)
        why = unavailable_reason(config, platform)
        if why is not None:
            tp = f" (TP {config.tp_degree} not covered)" if config.tp_degree > 1 else ""
            notes.append(f"benign variation {config.key} not run here{tp}: {why}")
            continue
        start = time.perf_counter()
        pairs = generate(config, prompts, max_new_tokens, pool, model_dir, eos)
        generated = time.perf_counter()
        null[config.key] = _scan(pairs, claim, pool, model_dir)
        log.info(
            "benign null: %s, %d prompts generated in %.1f s, scanned in %.1f s",
            config.key,
            len(pairs),
            generated - start,
            time.perf_counter() - generated,
        )
    kernel = claim.attn_kernel or "sdpa"
    claimed = ScreenConfig(claim.dtype, attn_kernel=kernel)  # type: ignore[arg-type]
    if progress is not None:
        progress("4-bit alternative", len(chosen), len(chosen) + 1)
    with tempfile.TemporaryDirectory(prefix="rtn4-") as tmp:
        rtn = rtn_checkpoint(model_dir, Path(tmp), bits=4, group_size=128)
        alt = _scan(
            generate(claimed, prompts, max_new_tokens, pool, rtn, eos), claim, pool, model_dir
        )
    if progress is not None:
        progress("done", len(chosen) + 1, len(chosen) + 1)
    env = load_arm(claim, pool, model_dir).engine.environment()
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
