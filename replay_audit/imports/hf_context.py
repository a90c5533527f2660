"""The import context of a transformers model running in this process (imports torch: the
HF helper's companion for users' own code and the CLI, never the API process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replay_audit.exceptions import FieldError
from replay_audit.formats import body_dtype
from replay_audit.imports.schemas import ImportContext
from replay_audit.json_value import JsonObject, JsonValue


def context_from_model(
    model: Any, model_dir: str | Path | None = None, **overrides: Any
) -> ImportContext:
    """The import context of `model` as it runs now (with `model_dir`: its weights_sha256 too).
    The batch size is left to `traces_from_generate` (the rows of the call). Keyword arguments
    override any field (`tags=[...]`)."""
    import torch
    import transformers

    from replay_audit.engine.hashing import weights_sha256

    dtype = body_dtype(model.dtype)
    if dtype is None:
        raise FieldError(
            f"dtype: model dtype {model.dtype} is not fp32, bf16 or fp16", field="dtype"
        )
    device = next(model.parameters()).device
    gpu: JsonObject | None = None
    kind = "cpu"
    if device.type == "cuda":
        kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        major, minor = torch.cuda.get_device_capability(device)
        gpu = {"name": torch.cuda.get_device_name(device), "sm": f"{major}.{minor}"}
    elif device.type in ("mps", "xpu"):
        kind = device.type
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    eos_ids: list[JsonValue] = (
        [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    )
    values: JsonObject = {
        "model": {
            "name": Path(model_dir).name if model_dir is not None else None,
            "weights_sha256": weights_sha256(model_dir) if model_dir is not None else None,
            "vocab_size": int(model.config.vocab_size),
        },
        "dtype": dtype,
        "lm_head_dtype": dtype,
        "weight_dtype": dtype,
        "device": kind,
        "gpu": gpu,
        "attn_kernel": str(model.config._attn_implementation),
        "tp_degree": 1,
        "engine": {"name": "transformers", "version": transformers.__version__},
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda if device.type == "cuda" else None,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32) if device.type == "cuda" else False,
        "decoding": {"eos_token_ids": eos_ids},
    }
    values.update(overrides)
    return ImportContext.model_validate(values)


class _DroppedCache:
    """Stands in for the KV cache a saved generate() output holds (its tensors are not read)."""


def load_generate_output(path: str | Path) -> dict[str, Any]:
    """A `generate(..., return_dict_in_generate=True)` output saved with `torch.save(out, path)`
    (or a dict of its tensors), as a dict for `hf.parse_hf`.

    Loaded with `weights_only=True`, never unrestricted pickle: besides tensors and containers,
    only the names of transformers' decoder-only output and KV-cache classes are allowed, and
    not what runs: an output is rebuilt as a plain dict of its fields (the unpickler cannot fill
    its OrderedDict subclass), a cache as an inert placeholder, dropped. Raises what
    `torch.load` raises on anything else."""
    import collections
    import dataclasses

    import torch
    from transformers import cache_utils
    from transformers.generation import utils

    allowed: list[Any] = []
    for output in (utils.GenerateDecoderOnlyOutput, utils.GenerateBeamDecoderOnlyOutput):
        names = [f.name for f in dataclasses.fields(output)]

        def fields(*values: Any, names: list[str] = names) -> Any:
            return collections.OrderedDict(zip(names, values, strict=False))

        allowed.append((fields, f"{output.__module__}.{output.__name__}"))
    bases = tuple(
        c for c in (cache_utils.Cache, getattr(cache_utils, "CacheLayerMixin", None)) if c
    )
    allowed += [
        (_DroppedCache, f"{cache_utils.__name__}.{name}")
        for name, c in vars(cache_utils).items()
        if isinstance(c, type) and issubclass(c, bases)
    ]
    with torch.serialization.safe_globals(allowed):
        data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict):
        raise TypeError(f"expected a generate() output or a dict, got {type(data).__name__}")
    return {k: v for k, v in data.items() if not isinstance(v, _DroppedCache)}
