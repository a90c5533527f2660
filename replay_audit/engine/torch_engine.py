"""The torch engine: a local Hugging Face checkpoint in one numerical configuration.

The transformer body is transformers' own; the lm_head, the top-k and the choice of token are
`numerics`' (the margin and the gate are `diff.step_numerics`'). Every probe runs under the
arm's process-wide switches (`loading.ProcessNumerics`: only those the arm names, put back
after) and records the SDPA backends torch picked (`attention.observe`). The paths:

    decode, faithful (default)  `piecewise.PiecewiseDecoder`: transformers' own `generate()`
                                prefill, then its steps with the rest of each step in CUDA
                                graphs (uncaptured off CUDA), checked call for call and bit
                                for bit against `decoder.GenerateDecoder` on the engine's first
                                decode; `generate()` itself decodes where the check fails, the
                                model is not one the pieces follow, or the batch is a logged
                                left-padded layout.
    decode, compiled (opt-in)   `decoder.CompiledDecoder`: static cache, torch.compile, one CUDA
                                graph per step; faster, not bitwise equal to `generate()`.
    single-step re-runs         `generate()` of one token from the context (`step`); contexts
                                of one length together, one row each (`step_batch`).
    scan                        one from-scratch forward per trace (`scan`), several traces per
                                forward (`scan_batch`).

At TP k > 1 (`tp`: this rank's place in a `tensor_parallel.TpGroup`; docs/engine.md "Tensor
parallel") the decode is `generate()`'s: the pieces follow an unsharded model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

import replay_audit
from replay_audit.diff.pieces import Piece
from replay_audit.engine import attention
from replay_audit.engine.batch import (
    PackedBatch,
    bucket_length,
    pack_batch,
    plan_rows,
    plan_scan,
    plan_steps,
    scan_extras,
    step_extras,
)
from replay_audit.engine.decoder import (
    Body,
    CompiledDecoder,
    Decoder,
    GenerateDecoder,
    StepOutput,
    batch_rows,
)
from replay_audit.engine.loading import (
    TORCH_DTYPES,
    ProcessNumerics,
    load_model,
    numerical_environment,
    resolve_device,
)
from replay_audit.engine.numerics import (
    HostTopK,
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
    BatchLayout,
    DecodeRequest,
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
from replay_audit.engine.sampling import draw_evidence, noise
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
        max_cache_len: int = 4096,
        tp: TpPlacement | None = None,
    ) -> None:
        attention.install()  # observe which SDPA backend each probe's calls get
        self.model = model
        #: This rank's place in its tensor-parallel group (None: TP 1).
        self.tp = tp
        self.tokenizer = tokenizer
        self._pieces = PieceReader(tokenizer) if tokenizer is not None else None
        self.device = device
        self.body = Body(model, target.batch_size, device)
        self.numerics = ProcessNumerics(target.deterministic, target.tf32, target.sdpa_backend)
        self.cache_kind: CacheKind = target.kv_cache or "piecewise"
        #: The compiled path's longest static cache (longer decodes run the faithful path).
        self.max_cache_len = max_cache_len
        #: Compiled decoders by cache length, each with its own cache and graph.
        self._compiled: dict[int, CompiledDecoder] = {}
        self.head = _lm_head(model, target.head_dtype, TORCH_DTYPES[target.dtype], tp)
        kernel = str(getattr(model.config, "_attn_implementation", None) or "eager")
        # The target as it actually runs: the attention kernel in use, not the one asked for.
        self._target = dataclasses.replace(target, attn_kernel=kernel, kv_cache=self.cache_kind)
        pad = getattr(model.config, "pad_token_id", None)
        pad_id = int(pad) if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        #: The reference decode and the single-step re-runs (the model's own lm_head gives the
        #: logits where the arm's head format is the body's).
        self.generate = GenerateDecoder(
            self.body,
            self.head,
            own_head=target.head_dtype == target.dtype and not target.fp8_linear,
            pad_id=pad_id,
        )
        #: The piecewise decoder once built and checked; else why not.
        self._piecewise: PiecewiseDecoder | None = None
        self._piecewise_error: str | None = None
        if tp is not None:
            self._piecewise_error = (
                f"tensor parallel (TP {tp.degree}): the pieces follow an unsharded model, so "
                "the decode is generate()'s"
            )
        self._decoders: set[str] = set()
        self._attention = attention.Observed()
        #: The token written at padded positions of a batched scan. No real position reads it
        #: (tests/engine/test_engine_torch_scan_batch.py changes it and gets the same bits).
        self.scan_pad_id = pad_id
        #: The batch shapes of the last batched scan and batched re-runs (`environment()`).
        self._scan_extras: dict[str, ExtraValue] = {}
        self._step_extras: dict[str, ExtraValue] = {}

    @classmethod
    def load(
        cls,
        model_dir: Path,
        target: Target,
        *,
        device: str | None = None,
        cache: CacheKind | None = None,
        max_cache_len: int = 4096,
        tp: TpPlacement | None = None,
    ) -> TorchEngine:
        """Load `model_dir` in `target`'s format (`loading.load_model`). Nothing process-wide is
        set: the probes run under the target's switches. `cache`: the decode path where the
        target names none (`LoadOptions`). `tp`: this rank's place in a group whose process
        group it has joined (`device` is not read), called on every rank alike."""
        if target.kv_cache is None and cache is not None:
            target = dataclasses.replace(target, kv_cache=cache)
        if tp is not None and (target.fp8_linear or target.kv_cache == "compiled"):
            what = "fp8 linear layers" if target.fp8_linear else "the compiled decode"
            raise UnsupportedFormat(f"{what} are not built for tensor parallel (TP {tp.degree})")
        dev = tp.device if tp is not None else resolve_device(device)
        if target.fp8_linear:
            ok, why = fp8_supported(dev, "fp8 linear layers")
            if not ok:
                raise UnsupportedFormat(why)
        model, tokenizer = load_model(
            model_dir,
            target.dtype,
            target.attn_kernel,
            dev,
            weight_dtype=target.weight_dtype,
            tp=tp,
        )
        if target.fp8_linear:
            quantize_body_linears(model.model, TORCH_DTYPES[target.dtype])
        return cls(model, tokenizer, target, dev, max_cache_len=max_cache_len, tp=tp)

    # -- the protocol -------------------------------------------------------------------------

    @property
    def target(self) -> Target:
        return self._target

    @property
    def vocab_size(self) -> int:
        return self.head.vocab_size

    @property
    def max_positions(self) -> int | None:
        n = getattr(self.model.config, "max_position_embeddings", None)
        return int(n) if isinstance(n, int) else None

    def environment(self) -> Environment:
        t = self._target
        return numerical_environment(
            dtype=t.dtype,
            lm_head_dtype=t.head_dtype,
            weight_dtype=t.weight_dtype or t.dtype,
            device=self.device,
            attn_kernel=t.attn_kernel or "eager",
            batch_size=t.batch_size,
            engine_name="replay-audit",
            engine_version=replay_audit.__version__,
            tp_degree=self.tp.degree if self.tp is not None else 1,
            numerics=self.numerics,
            extras={**self._extras(), "torch_threads": torch.get_num_threads()},
        )

    @contextlib.contextmanager
    def _probe(self) -> Iterator[None]:
        """A probe of this arm: under its switches (one probe at a time in the process), its
        SDPA calls observed."""
        with self.numerics.applied(), attention.observe() as seen:
            yield
        self._attention.merge(seen)

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
        layout: BatchLayout | None = None,
    ) -> DecodeRun:
        request = DecodeRequest(prompt_ids, max_new_tokens, eos_ids, forced_prefix, window, layout)
        row = _RowDecode(self, request, intervention or self._target.intervention, top_k)
        if row.done is None:
            processing = self._processing(processors, len(prompt_ids))
            if processing is not None:
                row.process(processing)
            with self._probe():
                decoder = self._decoder(row.context, row.total, layout)
                decoder.run(row.context, row.new_tokens, row.choose, top_k, layout)
        return row.result()

    @torch.inference_mode()
    def decode_batch(
        self,
        requests: Sequence[DecodeRequest],
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        processors: LogitsProcessors | None = None,
    ) -> list[DecodeRun]:
        """`Engine.decode_batch`: the rows of one logged batch (`batch.plan_rows`) run together
        through `generate()` (the decode a lone row of a padded layout gets; the piecewise
        decode of an unpadded one is checked bitwise against it); logits processors, the
        compiled path and tensor parallel decode one by one."""
        iv = intervention or self._target.intervention
        rows = [_RowDecode(self, r, iv, top_k) for r in requests]
        alone = (processors is not None and processors.active) or self.tp is not None
        alone = alone or self.cache_kind == "compiled"
        keys = [
            None if alone or row.done is not None else row.batch_key(self.body.batch_size)
            for row in rows
        ]
        plan = plan_rows(keys)
        for members in plan.together:
            self._decode_rows([rows[i] for i in members], top_k)
        for i in plan.alone:
            r = requests[i]
            rows[i].run = self.decode(
                r.prompt_ids,
                r.max_new_tokens,
                r.eos_ids,
                iv,
                top_k,
                forced_prefix=r.forced_prefix,
                processors=processors,
                window=r.window,
                layout=r.layout,
            )
        return [row.result() for row in rows]

    def _decode_rows(self, rows: Sequence[_RowDecode], top_k: int) -> None:
        """One `generate()` of a logged batch whose rows `rows` are (each at its layout's row;
        the batch's other rows filler as `decoder.batch_rows` makes them)."""
        first = rows[0]
        layout = first.layout
        for row in rows:
            row.rows = len(rows)
        assert layout is not None
        ids, mask, _ = batch_rows(first.context, layout.size, layout, self.generate.pad_id)
        for row in rows:
            assert row.layout is not None
            ids[row.layout.row] = ids[row.layout.row][: -len(row.context)] + list(row.context)
        at = {row.layout.row: row for row in rows if row.layout is not None}
        tokens = [int(ids[j][-1]) for j in range(len(ids))]  # filler rows: any token

        def choose(hidden: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], bool]:
            active = [j for j, row in at.items() if not row.stopped]
            top = top_k_on_host(logits[active], top_k)  # one copy for every row
            for r, j in enumerate(active):
                one = HostTopK(top.ids[r : r + 1], top.logits[r : r + 1], top.native[r : r + 1])
                tokens[j], _ = at[j].choose(StepOutput(hidden[j : j + 1], logits[j], one))
            return tokens, all(row.stopped for row in rows)

        with self._probe():
            self.generate.run_each(ids, mask, max(row.new_tokens for row in rows), choose)
        self._decoders.add("generate")

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
        if len(output_ids) == 0:
            return ScanRun(Steps.empty(top_k), np.zeros(0, bool), LoggedEvidence.empty())
        context = [*prompt_ids, *output_ids[:-1]]
        process = self._scan_processing([(0, ScanItem(prompt_ids, output_ids, processors))])
        with self._probe():
            # Position p's hidden state predicts token p + 1: output step t is at
            # len(prompt) - 1 + t.
            hs = self.body.forward(context, None, 0)[0, len(prompt_ids) - 1 :]
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
        """`Engine.scan_batch`. The rows are other traces, not copies of one:
        `Target.batch_size` is the decode's and `scan`'s."""
        iv = intervention or self._target.intervention
        items = list(items)
        plan = plan_scan(items, token_budget)
        runs: list[ScanRun | None] = [None] * len(items)
        for batch in plan:
            members = [items[i] for i in batch.indices]
            packed = pack_batch(members, batch.padded_length, self.scan_pad_id)
            logged = np.concatenate([np.asarray(m.output_ids, dtype=np.int64) for m in members])
            rows = [(int(packed.row_steps[r]), m) for r, m in enumerate(members)]
            process = self._scan_processing(rows)
            draws = [(start, m) for start, m in rows if m.sampling is not None]
            with self._probe():
                steps, evidence = self._scan_packed(packed, logged, iv, top_k, process, draws)
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
        layout: BatchLayout | None = None,
    ) -> StepInfo:
        """The arm's `generate()` of one token from prompt ‖ prefix (its batch: copies, or the
        logged `layout`), its choice made as a decode step's."""
        context = [*prompt_ids, *prefix_ids]
        process = self._context_processing(processors, context, len(prompt_ids))
        chosen: list[Steps] = []

        def choose(out: StepOutput) -> tuple[int, bool]:
            chosen.append(self._decide(out.logits[None], out.hidden, intervention, top_k, process))
            return int(chosen[0].token_ids[0]), True

        with self._probe():
            self.generate.run(context, 1, choose, top_k, layout)
        return StepInfo.from_steps(chosen[0])

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
        layouts: Sequence[BatchLayout | None] | None = None,
    ) -> list[StepInfo]:
        """`Engine.step_batch`, each row's choice made alone. A target that decodes among copies
        (`batch_size` > 1), and a context with a logged padded layout, runs `step` alone: its
        step's batch is the copies or the layout."""
        active = processors is not None and processors.active
        if active and (prompt_lengths is None or len(prompt_lengths) != len(contexts)):
            raise ValueError("step_batch: logits processors need each context's prompt length")
        lengths = list(prompt_lengths) if prompt_lengths is not None else [len(c) for c in contexts]
        laid = list(layouts) if layouts is not None else [None] * len(contexts)
        out: list[StepInfo | None] = [None] * len(contexts)
        rest = []  # the contexts batched; the others run `step` alone
        for i, layout in enumerate(laid):
            if self.body.batch_size == 1 and (layout is None or not layout.padded):
                rest.append(i)
                continue
            c, n = contexts[i], lengths[i]
            out[i] = self.step(
                c[:n], c[n:], intervention, top_k, processors=processors, layout=layout
            )
        plan = plan_steps([len(contexts[i]) for i in rest], token_budget)
        for batch in plan:
            members = [rest[j] for j in batch.indices]

            def choose(hidden: torch.Tensor, logits: torch.Tensor, _row: int) -> tuple[int, bool]:
                for r, i in enumerate(members):  # noqa: B023 (called within this iteration)
                    process = self._context_processing(processors, contexts[i], lengths[i])
                    z32 = logits[r : r + 1]
                    chosen = self._decide(z32, hidden[r : r + 1], intervention, top_k, process)
                    out[i] = StepInfo.from_steps(chosen)
                return 0, True

            rows = [list(contexts[i]) for i in members]
            with self._probe():
                self.generate.run_rows(rows, [[1] * len(r) for r in rows], 0, 1, choose)
        if plan:
            self._step_extras = step_extras(plan, token_budget)
        return [x for x in out if x is not None]

    def _decide(
        self,
        z32: torch.Tensor,
        hs: torch.Tensor,
        intervention: Intervention,
        top_k: int,
        process: StepProcessing | None = None,
    ) -> Steps:
        """`numerics.decide` over M steps' logits (M, V), processed first."""
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
        """`HiddenStates.hidden_states`, under the arm's switches."""
        with self._probe():
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
        draws: Sequence[tuple[int, ScanItem]] = (),
    ) -> tuple[Steps, LoggedEvidence]:
        """One forward of a batched scan: its rows' steps, concatenated, and their evidence."""
        ids = torch.from_numpy(packed.input_ids).to(self.device)
        # The causal mask alone keeps right padding unread (`batch`): no padding mask.
        hidden = self.body.forward_rows(ids)
        positions = torch.from_numpy(packed.output_positions).to(self.device)
        # Only the real output positions' hidden states go on: padding's are never read.
        hs = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        return self._scan_steps(hs, logged, iv, top_k, process, draws)

    def _scan_steps(
        self,
        hs: torch.Tensor,
        logged: Sequence[int] | npt.NDArray[np.int64],
        iv: Intervention,
        top_k: int,
        process: StepProcessing | None = None,
        draws: Sequence[tuple[int, ScanItem]] = (),
    ) -> tuple[Steps, LoggedEvidence]:
        """A scan's steps, and from the same (processed) logits the logged tokens' evidence;
        `draws`: the (first row, item) of each sampled item, whose rows are measured against
        the reference's own draws (`engine.sampling`)."""
        z32 = self.head.native_steps(hs)
        if process is not None:
            z32 = process(z32)
        steps = decide(self.head, top_k_on_host(z32, top_k), z32, hs, iv, top_k, process)
        ids = torch.as_tensor(np.asarray(logged, dtype=np.int64), device=z32.device)
        packed = logged_evidence(z32, ids)
        logits, ranks = packed[:, 0].astype(np.float32), packed[:, 1].astype(np.int64)
        if not draws:
            return steps, LoggedEvidence(logits, ranks)
        deficits = np.full(len(ranks), np.nan)
        drawn = np.full(len(ranks), -1, dtype=np.int64)
        drawn_logits = np.full(len(ranks), np.nan, dtype=np.float32)
        for start, item in draws:
            assert item.sampling is not None
            stop = start + len(item.output_ids)
            q = noise(item.sampling, stop - start, z32.shape[-1], z32.device)
            e = draw_evidence(z32[start:stop], ids[start:stop], q, item.sampling.recipe)
            deficits[start:stop] = e.deficit.cpu().numpy()
            drawn[start:stop] = e.drawn.cpu().numpy()
            drawn_logits[start:stop] = e.drawn_logit.float().cpu().numpy()
            ranks[start:stop] = e.rank.cpu().numpy()
        return steps, LoggedEvidence(logits, ranks, deficits, drawn, drawn_logits)

    def _decoder(self, context: Sequence[int], total: int, layout: BatchLayout | None) -> Decoder:
        """The decoder for `total` tokens (context and new): compiled where asked and its cache
        holds them, else piecewise if it passed its check, else `generate()` (which alone
        follows a logged left-padded layout)."""
        decoder: Decoder = self.generate
        name = "generate"
        padded = layout is not None and layout.padded
        if not padded and self.cache_kind == "compiled" and total <= self.max_cache_len:
            decoder, name = self._compiled_decoder(total), "compiled"
        elif not padded and (piecewise := self._piecewise_decoder(context)) is not None:
            decoder, name = piecewise, "piecewise"
        self._decoders.add(name)
        return decoder

    def _piecewise_decoder(self, context: Sequence[int]) -> PiecewiseDecoder | None:
        """The piecewise decoder, checked on the first decode (`PiecewiseDecoder.check`), or None
        (`_piecewise_error` says why)."""
        if self._piecewise is None and self._piecewise_error is None:
            try:
                piecewise = PiecewiseDecoder(self.body, self.head, self.generate)
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
        length = min(bucket_length(total, MIN_STATIC_BUCKET), self.max_cache_len)
        if length not in self._compiled:
            self._compiled[length] = CompiledDecoder(self.body, self.head, length)
        return self._compiled[length]

    def _extras(self) -> dict[str, ExtraValue]:
        """What ran (docs/engine.md lists the keys); `decoder` before any decode: the path the
        next one takes."""
        extras: dict[str, ExtraValue] = {**self._scan_extras, **self._step_extras}
        backends = self._attention.backends()
        if backends is not None:
            extras["attention_backends"] = backends
        if self.tp is not None:
            extras.update(tp_plan="auto", tp_backend=self.tp.backend)
        if self._target.fp8_linear:
            extras["fp8_linear"] = True
        planned = "compiled" if self.cache_kind == "compiled" else "piecewise"
        if planned == "piecewise" and self._piecewise_error is not None:
            planned = "generate"
        decoders = ",".join(sorted(self._decoders)) if self._decoders else planned
        extras.update(decoder=decoders, cuda_graph=False)
        extras["kv_cache"] = "static" if decoders == "compiled" else "dynamic"
        if "compiled" in self._decoders or planned == "compiled":
            compiled = list(self._compiled.values())
            errors = sorted({d.compile_error for d in compiled if d.compile_error})
            extras.update(
                cuda_graph=bool(compiled) and all(d.graph is not None for d in compiled),
                static_cache_len=self.max_cache_len,
                static_cache_lens_used=",".join(str(n) for n in sorted(self._compiled)),
                compiled=bool(compiled) and all(d.compiled for d in compiled),
                compile_mode="default",
            )
            if errors:
                extras["compile_error"] = errors[0][:200]
        pw = self._piecewise
        if self._piecewise_error is not None:
            extras["piecewise_error"] = self._piecewise_error[:200]
        elif pw is not None:
            extras.update(cuda_graph=bool(pw.graphs), piecewise_check=pw.check_result)
            if pw.capture_error is not None:
                extras["capture_error"] = pw.capture_error[:200]
        return extras


class _RowDecode:
    """One greedy decode's state (`TorchEngine.decode`, or a row of `decode_batch`): the output
    so far, each step's record, and why it stopped. `choose` takes each step's output and says
    which token the row takes and whether the decode stops after it; `done` is the run where
    nothing is left to decode."""

    def __init__(
        self, engine: TorchEngine, request: DecodeRequest, iv: Intervention, top_k: int
    ) -> None:
        self.engine, self.iv, self.top_k = engine, iv, top_k
        self.prompt = list(request.prompt_ids)
        self.max_new_tokens = request.max_new_tokens
        self.eos = set(request.eos_ids)
        self.window = request.window
        self.layout = request.layout
        self.out = [int(x) for x in request.forced_prefix]
        self.start = len(self.out)
        self.parts: list[Steps] = []
        self.stop: DecodeStop = "length"
        self.stopped = False
        self.rows = 1  # of its logged batch, decoded in the same run
        self.sequence: torch.Tensor | None = None
        self.processing: Processing | None = None
        #: The run, where it is known without decoding (or was decoded alone).
        self.run: DecodeRun | None = None
        w, out = self.window, self.out
        self.differs = w.first_difference(out, None) if w is not None else None
        if self.start >= self.max_new_tokens or (out and out[-1] in self.eos):
            stop: DecodeStop = "eos" if out and out[-1] in self.eos else "length"
            self.run = DecodeRun(out, Steps.empty(top_k), self.start, stop)
        elif w is not None and w.reached(self.differs, self.start):
            self.run = DecodeRun(out, Steps.empty(top_k), self.start, "window")

    @property
    def done(self) -> DecodeRun | None:
        return self.run

    @property
    def context(self) -> list[int]:
        return [*self.prompt, *self.out[: self.start]]

    @property
    def new_tokens(self) -> int:
        return self.max_new_tokens - self.start

    @property
    def total(self) -> int:
        """The tokens the decode's cache holds at most: context and new."""
        return len(self.prompt) + self.max_new_tokens

    def batch_key(self, batch_size: int) -> tuple[tuple[int, ...], int, int] | None:
        """Which logged batch the row replays in (`batch.plan_rows`): the layout's prompt
        lengths, the tokens past the logged prompt, the row; None where it has no logged batch
        of the arm's size."""
        layout = self.layout
        if layout is None or layout.size != batch_size or batch_size == 1:
            return None
        if len(self.prompt) != layout.prompt_lengths[layout.row]:
            return None
        return layout.prompt_lengths, self.start, layout.row

    def process(self, processing: Processing) -> None:
        """Process every step's logits (prompt ‖ output written as tokens come)."""
        self.processing = processing
        dev = self.engine.device
        self.sequence = torch.zeros(
            (1, len(self.prompt) + self.max_new_tokens), dtype=torch.long, device=dev
        )
        context = self.context
        self.sequence[0, : len(context)] = torch.tensor(context, dtype=torch.long)

    def choose(self, step: StepOutput) -> tuple[int, bool]:
        engine, out = self.engine, self.out
        z32, top, process = step.logits[None], step.top, None
        if self.processing is not None and self.sequence is not None:
            process = StepProcessing([Span(0, 1, self.processing, self.sequence, len(out))])
            z32 = process(z32)
            top = top_k_on_host(z32, self.top_k)
        chosen = decide(engine.head, top, z32, step.hidden[:1], self.iv, self.top_k, process)
        self.parts.append(chosen)
        token = int(chosen.token_ids[0])
        out.append(token)
        seq = self.sequence
        if seq is not None and len(self.prompt) + len(out) <= seq.shape[1]:
            seq[0, len(self.prompt) + len(out) - 1] = token
        if token in self.eos:
            self.stop = "eos"
        elif len(out) < self.max_new_tokens and self.window is not None:
            self.differs = self.window.first_difference(out, self.differs, len(out) - 1)
            if self.window.reached(self.differs, len(out)):
                self.stop = "window"
        self.stopped = self.stop != "length" or len(out) >= self.max_new_tokens
        return token, self.stopped

    def result(self) -> DecodeRun:
        if self.run is not None:
            return self.run
        return DecodeRun(self.out, Steps.concat(self.parts), self.start, self.stop, self.rows)


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
