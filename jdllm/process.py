"""What a jdllm command does to its own process: the environment it sets, how Ctrl-C ends it,
how it exits. Shared by the `jdllm` command (`jdllm.cli`) and `python -m convert` (`convert.cli`);
imports nothing heavy (no JAX), so both stay quick to start.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading

INTERRUPTED = 130  # the exit code after Ctrl-C (128 + SIGINT)
TERMINATED = 143  # the exit code after SIGTERM (128 + SIGTERM), as a shell reports a process it ended


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where `interrupt_outside_gc(signal.SIGTERM)` is in force: a KeyboardInterrupt
    (so every cleanup that runs on Ctrl-C runs) that exits with 143, not Ctrl-C's 130."""


def interrupt_code(e: KeyboardInterrupt) -> int:
    """The exit code for an interruption: 143 after SIGTERM (`Terminated`), 130 after Ctrl-C."""
    return TERMINATED if isinstance(e, Terminated) else INTERRUPTED


def quiet_transformers() -> None:
    """Silence transformers' import-time advice ("PyTorch was not found ..."): jdllm never needs
    PyTorch, and the notice reads as an error. Entry points only: they own their process."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def exit_on_interrupt(command: str) -> None:
    """Make Ctrl-C end the process at once with code 130. A KeyboardInterrupt raised while JAX
    runs can be swallowed (in one of its gc callbacks) or crash the interpreter's teardown, so
    for commands with nothing to clean up the handler leaves directly."""
    def handler(signum, frame):
        print(f"{command}: interrupted", file=sys.stderr)
        exit_with(INTERRUPTED)

    signal.signal(signal.SIGINT, handler)


def interrupt_outside_gc(signum: int = signal.SIGINT):
    """Make Ctrl-C (or signal `signum`: SIGTERM raises `Terminated`, a KeyboardInterrupt) raise
    KeyboardInterrupt, but never inside a garbage-collector callback (JAX registers one), where Python would print the exception and
    drop it: there the signal is sent again a moment later, so the command still stops and cleans
    up. Returns the handler it replaced."""
    def handler(signum, frame):
        callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks} - {None}
        f = frame
        while f is not None:
            if f.f_code in callbacks:
                again = threading.Timer(0.05, os.kill, (os.getpid(), signum))
                again.daemon = True
                again.start()
                return
            f = f.f_back
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt

    return signal.signal(signum, handler)


def exit_with(code: int):
    """Leave the process with `code`. After Ctrl-C or SIGTERM, skip the interpreter's teardown: JAX
    can crash there (a segmentation fault) when interrupted mid-compile. Once the command is done,
    a Ctrl-C during the teardown is ignored for the same reason."""
    if code not in (INTERRUPTED, TERMINATED):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    sys.exit(code)


__all__ = ["INTERRUPTED", "TERMINATED", "Terminated", "interrupt_code", "quiet_transformers", "exit_on_interrupt", "interrupt_outside_gc", "exit_with"]
