"""Loading a local checkpoint, setting the numerical flags, and reading the numerical
environment back from the running process. Imports torch: only the engine's torch modules use
this."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch

from replay_audit.engine.protocol import Environment, ExtraValue, GpuName
from replay_audit.exceptions import EngineError, UnsupportedFormat
from replay_audit.formats import BODY_DTYPES, DEFAULT_ATTN_KERNEL, FORMATS, SDPA_BACKENDS

if TYPE_CHECKING:
    from replay_audit.engine.tensor_parallel import TpPlacement

#: The body dtypes as torch's.
TORCH_DTYPES: dict[str, torch.dtype] = {
    d: getattr(torch, FORMATS[d].torch_name) for d in BODY_DTYPES
}


def resolve_device(device: str | None) -> torch.device:
    """`device` None: CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedFormat("device 'cuda' was asked for, but torch sees no CUDA device")
    return d


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks (macOS)
        return os.cpu_count() or 1


def set_torch_threads(threads: int | None = None, *, leave_free: int = 0) -> int:
    """Set torch's CPU (intra-op) threads: the one place the product sets them (the setting
    REPLAY_AUDIT_TORCH_THREADS and the CLI's --threads arrive here).

    `threads` given: that many. None: the usable cores less `leave_free`, at least one (the
    in-process runner leaves a core to the API it runs beside), or, with nothing to leave free,
    torch's own default. OpenMP keeps the count per thread (threads started later inherit it),
    so every thread that runs the engine calls this itself. Returns the count in use.
    """
    if threads is None and leave_free > 0:
        threads = max(1, usable_cores() - leave_free)
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def configure_numerics(*, deterministic: bool, tf32: bool) -> None:
    """Set torch's process-wide numerical flags explicitly (never at import time).

    Deterministic algorithms are requested with `warn_only` so an op without a deterministic
    implementation warns instead of failing a replay; cuBLAS needs its workspace setting before
    its first use for deterministic results.
    """
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False
    matmul: Any = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32" if tf32 else "ieee"
        torch.backends.cudnn.conv.fp32_precision = "tf32" if tf32 else "ieee"  # type: ignore[attr-defined]
    else:  # older torch
        matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


#: The SDPA backends the engine lets torch choose from (`only` None in `enable_sdpa_backends`):
#: all of torch's but cuDNN attention. With cuDNN's (`aten::_cudnn_attention_forward`),
#: transformers' `generate()` and the piecewise decode, which must be bitwise equal, were
#: measured to diverge past about 250 tokens on an H100; without it every decode matched.
FAITHFUL_SDPA_BACKENDS: Final[tuple[str, ...]] = tuple(n for n in SDPA_BACKENDS if n != "cudnn")


def enable_sdpa_backends(only: str | None) -> None:
    """Let torch's SDPA use the engine's backends (`only` None: `FAITHFUL_SDPA_BACKENDS`, every
    one but cuDNN's), or only one of `formats.SDPA_BACKENDS`. Process-wide, like the TF32
    flag."""
    if only is not None and only not in SDPA_BACKENDS:
        raise UnsupportedFormat(f"unknown SDPA backend {only!r}")
    for name, backend in SDPA_BACKENDS.items():
        setter = getattr(torch.backends.cuda, backend.enable_switch, None)
        if setter is not None:
            setter(name in FAITHFUL_SDPA_BACKENDS if only is None else name == only)


def apply_sdpa_policy(device: torch.device) -> None:
    """On a CUDA device, the engine's SDPA backends (`FAITHFUL_SDPA_BACKENDS`: no cuDNN
    attention), set where an engine or a generator loads; nothing elsewhere (a CPU has no cuDNN
    attention). Process-wide: `environment()` reads the switches back (`sdpa_backends`)."""
    if device.type == "cuda":
        enable_sdpa_backends(None)


def sdpa_backends_enabled(device: torch.device) -> str:
    """The SDPA backends torch may choose from on `device` now, read from its switches
    (`flash,efficient,math` on CUDA under the engine's policy; a CPU's have `on_cpu`)."""
    enabled = []
    for name, backend in SDPA_BACKENDS.items():
        reader = getattr(
            torch.backends.cuda, backend.enable_switch.removeprefix("enable_") + "_enabled", None
        )
        if (device.type == "cuda" or backend.on_cpu) and reader is not None and reader():
            enabled.append(name)
    return ",".join(enabled)


def tf32_enabled() -> bool:
    matmul: Any = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        return bool(matmul.fp32_precision == "tf32")
    return bool(matmul.allow_tf32)


def cublas_version() -> str | None:
    """cuBLAS's version as loaded in this process (read from the library itself), or None."""
    if not torch.cuda.is_available():
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcublas.so" in line}
        lib = ctypes.CDLL(sorted(paths)[0])
        parts = []
        for prop in (0, 1, 2):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
            v = ctypes.c_int()
            if lib.cublasGetProperty(prop, ctypes.byref(v)) != 0:
                return None
            parts.append(str(v.value))
        return ".".join(parts)
    except (OSError, IndexError, AttributeError):
        return None


def numerical_environment(
    *,
    dtype: str,
    lm_head_dtype: str,
    weight_dtype: str,
    device: torch.device,
    attn_kernel: str,
    batch_size: int,
    engine_name: str,
    engine_version: str | None,
    tp_degree: int = 1,
    extras: dict[str, ExtraValue] | None = None,
) -> Environment:
    """The numerical configuration in use, with `NumericalConfig`'s keys, read from torch.
    `tp_degree`: the tensor-parallel degree the model runs at (`device` is the rank's)."""
    import transformers

    gpu: GpuName | None = None
    kind = "cpu"
    if device.type == "cuda":
        kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        idx = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(idx)
        gpu = {"name": torch.cuda.get_device_name(idx), "sm": f"{major}.{minor}"}
    elif device.type in ("mps", "xpu"):
        kind = device.type
    cuda_matmul = torch.backends.cuda.matmul
    return {
        "dtype": dtype,
        "lm_head_dtype": lm_head_dtype,
        "weight_dtype": weight_dtype,
        "device": kind,
        "gpu": gpu,
        "attn_kernel": attn_kernel,
        "batch_size": batch_size,
        "tp_degree": tp_degree,
        "engine": {"name": engine_name, "version": engine_version},
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda if device.type == "cuda" else None,
        "cublas_version": cublas_version() if device.type == "cuda" else None,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "tf32": tf32_enabled() if device.type == "cuda" else False,
        "extras": {
            "transformers_version": transformers.__version__,
            "fp16_reduced_precision_reduction": bool(
                cuda_matmul.allow_fp16_reduced_precision_reduction
            ),
            "bf16_reduced_precision_reduction": bool(
                cuda_matmul.allow_bf16_reduced_precision_reduction
            ),
            # The backends SDPA chose from (`apply_sdpa_policy`), where SDPA is the kernel.
            **({"sdpa_backends": sdpa_backends_enabled(device)} if attn_kernel == "sdpa" else {}),
            **(extras or {}),
        },
    }


def load_model(
    model_dir: Path,
    dtype: str,
    attn_kernel: str | None,
    device: torch.device,
    *,
    weight_dtype: str | None = None,
    tp: TpPlacement | None = None,
) -> tuple[Any, Any]:
    """The checkpoint as a transformers causal LM in `dtype` on `device`, in eval mode, and its
    tokenizer (None when the directory has none). Local files only.

    `weight_dtype` (storage) other than `dtype` (compute): the checkpoint is loaded in
    `weight_dtype`, then cast to `dtype`, so the weights carry `weight_dtype`'s rounding while
    every product runs in `dtype` (the paper's storage-vs-compute ablation: BF16-stored weights
    computed in FP32). The cast after loading also casts the buffers (RoPE's inverse
    frequencies).

    `tp`: this rank's place in a tensor-parallel group (`tensor_parallel.TpPlacement`; the
    process group already joined): the checkpoint is loaded with transformers' tensor-parallel
    plan (`tp_plan="auto"`), sharded over the group's ranks, on this rank's device."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    quiet_transformers()

    if dtype not in TORCH_DTYPES:
        raise UnsupportedFormat(f"body dtype must be one of {tuple(TORCH_DTYPES)}, got {dtype!r}")
    if not Path(model_dir).is_dir():
        # Not a local checkpoint: transformers would take the path for a hub repo id and answer
        # with an error about repo ids.
        raise EngineError(f"{model_dir} is not a directory")
    stored = weight_dtype or dtype
    if stored not in TORCH_DTYPES:
        raise UnsupportedFormat(
            f"weight dtype must be one of {tuple(TORCH_DTYPES)}, got {weight_dtype!r}"
        )
    model: Any
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir),
            dtype=TORCH_DTYPES[stored],
            attn_implementation=attn_kernel or DEFAULT_ATTN_KERNEL,
            local_files_only=True,
            **(_tp_loading(tp.degree) if tp is not None else {}),
        )
    except (ImportError, ValueError) as exc:
        if tp is not None:
            raise UnsupportedFormat(
                f"cannot load {model_dir} at TP {tp.degree} with attention {attn_kernel!r}: {exc}"
            ) from exc
        # transformers refuses an attention kernel it cannot run here (e.g. flash_attention_2).
        raise UnsupportedFormat(
            f"cannot load {model_dir} with attention {attn_kernel!r}: {exc}"
        ) from exc
    except OSError as exc:
        raise EngineError(f"cannot load a checkpoint from {model_dir}: {exc}") from exc
    if stored != dtype:
        model = model.to(TORCH_DTYPES[dtype])
    if tp is None:  # transformers placed a sharded model on the rank's device
        model = model.to(device)
    model = model.eval()
    model.requires_grad_(False)
    return model, load_tokenizer(model_dir)


def _tp_loading(degree: int) -> Mapping[str, object]:
    """`from_pretrained`'s arguments for transformers' tensor-parallel loading over `degree`
    ranks with the model's own plan ("auto"): a `DistributedConfig` where transformers has one
    (5.x), else the `tp_plan` argument (4.x)."""
    try:
        from transformers.distributed.configuration_utils import DistributedConfig
    except ImportError:
        return {"tp_plan": "auto", "tp_size": degree}
    config_cls: Any = DistributedConfig
    return {"distributed_config": config_cls(tp_plan="auto", tp_size=degree)}


def load_tokenizer(model_dir: Path) -> Any:
    """The checkpoint's tokenizer, or None when the directory has none."""
    from transformers import AutoTokenizer
    from transformers import PreTrainedTokenizerFast as Fast

    fast: Any = Fast
    with contextlib.suppress(Exception):
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if (model_dir / "tokenizer.json").is_file():
        return fast(tokenizer_file=str(model_dir / "tokenizer.json"))
    return None


#: transformers' notice that the engine's own use of `past_key_values` is deprecated: a message
#: for the engine's authors, printed to every user on every run (issue 20).
_PAST_KEY_VALUES_NOTICE: Final = r".*`?past_key_values`?.*deprecated"


class _DropNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return re.match(_PAST_KEY_VALUES_NOTICE, record.getMessage(), re.S) is None


def quiet_transformers() -> None:
    """What transformers prints about the engine's own calls, silenced where the engine loads a
    checkpoint (not at import): the "Loading weights" progress bars and the `past_key_values`
    deprecation notice. Every other warning stays."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    warnings.filterwarnings("ignore", message=_PAST_KEY_VALUES_NOTICE, category=FutureWarning)
    hf_logger = logging.getLogger("transformers")
    for name in ("transformers", "transformers.utils.generic"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) for f in logger.filters):
            logger.addFilter(_DropNotice())
    for handler in hf_logger.handlers:  # records of child loggers pass the handler's filters
        if not any(isinstance(f, _DropNotice) for f in handler.filters):
            handler.addFilter(_DropNotice())
