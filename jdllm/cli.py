"""`jdllm` command line: convert, generate, bench, serve.

Each subcommand lives beside the code it drives and registers itself through
`add_arguments(parser)` / `run_command(args)`; this file only dispatches, shows
jdllm's warnings as one-line notes, and turns a `jdllm.errors.JdllmError` into
one line on stderr and exit code 2 (Ctrl-C: exit code 130; SIGTERM during convert: 143).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import warnings

from jdllm import __version__
from jdllm.errors import JdllmError
from jdllm.process import (INTERRUPTED, exit_on_interrupt, exit_with, interrupt_code, interrupt_outside_gc,
                           quiet_transformers)

# subcommand -> module exposing add_arguments(parser) and run_command(args) -> int
SUBCOMMANDS = {
    "convert": ("convert.cli", "Hugging Face directory -> jdllm checkpoint"),
    "generate": ("jdllm.generate_cli", "generate text with a model directory"),
    "bench": ("jdllm.bench_cli", "run the decode benchmark on a model directory"),
    "serve": ("jdllm.serve.cli", "OpenAI-compatible HTTP server with continuous batching"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jdllm", description="Diffusion language models on JAX/XLA.")
    p.add_argument("--version", action="version", version=f"jdllm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (mod, help_) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue  # subcommand not built yet: leave it out rather than break the others
        sp = sub.add_parser(name, help=help_, description=help_)
        module.add_arguments(sp)
        sp.set_defaults(_module=mod)
    return p


@contextlib.contextmanager
def notes(command: str):
    """Warnings raised while the command runs print as `<command>: note: <message>`."""
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"{command}: note: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


@contextlib.contextmanager
def progress(command: str):
    """Turn on JAX's persistent compilation cache (`jdllm.compile_cache`, before anything compiles;
    a bad JDLLM_CACHE_DIR fails here) and, while the command runs, progress lines on stderr for its
    long compiles (`jdllm.compile_progress`). Commands that never compile (convert) skip both."""
    if command == "jdllm convert":
        yield
        return
    from jdllm import compile_cache, compile_progress  # noqa: PLC0415 (imports JAX)

    compile_cache.enable()
    with compile_progress.show(command):
        yield


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """Run one command; returns the exit code (2 on a jdllm error, 130 on Ctrl-C).

    own_process: the console script's call; Ctrl-C then ends the process at once
    (`exit_on_interrupt`), except for `convert`, which removes its partial
    output on the way out (`interrupt_outside_gc`).
    """
    quiet_transformers()
    command = "jdllm"
    try:
        args = build_parser().parse_args(argv)
        command = f"jdllm {args.command}"
        if own_process:
            interrupt_outside_gc() if args.command == "convert" else exit_on_interrupt(command)
        with notes(command), progress(command):
            return int(importlib.import_module(args._module).run_command(args) or 0)
    except JdllmError as e:
        print(f"{command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C: 130; SIGTERM (convert turns it into `Terminated`): 143
        code = interrupt_code(e)
        print(f"{command}: {'terminated' if code != INTERRUPTED else 'interrupted'}", file=sys.stderr)
        return code


def entry() -> None:
    """The `jdllm` console script."""
    exit_on_interrupt("jdllm")  # until the command is known (imports can crash when interrupted)
    try:
        code = main(own_process=True)
    except KeyboardInterrupt as e:  # between main's handlers and here
        code = interrupt_code(e)
    exit_with(code)


if __name__ == "__main__":
    entry()
