"""The torch engine: a local Hugging Face checkpoint in one numerical configuration.

The transformer body is transformers' own (`model.model(...)`, its final norm included); the
lm_head projection, the margin, the gate and the interventions are ours (`numerics`). The decode
loop keeps a KV cache; the scan and the single-step re-run are one from-scratch forward each.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

import replay_audit
from replay_audit.diff.margin import Margin, margins_in_ulps
from replay_audit.engine.loading import (
    TORCH_DTYPES,
    configure_numerics,
    load_model,
    numerical_environment,
    resolve_device,
)
from replay_audit.engine.numerics import (
    Choice,
    LmHead,
    apply_intervention,
    choose,
    decide,
    pack_top_k,
    top_k_size,
    unpack_top_k,
)
from replay_audit.engine.protocol import DecodeRun, Intervention, ScanRun, StepInfo, Steps, Target
from replay_audit.formats import ulp

#: "dynamic": transformers' growing cache, token-identical to `generate()`. "static": a
#: preallocated cache with the decode step captured in a CUDA graph. "compiled": "static" with the
#: decode step compiled by `torch.compile` (inductor fuses the elementwise kernels) before it is
#: captured; its bits may differ from "static"'s (fused RMSNorm, RoPE, SiLU).
CacheKind = Literal["dynamic", "static", "compiled"]
#: Static cache lengths are powers of two from this up to `max_cache_len`: a decode gets the
#: smallest that holds it, so attention reads (and masks) as few unwritten positions as it can.
MIN_STATIC_BUCKET = 256


def steps_from_choices(rows: Sequence[Choice], k: int) -> Steps:
    """Stack per-step choices into `Steps` arrays."""
    if not rows:
        return Steps.empty(k)
    return Steps(
        token_ids=np.asarray([c.token for c in rows], np.int64),
        native_token_ids=np.asarray([c.native_token for c in rows], np.int64),
        top_k_ids=np.stack([c.top_k_ids for c in rows]).astype(np.int64),
        top_k_logits=np.stack([c.top_k_logits for c in rows]).astype(np.float32),
        margins=np.asarray([c.margin for c in rows], np.float64),
        margins_ulps=np.asarray([c.margin_ulps for c in rows], np.float64),
        gate_fired=np.asarray([c.gate_fired for c in rows], bool),
    )


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
            extras=self._extras(),
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
        total = len(context) + max_new_tokens - start
        static = self.cache_kind != "dynamic" and total <= self.max_cache_len
        decoder: StaticDecoder | None = None
        if static:
            decoder = self._static_decoder(total)
            h = decoder.prefill(context)
        else:
            cache = self._new_cache()
            h = self._forward(context, cache, 0)[:, -1]
        pos = len(context)
        rows: list[Choice] = []
        stop = "length"
        c = choose(self.head, self.head.native(h)[0], h[0], iv, top_k)
        while True:
            rows.append(c)
            out.append(c.token)
            if c.token in eos:
                stop = "eos"
                break
            if len(out) >= max_new_tokens:
                break
            if decoder is not None:
                h, z32, top = decoder.step(c.token, pos, top_k)
                c = decide(self.head, top, z32, h[0], iv, top_k)
            else:
                h = self._forward([c.token], cache, pos)[:, -1]
                c = choose(self.head, self.head.native(h)[0], h[0], iv, top_k)
            pos += 1
        return DecodeRun(out, steps_from_choices(rows, top_k), start, stop)

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
        hs = self._forward(context, None, 0)[0, len(prompt_ids) - 1 :]
        steps = self._choose_rows(hs, iv, top_k)
        return ScanRun(steps, np.asarray(steps.token_ids == np.asarray(output_ids), dtype=bool))

    @torch.inference_mode()
    def step(
        self, prompt_ids: Sequence[int], prefix_ids: Sequence[int], top_k: int = 5
    ) -> StepInfo:
        h = self._forward([*prompt_ids, *prefix_ids], None, 0)[:, -1]
        c = choose(self.head, self.head.native(h)[0], h[0], Intervention(), top_k)
        top1 = float(c.top_k_logits[0])
        return StepInfo(
            token=c.native_token,
            top_k_ids=c.top_k_ids,
            top_k_logits=c.top_k_logits,
            margin=Margin(abs=c.margin, ulps=c.margin / ulp(top1, self.head.fmt), top1=top1),
        )

    def detokenize(self, ids: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    # -- internals ----------------------------------------------------------------------------

    def _static_decoder(self, total: int) -> StaticDecoder:
        """The static decoder whose cache length is the smallest bucket holding `total` tokens."""
        length = MIN_STATIC_BUCKET
        while length < total:
            length *= 2
        length = min(length, self.max_cache_len)
        if length not in self._static:
            mode = "default" if self.cache_kind == "compiled" else None
            self._static[length] = StaticDecoder(self, length, compile_mode=mode)
        return self._static[length]

    def _extras(self) -> dict[str, Any]:
        """Which decode path ran: the cache, the static cache lengths used so far, whether the
        step was captured in a CUDA graph and compiled (and why not, if compiling failed)."""
        if self.cache_kind == "dynamic":
            return {"kv_cache": "dynamic", "cuda_graph": False, "static_cache_len": None}
        decoders = list(self._static.values())
        errors = sorted({d.compile_error for d in decoders if d.compile_error})
        extras: dict[str, Any] = {
            "kv_cache": "static",
            "cuda_graph": bool(decoders) and all(d.graph is not None for d in decoders),
            "static_cache_len": self.max_cache_len,
            "static_cache_lens_used": ",".join(str(n) for n in sorted(self._static)),
            "compiled": bool(decoders) and all(d.compiled for d in decoders),
        }
        if self.cache_kind == "compiled":
            extras["compile_mode"] = "default"
            if errors:
                extras["compile_error"] = errors[0][:200]
        return extras

    @torch.inference_mode()
    def hidden_states(self, ids: Sequence[int]) -> torch.Tensor:
        """Final normed hidden states (n, d) of a from-scratch forward over `ids` (row 0)."""
        return self._forward(ids, None, 0)[0]

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _forward(self, ids: Sequence[int], cache: Any, start: int) -> torch.Tensor:
        """Body forward of `ids` at positions start.. (batch rows: identical copies); the final
        normed hidden states (batch, n, d). Without a cache, positions are transformers' default
        (0..n-1), exactly as a plain forward of the model would use."""
        b = self._target.batch_size
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device).expand(b, -1)
        pos = None
        if cache is not None:
            pos = torch.arange(start, start + len(ids), device=self.device)
            pos = pos.unsqueeze(0).expand(b, -1)
        out = self.model.model(
            input_ids=x, position_ids=pos, past_key_values=cache, use_cache=cache is not None
        )
        hidden: torch.Tensor = out.last_hidden_state
        return hidden

    def _choose_rows(self, hs: torch.Tensor, iv: Intervention, k: int) -> Steps:
        """Steps for many positions: one batched head product (per row for FP8, whose
        activation scale is per step), one transfer of the top-k, margins and gate vectorised
        on the host (the same arithmetic as `numerics.decide`), interventions per gated row."""
        if self.head.fmt.startswith("fp8"):
            z = torch.cat([self.head.native(hs[i : i + 1]) for i in range(hs.shape[0])])
        else:
            z = self.head.native(hs)
        z32 = z.float()
        kk = top_k_size(k, z32.shape[-1])
        vals, ids = torch.topk(z32, kk, dim=-1)
        native = torch.argmax(z32, dim=-1)
        v = vals.cpu().numpy().astype(np.float32)
        i = ids.cpu().numpy().astype(np.int64)
        nat = native.cpu().numpy().astype(np.int64)
        order = np.lexsort((i, -v.astype(np.float64)), axis=-1)
        v = np.take_along_axis(v, order, axis=-1)
        i = np.take_along_axis(i, order, axis=-1)
        top1 = v[:, 0].astype(np.float64)
        margins = top1 - v[:, 1].astype(np.float64)
        fired = iv.gate.fires_array(margins, top1, self.head.fmt)
        tokens = nat.copy()
        if iv.kind != "none":
            for t in np.flatnonzero(fired):
                width = iv.bin_width(float(top1[t]), self.head.fmt)
                tokens[t] = apply_intervention(self.head, z32[t], hs[t], iv, width)
        return Steps(
            token_ids=tokens,
            native_token_ids=nat,
            top_k_ids=i[:, :k],
            top_k_logits=v[:, :k],
            margins=margins,
            margins_ulps=margins_in_ulps(margins, top1, self.head.fmt),
            gate_fired=fired,
        )


class StaticDecoder:
    """A preallocated KV cache written by position (transformers' `StaticCache`), reused across
    decodes, and on CUDA the one-token decode step (body, native head, top-k) captured once in a
    CUDA graph, as gpt-fast does: a step is then one graph replay and one device-to-host copy
    instead of hundreds of kernel launches from Python.

    The captured step also feeds itself: it writes its argmax into the token buffer and advances
    the position buffer, so the host writes them only when the chosen token is not the argmax
    (a gated step that an intervention changed) or a decode starts.

    With `compile_mode` (a `torch.compile` mode without CUDA graphs of its own: "default" or
    "max-autotune-no-cudagraphs"), the step is compiled before it is captured: inductor fuses
    the elementwise kernels (RMSNorm, RoPE, SiLU·mul, residual adds), so its bits may differ
    from the eager step's. If compiling fails, the eager step is captured and `compile_error`
    says why.

    Its attention runs over the whole preallocated length with the unwritten positions masked,
    so its bits may differ from a growing cache's: `environment()` records `kv_cache`.
    """

    def __init__(
        self, engine: TorchEngine, max_len: int, *, compile_mode: str | None = None
    ) -> None:
        from transformers import StaticCache

        if compile_mode not in (None, "default", "max-autotune-no-cudagraphs"):
            raise ValueError(
                f"compile mode {compile_mode!r}: the step is captured in our own CUDA graph, so "
                "use 'default' or 'max-autotune-no-cudagraphs'"
            )
        self.engine = engine
        self.model = engine.model
        self.max_len = max_len
        b = engine.target.batch_size
        self.cache: Any = StaticCache(config=engine.model.config, max_cache_len=max_len)
        self.token = torch.zeros((b, 1), dtype=torch.long, device=engine.device)
        self.position = torch.zeros((b, 1), dtype=torch.long, device=engine.device)
        self.kk = top_k_size(0, engine.vocab_size)
        self.graph: Any = None
        self.outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._capture_failed = engine.device.type != "cuda"
        self.compile_mode = compile_mode
        self.compiled = False
        self.compile_error: str | None = None
        # What the token and position buffers hold now (None: unknown, write them).
        self._dev_token: int | None = None
        self._dev_position: int | None = None

    def prefill(self, context: Sequence[int]) -> torch.Tensor:
        self.cache.reset()
        h = self.engine._forward(context, self.cache, 0)[:, -1]
        if self.graph is None and not self._capture_failed:
            self._capture()
        self._dev_token = self._dev_position = None
        return h

    def step(
        self, token: int, position: int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[np.ndarray, np.ndarray, int]]:
        """One decode step: hidden states (b, d), float32 native logits of row 0 (V,), and the
        host-side top-k of those logits."""
        if token != self._dev_token:
            self.token.fill_(token)
        if position != self._dev_position:
            self.position.fill_(position)
        if self.graph is not None:
            self.graph.replay()
            assert self.outputs is not None
            h, z32, packed = self.outputs
        else:
            h, z32, packed = self._step_and_advance(self._step_body)
        host = packed.cpu().numpy()
        kk = top_k_size(k, z32.shape[-1])
        top = unpack_top_k(host, self.kk)
        if kk != self.kk:  # more than TOP_K_CAP asked for: outside the captured step
            top = unpack_top_k(pack_top_k(z32, kk).cpu().numpy(), kk)
        self._dev_token, self._dev_position = top[2], position + 1
        return h, z32, top

    def _step_body(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.model.model(
            input_ids=self.token,
            position_ids=self.position,
            past_key_values=self.cache,
            use_cache=True,
        )
        h: torch.Tensor = out.last_hidden_state[:, -1]
        z32 = self.engine.head.native(h)[0].float()
        return h, z32, pack_top_k(z32, self.kk)

    def _step_and_advance(self, body: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step, then its argmax into the token buffer and the position one on."""
        h, z32, packed = body()
        self.token.copy_(packed[-1].to(torch.long).expand_as(self.token))
        self.position.add_(1)
        return h, z32, packed

    def _capture(self) -> None:
        """Warm up on a side stream (compiling the step first, with `compile_mode`), then
        capture one step. The warm-up writes K/V at the next position (which the real step
        overwrites) and advances the cache's length counters, which are put back.

        Captured with torch's deterministic-algorithms check off: under it, the cache write
        (`index_copy_` at one position) takes a sort-based path that costs a third of the step.
        The write is a copy to distinct positions, exact either way, and nothing in the step
        accumulates with atomics; the replay is bitwise equal to the uncaptured step
        (tests/engine/test_engine_gpu.py).
        """
        lengths = [layer.cumulative_length.clone() for layer in self.cache.layers]

        def restore() -> None:
            for layer, n in zip(self.cache.layers, lengths, strict=True):
                layer.cumulative_length.copy_(n)

        deterministic = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(False)
        try:
            stream_cls: Any = torch.cuda.Stream
            side = stream_cls()
            side.wait_stream(torch.cuda.current_stream())
            body: Any = self._step_body
            with torch.cuda.stream(side):
                if self.compile_mode is not None:
                    body = self._compile(restore)
                for _ in range(2):
                    self._step_and_advance(body)
                    restore()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.outputs = self._step_and_advance(body)
            restore()
            self.graph = graph
        except RuntimeError:
            # An op that cannot be captured (a host sync): decode the static cache uncaptured.
            restore()
            self._capture_failed = True
            self.graph = None
            self.compiled = False
        finally:
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)

    def _compile(self, restore: Any) -> Any:
        """The compiled step, run once (which compiles it), or the eager step if that fails."""
        import torch._dynamo

        # One compiled entry per static decoder (cache length x engine) on the same code.
        dynamo_config: Any = torch._dynamo.config
        dynamo_config.cache_size_limit = max(int(dynamo_config.cache_size_limit), 64)
        fn = torch.compile(self._step_body, mode=self.compile_mode, dynamic=False)
        try:
            fn()
            restore()
        except Exception as exc:  # inductor and dynamo raise many kinds; keep decoding eagerly
            restore()
            self.compile_error = f"{type(exc).__name__}: {exc}"
            return self._step_body
        self.compiled = True
        return fn
