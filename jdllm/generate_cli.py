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
    p.add_argument("model", help="Hugging Face model directory or jdllm checkpoint")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    p.add_argument("--prompt-ids", action="append", default=[], type=_ids,
                   help="a prompt as comma-separated token ids (repeatable; for models without a tokenizer)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--dtype", default="float32", help="parameter dtype (float32, bfloat16)")
    p.add_argument("--attn-impl", default="auto", choices=("auto", "xla", "pallas", "cudnn"))
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--stop-token-id", type=int, action="append", default=None,
                   help="stop token id (repeatable; default: the model's eos ids)")
    s.add_argument("--show-steps", action="store_true", help="show which step revealed each token")
    add_paradigm_arguments(p)


def add_paradigm_arguments(p: argparse.ArgumentParser) -> None:
    """--paradigm plus one --field-name option per field of every registered paradigm config."""
    from jdllm.decode.loop import PARADIGMS  # noqa: PLC0415

    p.add_argument("--paradigm", choices=sorted(PARADIGMS), default=None,
                   help="decoding paradigm (default: ar for causal models, block_diffusion for block-causal)")
    g = p.add_argument_group("paradigm options (each applies to the paradigms that have it)")
    classes, fields = _paradigm_fields()
    for name, f in fields.items():
        owners = [n for n, c in classes.items() if name in {x.name for x in dataclasses.fields(c)}]
        flag = "--" + name.replace("_", "-")
        helptext = f"{', '.join(owners)} (default {f.default!r})"
        if isinstance(f.default, bool):
            g.add_argument(flag, dest=f"opt_{name}", action=argparse.BooleanOptionalAction, default=None,
                           help=helptext)
        else:
            kind = _field_type(f)
            plural = name.upper()[:-1] + "IES" if name.endswith("y") else name.upper() + "S"
            choices = getattr(classes[owners[0]], plural, None)
            g.add_argument(flag, dest=f"opt_{name}", type=kind, default=None, help=helptext, metavar=name.upper(),
                           choices=choices if isinstance(choices, tuple) else None)


def decoding_from_args(args, cfg, command: str = "generate"):
    """The paradigm config the parsed options describe (the model's default paradigm if none given)."""
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
    return cls(**{**base, **{n: v for n, v in given.items() if n in own}})


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


def run(args) -> int:
    import jdllm  # noqa: PLC0415

    model = jdllm.load(args.model, dtype=args.dtype, attn_impl=args.attn_impl)
    decoding = decoding_from_args(args, model.config)
    cls = type(decoding)
    sampling = jdllm.Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens, seed=args.seed,
                              stop_token_ids=None if args.stop_token_id is None else tuple(args.stop_token_id))
    prompts = list(args.prompt) + list(args.prompt_ids)
    if not prompts:
        raise jdllm.errors.InputError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    t0 = time.perf_counter()
    outs = jdllm.generate(model, prompts, decoding, sampling, apply_chat_template=args.chat)
    dt = time.perf_counter() - t0
    colour = sys.stdout.isatty()
    for i, out in enumerate(outs):
        if len(outs) > 1:
            print(f"=== prompt {i} ===")
        print(out.text if out.text is not None else out.token_ids)
        if args.show_steps:
            print(format_steps(model.tokenizer, out, colour))
        print(f"[{len(out.token_ids)} tokens, {max(out.step_map, default=0)} steps, nfe {out.nfe}, "
              f"finish {out.finish_reason}]", file=sys.stderr)
    total = sum(len(o.token_ids) for o in outs)
    print(f"[{cls.name}: {total} tokens in {dt:.2f}s incl. compile]", file=sys.stderr)
    return 0
