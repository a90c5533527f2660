"""Models for the engine benchmarks: a checkpoint directory, or a TinyLlama-shaped Llama with
random weights built on the device (no download)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from replay_audit.engine.loading import TORCH_DTYPES, resolve_device
from replay_audit.engine.protocol import Target
from replay_audit.engine.torch_engine import TorchEngine

#: TinyLlama-1.1B's shape.
TINYLLAMA_SHAPE: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
}


def random_tinyllama(dtype: str, device: str | None, attn_kernel: str = "sdpa") -> Any:
    """TinyLlama's architecture with transformers' default random init, in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dev = resolve_device(device)
    config = LlamaConfig(**TINYLLAMA_SHAPE, tie_word_embeddings=False)
    config._attn_implementation = attn_kernel
    torch.manual_seed(0)
    with torch.device(dev):
        model: Any = LlamaForCausalLM(config)
    return model.to(TORCH_DTYPES[dtype]).eval()


def save_random_tinyllama(path: Path, dtype: str, device: str | None) -> Path:
    """`random_tinyllama` in `dtype` saved as a checkpoint directory (safetensors) with the
    tiny checkpoints' byte-level tokenizer: what a loader that reads a directory (tensor-parallel
    loading, `replay-audit generate`) needs. Kept where it already is."""
    from replay_audit.engine.testing import write_byte_tokenizer

    if not any(path.glob("*.safetensors")):
        model = random_tinyllama(dtype, device)
        model.save_pretrained(path, safe_serialization=True)
        del model
        write_byte_tokenizer(path)
    return path


def build_engine(
    model_dir: Path | None,
    target: Target,
    device: str | None,
    *,
    cache: str | None = None,
    model: Any = None,
) -> TorchEngine:
    """An engine over `model_dir`, or over an already-built `model` (shared between engines).
    `cache`: the decode path, "piecewise" (None) or "compiled"; or "generate", the piecewise
    path's reference and fallback (transformers' own `generate()`, as where its check fails),
    timed as the baseline the piecewise path speeds up. No process-wide switch is set here:
    the engine runs under what the target names (`loading.ProcessNumerics`)."""
    path: Any = None if cache == "generate" else cache
    if model is None:
        assert model_dir is not None
        engine = TorchEngine.load(model_dir, target, device=device, cache=path)
    else:
        if path is not None:
            target = replace(target, kv_cache=path)
        engine = TorchEngine(model, None, target, resolve_device(device))
    if cache == "generate":
        engine._piecewise_error = "benchmark: generate() itself, timed as the baseline"
    return engine


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
