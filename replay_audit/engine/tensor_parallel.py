"""Tensor-parallel execution: one process per rank, every rank a child of this process.

The group, its lockstep and what each rank computes: docs/engine.md "Tensor parallel".

This process drives and joins no process group itself: closing a group stops its processes, and
the next group, of any degree, is k new processes. (A process that closed one NCCL group and
made another segfaulted in transformers' device-mesh setup on 2x H200.)

Every rank answers each operation with a digest of its result, so a result says what every rank
computed, not what rank 0 hoped they did.

    TpGroup                the processes and their store; `run(op, *args)`
    TensorParallelEngine   (`tp_engine`) an `Engine` whose every call is a `run` of each
                           rank's own `TorchEngine`
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

from replay_audit.exceptions import EngineError, UnsupportedFormat

log = logging.getLogger(__name__)

#: NVLink multicast (NVLS) off in every rank: set in this process before its NCCL communicator
#: exists and in each rank's environment (the issue's rule: a program using it can put a host's
#: shared GPUs out of service).
NVLS_OFF: Final[Mapping[str, str]] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
#: Seconds a collective may wait for the other ranks before it fails (the process group's
#: timeout), and the driving process for a rank's answer beyond it.
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
T = TypeVar("T")


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
    key the driving process gave them)."""

    placement: TpPlacement
    objects: dict[str, object] = field(default_factory=dict)

    def get(self, key: str, kind: type[T]) -> T:
        """The object kept under `key`, which is a `kind`."""
        obj = self.objects[key]
        if not isinstance(obj, kind):
            raise TypeError(f"{key} holds a {type(obj).__name__}, not a {kind.__name__}")
        return obj


#: An operation every rank runs: a module-level function (pickled by reference) of the rank's
#: state and the arguments the driving process sent.
Op = Callable[..., object]


class TpGroup:
    """k >= 2 rank processes joined by torch.distributed, all started by this process, which
    drives them and is no rank itself. `device` "cuda" puts rank r on cuda:r (NCCL), "cpu" every
    rank on the CPU (gloo); None: CUDA when available. `threads`: torch's CPU threads per rank
    (None: this process's count)."""

    def __init__(
        self,
        degree: int,
        *,
        device: str | None = None,
        threads: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        import torch.distributed as dist

        if degree < 2:
            raise ValueError("a tensor-parallel group has at least two ranks")
        device_type = _device_type(device)
        _check_can_start(degree, device_type)
        self.degree = degree
        self.device_type: DeviceType = device_type
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._broken: str | None = None
        self._closed = False
        # The ranks' rendezvous: served here for the group's life, joined by every rank.
        self._store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1",
            0,
            degree + 1,
            is_master=True,
            timeout=timedelta(seconds=start_timeout_s),
            wait_for_workers=False,
        )
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        try:
            for rank in range(degree):
                proc, conn = _start_rank(
                    rank, degree, self._store.port, device_type, threads, timeout_s
                )
                self._procs.append(proc)
                self._conns.append(conn)
            for what in ("started", "ready"):
                for rank, conn in enumerate(self._conns):
                    self._expect(rank, conn, what, start_timeout_s)
        except BaseException:
            self._stop_ranks()
            self._closed = True
            raise
        log.info(
            "tensor-parallel group of %d ranks (%s, %s): rank pids %s",
            degree,
            device_type,
            backend_for(device_type),
            ", ".join(str(p.pid) for p in self._procs),
        )

    @property
    def alive(self) -> bool:
        """Whether the group can run operations (not closed, not broken, every rank running)."""
        return (
            not self._closed and self._broken is None and all(p.poll() is None for p in self._procs)
        )

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids (rank 0 first)."""
        return [p.pid for p in self._procs]

    def new_key(self, what: str) -> str:
        """A key no object of this group has had: what the ranks keep an object under."""
        return f"{what}#{next(self._keys)}"

    def run(self, op: Op, *args: object) -> Any:
        """`op(state, *args)` on every rank, rank 0's result returned.

        An operation a rank cannot read, or one that fails on every rank alike, raises and leaves
        the group usable. Ranks that disagree (one failed, or computed other bits) raise
        `EngineError`; a rank that failed alone or went silent leaves the group broken (`alive`
        False), since the ranks may no longer be in step."""
        with self._lock:
            if not self.alive:
                raise EngineError(f"the tensor-parallel group is not usable: {self._why_not()}")
            message = pickle.dumps((op, args), protocol=5)
            for conn in self._conns:
                conn.send_bytes(message)
            # Every rank reads the operation before any runs it: one that cannot refuses it,
            # and no rank waits in a collective for it.
            taken = [self._answer(rank, conn) for rank, conn in enumerate(self._conns)]
            refused = [(rank, a.detail) for rank, a in enumerate(taken) if a.status != "taken"]
            go = not refused
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send(go)
            if refused:
                rank, what = refused[0]
                raise EngineError(
                    f"tensor-parallel rank {rank} could not take the operation: {what}"
                )
            try:
                answers = [self._answer(rank, conn) for rank, conn in enumerate(self._conns)]
            except BaseException:  # Ctrl-C mid-operation: the ranks' answers are not read
                self._broken = "interrupted while the ranks ran an operation"
                raise
            failed = [(rank, a) for rank, a in enumerate(answers) if a.status != "ok"]
            if failed and len(failed) == len(answers):
                raise answers[0].error()  # every rank failed alike: rank 0's error
            if failed:
                rank, answer = failed[0]
                ok = [r for r, a in enumerate(answers) if a.status == "ok"]
                self._broken = f"rank {rank} failed ({answer.detail}) where ranks {ok} did not"
                raise EngineError(f"tensor-parallel {self._broken}")
            mine = answers[0].detail
            for rank, answer in enumerate(answers[1:], start=1):
                if answer.detail != mine:
                    raise EngineError(
                        f"tensor-parallel rank {rank} computed another result than rank 0 for "
                        f"{getattr(op, '__name__', op)}: the ranks' numerics are not replicated"
                    )
            return pickle.loads(answers[0].payload)  # rank 0's, over a private socket

    def close(self) -> None:
        """Stop the ranks (each leaves the process group and exits; one that does not within
        30 s is killed) and the store. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop_ranks()
            del self._store

    # -- internals ----------------------------------------------------------------------------

    def _why_not(self) -> str:
        if self._closed:
            return "closed"
        if self._broken is not None:
            return self._broken
        dead = [(r, p.poll()) for r, p in enumerate(self._procs)]
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
            code = self._procs[rank].wait(timeout=30)
            raise EngineError(
                f"tensor-parallel rank {rank} exited with {code} while starting"
            ) from None
        if status != what:
            raise EngineError(f"tensor-parallel rank {rank} could not start: {detail}")

    def _answer(self, rank: int, conn: Connection) -> Answer:
        """Rank `rank`'s answer to the operation just sent (an error where it gave none)."""
        try:
            if not conn.poll(self.timeout_s + 60):
                self._broken = f"rank {rank} gave no answer in {self.timeout_s + 60:g} s"
                return Answer("error", self._broken)
            answer = conn.recv()  # a rank's, over a private socket
        except (EOFError, OSError):
            try:
                code: int | None = self._procs[rank].wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            self._broken = f"rank {rank} closed its channel (exit status {code})"
            return Answer("error", self._broken)
        if not isinstance(answer, Answer):
            self._broken = f"rank {rank} answered {type(answer).__name__}"
            return Answer("error", self._broken)
        return answer

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


@dataclass(frozen=True)
class Answer:
    """A rank's answer: "taken" (it read the operation), "refused" (it could not), "ok" (its
    result's digest in `detail`) or "error" (why in `detail`); `payload` is rank 0's pickled
    result, or the pickled exception a rank raised where it pickles."""

    status: Literal["taken", "refused", "ok", "error"]
    detail: str
    payload: bytes = b""

    def error(self) -> Exception:
        """The exception this "error" answer carries (an `EngineError` of its text where the
        rank's own could not travel)."""
        with contextlib.suppress(Exception):
            exc = pickle.loads(self.payload)  # a rank's, over a private socket
            if isinstance(exc, Exception):
                return exc
        return EngineError(self.detail)

    @classmethod
    def of_error(cls, exc: Exception) -> Answer:
        detail = f"{type(exc).__name__}: {exc}"
        try:
            payload = pickle.dumps(exc, protocol=5)
            pickle.loads(payload)  # an exception whose arguments do not rebuild it stays here
        except Exception:
            payload = b""
        return cls("error", detail, payload)


def check_shards(model_dir: Path, degree: int) -> None:
    """Refuse TP `degree` for a checkpoint whose attention heads or KV heads it does not divide
    (its `config.json`), before any process starts: transformers' plan would split heads
    across ranks and compute something no server runs, where vLLM refuses such a degree
    ("Total number of attention heads must be divisible by tensor parallel size")."""
    if degree < 2:
        return
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return  # no readable config: the load says what is wrong
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    for name, n in (("attention heads", heads), ("KV heads", kv_heads)):
        if isinstance(n, int) and n % degree:
            raise UnsupportedFormat(
                f"TP {degree} does not divide the checkpoint's {n} {name}: a tensor-parallel "
                "degree must divide them",
                field="tp_degree",
            )


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
    """Start rank `rank`, a private socket pair its control channel; return our half."""
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


def empty_device_cache(device_type: DeviceType) -> None:
    """Give the allocator's cached blocks back to the device (nothing on the CPU)."""
    if device_type == "cuda":
        import torch

        torch.cuda.empty_cache()


# -- a rank's side ------------------------------------------------------------------------------


def die_with_parent(parent_pid: int) -> None:
    """This process lives as long as its parent (SIGKILL by Linux's PR_SET_PDEATHSIG), and
    ignores SIGINT and SIGTERM sent to the whole process group: the driving process decides
    when the operation in progress ends (a worker's warm shutdown) and stops its ranks itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def follow(conn: Connection, state: RankState) -> None:
    """A rank's loop over the driving process's operations (`TpGroup.run`), until told to stop
    (None) or the channel closes."""
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            request = pickle.loads(message)  # the driving process's, over a private socket
        except Exception as exc:
            conn.send(Answer("refused", f"{type(exc).__name__}: {exc}"))
            request = ()
        else:
            if request is None:
                return
            conn.send(Answer("taken", ""))
        if not conn.recv():  # a rank could not take it: no rank runs it
            continue
        op, args = request
        try:
            result = op(state, *args)
            payload = pickle.dumps(result, protocol=5)
            answer = Answer(
                "ok",
                hashlib.sha256(payload).hexdigest(),
                payload if state.placement.rank == 0 else b"",
            )
        except Exception as exc:
            answer = Answer.of_error(exc)
        conn.send(answer)
