"""What a screening needs to know of a checkpoint on this device, besides its engines (which
come from the replay pipeline, `replays.pipeline.load_arm`, as every arm's): the platform, which
SDPA backends accept the model's attention calls, the checkpoint's own dtype and eos ids, and
its tokenizer for the prompts. Imports torch (through the engine) on first use: workers and the
CLI only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replay_audit.exceptions import EngineError
from replay_audit.formats import BodyDType, body_dtype
from replay_audit.screenings.sweep.outputs import PromptRow, ScreenPrompt
from replay_audit.screenings.sweep.plan import Platform, ScreenConfig


def checkpoint_dtype(model_dir: Path) -> BodyDType:
    """The checkpoint's own dtype (config.json `dtype` or `torch_dtype`), fp32 when unsaid."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise EngineError(f"cannot read {model_dir / 'config.json'}: {e}") from e
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return body_dtype(name) or "fp32"


def probe(device: str | None, owned: int | None = None) -> Platform:
    """The platform of `device` (None: CUDA when available); its `devices` are the CUDA GPUs
    seen, at most `owned` (a worker's pool's devices) when given."""
    from replay_audit.engine.platform import probe_platform

    f = probe_platform(device)
    gpus = min(f.cuda_devices, owned) if owned is not None else f.cuda_devices
    return Platform(
        device="cuda" if f.device == "cuda" else "cpu",
        gpu_name=f.gpu_name,
        sm=f.sm,
        fp8_unavailable=f.fp8_unavailable,
        flash_attn_installed=f.flash_attn_installed,
        devices=max(gpus, 1),
    )


class TorchFacts:
    """The screening's facts of a local checkpoint on `device` (None: CUDA when available)."""

    def __init__(self, model_dir: Path, device: str | None, *, devices: int | None = None) -> None:
        """`devices`: the GPUs a tensor-parallel group may span here (a worker's pool's); None:
        every CUDA GPU this process sees."""
        self.model_dir = model_dir
        self.device = device
        self.devices = devices
        self._tokenizer: Any = None
        self._eos: list[int] | None = None

    def availability(self, config: ScreenConfig) -> str | None:
        """Why `config` cannot run on this device, found by trying it (None: it can): the SDPA
        backend it limits attention to must accept the model's attention calls (its heads, kv
        heads, head_dim) in the configuration's compute dtype. The plan's probe."""
        if config.sdpa_backend is None or config.attn_kernel != "sdpa":
            return None
        from replay_audit.engine.platform import AttentionShape, sdpa_refusal

        return sdpa_refusal(
            config.sdpa_backend,
            AttentionShape(
                *self._heads(),
                dtype=config.dtype,
                masked=config.kv_cache == "compiled" or config.batch_size > 1,
            ),
            self.device,
        )

    def _heads(self) -> tuple[int, int, int]:
        """(heads, kv heads, head_dim) of the checkpoint, from its config.json."""
        c = json.loads((self.model_dir / "config.json").read_text(encoding="utf-8"))
        c = c.get("text_config", c)
        heads = int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
        return heads, kv_heads, head_dim

    def _tok(self) -> Any:
        if self._tokenizer is None:
            from replay_audit.engine.loading import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_dir)
            if self._tokenizer is None:
                raise EngineError(f"{self.model_dir} has no tokenizer: give prompt_token_ids")
        return self._tokenizer

    def eos_ids(self) -> list[int]:
        if self._eos is None:
            config = json.loads((self.model_dir / "config.json").read_text(encoding="utf-8"))
            eos: Any = None
            gen = self.model_dir / "generation_config.json"
            if gen.is_file():
                eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
            if eos is None:
                eos = config.get("eos_token_id")
            self._eos = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        return self._eos

    def platform(self) -> Platform:
        return probe(self.device, self.devices)

    def reference_dtype(self) -> BodyDType:
        """The checkpoint's own dtype (the reference a request naming none gets)."""
        return checkpoint_dtype(self.model_dir)

    def prompts(self, rows: Sequence[PromptRow]) -> list[ScreenPrompt]:
        """Screening prompts from rows with `id` and `prompt` (text) or `prompt_token_ids`."""
        out = []
        for i, row in enumerate(rows):
            pid = str(row.get("id", i))
            ids = row.get("prompt_token_ids")
            if ids is None:
                ids = [int(x) for x in self._tok()(row["prompt"])["input_ids"]]
            if not ids:
                raise EngineError(f"prompt {pid} encodes to no tokens")
            out.append(ScreenPrompt(pid, tuple(int(x) for x in ids)))
        return out
