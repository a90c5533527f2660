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
from replay_audit.diff.margin import Margin
from replay_audit.engine.loading import (
    TORCH_DTYPES,
    configure_numerics,
    load_model,
    numerical_environment,
    resolve_device,
)
from replay_audit.engine.numerics import Choice, LmHead, apply_intervention, choose
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
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.cache_kind: CacheKind = cache
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
    ) -> TorchEngine:
        """Set the numerical flags, then load `model_dir` in `target`'s format."""
        configure_numerics(deterministic=deterministic, tf32=tf32)
        dev = resolve_device(device)
        model, tokenizer = load_model(model_dir, target.dtype, target.attn_kernel, dev)
        return cls(model, tokenizer, target, dev, cache=cache)

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
            extras={"kv_cache": self.cache_kind},
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
        cache = self._new_cache(len(context) + max_new_tokens - start)
        h = self._forward(context, cache, 0)[:, -1]
        pos = len(context)
        rows: list[Choice] = []
        stop = "length"
        while True:
            c = choose(self.head, self.head.native(h)[0], h[0], iv, top_k)
            rows.append(c)
            out.append(c.token)
            if c.token in eos:
                stop = "eos"
                break
            if len(out) >= max_new_tokens:
                break
            h = self._forward([c.token], cache, pos)[:, -1]
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
        rows = self._choose_rows(hs, iv, top_k)
        steps = steps_from_choices(rows, top_k)
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

    def _new_cache(self, max_len: int) -> Any:
        from transformers import DynamicCache, StaticCache

        if self.cache_kind == "static":
            return StaticCache(config=self.model.config, max_cache_len=max_len)
        return DynamicCache(config=self.model.config)

    def _forward(self, ids: Sequence[int], cache: Any, start: int) -> torch.Tensor:
        """Body forward of `ids` at positions start.. (batch rows: identical copies); the final
        normed hidden states (batch, n, d)."""
        b = self._target.batch_size
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device).expand(b, -1)
        pos = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0).expand(b, -1)
        out = self.model.model(
            input_ids=x, position_ids=pos, past_key_values=cache, use_cache=cache is not None
        )
        hidden: torch.Tensor = out.last_hidden_state
        return hidden

    def _choose_rows(self, hs: torch.Tensor, iv: Intervention, k: int) -> list[Choice]:
        """Choices for many positions: one batched head product (per row for FP8, whose
        activation scale is per step), one transfer of the top-k, interventions per gated row."""
        if self.head.fmt.startswith("fp8"):
            z = torch.cat([self.head.native(hs[i : i + 1]) for i in range(hs.shape[0])])
        else:
            z = self.head.native(hs)
        z32 = z.float()
        kk = min(max(k, 2), z32.shape[-1])
        vals, ids = torch.topk(z32, kk, dim=-1)
        native = torch.argmax(z32, dim=-1)
        v = vals.cpu().numpy().astype(np.float32)
        i = ids.cpu().numpy().astype(np.int64)
        nat = native.cpu().numpy()
        rows = []
        for t in range(hs.shape[0]):
            order = np.lexsort((i[t], -v[t].astype(np.float64)))
            vt, it = v[t][order], i[t][order]
            top1 = float(vt[0])
            margin = top1 - float(vt[1])
            fired = iv.gate.fires(margin, top1, self.head.fmt)
            token = int(nat[t])
            if fired and iv.kind != "none":
                width = iv.bin_width(top1, self.head.fmt)
                token = apply_intervention(self.head, z32[t], hs[t], iv, width)
            rows.append(
                Choice(
                    token=token,
                    native_token=int(nat[t]),
                    top_k_ids=it[:k],
                    top_k_logits=vt[:k],
                    margin=margin,
                    margin_ulps=margin / ulp(top1, self.head.fmt),
                    gate_fired=fired,
                )
            )
        return rows
