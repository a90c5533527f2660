"""The lm_head in an arm's native format, its top-k on the device, and the per-step choice: the
margin and gate decided on the host by `diff.step_numerics`, then interventions A, B and C in
torch. The transformer body is transformers' own; only the head and the choice of token are
ours, so the numerics that the paper's interventions touch are explicit here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from replay_audit.diff.margin import step_numerics
from replay_audit.engine.loading import TORCH_DTYPES
from replay_audit.engine.protocol import Intervention, Steps, steps_from_numerics
from replay_audit.exceptions import UnsupportedFormat

FP8_E4M3_MAX = 448.0
#: `torch._scaled_mm` wants the rows of its first operand in multiples of 16.
_FP8_ROW_MULTIPLE = 16


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    """Whether an FP8-E4M3 lm_head can run on `device`, and why not."""
    if device.type != "cuda":
        return (
            False,
            "an fp8_e4m3 lm_head needs a CUDA GPU of compute capability >= 8.9; "
            f"this is {device.type}",
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (
            False,
            f"an fp8_e4m3 lm_head needs compute capability >= 8.9; this GPU is {major}.{minor}",
        )
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return False, f"torch {torch.__version__} has no FP8 matrix product (_scaled_mm)"
    return True, ""


class LmHead:
    """The lm_head of one arm: the native projection in the arm's head format, and the FP32
    recomputes of interventions B and C from the same stored weight.

    16/32-bit heads keep the weight in the head format and compute `F.linear` in it (exactly
    what transformers' `lm_head` does when the head format is the body's). The FP8-E4M3 head
    keeps the weight in the body format (BF16 in the paper), quantises it once with a per-tensor
    scale amax/448, quantises each step's activation with its own per-tensor dynamic scale, and
    multiplies with `torch._scaled_mm` into the body dtype. C and B upcast the stored weight on
    the fly (`weight.float()`): there is no persistent FP32 copy unless the head format is fp32.
    """

    def __init__(self, weight: torch.Tensor, fmt: str, body_dtype: torch.dtype) -> None:
        self.fmt = fmt
        w = weight.detach()
        self._w8: torch.Tensor | None = None
        self._w_scale: torch.Tensor | None = None
        self._out_dtype = body_dtype
        if fmt in TORCH_DTYPES:
            self.weight = w if w.dtype == TORCH_DTYPES[fmt] else w.to(TORCH_DTYPES[fmt])
        elif fmt == "fp8_e4m3":
            ok, why = fp8_supported(w.device)
            if not ok:
                raise UnsupportedFormat(why)
            self.weight = w if w.dtype == body_dtype else w.to(body_dtype)
            w32 = self.weight.float()
            self._w_scale = (w32.abs().amax().clamp(min=1e-12) / FP8_E4M3_MAX).reshape(())
            self._w8 = (w32 / self._w_scale).to(torch.float8_e4m3fn)
            if self.weight.shape[0] % 16 or self.weight.shape[1] % 16:
                raise UnsupportedFormat(
                    "an fp8 lm_head needs vocab and hidden sizes divisible by 16"
                )
        else:
            raise UnsupportedFormat(f"lm_head format {fmt!r} is not supported by this engine")

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def native(self, h: torch.Tensor) -> torch.Tensor:
        """Native logits (M, V) of hidden states (M, d): one per-tensor product."""
        if self._w8 is None:
            return F.linear(h.to(self.weight.dtype), self.weight)
        assert self._w_scale is not None
        m = h.shape[0]
        h32 = h.float()
        a_scale = (h32.abs().amax().clamp(min=1e-12) / FP8_E4M3_MAX).reshape(())
        rows = -(-m // _FP8_ROW_MULTIPLE) * _FP8_ROW_MULTIPLE
        a8 = torch.zeros(rows, h.shape[1], dtype=torch.float8_e4m3fn, device=h.device)
        a8[:m] = (h32 / a_scale).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(
            a8, self._w8.t(), scale_a=a_scale, scale_b=self._w_scale, out_dtype=self._out_dtype
        )
        return out[:m]

    def fp32(self, h: torch.Tensor) -> torch.Tensor:
        """Intervention C: fp32(W_lm) · fp32(h) over the whole vocabulary, (M, V) float32."""
        return F.linear(h.float(), self.weight.float())

    def fp32_rows(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Intervention B: fp32(W_lm[ids]) · fp32(h) for one hidden state h (d,), (K,) float32."""
        return F.linear(h.float().unsqueeze(0), self.weight[ids].float())[0]


@dataclass(frozen=True, eq=False)
class HostTopK:
    """The top-kk of (steps, V) native logits as copied to the host, in the device's order:
    `ids` (T, kk), `logits` (T, kk) float32, `native` (T,) the argmax (smallest id among equal
    maxima). `diff.step_numerics` orders them (the tie rule) and decides the margin and gate."""

    ids: npt.NDArray[np.int64]
    logits: npt.NDArray[np.float32]
    native: npt.NDArray[np.int64]


#: Top-k computed on the device each step (then cut to the k asked for): a fixed size, so a
#: captured decode step can include it, and the same in every path, so ties at the k-th place
#: resolve the same way (smaller id first) whichever path ran.
TOP_K_CAP = 20


def pack_top_k(z32: torch.Tensor, kk: int) -> torch.Tensor:
    """Top-kk values, their ids and the argmax of one step's float32 logits (V,), packed into
    one float64 vector (ids < 2**53 are exact) so a single device-to-host copy carries them."""
    vals, ids = torch.topk(z32, kk)
    native = torch.argmax(z32).reshape(1)
    return torch.cat([vals.double(), ids.double(), native.double()])


def unpack_top_k(packed: np.ndarray, kk: int) -> HostTopK:
    """One step's `pack_top_k` vector, copied to the host, as a one-row `HostTopK`."""
    return HostTopK(
        ids=packed[kk : 2 * kk].astype(np.int64)[None],
        logits=packed[:kk].astype(np.float32)[None],
        native=np.asarray([int(packed[2 * kk])], dtype=np.int64),
    )


def top_k_size(k: int, vocab: int) -> int:
    return min(max(k, 2, TOP_K_CAP), vocab)


def top_k_on_host(z32: torch.Tensor, k: int) -> HostTopK:
    """The host-side top-k of one step's float32 logits (V,), with one device transfer."""
    kk = top_k_size(k, z32.shape[-1])
    return unpack_top_k(pack_top_k(z32, kk).cpu().numpy(), kk)


def top_k_rows(z32: torch.Tensor, k: int) -> HostTopK:
    """The host-side top-k of many steps' float32 logits (T, V): one batched top-k."""
    kk = top_k_size(k, z32.shape[-1])
    vals, ids = torch.topk(z32, kk, dim=-1)
    native = torch.argmax(z32, dim=-1)
    return HostTopK(
        ids=ids.cpu().numpy().astype(np.int64),
        logits=vals.cpu().numpy().astype(np.float32),
        native=native.cpu().numpy().astype(np.int64),
    )


def decide(
    head: LmHead,
    top: HostTopK,
    z32: torch.Tensor,
    hs: torch.Tensor,
    intervention: Intervention,
    k: int,
) -> Steps:
    """The steps chosen from their host-side top-k: order, margin, ulps and gate by
    `diff.step_numerics` on the native logits, then the intervention at each step where the
    gate fired (on the device, from that step's float32 logits z32[t] (V,) and hidden state
    hs[t] (d,)). One decode step is T = 1; a scan is all its steps."""
    numerics = step_numerics(top.logits, top.ids, head_format=head.fmt, gate=intervention.gate)
    steps = steps_from_numerics(top.native, top.native, numerics, k)
    if intervention.kind == "none" or not steps.gate_fired.any():
        return steps
    tokens = top.native.copy()
    for t in np.flatnonzero(steps.gate_fired):
        width = intervention.bin_width(float(numerics.top1[t]), head.fmt)
        tokens[t] = apply_intervention(head, z32[t], hs[t], intervention, width)
    return replace(steps, token_ids=tokens)


def integer_argmax(values: torch.Tensor, width: float) -> int:
    """argmax of round(values / width) (width 0: of the values), the smallest index winning
    ties. torch.argmax returns the first maximal index, which gives that tie-break."""
    if width > 0:
        values = torch.round(values.double() / width)
    return int(torch.argmax(values))


def apply_intervention(
    head: LmHead, z32: torch.Tensor, h: torch.Tensor, intervention: Intervention, width: float
) -> int:
    """The token chosen by intervention A, B or C at a gated step."""
    if intervention.kind == "A":
        return integer_argmax(z32, width)
    if intervention.kind == "B":
        k = min(intervention.top_k, z32.shape[-1])
        cand = torch.sort(torch.topk(z32, k).indices).values  # ascending ids: smallest wins ties
        return int(cand[integer_argmax(head.fp32_rows(h, cand), width)])
    if intervention.kind == "C":
        return int(torch.argmax(head.fp32(h.unsqueeze(0))[0]))
    raise ValueError(f"no intervention {intervention.kind!r}")


def top_k_ordered(z32: torch.Tensor, k: int) -> HostTopK:
    """The host-side top-k of many steps' float32 logits (M, V), reduced and ordered on the
    device: by logit descending, then by id ascending (`diff.sort_top_k`'s tie rule, so
    `step_numerics` takes them as ordered), then one copy of (M, 2k + 1) values to the host. The
    (M, V) logits never leave the device, and the host does no sort (which costs as much as a
    GPU forward at tens of thousands of steps)."""
    kk = top_k_size(k, z32.shape[-1])
    vals, ids = torch.topk(z32, kk, dim=-1)  # values descending; equal values in any id order
    ids, by_id = torch.sort(ids, dim=-1)
    vals, by_value = torch.sort(vals.gather(-1, by_id), dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, by_value)
    native = torch.argmax(z32, dim=-1, keepdim=True)
    host = torch.cat([vals.double(), ids.double(), native.double()], dim=-1).cpu().numpy()
    return HostTopK(
        ids=host[:, kk : 2 * kk].astype(np.int64),
        logits=host[:, :kk].astype(np.float32),
        native=host[:, 2 * kk].astype(np.int64),
    )


#: Elements of the largest temporary one batched intervention makes (float64 bins of A, FP32
#: logits of C, gathered FP32 rows of B): the gated steps are taken this many elements at a
#: time, 512 MiB in float64 (2048 steps of a 32k vocabulary).
INTERVENTION_ELEMENTS = 2**26


def decide_rows(
    head: LmHead,
    top: HostTopK,
    z32: torch.Tensor,
    hs: torch.Tensor,
    intervention: Intervention,
    k: int,
) -> Steps:
    """`decide` for many steps at once (a batched scan's): the top-k as `top_k_ordered` gives
    it, its margins and gate by one call of `diff.step_numerics`, then the intervention at all
    gated steps together on the device (`intervene_rows`), a bounded chunk at a time."""
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
        index = torch.from_numpy(rows).to(z32.device)
        tokens[rows] = intervene_rows(
            head, z32[index], hs[index], intervention, widths[start : start + chunk]
        )
    return replace(steps, token_ids=tokens)


def integer_argmax_rows(values: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """`integer_argmax` of each row of `values` (G, n) with its own bin width (G,) float64."""
    w = widths.unsqueeze(-1)
    v = values.double()
    binned = torch.where(w > 0, torch.round(v / torch.where(w > 0, w, 1.0)), v)
    return torch.argmax(binned, dim=-1)


def intervene_rows(
    head: LmHead,
    z32: torch.Tensor,
    hs: torch.Tensor,
    intervention: Intervention,
    widths: npt.NDArray[np.float64],
) -> npt.NDArray[np.int64]:
    """`apply_intervention` at G gated steps at once, from their float32 logits z32 (G, V),
    hidden states hs (G, d) and bin widths (G,): one FP32 product for all of them (B, C), one
    copy of the chosen tokens to the host. A is elementwise, so it chooses exactly what the
    per-step A chooses; B's and C's FP32 products run at G rows instead of 1, and a kernel may
    sum in another order at another row count (MKL's one-row product on the CPU does)."""
    w = torch.from_numpy(np.ascontiguousarray(widths, dtype=np.float64)).to(z32.device)
    if intervention.kind == "A":
        chosen = integer_argmax_rows(z32, w)
    elif intervention.kind == "B":
        k = min(intervention.top_k, z32.shape[-1])
        cand = torch.sort(torch.topk(z32, k, dim=-1).indices, dim=-1).values  # smallest id first
        vals = torch.bmm(head.weight[cand].float(), hs.float().unsqueeze(-1)).squeeze(-1)
        chosen = cand.gather(-1, integer_argmax_rows(vals, w).unsqueeze(-1)).squeeze(-1)
    elif intervention.kind == "C":
        chosen = torch.argmax(head.fp32(hs), dim=-1)
    else:
        raise ValueError(f"no intervention {intervention.kind!r}")
    return np.asarray(chosen.cpu().numpy(), dtype=np.int64)
