"""What attention actually ran: torch's SDPA calls observed as they are made.

transformers' `sdpa` attention calls `torch.nn.functional.scaled_dot_product_attention`, and
torch picks a kernel (math, flash, efficient, cuDNN) for each call from its shapes, strides,
dtype, mask and the process's switches. A trace that records only the switches (the backends
allowed) does not say which kernel ran, and another call form (other strides, a mask where
`generate()` passes none) can make torch pick another one. So the engine observes the calls
themselves: `install()` wraps the function once (a pass-through, nothing is recorded and no
value changes), and inside `observe()` each call is recorded with the backend torch's own
dispatcher chooses for exactly those arguments (`torch._fused_sdp_choice`, the function SDPA
dispatches on). `Observed.backends()` is what a trace and a resolved arm record;
`Observed.calls` (with `keep_calls`) is what the piecewise decoder's check compares with
`generate()`'s calls, argument for argument.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import torch

#: torch's `SDPBackend` values by this project's names (`formats.SDPA_BACKENDS`).
BACKEND_NAMES: Final = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
#: A call's phase: a prefill (several query positions) or a decode step (one).
PHASES: Final = ("prefill", "decode")

#: `scaled_dot_product_attention`'s parameters in order, and the defaults of its options.
_ARGUMENTS: Final = (
    "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa",
)  # fmt: skip


@dataclass(frozen=True)
class SdpaOptions:
    """An SDPA call's arguments but the tensors and the mask, every one spelled out (a call
    that names a default and one that leaves it out are the same call)."""

    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False

    @classmethod
    def of(cls, given: Mapping[str, object]) -> SdpaOptions:
        """The options among a call's keyword arguments (others are not SDPA's: ignored)."""
        dropout, scale = given.get("dropout_p"), given.get("scale")
        return cls(
            float(dropout) if isinstance(dropout, int | float) else 0.0,
            bool(given.get("is_causal", False)),
            float(scale) if isinstance(scale, int | float) else None,
            bool(given.get("enable_gqa", False)),
        )

    def call(
        self,
        sdpa: Callable[..., torch.Tensor],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`sdpa(q, k, v)` with these options, as transformers passes them (by keyword: the
        fields are SDPA's keyword arguments)."""
        return sdpa(q, k, v, attn_mask=mask, **vars(self))


_local = threading.local()
_installed: list[Callable[..., torch.Tensor]] = []
_install_lock = threading.Lock()


def _meta(t: torch.Tensor) -> tuple[object, ...]:
    return (tuple(t.shape), t.stride(), str(t.dtype))


@dataclass(frozen=True)
class SdpaCall:
    """One SDPA call as torch saw it: every argument but the values, and the backend chosen."""

    query: tuple[object, ...]
    key: tuple[object, ...]
    value: tuple[object, ...]
    mask: tuple[object, ...] | None
    #: The other arguments (dropout, causality, scale, GQA).
    options: SdpaOptions
    backend: str

    @property
    def phase(self) -> str:
        """`decode` where the queries are fewer than the keys (a cache is read): the rows of
        a decode step are not always one, since transformers folds a step's grouped query
        heads into the rows of their key/value head (a padded batch's decode)."""
        q, k = self.query[0], self.key[0]
        assert isinstance(q, tuple) and isinstance(k, tuple)
        return "decode" if q[-2] < k[-2] else "prefill"


@dataclass
class Observed:
    """The SDPA calls seen inside one `observe()`: the backends by phase, and (with
    `keep_calls`) every call in order."""

    keep_calls: bool = False
    by_phase: dict[str, set[str]] = field(default_factory=dict)
    calls: list[SdpaCall] = field(default_factory=list)
    #: Choices already made, by call signature: the dispatcher is asked once per signature.
    _chosen: dict[tuple[object, ...], str] = field(default_factory=dict)

    def add(self, args: tuple[object, ...], kwargs: Mapping[str, object]) -> None:
        given = dict(zip(_ARGUMENTS, args, strict=False)) | dict(kwargs)
        q, k, v = given.pop("query"), given.pop("key"), given.pop("value")
        mask = given.pop("attn_mask", None)
        assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
        assert isinstance(v, torch.Tensor) and (mask is None or isinstance(mask, torch.Tensor))
        options = SdpaOptions.of(given)
        shapes = (_meta(q), _meta(k), _meta(v), _meta(mask) if mask is not None else None)
        signature = (*shapes, options, str(q.device))
        backend = self._chosen.get(signature)
        if backend is None:
            backend = self._chosen[signature] = _choice(q, k, v, mask, options)
        call = SdpaCall(*shapes, options, backend)
        self.by_phase.setdefault(call.phase, set()).add(backend)
        if self.keep_calls:
            self.calls.append(call)

    def merge(self, other: Observed) -> None:
        for phase, names in other.by_phase.items():
            self.by_phase.setdefault(phase, set()).update(names)

    def backends(self) -> str | None:
        """`prefill:flash;decode:cudnn,flash` (None: no SDPA call was seen)."""
        parts = [
            f"{phase}:{','.join(sorted(self.by_phase[phase]))}"
            for phase in PHASES
            if self.by_phase.get(phase)
        ]
        return ";".join(parts) or None


def _choice(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    options: SdpaOptions,
) -> str:
    """The backend torch's SDPA dispatcher picks for these arguments under the switches now."""
    try:
        chosen = torch._fused_sdp_choice(q, k, v, mask, **vars(options))
    except (RuntimeError, TypeError) as exc:  # no backend accepts them: SDPA itself will raise
        return f"none ({type(exc).__name__})"
    return BACKEND_NAMES.get(int(chosen), str(chosen))


def install() -> None:
    """Wrap torch's SDPA function once per process so that `observe()` sees its calls. The
    wrapper passes every call through unchanged; outside `observe()` it records nothing."""
    with _install_lock:
        if _installed:
            return
        original = torch.nn.functional.scaled_dot_product_attention

        def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
            observed: Observed | None = getattr(_local, "observed", None)
            if observed is not None:
                observed.add(args, dict(kwargs))
            return original(*args, **kwargs)

        scaled_dot_product_attention.__doc__ = original.__doc__
        torch.nn.functional.scaled_dot_product_attention = scaled_dot_product_attention
        _installed.append(original)


def unobserved() -> Callable[..., torch.Tensor]:
    """torch's own SDPA function, not through the observing wrapper (for calls whose backend
    an observed call of the same shapes already recorded)."""
    install()
    return _installed[0]


@contextlib.contextmanager
def observe(keep_calls: bool = False) -> Iterator[Observed]:
    """Record the SDPA calls this thread makes inside the block (nested blocks: the inner one
    records, then hands its backends, and its calls where the outer one keeps them, to the
    outer one)."""
    install()
    outer: Observed | None = getattr(_local, "observed", None)
    observed = Observed(keep_calls or (outer is not None and outer.keep_calls))
    _local.observed = observed
    try:
        yield observed
    finally:
        _local.observed = outer
        if outer is not None:
            outer.merge(observed)
            if outer.keep_calls:
                outer.calls.extend(observed.calls)
