"""`jdllm generate MODEL --prompt ...`: generate from the command line.

Paradigm options are read off the registered paradigm config dataclasses
(`jdllm.decode.loop.PARADIGMS`): every field becomes `--field-name`, so a new
paradigm file brings its options with it. Only the options the user gives are
passed, to the chosen paradigm; each config checks its own values.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

_COLOURS = ("\033[31m", "\033[32m", "\033[33m", "\033[34m", "\033[35m", "\033[36m")
_RESET = "\033[0m"


def _paradigm_fields():
    """(paradigm classes by name, {field name: dataclasses.Field}) over all registered paradigms."""
    from jdllm.decode.loop import available_paradigms  # noqa: PLC0415

    classes = available_paradigms()
    fields: dict[str, dataclasses.Field] = {}
    for cls in classes.values():
        for f in dataclasses.fields(cls):
            fields.setdefault(f.name, f)
    return classes, fields


def _field_type(f: dataclasses.Field):
    """int / float / str for a config field, from its default or (None default) its annotation."""
    if f.default is not dataclasses.MISSING and f.default is not None:
        return type(f.default)
    ann = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for name, kind in (("float", float), ("int", int)):
        if name in ann:
            return kind
    return str


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids {text!r}: expected comma-separated integers") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    from jdllm.checkpoint import ATTN_IMPLS, DTYPES  # noqa: PLC0415 (light: no JAX)

    p.add_argument("model", help="Hugging Face model directory or jdllm checkpoint")
    # One list for both flags, so prompts come out in the order they were given.
    p.add_argument("--prompt", dest="prompts", action="append", default=[],
                   help="prompt text (repeat for a batch)")
    p.add_argument("--prompt-ids", dest="prompts", action="append", type=_ids,
                   help="a prompt as comma-separated token ids (repeatable; for models without a tokenizer)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="parameter dtype (default: float32)")
    add_quantize_arguments(p)
    p.add_argument("--attn-impl", default="auto", choices=ATTN_IMPLS,
                   help="attention implementation (default: auto = Pallas on a GPU, XLA elsewhere)")
    add_check_finite_argument(p)
    add_mesh_argument(p)
    p.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (one process per host; the cluster "
                        "environment, e.g. SLURM, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / "
                        "JAX_PROCESS_ID, says where the others are)")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to generate at most (default: 256, or what the model's context leaves)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    s.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--stop-token-id", type=int, action="append", default=None,
                   help="stop token id (repeatable; default: the model's eos ids)")
    s.add_argument("--show-steps", action="store_true", help="show which step revealed each token")
    add_constraint_arguments(p)
    add_paradigm_arguments(p)


def add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    """--quantize, --group-size and --kv-cache (generate, serve, bench; convert has its own)."""
    # choices: jdllm.quant.SCHEMES and KV_CACHE_DTYPES, spelled out so --help stays free of JAX
    p.add_argument("--quantize", default=None, choices=("int8", "fp8", "int4"),
                   help="weight-only quantization of the matmul weights, one scale per output channel "
                        "(int4: per --group-size inputs; --dtype stays the activation dtype; default: none)")
    p.add_argument("--group-size", type=int, default=None, metavar="N",
                   help="--quantize int4: contraction elements sharing a scale (default 128); it must divide "
                        "each weight's contracted axis (the head dim for the attention output)")
    p.add_argument("--kv-cache", default=None, choices=("int8",),
                   help="int8: the KV cache in int8, one scale per token and KV head (default: the activation dtype)")


def quantize_from_args(args):
    """`quantize=` for jdllm.load from --quantize / --group-size."""
    from jdllm.quant import quantization_arg  # noqa: PLC0415 (imports JAX: after parsing)

    return quantization_arg(args.quantize, args.group_size)


def add_constraint_arguments(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("constrained decoding (one for every prompt)")
    x = c.add_mutually_exclusive_group()
    x.add_argument("--regex", default=None, metavar="PATTERN", help="outputs that fully match PATTERN")
    x.add_argument("--json-schema", default=None, metavar="FILE", help="outputs valid under the JSON schema in FILE")
    x.add_argument("--lark", default=None, metavar="FILE", help="outputs in the language of the Lark grammar in FILE")
    c.add_argument("--constraint-backend", default="llguidance", choices=("llguidance", "dfa"),
                   help="constraint backend (default: llguidance)")


def add_mesh_argument(p) -> None:
    p.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="decode on a device mesh: rows split over D data shards, heads / MLP over M model "
                        "shards (D * M = the number of devices; see README 'Scaling out')")


def constraint_from_args(args):
    """The `jdllm.constraints` constraint the options describe, or None."""
    from jdllm import constraints, errors  # noqa: PLC0415

    def read(flag: str, path: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise errors.ConstraintError(f"{flag} {path!r}: cannot read it ({e.strerror})") from None

    backend = getattr(args, "constraint_backend", "llguidance")
    if getattr(args, "regex", None) is not None:
        return constraints.regex(args.regex, backend=backend)
    if getattr(args, "json_schema", None) is not None:
        return constraints.json_schema(read("--json-schema", args.json_schema), backend=backend)
    if getattr(args, "lark", None) is not None:
        return constraints.lark(read("--lark", args.lark), backend=backend)
    return None


def add_check_finite_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check-finite", action=argparse.BooleanOptionalAction, default=True,
                   help="check every weight is finite while loading (default: on)")


def _choices(cls, name: str):
    """A string option's accepted values, as the paradigm config declares them (or None)."""
    import sys as _sys  # noqa: PLC0415

    plural = name.upper()[:-1] + "IES" if name.endswith("y") else name.upper() + "S"
    module = _sys.modules[cls.__module__]
    for found in (getattr(cls, plural, None), getattr(module, plural, None),
                  getattr(module, name.upper() + "_MODES", None)):
        if isinstance(found, tuple):
            return found
    return None


def add_paradigm_arguments(p: argparse.ArgumentParser) -> None:
    """--paradigm plus one --field-name option per field of every registered paradigm config.

    An option several paradigms share lists each one's default (and choices) in
    its help; it is passed only to the chosen paradigm.
    """
    from jdllm.decode.loop import PARADIGMS  # noqa: PLC0415

    p.add_argument("--paradigm", choices=sorted(PARADIGMS), default=None,
                   help="decoding paradigm (default: ar for causal models, block_diffusion for block-causal, "
                        "masked_diffusion for bidirectional)")
    g = p.add_argument_group(
        "paradigm options (each applies to the paradigms named in its help; block sizes default to the "
        "model's block_size on block-causal models)")
    classes, fields = _paradigm_fields()
    for name, f in fields.items():
        owners = {n: c for n, c in classes.items() if name in {x.name for x in dataclasses.fields(c)}}
        flag = "--" + name.replace("_", "-")
        per = []
        union: list[str] = []
        for owner, cls in owners.items():
            default = next(x.default for x in dataclasses.fields(cls) if x.name == name)
            choices = _choices(cls, name)
            union += [c for c in choices or () if c not in union]
            per.append(f"{owner}: default {default!r}" + (f", one of {', '.join(choices)}" if choices else ""))
        helptext = "; ".join(per)
        if isinstance(f.default, bool):
            g.add_argument(flag, dest=f"opt_{name}", action=argparse.BooleanOptionalAction, default=None,
                           help=helptext)
        else:
            g.add_argument(flag, dest=f"opt_{name}", type=_field_type(f), default=None, help=helptext,
                           metavar=name.upper(), choices=union or None)


def decoding_from_args(args, cfg, command: str = "generate"):
    """The paradigm config the parsed options describe (the model's default paradigm if none given).

    On a block-causal model the block size (block_diffusion's block_length,
    multi_block's block_size) defaults to the model's own (`Paradigm.for_model`),
    as the default paradigm does.
    """
    from jdllm import errors  # noqa: PLC0415
    from jdllm.api import default_paradigm  # noqa: PLC0415

    classes, fields = _paradigm_fields()
    if args.paradigm is None:
        decoding = default_paradigm(cfg)
        cls = type(decoding)
        base = {f.name: getattr(decoding, f.name) for f in dataclasses.fields(cls)}
    else:
        if args.paradigm not in classes:
            raise errors.DecodingConfigError(
                f"paradigm {args.paradigm!r} is not available in this installation; "
                f"available: {sorted(classes)}")
        cls, base = classes[args.paradigm], {}
    own = {f.name for f in dataclasses.fields(cls)}
    given = {n: getattr(args, f"opt_{n}") for n in fields if getattr(args, f"opt_{n}", None) is not None}
    ignored = sorted(set(given) - own)
    if ignored:
        print(f"jdllm {command}: note: {', '.join('--' + n.replace('_', '-') for n in ignored)} "
              f"does not apply to {cls.name}", file=sys.stderr)
    given = {n: v for n, v in given.items() if n in own}
    # a default denoising_steps that does not divide the block (the model's, or --block-length's) becomes
    # the block's length: one token a step, rather than an error about a value the user never set
    steps = base.get("denoising_steps", next((f.default for f in dataclasses.fields(cls)
                                              if f.name == "denoising_steps"), None))
    block = given.get("block_length", base.get("block_length"))
    if block is None and "block_length" in own and cfg.attention == "block_causal":
        block = cfg.block_size  # what `BlockDiffusion.for_model` makes of block_length=None
    if (steps is not None and "denoising_steps" not in given and isinstance(block, int) and block >= 1
            and block % steps):
        base["denoising_steps"] = block
        if "block_length" in given:
            print(f"jdllm {command}: note: --denoising-steps is {block} (one token a step): the default {steps} "
                  f"does not divide --block-length {block}; give --denoising-steps to choose", file=sys.stderr)
    choices = {n: _choices(cls, n) for n in given if isinstance(given[n], str)}
    for n, allowed in choices.items():
        if allowed is not None and given[n] not in allowed:
            raise errors.DecodingConfigError(
                f"--{n.replace('_', '-')} {given[n]} is not one of {allowed} for {cls.name}")
    return cls(**{**base, **given}).for_model(cfg)  # the block size the run uses, shown as such


def format_steps(tokenizer, out, colour: bool) -> str:
    """Tokens grouped (or coloured) by the step that revealed them."""
    piece = (lambda t: tokenizer.decode([t])) if tokenizer is not None else str
    if colour:
        text = "".join(f"{_COLOURS[(s - 1) % len(_COLOURS)]}{piece(t)}{_RESET}"
                       for t, s in zip(out.token_ids, out.step_map))
        return text + f"\n({max(out.step_map, default=0)} steps; colour = step mod {len(_COLOURS)})"
    by_step: dict[int, list[str]] = {}
    for t, s in zip(out.token_ids, out.step_map):
        by_step.setdefault(s, []).append(repr(piece(t)))
    return "\n".join(f"step {s:4d}: {' '.join(v)}" for s, v in sorted(by_step.items()))


def jax_process_index() -> int:
    import jax  # noqa: PLC0415

    return jax.process_index()


def run_command(args) -> int:
    import jdllm  # noqa: PLC0415

    if not args.prompts:
        raise jdllm.errors.InputError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    extra = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
    sampling = jdllm.Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              stop_token_ids=None if args.stop_token_id is None else tuple(args.stop_token_id),
                              **extra)  # checked before the model loads (jdllm.inputs.check_temperature, ...)
    mesh = None
    if getattr(args, "mesh", None) or getattr(args, "distributed", False):
        from jdllm import sharding  # noqa: PLC0415

        if args.distributed:
            sharding.initialize_distributed()
        mesh = sharding.make_mesh(args.mesh)
    model = jdllm.load(args.model, dtype=args.dtype, attn_impl=args.attn_impl, check_finite=args.check_finite,
                       mesh=mesh, quantize=quantize_from_args(args), kv_cache=args.kv_cache)
    decoding = decoding_from_args(args, model.config)
    cls = type(decoding)
    constraint = constraint_from_args(args)
    t0 = time.perf_counter()
    outs = jdllm.generate(model, list(args.prompts), decoding, sampling, apply_chat_template=args.chat,
                          constraint=constraint)
    dt = time.perf_counter() - t0
    colour = sys.stdout.isatty()
    if mesh is not None and jax_process_index() != 0:  # every process holds the same outputs
        return 0
    for i, out in enumerate(outs):
        if len(outs) > 1:
            print(f"=== prompt {i} ===")
        print(out.text if out.text is not None else out.token_ids)
        if args.show_steps:
            print(format_steps(model.tokenizer, out, colour))
        print(f"[{len(out.token_ids)} tokens, {max(out.step_map, default=0)} steps, nfe {out.nfe}, "
              f"finish {out.finish_reason}"
              + ("" if out.constraint_ok is None else f", constraint_ok {out.constraint_ok}") + "]", file=sys.stderr)
    total = sum(len(o.token_ids) for o in outs)
    print(f"[{cls.name}: {total} tokens in {dt:.2f}s incl. compile]", file=sys.stderr)
    return 0
