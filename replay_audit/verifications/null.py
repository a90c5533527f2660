"""The benign null of a checkpoint on this scanning platform: traces generated from the
checkpoint under benign numerical variations (formats, attention kernels, batch sizes, TP 2
where two CUDA GPUs are owned), scanned in the claimed configuration here, and calibrated
(`stats.verification.calibrate`) against the alternative a decision must detect: a 4-bit RTN
(group 128) copy of the checkpoint.

Each variation is a provider as users run one: transformers' plain `generate()` with its
default kernels (`engine.generate.TraceGenerator`), distinct prompts batched `batch_size` at a
time and left-padded, so a null of 64 prompts x 128 tokens x 8 variations takes minutes on a
CPU for the bundled model instead of the better part of an hour one prompt at a time through
the replay engine. The TP-2 variation decodes on the engine pool's TP group (`load_arm`), as
before. A sampled claim's null samples with the claim's recipe, one seed per batch. Workers and
the CLI only (torch is imported where a null is generated)."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypedDict

import numpy as np

from replay_audit.engine.pool import EnginePool
from replay_audit.engine.protocol import SamplingRecipe, Target
from replay_audit.formats import BodyDType, SamplingJson, Strategy
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

if TYPE_CHECKING:
    from replay_audit.engine.generate import TraceGenerator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NullVariation:
    """One benign provider of the null: plain `generate()` in `dtype` with `attn_kernel`
    (None: transformers' default kernels, sdpa), `batch_size` distinct prompts a call
    (left-padded), at TP `tp_degree` (k > 1: the engine pool's TP group, one prompt a call)."""

    dtype: BodyDType
    attn_kernel: str | None = None
    batch_size: int = 1
    tp_degree: int = 1

    @property
    def key(self) -> str:
        """Its name in a calibration, saying what ran: e.g. `bf16 b8`, `fp16 eager b1`."""
        kernel = f" {self.attn_kernel}" if self.attn_kernel not in (None, "sdpa") else ""
        tp = f" tp{self.tp_degree}" if self.tp_degree > 1 else ""
        return f"{self.dtype}{kernel}{tp} b{self.batch_size}"

    def screen_config(self) -> ScreenConfig:
        """The screening's configuration of it (what `unavailable_reason` and `load_arm` take)."""
        return ScreenConfig(
            self.dtype,
            attn_kernel=self.attn_kernel or "sdpa",
            batch_size=self.batch_size,
            tp_degree=self.tp_degree,
        )

    @classmethod
    def of(cls, config: NullVariation | ScreenConfig) -> NullVariation:
        """A variation from a screening configuration (its format, kernel, batch and TP)."""
        if isinstance(config, NullVariation):
            return config
        kernel = None if config.attn_kernel == "sdpa" else config.attn_kernel
        return cls(config.dtype, kernel, config.batch_size, config.tp_degree)


#: The benign variations generated everywhere: the claimed format, FP16, and eager attention one
#: prompt a call (the batch-1 numerics a provider without batching has), and distinct prompts
#: batched 4 and 8 a call in BF16, FP16, FP32 and eager FP16; TP 2 where the pool owns two CUDA
#: GPUs. Batch 1 is the costly kind on a CPU (a prompt a call), so only those three run there.
BENIGN_VARIATIONS: Final = (
    NullVariation("bf16"),
    NullVariation("fp16"),
    NullVariation("bf16", "eager"),
    NullVariation("bf16", batch_size=4),
    NullVariation("bf16", batch_size=8),
    NullVariation("fp16", batch_size=8),
    NullVariation("fp32", batch_size=8),
    NullVariation("fp16", "eager", batch_size=8),
)
#: The tensor-parallel variation: where the pool owns two CUDA GPUs (on its TP group); elsewhere
#: the calibration's notes say TP was not covered.
TP_VARIATION: Final = NullVariation("bf16", tp_degree=2)
#: The batch the 4-bit alternative is generated in (its numerics barely move its power).
ALTERNATIVE_BATCH: Final = 1


class BatchJson(TypedDict):
    """A trace's `decoding.batch`: every row's prompt length and this trace's row."""

    prompt_lengths: list[int]
    row: int


class NullDecoding(TypedDict, total=False):
    """What a null generation's decoding logged beyond greedy: a sampled one's strategy,
    sampler and batch (what the scan reproduces its draws from)."""

    strategy: Strategy
    sampling: SamplingJson
    batch: BatchJson


@dataclass(frozen=True)
class NullTrace:
    """One generation of the null: prompt and output ids, and its `NullDecoding`."""

    prompt: list[int]
    output: list[int]
    decoding: NullDecoding = field(default_factory=NullDecoding)


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


def generate_batches(
    generator: TraceGenerator,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    batch_size: int,
    sampling: SamplingRecipe | None = None,
) -> list[NullTrace]:
    """`prompts` generated `batch_size` distinct prompts a `generate()` call, in order, as a
    user batches them (left-padded); sampled with `sampling` (None: greedy), the seed of each
    call its batch's index."""
    from replay_audit.engine.generate import sampling_json

    out: list[NullTrace] = []
    for seed, start in enumerate(range(0, len(prompts), batch_size)):
        rows = [list(p) for p in prompts[start : start + batch_size]]
        g = generator.generate_batch(rows, max_new, sampling=sampling, seed=seed)
        for row, (prompt, (ids, _)) in enumerate(zip(rows, g.rows, strict=True)):
            decoding = NullDecoding()
            if sampling is not None:
                decoding = NullDecoding(
                    strategy="sample",
                    sampling=sampling_json(sampling, seed, generator.device),
                    batch=BatchJson(prompt_lengths=[len(r) for r in rows], row=row),
                )
            out.append(NullTrace(prompt, list(ids), decoding))
    return out


def generate(
    variation: NullVariation,
    prompts: Sequence[ScreenPrompt],
    max_new: int,
    pool: EnginePool,
    model_dir: Path,
    eos: Sequence[int],
    *,
    device: str,
    sampling: SamplingRecipe | None = None,
) -> list[NullTrace]:
    """The generations of `prompts` by `variation` on `model_dir` (`generate_batches` with
    transformers' `generate()`; at TP k > 1 the pool's TP group decodes each prompt greedily)."""
    ids = [list(p.token_ids) for p in prompts]
    if variation.tp_degree > 1:
        config = variation.screen_config()
        arm = load_arm(config.target(), pool, model_dir, tp_degree=config.tp_degree)
        return [NullTrace(p, arm.decode(p, max_new, eos, 2).output_token_ids) for p in ids]
    from replay_audit.engine.generate import TraceGenerator

    with TraceGenerator(
        model_dir, dtype=variation.dtype, attn_kernel=variation.attn_kernel, device=device
    ) as generator:
        return generate_batches(generator, ids, max_new, variation.batch_size, sampling)


def _scan(
    generated: Sequence[NullTrace], claim: Target, pool: EnginePool, model_dir: Path
) -> list[np.ndarray]:
    """The deficits in ulps of `generated` scanned in `claim` (each as a trace that claims it)."""
    from replay_audit.verifications.scan import deficit_arrays, scan_evidence

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
            decoding={"strategy": "greedy", **t.decoding},
            prompt_token_ids=t.prompt,
            output_token_ids=t.output,
            top_k_logits=None,
        )
        for t in generated
        if t.output
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
    variations: Sequence[NullVariation | ScreenConfig] | None = None,
    false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE,
    budgets: Sequence[int] = BUDGETS,
    draws: int = DRAWS,
    progress: Callable[[str, int, int], None] | None = None,
    sampling: SamplingJson | None = None,
) -> Calibration:
    """The calibration of `claim` on `model_dir` on this platform (the module docstring says
    how); a benign variation that cannot run here is named in its notes. `progress(what,
    done, total)` before each variation and the 4-bit alternative, and at the end. `sampling`:
    a sampled claim's recipe (`Claim["sampling"]`): the null samples with it."""
    from replay_audit.engine.testing import rtn_checkpoint

    facts = TorchFacts(model_dir, device, devices=pool.devices)
    platform = facts.platform()
    eos = facts.eos_ids()
    recipe = SamplingRecipe.from_json(sampling) if sampling is not None else None
    chosen = [NullVariation.of(v) for v in (variations or BENIGN_VARIATIONS)]
    if variations is None:
        chosen.append(TP_VARIATION)
    notes: list[str] = []
    null: dict[str, list[np.ndarray]] = {}
    total = len(chosen) + 1
    for done, variation in enumerate(chosen):
        if progress is not None:
            progress(variation.key, done, total)
        why = unavailable_reason(variation.screen_config(), platform)
        if why is None and variation.tp_degree > 1 and recipe is not None:
            why = "the engine pool's TP group decodes greedily only"
        if why is not None:
            tp = f" (TP {variation.tp_degree} not covered)" if variation.tp_degree > 1 else ""
            notes.append(f"benign variation {variation.key} not run here{tp}: {why}")
            continue
        start = time.perf_counter()
        generated = generate(
            variation,
            prompts,
            max_new_tokens,
            pool,
            model_dir,
            eos,
            device=platform.device,
            sampling=recipe,
        )
        made = time.perf_counter()
        null[variation.key] = _scan(generated, claim, pool, model_dir)
        log.info(
            "benign null: %s, %d prompts generated in %.1f s, scanned in %.1f s",
            variation.key,
            len(generated),
            made - start,
            time.perf_counter() - made,
        )
    if progress is not None:
        progress("4-bit alternative", len(chosen), total)
    claimed = NullVariation(
        claim.dtype,  # type: ignore[arg-type]
        claim.attn_kernel,
        batch_size=ALTERNATIVE_BATCH,
    )
    with tempfile.TemporaryDirectory(prefix="rtn4-") as tmp:
        rtn = rtn_checkpoint(model_dir, Path(tmp), bits=4, group_size=128)
        made_alt = generate(
            claimed,
            prompts,
            max_new_tokens,
            pool,
            rtn,
            eos,
            device=platform.device,
            sampling=recipe,
        )
        alt = _scan(made_alt, claim, pool, model_dir)
    if progress is not None:
        progress("done", total, total)
    env = load_arm(claim, pool, model_dir).engine.environment()
    key = claim_key(claim)
    if recipe is not None:
        key["sampling"] = recipe.to_json()
    cal = calibrate(
        null,
        alt,
        weights_sha256=pool.weights_sha256(model_dir),
        claim=key,
        platform=platform_key(platform, env["torch_version"]),
        false_alarm_rate=false_alarm_rate,
        budgets=budgets,
        draws=draws,
    )
    ran = "sampled with " + recipe.label() if recipe is not None else "greedy"
    notes.append(
        f"null measured on {platform.device}"
        + (f" ({platform.gpu_name})" if platform.gpu_name else "")
        + f" from {len(prompts)} prompts x {len(null)} benign variations (transformers "
        f"generate(), {ran}, distinct prompts batched as each variation's name says: b8 is 8 "
        "a call); it backs groups of up to "
        + (f"{cal.reach:,} tokens" if cal.reach is not None else "no calibrated budget")
    )
    return replace(cal, notes=notes, null_prompts=len(prompts), null_max_new_tokens=max_new_tokens)
