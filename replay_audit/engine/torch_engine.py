"""The torch engine: a local Hugging Face checkpoint in one numerical configuration.

The transformer body is transformers' own (`model.model(...)`, its final norm included); the
lm_head projection and the interventions are ours (`numerics`), the margin and the gate are
`diff.step_numerics`'. The decode loop keeps a KV cache (`decoder`: dynamic or static, one loop
for both); the scan and the single-step re-run are one from-scratch forward each.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

import replay_audit
from replay_audit.engine.batch import PackedBatch, pack_batch, plan_scan, scan_extras
from replay_audit.engine.decoder import Body, Decoder, DynamicDecoder, StaticDecoder, head_step
from replay_audit.engine.loading import (
    TORCH_DTYPES,
    configure_numerics,
    load_model,
    numerical_environment,
    resolve_device,
)
from replay_audit.engine.numerics import LmHead, decide, decide_rows, top_k_ordered, top_k_rows
from replay_audit.engine.protocol import (
    DEFAULT_SCAN_TOKEN_BUDGET,
    DecodeRun,
    Intervention,
    ScanItem,
    ScanRun,
    StepInfo,
    Steps,
    Target,
)

#: "dynamic": transformers' growing cache, token-identical to `generate()`. "static": a
#: preallocated cache with the decode step captured in a CUDA graph. "compiled": "static" with the
#: decode step compiled by `torch.compile` (inductor fuses the elementwise kernels) before it is
#: captured; its bits may differ from "static"'s (fused RMSNorm, RoPE, SiLU).
CacheKind = Literal["dynamic", "static", "compiled"]
#: Static cache lengths are powers of two from this up to `max_cache_len`: a decode gets the
#: smallest that holds it, so attention reads (and masks) as few unwritten positions as it can.
MIN_STATIC_BUCKET = 256


class TorchEngine:
    """An `Engine` over a transformers causal LM (Llama and its relatives)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        target: Target,
        device: torch.device,
        *,
        cache: CacheKind = "dynamic",
        max_cache_len: int = 4096,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.body = Body(model, target.batch_size, device)
        self.cache_kind: CacheKind = cache
        self.max_cache_len = max_cache_len
        #: Static decoders by cache length (bucket), each with its own cache and graph.
        self._static: dict[int, StaticDecoder] = {}
        body_dtype = TORCH_DTYPES[target.dtype]
        self.head = LmHead(model.get_output_embeddings().weight, target.head_dtype, body_dtype)
        kernel = str(getattr(model.config, "_attn_implementation", None) or "eager")
        # The target as it actually runs: the attention kernel in use, not the one asked for.
        self._target = Target(
            target.dtype, target.lm_head_dtype, kernel, target.batch_size, target.intervention
        )
        #: The token written at padded positions of a batched scan. No real position reads it
        #: (tests/engine/test_engine_torch_scan_batch.py changes it and gets the same bits).
        pad = getattr(model.config, "pad_token_id", None)
        self.scan_pad_id = int(pad) if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        #: What the last batched scan recorded in `environment()["extras"]` (its batch shapes).
        self._scan_extras: dict[str, str | int] = {}

    @classmethod
    def load(
        cls,
        model_dir: Path,
        target: Target,
        *,
        device: str | None = None,
        deterministic: bool = True,
        tf32: bool = False,
        cache: CacheKind = "dynamic",
        max_cache_len: int = 4096,
    ) -> TorchEngine:
        """Set the numerical flags, then load `model_dir` in `target`'s format. `cache`: see
        `CacheKind` ("compiled" for the fastest decode on CUDA, not bitwise equal to "static")."""
        configure_numerics(deterministic=deterministic, tf32=tf32)
        dev = resolve_device(device)
        model, tokenizer = load_model(model_dir, target.dtype, target.attn_kernel, dev)
        return cls(model, tokenizer, target, dev, cache=cache, max_cache_len=max_cache_len)

    # -- the protocol -------------------------------------------------------------------------

    @property
    def target(self) -> Target:
        return self._target

    @property
    def vocab_size(self) -> int:
        return self.head.vocab_size

    def environment(self) -> dict[str, Any]:
        t = self._target
        return numerical_environment(
            dtype=t.dtype,
            lm_head_dtype=t.head_dtype,
            weight_dtype=t.dtype,
            device=self.device,
            attn_kernel=t.attn_kernel or "eager",
            batch_size=t.batch_size,
            engine_name="replay-audit",
            engine_version=replay_audit.__version__,
            extras={**self._extras(), "torch_threads": torch.get_num_threads()},
        )

    @torch.inference_mode()
    def decode(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_ids: Sequence[int] = (),
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        forced_prefix: Sequence[int] = (),
    ) -> DecodeRun:
        iv = intervention or self._target.intervention
        eos = set(eos_ids)
        out = [int(x) for x in forced_prefix]
        start = len(out)
        if start >= max_new_tokens or (out and out[-1] in eos):
            stop: Literal["eos", "length"] = "eos" if out and out[-1] in eos else "length"
            return DecodeRun(out, Steps.empty(top_k), start, stop)
        context = [*prompt_ids, *out]
        decoder = self._decoder(len(context) + max_new_tokens - start)
        step = decoder.prefill(context, top_k)
        parts: list[Steps] = []
        stop = "length"
        while True:
            chosen = decide(self.head, step.top, step.logits[None], step.hidden[:1], iv, top_k)
            parts.append(chosen)
            token = int(chosen.token_ids[0])
            out.append(token)
            if token in eos:
                stop = "eos"
                break
            if len(out) >= max_new_tokens:
                break
            step = decoder.step(token)
        return DecodeRun(out, Steps.concat(parts), start, stop)

    @torch.inference_mode()
    def scan(
        self,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        intervention: Intervention | None = None,
        top_k: int = 5,
    ) -> ScanRun:
        iv = intervention or self._target.intervention
        n_out = len(output_ids)
        if n_out == 0:
            return ScanRun(Steps.empty(top_k), np.zeros(0, bool))
        context = [*prompt_ids, *output_ids[:-1]]
        # Position p's hidden state predicts token p + 1: output step t is at len(prompt) - 1 + t.
        hs = self.body.forward(context, None, 0)[0, len(prompt_ids) - 1 :]
        # One batched head product (per row for FP8, whose activation scale is per step), one
        # batched top-k, one call of the numerics for all steps.
        if self.head.fmt.startswith("fp8"):
            z = torch.cat([self.head.native(hs[i : i + 1]) for i in range(hs.shape[0])])
        else:
            z = self.head.native(hs)
        z32 = z.float()
        steps = decide(self.head, top_k_rows(z32, top_k), z32, hs, iv, top_k)
        return ScanRun(steps, np.asarray(steps.token_ids == np.asarray(output_ids), dtype=bool))

    @torch.inference_mode()
    def scan_batch(
        self,
        items: Sequence[ScanItem],
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        token_budget: int = DEFAULT_SCAN_TOKEN_BUDGET,
    ) -> list[ScanRun]:
        """`scan` of each item, several traces per forward (`replay_audit.engine.batch`: length
        buckets, right padding, at most `token_budget` tokens a forward; a longer trace alone).
        Per forward: the body over the right-padded rows (causal mask only: padding comes after
        every real position, so none reads it), the lm_head over the real output positions
        only, top-k and its tie order on the device, one copy of (steps, k) values to the host,
        the margins and gate of all steps in one call of `diff.step_numerics`, and the
        intervention at all gated steps together. The rows are other traces, not copies of one:
        `Target.batch_size` is the decode's and `scan`'s. The batch shapes go into
        `environment()["extras"]` (`scan_batch_shapes`, `scan_token_budget`)."""
        iv = intervention or self._target.intervention
        items = list(items)
        plan = plan_scan(items, token_budget)
        runs: list[ScanRun | None] = [None] * len(items)
        for batch in plan:
            members = [items[i] for i in batch.indices]
            packed = pack_batch(members, batch.padded_length, self.scan_pad_id)
            steps = self._scan_packed(packed, iv, top_k)
            for r, (i, item) in enumerate(zip(batch.indices, members, strict=True)):
                s = steps.slice(int(packed.row_steps[r]), int(packed.row_steps[r + 1]))
                agrees = np.asarray(s.token_ids == np.asarray(item.output_ids), dtype=bool)
                runs[i] = ScanRun(s, agrees)
        self._scan_extras = scan_extras(plan, token_budget)
        empty = ScanRun(Steps.empty(top_k), np.zeros(0, bool))
        return [run if run is not None else empty for run in runs]

    @torch.inference_mode()
    def step(
        self, prompt_ids: Sequence[int], prefix_ids: Sequence[int], top_k: int = 5
    ) -> StepInfo:
        h = self.body.forward([*prompt_ids, *prefix_ids], None, 0)[:, -1]
        out = head_step(self.head, h, top_k)
        s = decide(self.head, out.top, out.logits[None], h[:1], Intervention(), top_k)
        return StepInfo(
            token=int(s.native_token_ids[0]),
            top_k_ids=s.top_k_ids[0],
            top_k_logits=s.top_k_logits[0],
            margin=s.margin_at(0),
        )

    def detokenize(self, ids: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    # -- internals ----------------------------------------------------------------------------

    def _scan_packed(self, packed: PackedBatch, iv: Intervention, top_k: int) -> Steps:
        """One forward of a batched scan: the steps of all its rows, row after row."""
        ids = torch.from_numpy(packed.input_ids).to(self.device)
        # The causal mask alone keeps right padding unread (`batch`): no padding mask.
        hidden = self.body.forward_rows(ids)
        positions = torch.from_numpy(packed.output_positions).to(self.device)
        # Only the real output positions' hidden states go on: padding's are never read.
        hs = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        if self.head.fmt.startswith("fp8"):  # per step, as `scan`: the activation scale is per step
            z32 = torch.cat([self.head.native(hs[i : i + 1]) for i in range(hs.shape[0])]).float()
        else:
            z32 = self.head.native(hs).float()  # the native (steps, V) freed at once
        return decide_rows(self.head, top_k_ordered(z32, top_k), z32, hs, iv, top_k)

    def _decoder(self, total: int) -> Decoder:
        """The decoder for a decode of `total` tokens (context and new): a static one where the
        cache kind asks for it and the longest static cache holds them, else a dynamic one."""
        if self.cache_kind == "dynamic" or total > self.max_cache_len:
            return DynamicDecoder(self.body, self.head)
        return self._static_decoder(total)

    def _static_decoder(self, total: int) -> StaticDecoder:
        """The static decoder whose cache length is the smallest bucket holding `total` tokens."""
        length = MIN_STATIC_BUCKET
        while length < total:
            length *= 2
        length = min(length, self.max_cache_len)
        if length not in self._static:
            mode = "default" if self.cache_kind == "compiled" else None
            self._static[length] = StaticDecoder(self.body, self.head, length, compile_mode=mode)
        return self._static[length]

    def _extras(self) -> dict[str, Any]:
        """Which decode path ran: the cache, the static cache lengths used so far, whether the
        step was captured in a CUDA graph and compiled (and why not, if compiling failed); after
        a batched scan, its batch shapes (`batch.scan_extras`)."""
        if self.cache_kind == "dynamic":
            return {
                "kv_cache": "dynamic",
                "cuda_graph": False,
                "static_cache_len": None,
                **self._scan_extras,
            }
        decoders = list(self._static.values())
        errors = sorted({d.compile_error for d in decoders if d.compile_error})
        extras: dict[str, Any] = {
            "kv_cache": "static",
            "cuda_graph": bool(decoders) and all(d.graph is not None for d in decoders),
            "static_cache_len": self.max_cache_len,
            "static_cache_lens_used": ",".join(str(n) for n in sorted(self._static)),
            "compiled": bool(decoders) and all(d.compiled for d in decoders),
            **self._scan_extras,
        }
        if self.cache_kind == "compiled":
            extras["compile_mode"] = "default"
            if errors:
                extras["compile_error"] = errors[0][:200]
        return extras
