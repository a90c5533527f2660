"""End-to-end FP8 linear layers (the paper's boundary case, Appendix on FP8): every linear layer
of the transformer body computes in FP8-E4M3 with per-tensor scales, as the FP8 lm_head does
(`numerics.LmHead`): the weight quantised once (scale amax/448), each call's activation with its
own dynamic scale, `torch._scaled_mm` into the body dtype. The lm_head keeps its own format."""

from __future__ import annotations

import torch
from torch import nn

from replay_audit.engine.numerics import FP8_E4M3_MAX
from replay_audit.exceptions import UnsupportedFormat

#: `torch._scaled_mm` wants the rows of its first operand in multiples of 16.
_ROW_MULTIPLE = 16


class Fp8Linear(nn.Module):
    """A linear layer computed in FP8-E4M3 (weight and activation), output in `out_dtype`."""

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype) -> None:
        super().__init__()
        out_features, in_features = linear.weight.shape
        if out_features % 16 or in_features % 16:
            raise UnsupportedFormat(
                f"an fp8 linear layer needs sizes divisible by 16, got {in_features}x{out_features}"
            )
        w32 = linear.weight.detach().float()
        scale = (w32.abs().amax().clamp(min=1e-12) / FP8_E4M3_MAX).reshape(())
        # Plain tensors on the weight's device (the model is on its device before it is
        # quantised and never moves after).
        self.w8: torch.Tensor = (w32 / scale).to(torch.float8_e4m3fn)
        self.w_scale: torch.Tensor = scale
        self.bias: torch.Tensor | None = (
            linear.bias.detach().to(out_dtype) if linear.bias is not None else None
        )
        self.out_dtype = out_dtype
        self.in_features = in_features
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, self.in_features).float()
        m = h.shape[0]
        a_scale = (h.abs().amax().clamp(min=1e-12) / FP8_E4M3_MAX).reshape(())
        rows = -(-m // _ROW_MULTIPLE) * _ROW_MULTIPLE
        a8 = torch.zeros(rows, self.in_features, dtype=torch.float8_e4m3fn, device=x.device)
        a8[:m] = (h / a_scale).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(
            a8, self.w8.t(), scale_a=a_scale, scale_b=self.w_scale, out_dtype=self.out_dtype
        )[:m]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


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
