"""How every command ends, on Ctrl-C (SIGINT), SIGTERM or a normal return: the threads this
process started are stopped and joined before the interpreter exits. Why: the in-process runner,
the embedded scheduler and the webhook runner are daemon threads, and one still inside torch
while the interpreter tears down aborts the whole process ("terminate called without an active
exception"), after the rest of the output is lost.

- SIGINT and SIGTERM raise `Interrupted` (a `KeyboardInterrupt`) in the main thread; uvicorn,
  while it serves, takes both over and raises the signal again once it has shut down;
- what the command started, it owns (`own`) and stops in reverse start order: the scheduler (a
  tick enqueues jobs) before the runners; a replay job returns between two traces, queued again
  in the database (`replays.tasks`) for the reconciler to re-enqueue (at the next `serve`);
- a second Ctrl-C while they stop leaves at once, as does a thread still running after
  `STOP_TIMEOUT_S` (with no C++ teardown: `os._exit`).

Exit codes: 130 after SIGINT (the shell's convention), 0 after SIGTERM (a service asked to stop
has stopped), the command's own otherwise.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from types import FrameType
from typing import Final

#: Seconds the threads get to stop (a replay job finishes the trace it is on).
STOP_TIMEOUT_S: Final = 30.0
SIGNALS: Final = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; raised in the main thread, where Ctrl-C raises
    KeyboardInterrupt (so whatever handles that handles both)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: A thread's stop: `stop(timeout_s)`, False if it is still running after that.
Stop = Callable[[float | None], bool]

#: What the running command owns, in start order: bound afresh per command, so nothing
#: outlives it and nothing is kept process-wide.
_owned: ContextVar[list[Stop] | None] = ContextVar("replay_audit_command_threads", default=None)


def own(stop: Stop) -> None:
    """Have `stop(timeout_s)` called when the running command ends, however it ends, before
    what was owned earlier: own a runner before the scheduler that feeds it. Outside
    `stopping_threads_on_exit` (a command's function called directly) nothing is owned."""
    owned = _owned.get()
    if owned is not None:
        owned.append(stop)


def stop_background_threads(owned: list[Stop], timeout_s: float | None = STOP_TIMEOUT_S) -> bool:
    """Stop the owned threads, the last started first; False if one still runs after `timeout_s`."""
    return all([stop(timeout_s) for stop in reversed(owned)])


def _leave_now(signum: int, _frame: FrameType | None) -> None:
    _flush()
    os._exit(128 + signum)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):  # a closed pipe: nothing more to say
            stream.flush()


@contextmanager
def stopping_threads_on_exit() -> Iterator[None]:
    """Run a command as the module docstring says. Outside the main thread (where signals
    cannot be handled) only the threads are stopped."""
    received: list[int] = []

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        raise Interrupted(signum)

    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, interrupt) for sig in SIGNALS} if main else {}
    owned: list[Stop] = []
    token = _owned.set(owned)
    code: int | str | None = None
    try:
        yield
    except Interrupted:
        pass  # the exit code is the signal's, below
    except SystemExit as exc:  # Typer turns KeyboardInterrupt into exit code 130
        code = exc.code
        if not received:
            raise
    finally:
        for sig in previous:
            signal.signal(sig, _leave_now)
        try:
            clean = stop_background_threads(owned)
        finally:
            _owned.reset(token)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if received:
            code = 0 if received[0] == signal.SIGTERM else 128 + received[0]  # module docstring
        if not clean:
            print("error: a worker thread did not stop in time; leaving it", file=sys.stderr)
            _flush()
            os._exit(code if isinstance(code, int) else 1)
    if received:
        raise SystemExit(code)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held back while the block runs (delivered, and so `Interrupted`
    raised, right after it): a result line and its count are written together or not at all."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
