"""lm-evaluation-harness on jdllm models: the `jdllm` model type (`JdllmLM`), every paradigm.

    pip install -e ".[eval]"
    python -m jdllm.evaluation --model jdllm \\
        --model_args path=models/tiny-llada,paradigm=masked_diffusion,steps=16,mc_samples=64 \\
        --tasks TASK [--include_path DIR_OF_TASK_YAMLS] [--batch_size 8]

`python -m jdllm.evaluation` is lm-evaluation-harness' own command line with the `jdllm` model
registered (the harness finds models only among those imported; LLaDA's eval_llada.py does the
same). From Python: `lm_eval.simple_evaluate(model=JdllmLM(model=jdllm_model, ...), tasks=[...])`.

* loglikelihood (multiple choice, ...): `jdllm.loglikelihood`: exact on causal models, a Monte
  Carlo ELBO (`mc_samples`, `mc_batch`, `seed`) on masked-diffusion (LLaDA's) and block-diffusion
  (SDAR, BD3-LM form) ones; `check_greedy` runs LLaDA's greedy check on masked-diffusion models
  (off by default, as LLaDA's: it costs one forward per token).
* loglikelihood_rolling (perplexity): causal models, in windows of `max_length` tokens.
* generate_until: `jdllm.generate` with the paradigm given (`paradigm=` and its fields as
  model_args, as `jdllm generate --paradigm ... --field ...`; the model's default paradigm
  otherwise), `batch_size` prompts at a time, each cut before its first `until` string.

model_args: `path` (or `model=`, a loaded `jdllm.Model`, from Python), `dtype` (float32),
`attn_impl`, `quantize`, `paradigm` and its fields, `max_length` (default: the model's
context), `max_gen_toks` (256), `mc_samples` (128), `mc_batch` (32), `seed` (0),
`check_greedy` (false), `apply_chat_template` is lm-eval's own flag. An unknown model_arg is an
error naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # pragma: no cover (the eval extra)
    raise ImportError("jdllm.evaluation needs lm-evaluation-harness: pip install 'jdllm[eval]'") from e

import jdllm
from jdllm import errors, inputs, likelihood
from jdllm.api import resolve_paradigm

HARNESS_ARGS = ("batch_size", "max_batch_size", "device")  # what lm-eval passes every model type


def _progress(items, desc: str, disable: bool):
    from tqdm import tqdm  # noqa: PLC0415 (lm-eval's dependency)

    return tqdm(items, desc=desc, disable=disable)


@register_model("jdllm")
class JdllmLM(TemplateLM):
    """A jdllm model as an lm-evaluation-harness model (see the module docstring)."""

    def __init__(self, path: str | None = None, model=None, dtype: str = "float32", attn_impl: str = "auto",
                 quantize: str | None = None, paradigm: str | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, mc_samples: int = 128, mc_batch: int = 32, seed: int = 0,
                 check_greedy: bool = False, batch_size=8, max_batch_size=None, device=None, **options):
        super().__init__()
        if (path is None) == (model is None):
            raise errors.InputError("JdllmLM needs one of path= (a model directory) or model= (a jdllm.Model)")
        self.model = model if model is not None else jdllm.load(path, dtype=dtype, attn_impl=attn_impl,
                                                                quantize=quantize)
        self.tokenizer = self.model.tokenizer
        if self.tokenizer is None:
            raise errors.InputError("lm-evaluation-harness works on text: this model has no tokenizer")
        cfg = self.model.config
        # every model_arg is checked here, before the harness builds its requests, not at the first request
        self.decoding = resolve_paradigm(_decoding(paradigm, options, cfg), cfg)
        self.decoding.validate_model(self.model)
        self._max_length = (cfg.max_position_embeddings if max_length is None else
                            _integer("max_length", max_length, 2, cfg.max_position_embeddings))
        self.max_gen_toks = _integer("max_gen_toks", max_gen_toks, 1)  # a task's gen_kwargs may set its own
        if check_greedy not in (True, False):
            raise errors.InputError(f"check_greedy={check_greedy!r} must be true or false")
        self.check_greedy = bool(check_greedy)
        self.seed, self.mc_samples, self.mc_batch = seed, mc_samples, mc_batch
        likelihood.check_estimator(cfg, mc_samples=mc_samples, mc_batch=mc_batch, seed=seed,
                                   greedy=self.check_greedy)
        if batch_size in (None, "auto") or str(batch_size).startswith("auto"):
            self.batch_size = 8
        else:
            self.batch_size = _integer("batch_size", batch_size, 1)

    # ------------------------------------------------------------------ what TemplateLM asks for
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        if eos is None and not self.model.config.eos_token_ids:
            raise errors.InputError("the model names no EOS token (lm-eval's prefix for an empty context)")
        return int(eos if eos is not None else self.model.config.eos_token_ids[0])

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "jdllm").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(inputs.encode_text(self.tokenizer, string, 0, lambda: self.tokenizer.encode(
            string, add_special_tokens=bool(add_special_tokens)), what="the request's text"))

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise errors.InputError("--apply_chat_template: this model's tokenizer has no chat template; run "
                                    "without it")
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # ------------------------------------------------------------------ scoring
    def _fit(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
        """The pair cut from the left to max_length tokens (the continuation whole; at least one context token)."""
        if len(cont) >= self.max_length:
            raise errors.SequenceTooLongError(f"a continuation of {len(cont)} tokens leaves no room for context "
                                              f"within max_length={self.max_length}")
        return ctx[-(self.max_length - len(cont)):], cont

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = []
        step = self.batch_size if self.model.config.attention == "causal" else 1
        for i in _progress(range(0, len(requests), step), "jdllm loglikelihood", disable_tqdm):
            part = requests[i:i + step]
            pairs = [self._fit(list(c), list(k)) for _, c, k in part]
            res = jdllm.loglikelihood(self.model, pairs, mc_samples=self.mc_samples, mc_batch=self.mc_batch,
                                      seed=(self.seed + i) % 2**32, greedy=self.check_greedy)
            for (key, _, _), r in zip(part, res):
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, r)
                out.append(r)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        if self.model.config.attention != "causal":
            raise errors.InputError("loglikelihood_rolling (perplexity tasks) needs a causal model; a diffusion "
                                    "model's likelihood is a Monte Carlo bound per continuation, not a sum per token")
        out = []
        for (text,) in _progress([r.args for r in requests], "jdllm loglikelihood_rolling", disable_tqdm):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length, 1)]
            total = sum(ll for ll, _ in jdllm.loglikelihood(self.model, windows)) if windows else 0.0
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        args = [r.args for r in requests]
        out: list[str | None] = [None] * len(args)
        groups: dict[str, list[int]] = {}
        for i, (_, kw) in enumerate(args):
            groups.setdefault(repr(sorted((kw or {}).items())), []).append(i)
        bar = _progress(range(len(args)), "jdllm generate_until", disable_tqdm)
        for idx in groups.values():
            kw = dict(args[idx[0]][1] or {})
            until, sampling = self._sampling(kw)
            room = self.max_length - sampling.max_new_tokens
            for j in range(0, len(idx), self.batch_size):
                part = idx[j:j + self.batch_size]
                prompts = [self.tok_encode(args[i][0])[-room:] for i in part]
                for i, o in zip(part, jdllm.generate(self.model, prompts, self.decoding, sampling)):
                    text = o.text
                    for u in until:
                        text = text.split(u)[0] if u else text
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", args[i], text)
                bar.update(len(part))
        bar.close()
        return out

    def _sampling(self, kw: dict):
        until = kw.pop("until", None)
        until = [until] if isinstance(until, str) else list(until or [])
        n = int(kw.pop("max_gen_toks", kw.pop("max_new_tokens", self.max_gen_toks)))
        if n >= self.max_length:
            raise errors.InputError(f"max_gen_toks={n} leaves no room for the prompt within max_length={self.max_length}")
        do_sample = kw.pop("do_sample", None)
        temperature = float(kw.pop("temperature", 1.0 if do_sample else 0.0))
        temperature = 0.0 if do_sample is False else temperature  # lm-eval's greedy: do_sample false
        top_p, top_k = float(kw.pop("top_p", 1.0)), int(kw.pop("top_k", 0))
        if kw:
            print(f"jdllm.evaluation: note: generation settings {sorted(kw)} are not used", file=sys.stderr)
        return until, jdllm.Sampling(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=n,
                                     seed=self.seed)


def _integer(name: str, v, lo: int, hi: int | None = None) -> int:
    """A whole-number model_arg in [lo, hi]: an InputError naming it otherwise (lm-eval passes what it
    could not read as a number as a string)."""
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v) or v < lo
            or (hi is not None and v > hi)):
        raise errors.InputError(f"{name}={v!r} must be an integer in [{lo}, {'...' if hi is None else hi}]")
    return int(v)


def _decoding(paradigm: str | None, options: dict, cfg):
    """The paradigm config from model_args (`jdllm generate`'s rules: the model's default paradigm,
    its fields by name); a model_arg that is no paradigm's field is an error naming it."""
    from jdllm.generate_cli import _choices, _paradigm_fields, decoding_from_args  # noqa: PLC0415

    classes, fields = _paradigm_fields()
    unknown = sorted(k for k in options if k not in fields and k not in HARNESS_ARGS)
    if unknown:
        raise errors.InputError(f"unknown model_args {unknown}; jdllm takes path, dtype, attn_impl, quantize, paradigm "
                                "and its fields, max_length, max_gen_toks, mc_samples, mc_batch, seed, check_greedy")
    # lm-eval reads `none` as None, which decoding_from_args takes for "not given": a choice whose
    # values include "none" (cache_mode=none) gets it back; for every other field None is the default
    none_choices = {f.name for c in classes.values() for f in dataclasses.fields(c)
                    if "none" in (_choices(c, f.name) or ())}
    options = {k: ("none" if v is None and k in none_choices else v) for k, v in options.items()}
    ns = argparse.Namespace(paradigm=paradigm, **{f"opt_{k}": v for k, v in options.items() if k in fields})
    return decoding_from_args(ns, cfg, command="evaluation")


def main(argv: list[str] | None = None) -> None:
    """lm-evaluation-harness' command line, with the `jdllm` model type registered."""
    from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


__all__ = ["JdllmLM", "main"]

if __name__ == "__main__":
    main()
