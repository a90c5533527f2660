"""Loading a local checkpoint, setting the numerical flags, and reading the numerical
environment back from the running process. Imports torch: only the engine's torch modules use
this."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from replay_audit.engine.protocol import Environment, ExtraValue, GpuName
from replay_audit.exceptions import EngineError, UnsupportedFormat
from replay_audit.formats import (
    BODY_DTYPES,
    DEFAULT_ATTN_KERNEL,
    FORMATS,
    SDPA_BACKENDS,
    SdpaBackendName,
)

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
    """Set torch's CPU (intra-op) threads, the one place the product sets them; returns the
    count in use. None: the usable cores less `leave_free` (at least one), or torch's default
    with nothing to leave free. OpenMP keeps the count per thread, so every thread that runs
    the engine calls this itself.
    """
    if threads is None and leave_free > 0:
        threads = max(1, usable_cores() - leave_free)
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


@dataclass(frozen=True)
class ProcessNumerics:
    """The process-wide torch switches an arm runs under, each as the logging stack had it.
    None: as this process has it: the engine never sets a switch the arm does not name."""

    deterministic: bool | None = None
    tf32: bool | None = None
    sdpa_backend: str | None = None

    def __post_init__(self) -> None:
        if self.sdpa_backend is not None and self.sdpa_backend not in SDPA_BACKENDS:
            raise UnsupportedFormat(f"unknown SDPA backend {self.sdpa_backend!r}")

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Run the block under these switches, then put back what the process had; probes of
        other arms, in other threads, wait (the switches are the process's)."""
        with _SWITCHES:
            saved = _Switches.read()
            saved.with_numerics(self).write()
            try:
                yield
            finally:
                saved.write()


#: One arm's switches at a time in this process (`ProcessNumerics.applied`).
_SWITCHES = threading.RLock()


@dataclass(frozen=True)
class _Switches:
    """torch's process-wide numerical switches as they are."""

    deterministic: bool
    warn_only: bool
    cudnn_deterministic: bool
    tf32: bool
    sdpa: tuple[tuple[SdpaBackendName, bool], ...]

    @classmethod
    def read(cls) -> _Switches:
        return cls(
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            bool(torch.backends.cudnn.deterministic),
            tf32_enabled(),
            tuple((name, _sdpa_enabled(name)) for name in SDPA_BACKENDS),
        )

    def with_numerics(self, n: ProcessNumerics) -> _Switches:
        sdpa = self.sdpa
        if n.sdpa_backend is not None:
            sdpa = tuple((name, name == n.sdpa_backend) for name, _ in self.sdpa)
        det = self.deterministic if n.deterministic is None else n.deterministic
        return _Switches(
            det,
            # Deterministic algorithms warn where an op has none, rather than failing a replay.
            self.warn_only if n.deterministic is None else True,
            self.cudnn_deterministic if n.deterministic is None else n.deterministic,
            self.tf32 if n.tf32 is None else n.tf32,
            sdpa,
        )

    def write(self) -> None:
        """Set the switches that differ from the process's now (none: nothing is touched)."""
        now = _Switches.read()
        if (now.deterministic, now.warn_only) != (self.deterministic, self.warn_only):
            torch.use_deterministic_algorithms(self.deterministic, warn_only=self.warn_only)
        if now.cudnn_deterministic != self.cudnn_deterministic:
            torch.backends.cudnn.deterministic = self.cudnn_deterministic
        if now.tf32 != self.tf32:
            matmul: Any = torch.backends.cuda.matmul
            if hasattr(matmul, "fp32_precision"):
                matmul.fp32_precision = "tf32" if self.tf32 else "ieee"
            else:  # older torch
                matmul.allow_tf32 = self.tf32
        for (name, on), (_, was) in zip(self.sdpa, now.sdpa, strict=True):
            setter = getattr(torch.backends.cuda, SDPA_BACKENDS[name].enable_switch, None)
            if on != was and setter is not None:
                setter(on)


def _sdpa_enabled(name: SdpaBackendName) -> bool:
    reader = getattr(
        torch.backends.cuda, SDPA_BACKENDS[name].enable_switch.removeprefix("enable_") + "_enabled"
    )
    return bool(reader())


def sdpa_backends_enabled(device: torch.device) -> str:
    """The SDPA backends torch may choose from on `device` now, read from its switches (all
    four on CUDA by torch's default; a CPU's are those it has)."""
    return ",".join(
        name
        for name, backend in SDPA_BACKENDS.items()
        if (device.type == "cuda" or backend.on_cpu) and _sdpa_enabled(name)
    )


def tf32_enabled() -> bool:
    matmul: Any = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        return bool(matmul.fp32_precision == "tf32")
    return bool(matmul.allow_tf32)


#: cuBLAS's version once read: a loaded library stays (reading it takes milliseconds, which
#: every `environment()`, so every result, paid before).
_CUBLAS_VERSION: list[str] = []


def cublas_version() -> str | None:
    """cuBLAS's version as loaded in this process (read from the library itself), or None."""
    if _CUBLAS_VERSION or not torch.cuda.is_available():
        return _CUBLAS_VERSION[0] if _CUBLAS_VERSION else None
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
        _CUBLAS_VERSION.append(".".join(parts))
        return _CUBLAS_VERSION[0]
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
    numerics: ProcessNumerics | None = None,
    extras: dict[str, ExtraValue] | None = None,
) -> Environment:
    """The numerical configuration in use (`Environment`), read from torch, with the switches
    as `numerics` sets them for the arm. `CUBLAS_WORKSPACE_CONFIG` is read, never set: cuBLAS
    reads it once."""
    import transformers

    n = numerics or ProcessNumerics()
    gpu: GpuName | None = None
    kind = "cpu"
    cuda = device.type == "cuda"
    if cuda:
        kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        idx = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(idx)
        gpu = {"name": torch.cuda.get_device_name(idx), "sm": f"{major}.{minor}"}
    elif device.type in ("mps", "xpu"):
        kind = device.type
    cuda_matmul = torch.backends.cuda.matmul
    cudnn = torch.backends.cudnn.version() if cuda else None  # type: ignore[no-untyped-call]
    sdpa: dict[str, ExtraValue] = {}
    if attn_kernel == "sdpa":
        # The backends SDPA may choose from; which ran is `attention_backends` (observed).
        sdpa = {"sdpa_backends": n.sdpa_backend or sdpa_backends_enabled(device)}
        if n.sdpa_backend is not None:
            sdpa["sdpa_backend"] = n.sdpa_backend
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
        "cuda_version": torch.version.cuda if cuda else None,
        "cublas_version": cublas_version() if cuda else None,
        "cudnn_version": str(cudnn) if cudnn is not None else None,
        "deterministic": (
            torch.are_deterministic_algorithms_enabled()
            if n.deterministic is None
            else n.deterministic
        ),
        "tf32": (tf32_enabled() if n.tf32 is None else n.tf32) if cuda else False,
        "extras": {
            "transformers_version": transformers.__version__,
            "fp16_reduced_precision_reduction": bool(
                cuda_matmul.allow_fp16_reduced_precision_reduction
            ),
            "bf16_reduced_precision_reduction": bool(
                cuda_matmul.allow_bf16_reduced_precision_reduction
            ),
            **({"cublas_workspace_config": _workspace()} if cuda else {}),
            **sdpa,
            **(extras or {}),
        },
    }


def _workspace() -> str:
    """`CUBLAS_WORKSPACE_CONFIG` as this process has it ("default": unset, cuBLAS's own)."""
    return os.environ.get("CUBLAS_WORKSPACE_CONFIG") or "default"


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

    `weight_dtype` other than `dtype`: loaded in `weight_dtype`, then cast, so the weights carry
    its rounding while every product runs in `dtype` (the paper's storage-vs-compute ablation);
    the cast also casts the buffers (RoPE's inverse frequencies). `tp` (the process group
    already joined): loaded with transformers' tensor-parallel plan on this rank's device."""
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
        # transformers refuses an attention kernel it cannot run here (e.g. flash_attention_2).
        at = f" at TP {tp.degree}" if tp is not None else ""
        raise UnsupportedFormat(
            f"cannot load {model_dir}{at} with attention {attn_kernel!r}: {exc}"
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
    """`from_pretrained`'s arguments for the model's own TP plan: a `DistributedConfig` (5.x),
    else `tp_plan` (4.x)."""
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


def quiet_transformers() -> None:
    """The "Loading weights" progress bars transformers prints, off where the engine loads a
    checkpoint (not at import); every warning stays (the engine calls no deprecated API:
    `decoder.cache_keyword`)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
