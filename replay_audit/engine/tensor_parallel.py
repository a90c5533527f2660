"""Tensor-parallel execution: one process per rank, rank 0 driving, the others in lockstep.

A `TpGroup` of degree k is this process (rank 0) and k - 1 rank processes it starts
(`python -m replay_audit.engine.tp_rank`, one per device: cuda:r, or the CPU for tests), joined
by torch.distributed (NCCL on CUDA, gloo on the CPU). Each rank loads the checkpoint with
transformers' tensor-parallel loading (`tp_plan="auto"`: attention and MLP projections split by
heads and columns, their row-parallel halves summed by an all-reduce, the lm_head split by
vocabulary and gathered) and keeps it loaded until the group drops it.

Every probe runs the same computation on every rank. Rank 0 sends each rank the operation and
its inputs (a module-level function and its arguments, pickled over a private socket); once
every rank has read it (a rank that cannot, say so, and none runs it), all run it, rank 0
included, and rank 0 reads each rank's answer: "ok" with a digest of its result, or its error. The
collectives inside the operation (the all-reduces of the body, the lm_head's gather) keep the
ranks in step; the digests check that every rank computed the same bits, so a result says what
every rank computed, not what rank 0 hoped they did.

    TpGroup                the processes and the process group; `run(op, *args)`
    TensorParallelEngine   an `Engine` whose every probe (decode, scan, scan_batch, step,
                           step_batch, hidden_states) is a `run` of the rank's own `TorchEngine`

NVLink multicast stays off in every rank (`NVLS_OFF`): this process sets it before its
communicator exists, and each rank gets it in its environment. A rank dies with its parent
(Linux's PR_SET_PDEATHSIG, set by the rank itself) and exits when the control socket closes, so
a killed worker leaves no rank behind.

One process is in one default process group at a time, so a process has one `TpGroup` at a time
(`EnginePool` keeps it, and replaces it when a job needs another degree).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, Unpack

import numpy.typing as npt

from replay_audit.diff.pieces import Piece
from replay_audit.engine.protocol import (
    DEFAULT_SCAN_TOKEN_BUDGET,
    DecodeRun,
    Environment,
    Intervention,
    ScanItem,
    ScanRun,
    StepInfo,
    Target,
)
from replay_audit.exceptions import EngineError, UnsupportedFormat

if TYPE_CHECKING:
    import numpy as np

    from replay_audit.engine.pool import LoadOptions
    from replay_audit.engine.torch_engine import TorchEngine

log = logging.getLogger(__name__)

#: NVLink multicast (NVLS) off in every rank: set in this process before its NCCL communicator
#: exists and in each rank's environment. Lent multi-GPU machines hang or fail with it on.
NVLS_OFF: Final[Mapping[str, str]] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
#: Seconds a collective may wait for the other ranks before it fails (the process group's
#: timeout), and rank 0 for a rank's answer beyond it.
DEFAULT_TIMEOUT_S: Final = 600.0
#: Seconds the ranks have to start (import torch and transformers) and join the group.
START_TIMEOUT_S: Final = 300.0
#: What the ranks' environment names (read by `tp_rank`).
ENV_CONTROL_FD: Final = "REPLAY_AUDIT_TP_CONTROL_FD"
ENV_PARENT_PID: Final = "REPLAY_AUDIT_TP_PARENT_PID"
ENV_DEVICE: Final = "REPLAY_AUDIT_TP_DEVICE"
ENV_THREADS: Final = "REPLAY_AUDIT_TP_THREADS"
ENV_TIMEOUT_S: Final = "REPLAY_AUDIT_TP_TIMEOUT_S"
#: prctl(2)'s option: the signal a process gets when its parent dies.
_PR_SET_PDEATHSIG: Final = 1

DeviceType = Literal["cpu", "cuda"]


def backend_for(device_type: DeviceType) -> str:
    """torch.distributed's backend for ranks on `device_type`: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


@dataclass(frozen=True)
class TpPlacement:
    """Where one rank's model goes: its rank, the group's size (the TP degree) and the device
    type (rank r on cuda:r, or the CPU). What `TorchEngine.load` and `load_model` take."""

    rank: int
    degree: int
    device_type: DeviceType

    @property
    def device(self) -> Any:
        import torch

        if self.device_type == "cuda":
            return torch.device("cuda", self.rank)
        return torch.device("cpu")

    @property
    def backend(self) -> str:
        return backend_for(self.device_type)


@dataclass
class RankState:
    """What one rank holds: its placement, and what it loaded (engines and generators, by the
    key rank 0 gave them)."""

    placement: TpPlacement
    objects: dict[str, Any] = field(default_factory=dict)


def digest(result: object) -> str:
    """A digest of an operation's result (its pickle: numpy arrays by their bytes), to check
    that every rank computed the same."""
    return hashlib.sha256(pickle.dumps(result, protocol=5)).hexdigest()


#: An operation every rank runs: a module-level function (pickled by reference) of the rank's
#: state and the arguments rank 0 sent.
Op = Callable[..., object]


class TpGroup:
    """k processes joined by torch.distributed: this one (rank 0) and k - 1 it starts.

    `degree` is k (at least 2); `device` "cuda" puts rank r on cuda:r (this process: cuda:0) and
    joins them with NCCL, "cpu" runs every rank on the CPU with gloo; None: CUDA when available.
    `threads`: torch's CPU threads in each started rank (None: this process's count).
    `run(op, *args)` runs `op(state, *args)` on every rank and returns rank 0's result.
    `close()` stops the ranks and leaves the process group (the group is then unusable)."""

    def __init__(
        self,
        degree: int,
        *,
        device: str | None = None,
        threads: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        import torch
        import torch.distributed as dist

        if degree < 2:
            raise ValueError("a tensor-parallel group has at least two ranks")
        device_type = _device_type(device)
        _check_can_start(degree, device_type)
        if dist.is_initialized():
            raise EngineError(
                "this process is already in a torch.distributed process group: one tensor-"
                "parallel group per process (close the other first)"
            )
        self.degree = degree
        self.device_type: DeviceType = device_type
        self.timeout_s = timeout_s
        self.state = RankState(TpPlacement(0, degree, device_type))
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._broken: str | None = None
        self._closed = False
        os.environ.update(NVLS_OFF)  # this process's communicator reads them when it is made
        if device_type == "cuda":
            torch.cuda.set_device(0)
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1",
            0,
            degree,
            is_master=True,
            timeout=timedelta(seconds=start_timeout_s),
            wait_for_workers=False,
        )
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        try:
            for rank in range(1, degree):
                proc, conn = _start_rank(rank, degree, store.port, device_type, threads, timeout_s)
                self._procs.append(proc)
                self._conns.append(conn)
            for rank, conn in enumerate(self._conns, start=1):
                self._expect(rank, conn, "started", start_timeout_s)
            dist.init_process_group(
                backend_for(device_type),
                store=store,
                rank=0,
                world_size=degree,
                timeout=timedelta(seconds=timeout_s),
                device_id=torch.device("cuda", 0) if device_type == "cuda" else None,
            )
            for rank, conn in enumerate(self._conns, start=1):
                self._expect(rank, conn, "ready", start_timeout_s)
        except BaseException:
            self._stop_ranks()
            with contextlib.suppress(Exception):
                if dist.is_initialized():
                    dist.destroy_process_group()
            self._closed = True
            raise
        log.info(
            "tensor-parallel group of %d ranks (%s, %s): rank pids %s",
            degree,
            device_type,
            self.backend,
            ", ".join(str(p.pid) for p in self._procs),
        )

    @property
    def backend(self) -> str:
        return backend_for(self.device_type)

    @property
    def alive(self) -> bool:
        """Whether the group can run operations (not closed, not broken, every rank running)."""
        return (
            not self._closed and self._broken is None and all(p.poll() is None for p in self._procs)
        )

    @property
    def pids(self) -> list[int]:
        """The started ranks' process ids (ranks 1..k-1)."""
        return [p.pid for p in self._procs]

    def new_key(self, what: str) -> str:
        """A key no object of this group has had: what the ranks keep an object under."""
        return f"{what}#{next(self._keys)}"

    def run(self, op: Op, *args: object) -> Any:
        """`op(state, *args)` on every rank, rank 0's result returned.

        A rank that cannot read the operation (a module it cannot import) refuses it, and no
        rank runs it (`EngineError`; the group stays usable). Then every rank must finish with
        the same outcome: the same result (by digest) or an error. An error on every rank (a
        format no rank can load) is raised as rank 0's, and the group stays usable; ranks that
        disagree (one failed, or computed other bits) raise `EngineError`, and a rank that
        failed alone or went silent leaves the group broken (`alive` False), since the ranks
        may no longer be in step."""
        with self._lock:
            if not self.alive:
                raise EngineError(f"the tensor-parallel group is not usable: {self._why_not()}")
            message = pickle.dumps((op, args), protocol=5)
            for conn in self._conns:
                conn.send_bytes(message)
            # Every rank has read the operation before any runs it: one that cannot (a module
            # it cannot import) refuses it, and no rank waits in a collective for it.
            taken = [self._answer(rank, conn) for rank, conn in enumerate(self._conns, start=1)]
            refused = [(rank, what) for rank, (status, what) in taken if status != "taken"]
            if refused:
                for conn in self._conns:
                    with contextlib.suppress(OSError):
                        conn.send(False)
                rank, what = refused[0]
                raise EngineError(
                    f"tensor-parallel rank {rank} could not take the operation: {what}"
                )
            for conn in self._conns:
                conn.send(True)
            error: BaseException | None = None
            result: object = None
            try:
                result = op(self.state, *args)
            except Exception as exc:  # every rank answers first; then this is raised
                error = exc
            answers = [self._answer(rank, conn) for rank, conn in enumerate(self._conns, start=1)]
            failed = [(rank, what) for rank, (status, what) in answers if status == "error"]
            if error is not None:
                if len(failed) != len(answers):
                    ok = [r for r, (status, _) in answers if status == "ok"]
                    self._broken = f"rank 0 failed ({error}) where ranks {ok} did not"
                raise error
            if failed:
                rank, what = failed[0]
                self._broken = f"rank {rank} failed: {what}"
                raise EngineError(
                    f"tensor-parallel rank {rank} failed where rank 0 did not: {what}"
                )
            mine = digest(result)
            for rank, (_, theirs) in answers:
                if theirs != mine:
                    raise EngineError(
                        f"tensor-parallel rank {rank} computed another result than rank 0 for "
                        f"{getattr(op, '__name__', op)}: the ranks' numerics are not replicated"
                    )
            return result

    def close(self) -> None:
        """Stop the ranks (each leaves the process group and exits; one that does not within
        30 s is killed) and leave the process group. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.state.objects.clear()
            self._stop_ranks()
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                if dist.is_initialized():
                    dist.destroy_process_group()
            gc.collect()
            _empty_device_cache(self.device_type)

    def __enter__(self) -> TpGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _why_not(self) -> str:
        if self._closed:
            return "closed"
        if self._broken is not None:
            return self._broken
        dead = [(r, p.poll()) for r, p in enumerate(self._procs, start=1)]
        return ", ".join(f"rank {r} exited with {c}" for r, c in dead if c is not None) or "?"

    def _expect(self, rank: int, conn: Connection, what: str, timeout_s: float) -> None:
        """Wait for rank `rank`'s `what` message while it starts."""
        if not conn.poll(timeout_s):
            raise EngineError(
                f"tensor-parallel rank {rank} did not say {what!r} in {timeout_s:g} s"
            )
        try:
            status, detail = conn.recv()
        except EOFError:
            code = self._procs[rank - 1].wait(timeout=30)
            raise EngineError(
                f"tensor-parallel rank {rank} exited with {code} while starting"
            ) from None
        if status != what:
            raise EngineError(f"tensor-parallel rank {rank} could not start: {detail}")

    def _answer(self, rank: int, conn: Connection) -> tuple[int, tuple[str, str]]:
        """Rank `rank`'s answer to the operation just sent: ("ok", digest) or ("error", why)."""
        try:
            if not conn.poll(self.timeout_s + 60):
                self._broken = f"rank {rank} gave no answer in {self.timeout_s + 60:g} s"
                return rank, ("error", self._broken)
            status, detail = conn.recv()
        except (EOFError, OSError):
            try:
                code: int | None = self._procs[rank - 1].wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            self._broken = f"rank {rank} closed its channel (exit status {code})"
            return rank, ("error", self._broken)
        return rank, (str(status), str(detail))

    def _stop_ranks(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(None))
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()


def _device_type(device: str | None) -> DeviceType:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise UnsupportedFormat(f"tensor parallel runs on CUDA GPUs or the CPU, not {kind}")
    if kind == "cuda" and torch.device(device).index not in (None, 0):
        raise UnsupportedFormat(
            f"a tensor-parallel group of this process takes cuda:0 onwards, not {device}: give "
            "the worker its GPUs with CUDA_VISIBLE_DEVICES"
        )
    return "cuda" if kind == "cuda" else "cpu"


def _check_can_start(degree: int, device_type: DeviceType) -> None:
    """Refuse, before any process starts, a group this host cannot run: too few GPUs, CPU ranks
    beside a GPU (transformers' TP loading takes the host's accelerator), or no accelerate
    (which transformers' TP loading needs)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("accelerate") is None:
        raise UnsupportedFormat(
            "tensor parallel needs the accelerate package (transformers' tp_plan loading): "
            "pip install 'replay-audit[tp]'"
        )
    if device_type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < degree:
            raise UnsupportedFormat(f"TP {degree} needs {degree} GPUs; this process sees {n}")
    elif torch.cuda.is_available():
        raise UnsupportedFormat(
            "tensor parallel on the CPU runs only on a host without CUDA (transformers' TP "
            "loading places every rank on the host's accelerator)"
        )


def _start_rank(
    rank: int,
    degree: int,
    port: int,
    device_type: DeviceType,
    threads: int | None,
    timeout_s: float,
) -> tuple[subprocess.Popen[bytes], Connection]:
    """Start rank `rank` (`python -m replay_audit.engine.tp_rank`) with its half of a private
    socket as the control channel, and return it with this process's half."""
    import socket

    import torch

    ours, theirs = socket.socketpair()
    env = {
        **os.environ,
        **NVLS_OFF,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(degree),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        ENV_CONTROL_FD: str(theirs.fileno()),
        ENV_PARENT_PID: str(os.getpid()),
        ENV_DEVICE: device_type,
        ENV_THREADS: str(threads if threads is not None else torch.get_num_threads()),
        ENV_TIMEOUT_S: repr(timeout_s),
    }
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "replay_audit.engine.tp_rank"],
            env=env,
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
    finally:
        theirs.close()  # the rank holds it now: its exit closes the channel
    return proc, Connection(ours.detach())


def _empty_device_cache(device_type: DeviceType) -> None:
    if device_type == "cuda":
        import torch

        torch.cuda.empty_cache()


# -- a rank's side ------------------------------------------------------------------------------


def die_with_parent(parent_pid: int) -> None:
    """This process gets SIGKILL when its parent dies (Linux's PR_SET_PDEATHSIG; elsewhere
    nothing), and exits now if the parent is already gone."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def follow(conn: Connection, state: RankState) -> None:
    """A started rank's loop: run each operation rank 0 sends, answer ("ok", digest) or
    ("error", why), until rank 0 says stop (None) or the channel closes."""
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            request = pickle.loads(message)  # rank 0's, over a private socket
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            request = ()
        else:
            if request is None:
                return
            conn.send(("taken", ""))
        if not conn.recv():  # a rank could not take it: no rank runs it
            continue
        op, args = request
        try:
            answer = ("ok", digest(op(state, *args)))
        except Exception as exc:
            answer = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(answer)


# -- operations (run on every rank) -----------------------------------------------------------


def _load_engine(
    state: RankState, key: str, model_dir: Path, target: Target, options: LoadOptions
) -> None:
    from replay_audit.engine.torch_engine import TorchEngine

    state.objects[key] = TorchEngine.load(model_dir, target, tp=state.placement, **options)


def _call(
    state: RankState, key: str, method: str, args: Sequence[object], kwargs: Mapping[str, object]
) -> object:
    return getattr(state.objects[key], method)(*args, **kwargs)


def _drop(state: RankState, key: str) -> None:
    state.objects.pop(key, None)
    gc.collect()
    _empty_device_cache(state.placement.device_type)


class TensorParallelEngine:
    """An `Engine` (and `HiddenStates`) at TP degree k: every rank of `group` holds a
    `TorchEngine` of the checkpoint loaded with transformers' tensor-parallel plan, and every
    probe runs on all of them (`TpGroup.run`); rank 0's answers. What needs no computation
    (the target, the environment, the tokenizer) is rank 0's engine's."""

    def __init__(self, group: TpGroup, key: str, local: TorchEngine) -> None:
        self.group = group
        self.key = key
        self.local = local

    @classmethod
    def load(
        cls, group: TpGroup, model_dir: Path, target: Target, **options: Unpack[LoadOptions]
    ) -> TensorParallelEngine:
        """Load `model_dir` in `target`'s format on every rank of `group`."""
        key = group.new_key(str(model_dir))
        group.run(_load_engine, key, Path(model_dir), target, options)
        local: TorchEngine = group.state.objects[key]
        return cls(group, key, local)

    def close(self) -> None:
        """Every rank drops its engine (nothing where the group is no longer usable)."""
        if self.group.alive:
            self.group.run(_drop, self.key)
        else:
            self.group.state.objects.pop(self.key, None)

    # -- the protocol -------------------------------------------------------------------------

    @property
    def target(self) -> Target:
        return self.local.target

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    def environment(self) -> Environment:
        return self.local.environment()

    def decode(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        eos_ids: Sequence[int] = (),
        intervention: Intervention | None = None,
        top_k: int = 5,
        *,
        forced_prefix: Sequence[int] = (),
    ) -> DecodeRun:
        args = (list(prompt_ids), max_new_tokens, list(eos_ids), intervention, top_k)
        run: DecodeRun = self._run("decode", args, {"forced_prefix": list(forced_prefix)})
        return run

    def scan(
        self,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        intervention: Intervention | None = None,
        top_k: int = 5,
    ) -> ScanRun:
        run: ScanRun = self._run(
            "scan", (list(prompt_ids), list(output_ids), intervention, top_k), {}
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
    ) -> StepInfo:
        info: StepInfo = self._run(
            "step", (list(prompt_ids), list(prefix_ids), intervention, top_k), {}
        )
        return info

    def step_batch(
        self,
        contexts: Sequence[Sequence[int]],
        intervention: Intervention,
        top_k: int = 5,
        *,
        token_budget: int = DEFAULT_SCAN_TOKEN_BUDGET,
    ) -> list[StepInfo]:
        infos: list[StepInfo] = self._run(
            "step_batch",
            ([list(c) for c in contexts], intervention, top_k),
            {"token_budget": token_budget},
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
        return self.local.detokenize(ids)

    def token_pieces(self, ids: Sequence[int]) -> tuple[Piece, ...] | None:
        return self.local.token_pieces(ids)

    def _run(self, method: str, args: Sequence[object], kwargs: Mapping[str, object]) -> Any:
        return self.group.run(_call, self.key, method, args, kwargs)
