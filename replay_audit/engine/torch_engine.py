"""The torch engine: a local Hugging Face checkpoint in one numerical configuration.

The transformer body is transformers' own (`model.model(...)`, its final norm included); the
lm_head, the top-k and the choice of token are `numerics`' (the margin and the gate are
`diff.step_numerics`'). Three paths run the body:

    decode, faithful (default)  `piecewise.PiecewiseDecoder`: transformers' growing cache with
                                the rest of each step in CUDA graphs (uncaptured off CUDA),
                                checked bitwise against `decoder.DynamicDecoder` on the engine's
                                first decode; that dynamic decode runs where the check fails or
                                the model is not one the pieces follow.
    decode, compiled (opt-in)   `decoder.CompiledDecoder`: static cache, torch.compile, one CUDA
                                graph per step; faster, not bitwise equal to `generate()`.
    scan                        one from-scratch forward per trace (`scan`), several traces per
                                forward (`scan_batch`); the single-step re-runs are the same
                                forward over a context.

At a tensor-parallel degree k > 1 (`tp`: this rank's place in a `tensor_parallel.TpGroup`) the
model is transformers' tensor-parallel one on this rank's device, every rank runs the same probe
(`tensor_parallel.TensorParallelEngine` drives them), the native lm_head is split by vocabulary
and gathered (`numerics.VocabShard`), and the decode runs transformers' dynamic cache: the
piecewise pieces follow an unsharded model, and the compiled path is not built for TP.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from replay_audit.engine.decoder import Body, CompiledDecoder, Decoder, DynamicDecoder
from replay_audit.engine.loading import (
    TORCH_DTYPES,
    apply_sdpa_policy,
    configure_numerics,
    load_model,
    numerical_environment,
    resolve_device,
)
from replay_audit.engine.numerics import (
    LmHead,
    VocabShard,
    decide,
    fp8_supported,
    logged_evidence,
    quantize_body_linears,
    top_k_on_host,
)
from replay_audit.engine.pieces import PieceReader
from replay_audit.engine.piecewise import PiecewiseDecoder
from replay_audit.engine.processors import Processing, Span, StepProcessing, sequence_tensor
from replay_audit.engine.processors import build as build_processing
from replay_audit.engine.protocol import (
    DEFAULT_SCAN_TOKEN_BUDGET,
    DecodeRun,
    DecodeStop,
    DecodeWindow,
    Environment,
    ExtraValue,
    Intervention,
    LoggedEvidence,
    LogitsProcessors,
    ScanItem,
    ScanRun,
    StepInfo,
    Steps,
    Target,
)
from replay_audit.exceptions import UnsupportedFormat
from replay_audit.formats import CacheKind

if TYPE_CHECKING:
    from replay_audit.engine.tensor_parallel import TpPlacement

#: Compiled decoders' cache lengths are powers of two from this up to `max_cache_len`: a decode
#: gets the smallest that holds it, so attention reads (and masks) as few unwritten positions
#: as it can.
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
        cache: CacheKind | None = None,
        max_cache_len: int = 4096,
        weight_dtype: str | None = None,
        tp: TpPlacement | None = None,
    ) -> None:
        apply_sdpa_policy(device)  # no cuDNN attention on CUDA: the decode stays = generate()
        self.model = model
        #: This rank's place in its tensor-parallel group (None: TP 1).
        self.tp = tp
        #: The dtype the weights were stored in before the cast to the compute dtype.
        self.weight_dtype = weight_dtype or target.dtype
        #: Whether the body's linear layers compute in FP8 (`numerics.Fp8Linear`).
        self.fp8_linear = False
        self.tokenizer = tokenizer
        self._pieces = PieceReader(tokenizer) if tokenizer is not None else None
        self.device = device
        self.body = Body(model, target.batch_size, device)
        #: The decode path (`formats.CacheKind`): faithful "piecewise" or opt-in "compiled".
        self.cache_kind: CacheKind = cache or "piecewise"
        #: The compiled path's longest static cache (longer decodes run the faithful path).
        self.max_cache_len = max_cache_len
        #: Compiled decoders by cache length (bucket), each with its own cache and graph.
        self._compiled: dict[int, CompiledDecoder] = {}
        #: The piecewise decoder once built and checked; why it is not used, if it is not.
        self._piecewise: PiecewiseDecoder | None = None
        self._piecewise_error: str | None = None
        if tp is not None:
            self._piecewise_error = (
                f"tensor parallel (TP {tp.degree}): the pieces follow an unsharded model, so "
                "the decode runs transformers' dynamic cache"
            )
        #: One decode at a time: the decoders (their buffers, caches and graphs) are the
        #: engine's, reused by every decode, and a pool hands one engine to every thread.
        self._decoding = threading.Lock()
        body_dtype = TORCH_DTYPES[target.dtype]
        self.head = _lm_head(model, target.head_dtype, body_dtype, tp)
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
        self._scan_extras: dict[str, ExtraValue] = {}
        #: What the last batched single-step re-runs recorded (their batch shapes).
        self._step_extras: dict[str, ExtraValue] = {}

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
        tp: TpPlacement | None = None,
    ) -> TorchEngine:
        """Set the numerical flags, then load `model_dir` in `target`'s format. `cache`: the
        decode path (`formats.CacheKind`; None: "piecewise", the faithful one; "compiled" for
        the fastest decode on CUDA, not token-identical to `generate()`).
        `weight_dtype`: the storage dtype when it differs from the compute dtype
        (`loading.load_model`). `fp8_linear`: every linear layer of the body in FP8-E4M3
        (`numerics.Fp8Linear`; a CUDA GPU of compute capability >= 8.9).
        `tp`: this rank's place in a tensor-parallel group whose process group it has joined
        (the model is loaded with transformers' plan, on the rank's device; `device` is not
        read): called on every rank alike (`tensor_parallel.TensorParallelEngine.load`)."""
        if tp is not None and (fp8_linear or cache == "compiled"):
            what = "fp8 linear layers" if fp8_linear else "the compiled decode"
            raise UnsupportedFormat(f"{what} are not built for tensor parallel (TP {tp.degree})")
        configure_numerics(deterministic=deterministic, tf32=tf32)
        dev = tp.device if tp is not None else resolve_device(device)
        if fp8_linear:
            ok, why = fp8_supported(dev, "fp8 linear layers")
            if not ok:
                raise UnsupportedFormat(why)
        model, tokenizer = load_model(
            model_dir, target.dtype, target.attn_kernel, dev, weight_dtype=weight_dtype, tp=tp
        )
        if fp8_linear:
            quantize_body_linears(model.model, TORCH_DTYPES[target.dtype])
        engine = cls(
            model,
            tokenizer,
            target,
            dev,
            cache=cache,
            max_cache_len=max_cache_len,
            weight_dtype=weight_dtype,
            tp=tp,
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

    def environment(self) -> Environment:
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
            tp_degree=self.tp.degree if self.tp is not None else 1,
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
        processors: LogitsProcessors | None = None,
        window: DecodeWindow | None = None,
    ) -> DecodeRun:
        iv = intervention or self._target.intervention
        eos = set(eos_ids)
        out = [int(x) for x in forced_prefix]
        start = len(out)
        differs = window.first_difference(out, None) if window is not None else None
        stop: DecodeStop
        if start >= max_new_tokens or (out and out[-1] in eos):
            stop = "eos" if out and out[-1] in eos else "length"
            return DecodeRun(out, Steps.empty(top_k), start, stop)
        if window is not None and window.reached(differs, start):
            return DecodeRun(out, Steps.empty(top_k), start, "window")
        context = [*prompt_ids, *out]
        parts: list[Steps] = []
        stop = "length"
        processing = self._processing(processors, len(prompt_ids))
        sequence = None
        if processing is not None:  # prompt ‖ output, written as tokens come
            sequence = torch.zeros(
                (1, len(prompt_ids) + max_new_tokens), dtype=torch.long, device=self.device
            )
            sequence[0, : len(context)] = torch.tensor(context, dtype=torch.long)
        with self._decoding:
            decoder = self._decoder(context, len(context) + max_new_tokens - start)
            step = decoder.prefill(context, top_k)
            while True:
                z32, top, process = step.logits[None], step.top, None
                if processing is not None and sequence is not None:
                    process = StepProcessing([Span(0, 1, processing, sequence, len(out))])
                    z32 = process(z32)
                    top = top_k_on_host(z32, top_k)
                chosen = decide(self.head, top, z32, step.hidden[:1], iv, top_k, process)
                parts.append(chosen)
                token = int(chosen.token_ids[0])
                out.append(token)
                if sequence is not None and len(prompt_ids) + len(out) <= sequence.shape[1]:
                    sequence[0, len(prompt_ids) + len(out) - 1] = token
                if token in eos:
                    stop = "eos"
                    break
                if len(out) >= max_new_tokens:
                    break
                if window is not None:
                    differs = window.first_difference(out, differs, len(out) - 1)
                    if window.reached(differs, len(out)):
                        stop = "window"
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
        *,
        processors: LogitsProcessors | None = None,
    ) -> ScanRun:
        iv = intervention or self._target.intervention
        n_out = len(output_ids)
        if n_out == 0:
            return ScanRun(Steps.empty(top_k), np.zeros(0, bool), LoggedEvidence.empty())
        context = [*prompt_ids, *output_ids[:-1]]
        # Position p's hidden state predicts token p + 1: output step t is at len(prompt) - 1 + t.
        hs = self.body.forward(context, None, 0)[0, len(prompt_ids) - 1 :]
        process = self._scan_processing([(0, ScanItem(prompt_ids, output_ids, processors))])
        steps, evidence = self._scan_steps(hs, output_ids, iv, top_k, process)
        agrees = np.asarray(steps.token_ids == np.asarray(output_ids), dtype=bool)
        return ScanRun(steps, agrees, evidence)

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
            logged = np.concatenate([np.asarray(m.output_ids, dtype=np.int64) for m in members])
            process = self._scan_processing(
                [(int(packed.row_steps[r]), m) for r, m in enumerate(members)]
            )
            steps, evidence = self._scan_packed(packed, logged, iv, top_k, process)
            for r, (i, item) in enumerate(zip(batch.indices, members, strict=True)):
                start, stop = int(packed.row_steps[r]), int(packed.row_steps[r + 1])
                s = steps.slice(start, stop)
                agrees = np.asarray(s.token_ids == np.asarray(item.output_ids), dtype=bool)
                runs[i] = ScanRun(s, agrees, evidence.slice(start, stop))
        self._scan_extras = scan_extras(plan, token_budget)
        empty = ScanRun(Steps.empty(top_k), np.zeros(0, bool), LoggedEvidence.empty())
        return [run if run is not None else empty for run in runs]

    @torch.inference_mode()
    def step(
        self,
        prompt_ids: Sequence[int],
        prefix_ids: Sequence[int],
        intervention: Intervention,
        top_k: int = 5,
        *,
        processors: LogitsProcessors | None = None,
    ) -> StepInfo:
        context = [*prompt_ids, *prefix_ids]
        h = self.body.forward(context, None, 0)[:, -1]
        process = self._context_processing(processors, context, len(prompt_ids))
        return StepInfo.from_steps(self._choose(h[:1], intervention, top_k, process))

    @torch.inference_mode()
    def step_batch(
        self,
        contexts: Sequence[Sequence[int]],
        intervention: Intervention,
        top_k: int = 5,
        *,
        token_budget: int = DEFAULT_SCAN_TOKEN_BUDGET,
        processors: LogitsProcessors | None = None,
        prompt_lengths: Sequence[int] | None = None,
    ) -> list[StepInfo]:
        """`step` of each context, the body batched: contexts of one length share a forward,
        unpadded (`batch.plan_steps`), then each row's last hidden state goes through the
        lm_head and `intervention` alone, as `step`'s does (a head product over many rows may
        sum in another order: on this CPU fp32 rows differ by an ulp). An engine whose target
        decodes among copies (`batch_size` > 1) runs `step` one context at a time: its step's
        batch is the copies. The shapes go into `environment()["extras"]`
        (`step_batch_shapes`). With `processors`, each context's logits go through them after
        its own prompt (`prompt_lengths`)."""
        active = processors is not None and processors.active
        if active and (prompt_lengths is None or len(prompt_lengths) != len(contexts)):
            raise ValueError("step_batch: logits processors need each context's prompt length")
        lengths = list(prompt_lengths) if prompt_lengths is not None else [len(c) for c in contexts]
        if self.body.batch_size != 1:
            return [
                self.step(c[:n], c[n:], intervention, top_k, processors=processors)
                for c, n in zip(contexts, lengths, strict=True)
            ]
        plan = plan_steps([len(c) for c in contexts], token_budget)
        out: list[StepInfo | None] = [None] * len(contexts)
        for batch in plan:
            ids = torch.tensor(
                [list(contexts[i]) for i in batch.indices], dtype=torch.long, device=self.device
            )
            last = self.body.forward_rows(ids)[:, -1]
            for r, i in enumerate(batch.indices):
                process = self._context_processing(processors, contexts[i], lengths[i])
                chosen = self._choose(last[r : r + 1], intervention, top_k, process)
                out[i] = StepInfo.from_steps(chosen)
        self._step_extras = step_extras(plan, token_budget)
        return [x for x in out if x is not None]

    def _choose(
        self,
        hs: torch.Tensor,
        intervention: Intervention,
        top_k: int,
        process: StepProcessing | None = None,
    ) -> Steps:
        """The lm_head, the logits processors, top-k, gate and intervention over M steps' final
        hidden states (M, d): what a scan, a batched scan and a single-step re-run choose (a
        decode step: `decode`)."""
        z32 = self.head.native_steps(hs)
        if process is not None:
            z32 = process(z32)
        return decide(self.head, top_k_on_host(z32, top_k), z32, hs, intervention, top_k, process)

    # -- logits processors ---------------------------------------------------------------------

    def _processing(
        self, processors: LogitsProcessors | None, prompt_length: int
    ) -> Processing | None:
        """The trace's processors built for its prompt, or None where none run."""
        if processors is None or not processors.active:
            return None
        return build_processing(processors, prompt_length, self.tokenizer, self.vocab_size)

    def _context_processing(
        self, processors: LogitsProcessors | None, context: Sequence[int], prompt_length: int
    ) -> StepProcessing | None:
        """The processing of one step after `context` (a single-step re-run), or None."""
        processing = self._processing(processors, prompt_length)
        if processing is None:
            return None
        sequence = sequence_tensor(context, self.device)
        return StepProcessing([Span(0, 1, processing, sequence, len(context) - prompt_length)])

    def _scan_processing(self, members: Sequence[tuple[int, ScanItem]]) -> StepProcessing | None:
        """The processing of a scan's rows: each (first row, item) whose item has processors
        gets its output steps' rows, after prompt ‖ output[:t]; None where no item has any."""
        spans = []
        for start, item in members:
            processing = self._processing(item.processors, len(item.prompt_ids))
            if processing is not None:
                sequence = sequence_tensor([*item.prompt_ids, *item.output_ids], self.device)
                spans.append(Span(start, start + len(item.output_ids), processing, sequence))
        return StepProcessing(spans) if spans else None

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

    def _scan_packed(
        self,
        packed: PackedBatch,
        logged: npt.NDArray[np.int64],
        iv: Intervention,
        top_k: int,
        process: StepProcessing | None,
    ) -> tuple[Steps, LoggedEvidence]:
        """One forward of a batched scan: the steps of all its rows, row after row, and the
        evidence of their `logged` tokens (the rows' outputs, concatenated)."""
        ids = torch.from_numpy(packed.input_ids).to(self.device)
        # The causal mask alone keeps right padding unread (`batch`): no padding mask.
        hidden = self.body.forward_rows(ids)
        positions = torch.from_numpy(packed.output_positions).to(self.device)
        # Only the real output positions' hidden states go on: padding's are never read.
        hs = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        return self._scan_steps(hs, logged, iv, top_k, process)

    def _scan_steps(
        self,
        hs: torch.Tensor,
        logged: Sequence[int] | npt.NDArray[np.int64],
        iv: Intervention,
        top_k: int,
        process: StepProcessing | None = None,
    ) -> tuple[Steps, LoggedEvidence]:
        """`_choose` of a scan's steps, and from the same (processed) logits the evidence of
        the logged tokens (`numerics.logged_evidence`)."""
        z32 = self.head.native_steps(hs)
        if process is not None:
            z32 = process(z32)
        steps = decide(self.head, top_k_on_host(z32, top_k), z32, hs, iv, top_k, process)
        ids = torch.as_tensor(np.asarray(logged, dtype=np.int64), device=z32.device)
        packed = logged_evidence(z32, ids)
        return steps, LoggedEvidence(packed[:, 0].astype(np.float32), packed[:, 1].astype(np.int64))

    def _decoder(self, context: Sequence[int], total: int) -> Decoder:
        """The decoder for a decode of `context` and `total` tokens (context and new): a
        compiled one where the path is "compiled" and its longest cache holds them; else the
        piecewise one if it passed its check, else a dynamic one."""
        if self.cache_kind == "compiled" and total <= self.max_cache_len:
            return self._compiled_decoder(total)
        piecewise = self._piecewise_decoder(context)
        return piecewise if piecewise is not None else DynamicDecoder(self.body, self.head)

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

    def _compiled_decoder(self, total: int) -> CompiledDecoder:
        """The compiled decoder whose cache length is the smallest bucket holding `total`."""
        length = MIN_STATIC_BUCKET
        while length < total:
            length *= 2
        length = min(length, self.max_cache_len)
        if length not in self._compiled:
            self._compiled[length] = CompiledDecoder(self.body, self.head, length)
        return self._compiled[length]

    def _extras(self) -> dict[str, ExtraValue]:
        """Which decode path ran (`decoder`: piecewise, dynamic or compiled), with its record:
        the piecewise check's outcome, or why the faithful path decodes dynamically; the
        compiled path's cache lengths so far, its CUDA graph and whether it compiled; after a
        batched scan or batched re-runs, their batch shapes (`batch.scan_extras`)."""
        extras: dict[str, ExtraValue] = {**self._scan_extras, **self._step_extras}
        if self.tp is not None:
            extras.update(tp_plan="auto", tp_backend=self.tp.backend)
        if self.fp8_linear:
            extras["fp8_linear"] = True
        if self.cache_kind == "compiled":
            decoders = list(self._compiled.values())
            errors = sorted({d.compile_error for d in decoders if d.compile_error})
            extras.update(
                kv_cache="static",
                decoder="compiled",
                cuda_graph=bool(decoders) and all(d.graph is not None for d in decoders),
                static_cache_len=self.max_cache_len,
                static_cache_lens_used=",".join(str(n) for n in sorted(self._compiled)),
                compiled=bool(decoders) and all(d.compiled for d in decoders),
                compile_mode="default",
            )
            if errors:
                extras["compile_error"] = errors[0][:200]
            return extras
        pw = self._piecewise
        extras.update(kv_cache="dynamic", decoder="piecewise", cuda_graph=False)
        if self._piecewise_error is not None:
            extras.update(decoder="dynamic", piecewise_error=self._piecewise_error[:200])
        elif pw is not None:
            extras.update(cuda_graph=bool(pw.graphs), piecewise_check=pw.check_result)
            if pw.capture_error is not None:
                extras["capture_error"] = pw.capture_error[:200]
        return extras


def _lm_head(model: Any, fmt: str, body_dtype: torch.dtype, tp: TpPlacement | None) -> LmHead:
    """The engine's lm_head over the model's output embedding. At TP > 1 transformers split it
    by vocabulary (a DTensor): the whole weight is gathered once here (every rank loads alike,
    so the collective matches) for B and C, and the native product stays split (`VocabShard`)."""
    weight = model.get_output_embeddings().weight
    if tp is None:
        return LmHead(weight, fmt, body_dtype)
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    whole = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
    shard = VocabShard(tp.rank, tp.degree, int(whole.shape[0]))
    if int(local.shape[0]) != shard.stop - shard.start:
        raise UnsupportedFormat(
            f"transformers split the lm_head {local.shape[0]} rows to rank {tp.rank}, not the "
            f"{shard.stop - shard.start} the engine's gather expects"
        )
    return LmHead(whole, fmt, body_dtype, shard=shard)
