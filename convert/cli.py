"""`jdllm convert HF_DIR OUT_DIR` (also `python -m convert HF_DIR OUT_DIR`)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from jdllm.checkpoint import DTYPES  # noqa: PLC0415 (light: no JAX)

    parser.add_argument("hf_dir", metavar="HF_DIR",
                        help="Hugging Face model directory (config.json + model.safetensors or a sharded index)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="jdllm checkpoint directory to create")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="parameter dtype of the checkpoint (default: bfloat16)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT_DIR if it is a jdllm checkpoint or an empty directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--quantize", default=None, choices=("int8", "fp8", "int4"),  # jdllm.quant.SCHEMES
                        help="store the matmul weights quantized (weight-only; int8 / fp8: one scale per output "
                             "channel, int4: one per --group-size inputs; --dtype is then the activation "
                             "dtype); `jdllm.load` reads them as they are")
    parser.add_argument("--group-size", type=int, default=None, metavar="N",
                        help="int4: contraction elements sharing a scale (default 128); it must divide each "
                             "weight's contracted axis (the head dim for the attention output)")
    parser.add_argument("--check-finite", action=argparse.BooleanOptionalAction, default=True,
                        help="refuse weights holding NaN / inf, in the source or once cast to --dtype; each "
                             "tensor is checked as it streams by (default: on)")


def run_command(args: argparse.Namespace) -> int:
    from convert.io import convert_checkpoint  # noqa: PLC0415 (keeps --help free of JAX)

    from jdllm.quant import quantization_arg  # noqa: PLC0415

    quantize = quantization_arg(args.quantize, args.group_size)
    out = convert_checkpoint(args.hf_dir, args.out_dir, dtype=args.dtype, overwrite=args.overwrite,
                             progress=not args.quiet, check_finite=args.check_finite, quantize=quantize)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """Stand-alone entry point: same arguments as `jdllm convert`, errors as one line (exit 2),
    Ctrl-C as exit 130, SIGTERM during the conversion as 143 (own_process: as `jdllm.cli.main`)."""
    try:
        from jdllm import __version__  # noqa: PLC0415
        from jdllm.process import interrupt_outside_gc, quiet_transformers  # noqa: PLC0415
        from jdllm.errors import JdllmError  # noqa: PLC0415

        quiet_transformers()
        parser = argparse.ArgumentParser(prog="python -m convert",
                                         description="Hugging Face directory -> jdllm checkpoint")
        parser.add_argument("--version", action="version", version=f"jdllm {__version__}")
        add_arguments(parser)
        args = parser.parse_args(argv)
        if own_process:
            interrupt_outside_gc()
        try:
            return run_command(args)
        except JdllmError as e:
            print(f"convert: error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    except KeyboardInterrupt as e:
        from jdllm.process import INTERRUPTED, interrupt_code  # noqa: PLC0415 (light: no JAX)

        code = interrupt_code(e)
        word = "interrupted" if code == INTERRUPTED else "terminated"
        print(f"convert: {word} (nothing was written to OUT_DIR)", file=sys.stderr)
        return code
