"""`TensorParallelEngine`: an `Engine` at TP degree k over a `tensor_parallel.TpGroup`, every
call one operation of the group on each rank's own `TorchEngine` (`TorchEngine.load(tp=...)`).
This process holds no model: what it says of the engine is what the ranks answer."""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Unpack

import numpy as np
import numpy.typing as npt

from replay_audit.diff.pieces import Piece
from replay_audit.engine.protocol import (
    DEFAULT_SCAN_TOKEN_BUDGET,
    BatchLayout,
    DecodeRequest,
    DecodeRun,
    DecodeWindow,
    Environment,
    Intervention,
    LoadOptions,
    LogitsProcessors,
    ScanItem,
    ScanRun,
    StepInfo,
    Target,
    decode_each,
)
from replay_audit.engine.tensor_parallel import RankState, TpGroup, empty_device_cache
from replay_audit.engine.torch_engine import TorchEngine

# -- operations (run on every rank) -----------------------------------------------------------


def _load_engine(
    state: RankState, key: str, model_dir: Path, target: Target, options: LoadOptions
) -> tuple[Target, int, int | None]:
    """Load the rank's engine; its target as loaded, its vocabulary size and context."""
    engine = TorchEngine.load(model_dir, target, tp=state.placement, **options)
    state.objects[key] = engine
    return engine.target, engine.vocab_size, engine.max_positions


def _call(
    state: RankState, key: str, method: str, args: Sequence[object], kwargs: Mapping[str, object]
) -> object:
    return getattr(state.objects[key], method)(*args, **kwargs)


def _drop(state: RankState, key: str) -> None:
    state.objects.pop(key, None)
    gc.collect()
    empty_device_cache(state.placement.device_type)


class TensorParallelEngine:
    """An `Engine` (and `HiddenStates`) at TP degree k (module docstring)."""

    def __init__(
        self,
        group: TpGroup,
        key: str,
        target: Target,
        vocab_size: int,
        max_positions: int | None = None,
    ) -> None:
        self.group = group
        self.key = key
        self.target = target
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        #: The ranks' environment as of the last probe (a probe's batch extras change it).
        self._environment: Environment | None = None

    @classmethod
    def load(
        cls, group: TpGroup, model_dir: Path, target: Target, **options: Unpack[LoadOptions]
    ) -> TensorParallelEngine:
        """Load `model_dir` in `target`'s format on every rank of `group`."""
        key = group.new_key(str(model_dir))
        loaded, vocab_size, positions = group.run(
            _load_engine, key, Path(model_dir), target, options
        )
        return cls(group, key, loaded, vocab_size, positions)

    def close(self) -> None:
        """Every rank drops its engine (an unusable group's ranks are stopped with it)."""
        if self.group.alive:
            self.group.run(_drop, self.key)

    # -- the protocol -------------------------------------------------------------------------

    def environment(self) -> Environment:
        """The ranks' `environment()`, asked again only after a probe (a run's results read it
        once per result)."""
        if self._environment is None:
            self._environment = self.group.run(_call, self.key, "environment", (), {})
        return self._environment

    def decode(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_ids: Sequence[int] = (),
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        forced_prefix: Sequence[int] = (),
        processors: LogitsProcessors | None = None,
        window: DecodeWindow | None = None,
        layout: BatchLayout | None = None,
    ) -> DecodeRun:
        args = (list(prompt_ids), max_new_tokens, list(eos_ids), intervention, top_k)
        kwargs = {
            "forced_prefix": list(forced_prefix),
            "processors": processors,
            "window": window,
            "layout": layout,
        }
        run: DecodeRun = self._run("decode", args, kwargs)
        return run

    def decode_batch(
        self,
        requests: Sequence[DecodeRequest],
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        processors: LogitsProcessors | None = None,
    ) -> list[DecodeRun]:
        """One by one: each rank's decode is `generate()`'s of the sharded model, a row alone."""
        return decode_each(self, requests, intervention, top_k, processors)

    def scan(
        self,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        processors: LogitsProcessors | None = None,
    ) -> ScanRun:
        run: ScanRun = self._run(
            "scan",
            (list(prompt_ids), list(output_ids), intervention, top_k),
            {"processors": processors},
        )
        return run

    def scan_batch(
        self,
        items: Sequence[ScanItem],
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        token_budget: int = DEFAULT_SCAN_TOKEN_BUDGET,
    ) -> list[ScanRun]:
        runs: list[ScanRun] = self._run(
            "scan_batch", (list(items), intervention, top_k), {"token_budget": token_budget}
        )
        return runs

    def step(
        self,
        prompt_ids: Sequence[int],
        prefix_ids: Sequence[int],
        intervention: Intervention,
        top_k: int = 5,
        *,
        processors: LogitsProcessors | None = None,
        layout: BatchLayout | None = None,
    ) -> StepInfo:
        info: StepInfo = self._run(
            "step",
            (list(prompt_ids), list(prefix_ids), intervention, top_k),
            {"processors": processors, "layout": layout},
        )
        return info

    def step_batch(
        self,
        contexts: Sequence[Sequence[int]],
        intervention: Intervention,
        top_k: int = 5,
        *,
        token_budget: int = DEFAULT_SCAN_TOKEN_BUDGET,
        processors: LogitsProcessors | None = None,
        prompt_lengths: Sequence[int] | None = None,
        layouts: Sequence[BatchLayout | None] | None = None,
    ) -> list[StepInfo]:
        lengths = None if prompt_lengths is None else list(prompt_lengths)
        infos: list[StepInfo] = self._run(
            "step_batch",
            ([list(c) for c in contexts], intervention, top_k),
            {
                "token_budget": token_budget,
                "processors": processors,
                "prompt_lengths": lengths,
                "layouts": None if layouts is None else list(layouts),
            },
        )
        return infos

    def hidden_states(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int]
    ) -> npt.NDArray[np.float32]:
        states: npt.NDArray[np.float32] = self._run(
            "hidden_states", (list(prompt_ids), list(output_ids)), {}
        )
        return states

    def detokenize(self, ids: Sequence[int]) -> str | None:
        text: str | None = self._run("detokenize", (list(ids),), {})
        return text

    def token_pieces(self, ids: Sequence[int]) -> tuple[Piece, ...] | None:
        pieces: tuple[Piece, ...] | None = self._run("token_pieces", (list(ids),), {})
        return pieces

    def _run(self, method: str, args: Sequence[object], kwargs: Mapping[str, object]) -> Any:
        if method not in ("detokenize", "token_pieces"):
            self._environment = None  # a probe may change what the environment says
        return self.group.run(_call, self.key, method, args, kwargs)
