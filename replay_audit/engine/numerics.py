"""The engine's numerics, each written once: the FP8-E4M3 matrix product (the FP8 lm_head and
the end-to-end FP8 body share it), the lm_head in an arm's native format, the top-k of native
logits with its tie order, and `decide`: the margin and gate (by `diff.step_numerics`) and the
paper's interventions A, B and C at the gated steps. Every decode path, the scans and the
single-step re-runs choose their tokens here. The transformer body is transformers' own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import nn

from replay_audit.diff.margin import step_numerics
from replay_audit.engine.loading import TORCH_DTYPES
from replay_audit.engine.protocol import Intervention, Steps, steps_from_numerics
from replay_audit.exceptions import UnsupportedFormat

# -- FP8 ------------------------------------------------------------------------------------

FP8_E4M3_MAX = 448.0
#: `torch._scaled_mm` wants the rows of its first operand in multiples of 16.
_FP8_ROW_MULTIPLE = 16


def fp8_supported(device: torch.device, what: str = "an fp8_e4m3 lm_head") -> tuple[bool, str]:
    """Whether FP8-E4M3 products (`what` needs them) can run on `device`, and why not."""
    if device.type != "cuda":
        return False, f"{what} needs a CUDA GPU of compute capability >= 8.9; this is {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, f"{what} needs compute capability >= 8.9; this GPU is {major}.{minor}"
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return False, f"torch {torch.__version__} has no FP8 matrix product (_scaled_mm)"
    return True, ""


def _fp8_scale(x32: torch.Tensor) -> torch.Tensor:
    """The per-tensor scale amax/448 of a float32 tensor (a 0-d tensor)."""
    return (x32.abs().amax().clamp(min=1e-12) / FP8_E4M3_MAX).reshape(())


def fp8_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight (out, in) in FP8-E4M3 with its per-tensor scale, quantised once."""
    out_features, in_features = weight.shape
    if out_features % 16 or in_features % 16:
        raise UnsupportedFormat(
            f"an fp8 product needs sizes divisible by 16, got {in_features}x{out_features}"
        )
    w32 = weight.detach().float()
    scale = _fp8_scale(w32)
    return (w32 / scale).to(torch.float8_e4m3fn), scale


def fp8_matmul(
    x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """x (M, in) · W^T in FP8-E4M3: the activation quantised with its own per-tensor dynamic
    scale, `torch._scaled_mm` into `out_dtype` (the rows padded to 16); (M, out)."""
    x32 = x.float()
    m = x32.shape[0]
    a_scale = _fp8_scale(x32)
    rows = -(-m // _FP8_ROW_MULTIPLE) * _FP8_ROW_MULTIPLE
    a8 = torch.zeros(rows, x32.shape[1], dtype=torch.float8_e4m3fn, device=x.device)
    a8[:m] = (x32 / a_scale).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(a8, w8.t(), scale_a=a_scale, scale_b=w_scale, out_dtype=out_dtype)
    return out[:m]


class Fp8Linear(nn.Module):
    """A linear layer of the body computed in FP8-E4M3 (`fp8_matmul`), output in `out_dtype`:
    the paper's end-to-end FP8 boundary case."""

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype) -> None:
        super().__init__()
        # Plain tensors on the weight's device (the model is on its device before it is
        # quantised and never moves after).
        self.w8, self.w_scale = fp8_quantize(linear.weight)
        self.bias = linear.bias.detach().to(out_dtype) if linear.bias is not None else None
        self.out_dtype = out_dtype
        self.out_features, self.in_features = linear.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fp8_matmul(x.reshape(-1, self.in_features), self.w8, self.w_scale, self.out_dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_body_linears(body: nn.Module, out_dtype: torch.dtype) -> int:
    """Replace every `nn.Linear` under `body` (the transformer body, not the lm_head) by an
    `Fp8Linear`; the number replaced."""
    n = 0
    for parent in list(body.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Fp8Linear(child, out_dtype))
                n += 1
    return n


# -- the lm_head ----------------------------------------------------------------------------


@dataclass(frozen=True)
class VocabShard:
    """One rank's rows of an lm_head split by vocabulary over `degree` ranks, as transformers'
    tensor-parallel plan splits it (`colwise_gather_output`: rank r holds rows
    [r * ceil(V / degree), ...), the last rank fewer), and the gather of every rank's logits
    into the whole vocabulary's (an exact concatenation, as transformers' gather)."""

    rank: int
    degree: int
    vocab: int

    @property
    def chunk(self) -> int:
        return math.ceil(self.vocab / self.degree)

    @property
    def start(self) -> int:
        return min(self.rank * self.chunk, self.vocab)

    @property
    def stop(self) -> int:
        return min(self.start + self.chunk, self.vocab)

    def gather(self, z: torch.Tensor) -> torch.Tensor:
        """Every rank's logits (..., stop - start) joined into (..., V) on every rank."""
        import torch.distributed as dist

        z = z.contiguous()
        if z.shape[-1] < self.chunk:
            z = F.pad(z, (0, self.chunk - z.shape[-1]))
        parts = [torch.empty_like(z) for _ in range(self.degree)]
        dist.all_gather(parts, z)
        return torch.cat(parts, dim=-1)[..., : self.vocab]


class LmHead:
    """The lm_head of one arm: the native projection in the arm's head format, and the FP32
    recompute of interventions B and C from the same stored weight.

    16/32-bit heads keep the weight in the head format and compute `F.linear` in it (exactly
    what transformers' `lm_head` does when the head format is the body's). The FP8-E4M3 head
    keeps the weight in the body format (BF16 in the paper) and multiplies with `fp8_matmul`
    into the body dtype. B and C upcast the stored weight on the fly (`weight.float()`): there
    is no persistent FP32 copy unless the head format is fp32.

    `shard` (a tensor-parallel rank): `weight` is still the whole vocabulary's, for B and C;
    the native product is split as transformers' tensor-parallel lm_head splits it.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        fmt: str,
        body_dtype: torch.dtype,
        *,
        shard: VocabShard | None = None,
    ) -> None:
        self.fmt = fmt
        w = weight.detach()
        self._fp8: tuple[torch.Tensor, torch.Tensor] | None = None
        self._out_dtype = body_dtype
        self.shard = shard
        if shard is not None and fmt not in TORCH_DTYPES:
            raise UnsupportedFormat(
                f"an {fmt} lm_head is not built for tensor parallel (a 16/32-bit head is)"
            )
        if fmt in TORCH_DTYPES:
            self.weight = w if w.dtype == TORCH_DTYPES[fmt] else w.to(TORCH_DTYPES[fmt])
        elif fmt == "fp8_e4m3":
            ok, why = fp8_supported(w.device)
            if not ok:
                raise UnsupportedFormat(why)
            self.weight = w if w.dtype == body_dtype else w.to(body_dtype)
            self._fp8 = fp8_quantize(self.weight)
        else:
            raise UnsupportedFormat(f"lm_head format {fmt!r} is not supported by this engine")

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def native(self, h: torch.Tensor) -> torch.Tensor:
        """Native logits (M, V) of hidden states (M, d): one product (for FP8, one activation
        scale over all M rows: a decode step's rows are copies of one).

        The product runs on (M, 1, d), the shape transformers' `lm_head` sees in a decode step
        (batch M, one position): on some CPUs a 2-D `F.linear` takes another FP16 kernel and
        rounds differently from the 3-D one."""
        if self._fp8 is not None:
            return fp8_matmul(h, *self._fp8, self._out_dtype)
        if self.shard is None:
            return F.linear(h.to(self.weight.dtype).unsqueeze(-2), self.weight).squeeze(-2)
        rows = self.weight[self.shard.start : self.shard.stop]
        return self.shard.gather(F.linear(h.to(rows.dtype).unsqueeze(-2), rows).squeeze(-2))

    def native_steps(self, hs: torch.Tensor) -> torch.Tensor:
        """Float32 native logits (M, V) of M steps' hidden states (a scan's): as each step's
        decode computes them, so for FP8 each step with its own activation scale."""
        if self._fp8 is None:
            return self.native(hs).float()
        return torch.cat([self.native(hs[i : i + 1]) for i in range(hs.shape[0])]).float()

    def fp32(self, h: torch.Tensor) -> torch.Tensor:
        """Intervention C: fp32(W_lm) · fp32(h) over the whole vocabulary, (M, V) float32."""
        return F.linear(h.float(), self.weight.float())


# -- top-k ----------------------------------------------------------------------------------

#: Top-k computed on the device each step (then cut to the k asked for): a fixed size, so a
#: captured decode step can include it, and the same in every path, so ties at the k-th place
#: resolve the same way whichever path ran.
TOP_K_CAP = 20


def top_k_size(k: int, vocab: int) -> int:
    """How many of the top logits the device reduces to when k are asked for."""
    return min(max(k, 2, TOP_K_CAP), vocab)


@dataclass(frozen=True, eq=False)
class HostTopK:
    """The top-kk of (M, V) float32 native logits, on the host: `ids` (M, kk) and `logits`
    (M, kk) ordered by logit descending, then id ascending (`diff.sort_top_k`'s tie rule);
    `native` (M,) the argmax (the smallest id among equal maxima, as greedy search)."""

    ids: npt.NDArray[np.int64]
    logits: npt.NDArray[np.float32]
    native: npt.NDArray[np.int64]


def pack_top_k(z32: torch.Tensor, kk: int) -> torch.Tensor:
    """The top-kk of float32 logits (M, V) or (V,), ordered on the device (logit descending,
    then id ascending), and the argmax, packed into one float64 tensor (M, 2kk + 1) (ids <
    2**53 are exact), so one device-to-host copy carries them and the (M, V) logits never leave
    the device. No host sync: a captured decode step includes it."""
    z = z32.reshape(-1, z32.shape[-1])
    vals, ids = torch.topk(z, kk, dim=-1)  # values descending; equal values in any id order
    ids, by_id = torch.sort(ids, dim=-1)
    vals, by_value = torch.sort(vals.gather(-1, by_id), dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, by_value)
    native = torch.argmax(z, dim=-1, keepdim=True)
    return torch.cat([vals.double(), ids.double(), native.double()], dim=-1)


def unpack_top_k(packed: npt.NDArray[np.float64], kk: int) -> HostTopK:
    """`pack_top_k`'s (M, 2kk + 1) values, copied to the host."""
    return HostTopK(
        ids=packed[:, kk : 2 * kk].astype(np.int64),
        logits=packed[:, :kk].astype(np.float32),
        native=packed[:, 2 * kk].astype(np.int64),
    )


def top_k_on_host(z32: torch.Tensor, k: int) -> HostTopK:
    """The host-side top-k (at least `top_k_size`) of float32 logits (M, V): one copy."""
    kk = top_k_size(k, z32.shape[-1])
    return unpack_top_k(pack_top_k(z32, kk).cpu().numpy(), kk)


def logged_evidence(z32: torch.Tensor, logged: torch.Tensor) -> npt.NDArray[np.float64]:
    """The logit and rank of each step's logged token (`protocol.LoggedEvidence`), from float32
    native logits z32 (M, V) and the logged ids (M,) on the same device: (M, 2) float64 on the
    host, one copy. The rank counts the tokens argmax would choose first (a larger logit, or an
    equal one with a smaller id), so rank 0 is exactly the scan's native choice. Elementwise
    compares over the (M, V) logits, on the device: no loop over steps."""
    ids = logged.reshape(-1, 1)
    value = z32.gather(-1, ids)
    vocab = torch.arange(z32.shape[-1], device=z32.device)
    first = (z32 > value) | ((z32 == value) & (vocab < ids))
    ranks = first.sum(dim=-1, dtype=torch.int64)
    return np.asarray(
        torch.stack([value[:, 0].double(), ranks.double()], dim=-1).cpu().numpy(),
        dtype=np.float64,
    )


# -- the choice of token ----------------------------------------------------------------------

#: Elements of the largest temporary one batched intervention makes (float64 bins of A, FP32
#: logits of C, gathered FP32 rows of B): the gated steps are taken this many elements at a
#: time, 512 MiB in float64 (2048 steps of a 32k vocabulary).
INTERVENTION_ELEMENTS = 2**26


#: A trace's logits processors over some of M steps' logits: `process(scores, rows)` gives
#: the processed float32 logits (G, V) of steps `rows` (G indices into the M steps; None: all
#: of them) from their unprocessed ones (G, V) (`processors.StepProcessing`).
Process = Callable[[torch.Tensor, npt.NDArray[np.int64] | None], torch.Tensor]


def decide(
    head: LmHead,
    top: HostTopK,
    z32: torch.Tensor,
    hs: torch.Tensor,
    intervention: Intervention,
    k: int,
    process: Process | None = None,
) -> Steps:
    """The tokens of M steps from their top-k: margins and gate by `diff.step_numerics`, then
    `intervene` at the gated steps, a bounded chunk at a time. With logits processors, `top`
    and `z32` are the processed logits' and `process` applies them to what B and C recompute."""
    numerics = step_numerics(
        top.logits, top.ids, head_format=head.fmt, gate=intervention.gate, sort=False
    )
    steps = steps_from_numerics(top.native, top.native, numerics, k)
    if intervention.kind == "none" or not steps.gate_fired.any():
        return steps
    gated = np.flatnonzero(steps.gate_fired)
    widths = np.maximum(intervention.gate.thresholds(numerics.top1[gated], head.fmt), 0.0)
    per_row = head.vocab_size
    if intervention.kind == "B":
        per_row = min(intervention.top_k, head.vocab_size) * int(hs.shape[-1])
    chunk = max(1, INTERVENTION_ELEMENTS // per_row)
    tokens = top.native.copy()
    for start in range(0, gated.size, chunk):
        rows = gated[start : start + chunk]
        # Every step gated (a gated decode step, an ungated scan): no gather, no index copy.
        index: slice | torch.Tensor = slice(None)
        if rows.size != tokens.size:
            index = torch.from_numpy(rows).to(z32.device)
        tokens[rows] = intervene(
            head,
            z32[index],
            hs[index],
            intervention,
            widths[start : start + chunk],
            _rows_process(process, rows),
        )
    return replace(steps, token_ids=tokens)


def _rows_process(
    process: Process | None, rows: npt.NDArray[np.int64]
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`process` of the gated steps `rows` (their logits in that order), or None."""
    if process is None:
        return None
    return lambda scores: process(scores, rows)


def integer_argmax(values: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """argmax of each row of round(values / width) (G, n), with the row's own bin width (G,)
    float64 (width 0: of the values themselves); the smallest index wins ties (torch.argmax
    returns the first maximal index)."""
    w = widths.unsqueeze(-1)
    v = values.double()
    binned = torch.where(w > 0, torch.round(v / torch.where(w > 0, w, 1.0)), v)
    return torch.argmax(binned, dim=-1)


def intervene(
    head: LmHead,
    z32: torch.Tensor,
    hs: torch.Tensor,
    intervention: Intervention,
    widths: npt.NDArray[np.float64],
    process: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> npt.NDArray[np.int64]:
    """The tokens intervention A, B or C (`Intervention`) chooses at G gated steps, with bin
    widths τ (G,). B's candidates go by ascending id, so the smallest id wins a shared bin. A is
    elementwise, so it chooses the same at any G; B's and C's products may sum in another order
    at another row count (MKL's one-row product on the CPU does).

    z32 is already processed (`process`); what B and C recompute goes through the same
    processors before its argmax, B's K values in a row of -inf (every processor keeps -inf)."""
    if intervention.kind == "C":
        z = head.fp32(hs)
        chosen = torch.argmax(process(z) if process is not None else z, dim=-1)
    elif intervention.kind in ("A", "B"):
        w = torch.from_numpy(np.ascontiguousarray(widths, dtype=np.float64)).to(z32.device)
        if intervention.kind == "A":
            chosen = integer_argmax(z32, w)
        else:
            k = min(intervention.top_k, z32.shape[-1])
            cand = torch.sort(torch.topk(z32, k, dim=-1).indices, dim=-1).values
            vals = torch.bmm(head.weight[cand].float(), hs.float().unsqueeze(-1)).squeeze(-1)
            if process is not None:
                full = torch.full_like(z32, -math.inf).scatter(-1, cand, vals)
                vals = process(full).gather(-1, cand)
            chosen = cand.gather(-1, integer_argmax(vals, w).unsqueeze(-1)).squeeze(-1)
    else:
        raise ValueError(f"no intervention {intervention.kind!r}")
    return np.asarray(chosen.cpu().numpy(), dtype=np.int64)
