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
import numpy.typing as npt
import torch

import replay_audit
from replay_audit.diff.pieces import Piece
from replay_audit.engine.batch import (
    PackedBatch,
    pack_batch,
    plan_scan,
    plan_steps,
    scan_extras,
    step_extras,
)
from replay_audit.engine.decoder import Body, Decoder, DynamicDecoder, StaticDecoder, head_step
from replay_audit.engine.loading import (
    TORCH_DTYPES,
    configure_numerics,
    load_model,
    numerical_environment,
    resolve_device,
)
from replay_audit.engine.numerics import (
    LmHead,
    decide,
    decide_rows,
    fp8_supported,
    top_k_ordered,
    top_k_rows,
)
from replay_audit.engine.pieces import PieceReader
from replay_audit.engine.piecewise import PiecewiseDecoder
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
from replay_audit.exceptions import UnsupportedFormat
from replay_audit.formats import CacheKind

#: The cache kind when none is asked for (`default_cache_kind`): on CUDA the piecewise decode,
#: whose logits are the dynamic path's bit for bit (checked on each engine's first decode; where
#: the check fails the engine decodes dynamically and says so), elsewhere the dynamic one.
DEFAULT_CUDA_CACHE_KIND: CacheKind = "piecewise"
#: Static cache lengths are powers of two from this up to `max_cache_len`: a decode gets the
#: smallest that holds it, so attention reads (and masks) as few unwritten positions as it can.
MIN_STATIC_BUCKET = 256


def default_cache_kind(device: torch.device) -> CacheKind:
    """The decode path when none is asked for: the fastest faithful one for the device."""
    return DEFAULT_CUDA_CACHE_KIND if device.type == "cuda" else "dynamic"


class TorchEngine:
    """An `Engine` over a transformers causal LM (Llama and its relatives)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        target: Target,
        device: torch.device,
        *,
        cache: CacheKind | None = None,
        max_cache_len: int = 4096,
        weight_dtype: str | None = None,
    ) -> None:
        self.model = model
        #: The dtype the weights were stored in before the cast to the compute dtype.
        self.weight_dtype = weight_dtype or target.dtype
        #: Whether the body's linear layers compute in FP8 (`fp8_linear.py`).
        self.fp8_linear = False
        self.tokenizer = tokenizer
        self._pieces = PieceReader(tokenizer) if tokenizer is not None else None
        self.device = device
        self.body = Body(model, target.batch_size, device)
        self.cache_kind: CacheKind = cache or default_cache_kind(device)
        self.max_cache_len = max_cache_len
        #: Static decoders by cache length (bucket), each with its own cache and graph.
        self._static: dict[int, StaticDecoder] = {}
        #: The piecewise decoder once built and checked; why it is not used, if it is not.
        self._piecewise: PiecewiseDecoder | None = None
        self._piecewise_error: str | None = None
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
        #: What the last batched single-step re-runs recorded (their batch shapes).
        self._step_extras: dict[str, str | int] = {}

    @classmethod
    def load(
        cls,
        model_dir: Path,
        target: Target,
        *,
        device: str | None = None,
        deterministic: bool = True,
        tf32: bool = False,
        cache: CacheKind | None = None,
        max_cache_len: int = 4096,
        weight_dtype: str | None = None,
        fp8_linear: bool = False,
    ) -> TorchEngine:
        """Set the numerical flags, then load `model_dir` in `target`'s format. `cache`: see
        `formats.CacheKind` (None: `default_cache_kind`; "compiled" for the fastest decode on
        CUDA, not token-identical to `generate()`).
        `weight_dtype`: the storage dtype when it differs from the compute dtype
        (`loading.load_model`). `fp8_linear`: every linear layer of the body in FP8-E4M3
        (`fp8_linear.py`; a CUDA GPU of compute capability >= 8.9)."""
        configure_numerics(deterministic=deterministic, tf32=tf32)
        dev = resolve_device(device)
        if fp8_linear:
            ok, why = fp8_supported(dev)
            if not ok:
                raise UnsupportedFormat(why.replace("an fp8_e4m3 lm_head", "fp8 linear layers"))
        model, tokenizer = load_model(
            model_dir, target.dtype, target.attn_kernel, dev, weight_dtype=weight_dtype
        )
        if fp8_linear:
            from replay_audit.engine.fp8_linear import quantize_body_linears

            quantize_body_linears(model.model, TORCH_DTYPES[target.dtype])
        engine = cls(
            model,
            tokenizer,
            target,
            dev,
            cache=cache,
            max_cache_len=max_cache_len,
            weight_dtype=weight_dtype,
        )
        engine.fp8_linear = fp8_linear
        return engine

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
            weight_dtype=self.weight_dtype,
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
        decoder = self._decoder(context, len(context) + max_new_tokens - start)
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
        self,
        prompt_ids: Sequence[int],
        prefix_ids: Sequence[int],
        intervention: Intervention,
        top_k: int = 5,
    ) -> StepInfo:
        h = self.body.forward([*prompt_ids, *prefix_ids], None, 0)[:, -1]
        return self._head_step(h[:1], intervention, top_k)

    @torch.inference_mode()
    def step_batch(
        self,
        contexts: Sequence[Sequence[int]],
        intervention: Intervention,
        top_k: int = 5,
        *,
        token_budget: int = DEFAULT_SCAN_TOKEN_BUDGET,
    ) -> list[StepInfo]:
        """`step` of each context, the body batched: contexts of one length share a forward,
        unpadded (`batch.plan_steps`), then each row's last hidden state goes through the
        lm_head and `intervention` alone, as `step`'s does (a head product over many rows may
        sum in another order: on this CPU fp32 rows differ by an ulp). An engine whose target
        decodes among copies (`batch_size` > 1) runs `step` one context at a time: its step's
        batch is the copies. The shapes go into `environment()["extras"]`
        (`step_batch_shapes`)."""
        if self.body.batch_size != 1:
            return [self.step(c, [], intervention, top_k) for c in contexts]
        plan = plan_steps([len(c) for c in contexts], token_budget)
        out: list[StepInfo | None] = [None] * len(contexts)
        for batch in plan:
            ids = torch.tensor(
                [list(contexts[i]) for i in batch.indices], dtype=torch.long, device=self.device
            )
            last = self.body.forward_rows(ids)[:, -1]
            for r, i in enumerate(batch.indices):
                out[i] = self._head_step(last[r : r + 1], intervention, top_k)
        self._step_extras = step_extras(plan, token_budget)
        return [x for x in out if x is not None]

    def _head_step(self, h: torch.Tensor, intervention: Intervention, top_k: int) -> StepInfo:
        """The lm_head, the gate and the intervention over one final hidden state (1, d)."""
        out = head_step(self.head, h, top_k)
        return StepInfo.from_steps(
            decide(self.head, out.top, out.logits[None], h, intervention, top_k)
        )

    @torch.inference_mode()
    def hidden_states(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int]
    ) -> npt.NDArray[np.float32]:
        """The final normed hidden states that feed the lm_head at output steps 0..len(output_ids)
        of a from-scratch forward over prompt ‖ output_ids (row t predicts output step t), as a
        float32 (len(output_ids) + 1, d) array: what the screening's hidden-state gap compares
        across arms along a shared prefix."""
        h = self.body.forward([*prompt_ids, *output_ids], None, 0)[0, len(prompt_ids) - 1 :]
        return np.asarray(h.float().cpu().numpy(), dtype=np.float32)

    def detokenize(self, ids: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def token_pieces(self, ids: Sequence[int]) -> tuple[Piece, ...] | None:
        return self._pieces(ids) if self._pieces is not None else None

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

    def _decoder(self, context: Sequence[int], total: int) -> Decoder:
        """The decoder for a decode of `context` and `total` tokens (context and new): the
        piecewise one where the cache kind asks for it and it passed its check, a static one
        where the cache kind asks for it and the longest static cache holds them, else a
        dynamic one."""
        if self.cache_kind == "piecewise":
            piecewise = self._piecewise_decoder(context)
            return piecewise if piecewise is not None else DynamicDecoder(self.body, self.head)
        if self.cache_kind == "dynamic" or total > self.max_cache_len:
            return DynamicDecoder(self.body, self.head)
        return self._static_decoder(total)

    def _piecewise_decoder(self, context: Sequence[int]) -> PiecewiseDecoder | None:
        """The engine's piecewise decoder, built and checked against the dynamic path on its
        first decode (`PiecewiseDecoder.check`: hidden states and logits bitwise equal), or None
        (and `_piecewise_error` says why) where the model is not one it follows or the check
        failed."""
        if self._piecewise is None and self._piecewise_error is None:
            try:
                piecewise = PiecewiseDecoder(self.body, self.head)
            except ValueError as exc:
                self._piecewise_error = str(exc)
                return None
            try:
                passed = piecewise.check(context)
            except Exception as exc:  # a transformers version whose pieces do not fit
                self._piecewise_error = f"check raised {type(exc).__name__}: {exc}"
                return None
            if passed:
                self._piecewise = piecewise
            else:
                self._piecewise_error = f"check failed: {piecewise.check_result}"
        return self._piecewise

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
        scan: dict[str, Any] = {**self._scan_extras, **self._step_extras}
        if self.fp8_linear:
            scan["fp8_linear"] = True
        if self.cache_kind in ("dynamic", "piecewise"):
            extras: dict[str, Any] = {
                "kv_cache": "dynamic",
                "cuda_graph": False,
                "static_cache_len": None,
                **scan,
            }
            if self.cache_kind == "piecewise":
                extras.update(self._piecewise_extras())
            return extras
        decoders = list(self._static.values())
        errors = sorted({d.compile_error for d in decoders if d.compile_error})
        extras = {
            "kv_cache": "static",
            "cuda_graph": bool(decoders) and all(d.graph is not None for d in decoders),
            "static_cache_len": self.max_cache_len,
            "static_cache_lens_used": ",".join(str(n) for n in sorted(self._static)),
            "compiled": bool(decoders) and all(d.compiled for d in decoders),
            **scan,
        }
        if self.cache_kind == "compiled":
            extras["compile_mode"] = "default"
            if errors:
                extras["compile_error"] = errors[0][:200]
        return extras

    def _piecewise_extras(self) -> dict[str, Any]:
        """The piecewise path's record: `decoder` is the path that decoded (or decodes next,
        before the first decode), `piecewise_check` the check's outcome, `piecewise_error` why
        the engine decodes dynamically instead."""
        pw = self._piecewise
        if self._piecewise_error is not None:
            return {"decoder": "dynamic", "piecewise_error": self._piecewise_error[:200]}
        extras: dict[str, Any] = {
            "decoder": "piecewise",
            "cuda_graph": pw is not None and bool(pw.graphs),
            "piecewise_check": pw.check_result if pw is not None else None,
        }
        if pw is not None and pw.capture_error is not None:
            extras["capture_error"] = pw.capture_error[:200]
        return extras
