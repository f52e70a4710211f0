"""`jdllm` command line: convert, generate, bench.

Each subcommand lives beside the code it drives and registers itself through
`add_arguments(parser)` / `run(args)`; this file only dispatches and turns a
`jdllm.errors.JdllmError` into one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "convert": ("convert.cli", "Hugging Face directory -> jdllm checkpoint"),
    "generate": ("jdllm.generate_cli", "generate text with a model directory"),
    "bench": ("jdllm.bench_cli", "run the decode benchmark on a model directory"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jdllm", description="Diffusion language models on JAX/XLA.")
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


def main(argv: list[str] | None = None) -> int:
    from jdllm.errors import JdllmError  # noqa: PLC0415

    args = build_parser().parse_args(argv)
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except JdllmError as e:
        print(f"jdllm {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"jdllm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
