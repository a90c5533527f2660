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

CacheKind = Literal["dynamic", "static"]


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
        self._static: StaticDecoder | None = None
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
        """Set the numerical flags, then load `model_dir` in `target`'s format."""
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
            extras={
                "kv_cache": self.cache_kind,
                "cuda_graph": self._static is not None and self._static.graph is not None,
                "static_cache_len": self.max_cache_len if self.cache_kind == "static" else None,
            },
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
        static = self.cache_kind == "static" and total <= self.max_cache_len
        if static:
            if self._static is None:
                self._static = StaticDecoder(self, self.max_cache_len)
            h = self._static.prefill(context)
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
            if static:
                assert self._static is not None
                h, z32, top = self._static.step(c.token, pos, top_k)
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

    Its attention runs over the whole preallocated length with the unwritten positions masked,
    so its bits may differ from a growing cache's: `environment()` records `kv_cache`.
    """

    def __init__(self, engine: TorchEngine, max_len: int) -> None:
        from transformers import StaticCache

        self.engine = engine
        self.model = engine.model
        b = engine.target.batch_size
        self.cache: Any = StaticCache(config=engine.model.config, max_cache_len=max_len)
        self.token = torch.zeros((b, 1), dtype=torch.long, device=engine.device)
        self.position = torch.zeros((b, 1), dtype=torch.long, device=engine.device)
        self.kk = top_k_size(0, engine.vocab_size)
        self.graph: Any = None
        self.outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._capture_failed = engine.device.type != "cuda"

    def prefill(self, context: Sequence[int]) -> torch.Tensor:
        self.cache.reset()
        h = self.engine._forward(context, self.cache, 0)[:, -1]
        if self.graph is None and not self._capture_failed:
            self._capture()
        return h

    def step(
        self, token: int, position: int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[np.ndarray, np.ndarray, int]]:
        """One decode step: hidden states (b, d), float32 native logits of row 0 (V,), and the
        host-side top-k of those logits."""
        self.token.fill_(token)
        self.position.fill_(position)
        if self.graph is not None:
            self.graph.replay()
            assert self.outputs is not None
            h, z32, packed = self.outputs
        else:
            h, z32, packed = self._step_body()
        kk = top_k_size(k, z32.shape[-1])
        if kk != self.kk:  # more than TOP_K_CAP asked for: outside the captured step
            packed = pack_top_k(z32, kk)
        return h, z32, unpack_top_k(packed.cpu().numpy(), kk)

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

    def _capture(self) -> None:
        """Warm up on a side stream, then capture one step. The warm-up writes K/V at the next
        position (which the real step overwrites) and advances the cache's length counters,
        which are put back.

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
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step_body()
                    restore()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.outputs = self._step_body()
            restore()
            self.graph = graph
        except RuntimeError:
            # An op that cannot be captured (a host sync): decode the static cache uncaptured.
            restore()
            self._capture_failed = True
            self.graph = None
        finally:
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
