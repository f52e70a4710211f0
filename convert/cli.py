"""`jdllm convert HF_DIR OUT_DIR` (also `python -m convert HF_DIR OUT_DIR`)."""

from __future__ import annotations

import argparse
import sys

from jdllm.checkpoint import DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", metavar="HF_DIR",
                        help="Hugging Face model directory (config.json + model.safetensors or a sharded index)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="jdllm checkpoint directory to create")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="parameter dtype of the checkpoint (default: bfloat16)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from convert.io import convert_checkpoint  # noqa: PLC0415 (keeps --help free of JAX)

    out = convert_checkpoint(args.hf_dir, args.out_dir, dtype=args.dtype, overwrite=args.overwrite,
                             progress=not args.quiet)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: same arguments as `jdllm convert`, errors as one line."""
    from jdllm.errors import JdllmError  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m convert",
                                     description="Hugging Face directory -> jdllm checkpoint")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except JdllmError as e:
        print(f"convert: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("convert: interrupted (nothing was written to OUT_DIR)", file=sys.stderr)
        return 130
