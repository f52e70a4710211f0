"""`jdllm serve MODEL --paradigm ... --max-batch N --port P [--mesh data=D,model=M]`: the OpenAI-compatible
server."""

from __future__ import annotations

import argparse
import os
import sys


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: give 1-65535 (0: any free port)")
    return port


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    from jdllm.checkpoint import ATTN_IMPLS, DTYPES  # noqa: PLC0415 (light: no JAX)
    from jdllm.generate_cli import (add_check_finite_argument, add_quantize_arguments,  # noqa: PLC0415
                                    add_mesh_argument, add_paradigm_arguments)

    p.add_argument("model", help="Hugging Face model directory or jdllm checkpoint")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    from jdllm.serve.openai_protocol import DEFAULT_MAX_BODY_BYTES  # noqa: PLC0415 (light: no JAX)

    p.add_argument("--port", type=_port, default=8000,
                   help="port to listen on, checked before the model loads (default: 8000; 0: any free port)")
    p.add_argument("--max-body-bytes", type=_positive, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"request bodies past this size are refused with 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--model-name", default=None, help="the id clients pass as `model` (default: the directory name)")
    p.add_argument("--max-batch", type=int, default=8, help="rows decoding at once (default: 8)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a row beyond which the server answers 429 (default: 256)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt accepted (default: the model's context, at most 512)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="longest generation a request may ask for (default: the model's context, at most 256)")
    p.add_argument("--steps-per-round", type=int, default=4,
                   help="decoding steps between two scheduling rounds (default: 4)")
    p.add_argument("--constraint-states", type=int, default=0,
                   help="accept constrained requests (response_format json_schema, jdllm.regex / choice) with "
                        "token DFAs of up to this many states, enforced on the device (default: 0, none)")
    p.add_argument("--constraint-classes", type=int, default=64,
                   help="token classes a constraint's DFA may have (with --constraint-states; default: 64)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="parameter dtype (default: float32)")
    add_quantize_arguments(p)
    p.add_argument("--attn-impl", default="auto", choices=ATTN_IMPLS)
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add_check_finite_argument(p)
    add_mesh_argument(p)
    add_paradigm_arguments(p)


def run_command(args) -> int:
    import jdllm  # noqa: PLC0415
    from jdllm.generate_cli import decoding_from_args, quantize_from_args  # noqa: PLC0415

    try:
        from jdllm.serve import server  # noqa: PLC0415
        import fastapi, uvicorn  # noqa: F401, E401, PLC0415
    except ImportError as e:
        raise jdllm.errors.InputError(f"`jdllm serve` needs the serve extra ({e.name} is missing): "
                                      'pip install "jdllm[serve]"') from None
    from jdllm.serve.engine import Engine  # noqa: PLC0415

    sock = server.bind(args.host, args.port)  # a port in use fails now, not after loading the model
    try:
        mesh = None
        if args.mesh:
            from jdllm import sharding  # noqa: PLC0415

            mesh = sharding.make_mesh(args.mesh)
        model = jdllm.load(args.model, dtype=args.dtype, attn_impl=args.attn_impl, check_finite=args.check_finite,
                           mesh=mesh, quantize=quantize_from_args(args), kv_cache=args.kv_cache)
        decoding = decoding_from_args(args, model.config, command="serve")
        engine = Engine(model, decoding, max_batch=args.max_batch, max_queue=args.max_queue,
                        max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                        steps_per_round=args.steps_per_round, constraint_states=args.constraint_states,
                        constraint_classes=args.constraint_classes)
    except BaseException:
        sock.close()
        raise
    name = args.model_name or os.path.basename(os.path.normpath(args.model))
    port = sock.getsockname()[1]
    print(f"jdllm serve: {name} ({decoding.name}, {args.max_batch} rows) on http://{args.host}:{port}/v1",
          file=sys.stderr)
    server.serve(engine, name, host=args.host, port=port, log_level=args.log_level, sock=sock,
                 max_body_bytes=args.max_body_bytes)
    return 0
