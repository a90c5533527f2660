"""The platform and claim the verification statistics' tests calibrate for (a CPU, BF16/sdpa)."""

from __future__ import annotations

from typing import Any

PLATFORM: Any = {"device": "cpu", "gpu_name": None, "sm": None, "torch_version": None, "devices": 1}
CLAIM: Any = {"dtype": "bf16", "lm_head_dtype": "bf16", "attn_kernel": "sdpa"}
