"""Checks on what a user hands to `generate` / `logits`, before anything compiles.

Each check raises a `jdllm.errors` exception naming the value and the fix;
`prepare` and `logits` call them, so the compiled code only ever sees inputs it
can decode.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import tempfile
import warnings

import numpy as np

from jdllm import errors

DTYPES = ("bfloat16", "float16", "float32")  # the dtypes a model loads in

INT32_MAX = 2**31 - 1
MAX_TEMPERATURE = 2.0  # OpenAI's bound; past it a token is close to a uniform draw from the vocabulary


def id_rows(token_ids, what: str = "token_ids") -> list[np.ndarray]:
    """A list of token-id lists or an int array [B, T] / [T] -> int64 rows (unchecked range).

    Text, floats, nesting deeper than two levels and scalars are refused with
    ArgumentTypeError, so nothing downstream sees a silently cast value.
    """
    if isinstance(token_ids, (str, bytes)):
        raise errors.ArgumentTypeError(
            f"{what} is text ({token_ids[:20]!r}); pass token ids, e.g. model.tokenizer.encode(text), "
            "or use jdllm.generate, which tokenizes")
    if isinstance(token_ids, (list, tuple)) and token_ids and not isinstance(token_ids[0], numbers.Integral):
        rows = [id_row(r, f"{what}[{b}]") for b, r in enumerate(token_ids)]
    else:
        arr = _int_array(token_ids, what)
        if arr.ndim == 0 or arr.ndim > 2:
            raise errors.ArgumentTypeError(
                f"{what} has {arr.ndim} dimensions (shape {arr.shape}); pass a list of token-id lists "
                "or an int array [batch, length]")
        rows = list(arr[None] if arr.ndim == 1 else arr)
    return rows


def id_row(row, what: str = "prompt") -> np.ndarray:
    """One row of token ids -> int64 [T]."""
    if isinstance(row, (str, bytes)):
        raise errors.ArgumentTypeError(f"{what} is text ({row[:20]!r}) where token ids were expected")
    arr = _int_array(row, what)
    if arr.ndim != 1:
        raise errors.ArgumentTypeError(
            f"{what} has shape {arr.shape}; a row of token ids is one-dimensional")
    return arr


def _int_array(x, what: str) -> np.ndarray:
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError) as e:  # ragged nesting and the like
        raise errors.ArgumentTypeError(f"{what} is not a list of integer token ids ({e})") from None
    if arr.size == 0:
        return arr.astype(np.int64).reshape(arr.shape)
    if arr.dtype != bool and not np.issubdtype(arr.dtype, np.integer):
        big = _outsized_int(x)
        if big is not None:  # Python ints past int64 (numpy made the row float64 or object)
            raise errors.TokenOutOfRangeError(f"token id {big} in {what} is outside the vocabulary")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise errors.ArgumentTypeError(
            f"{what} holds {arr.dtype} values, not integer token ids (e.g. {arr.reshape(-1)[0]!r})")
    if arr.dtype == np.uint64 and arr.max() > INT32_MAX:
        raise errors.TokenOutOfRangeError(f"token id {int(arr.max())} in {what} is outside the vocabulary")
    return arr.astype(np.int64)


def _outsized_int(x):
    """The first Python int of a list (or list of lists) of ints that int64 cannot hold, else None
    (also when anything in it is not an int)."""
    items = [t for r in x for t in (r if isinstance(r, (list, tuple)) else [r])] if isinstance(x, (list, tuple)) else []
    if not items or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in items):
        return None
    return next((int(t) for t in items if not -2**63 <= int(t) < 2**63), None)


def check_id_range(ids: np.ndarray, vocab_size: int, what: str = "token id") -> None:
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise errors.TokenOutOfRangeError(
            f"{what} {bad} is outside the vocabulary [0, {vocab_size}); "
            "check the tokenizer matches the model")


# --------------------------------------------------------------------------- text
def encode_text(tokenizer, text, index: int, encode, what: str | None = None):
    """`encode()` (the tokenizer call for prompt `index`, named `what` if given), with text it cannot
    encode turned into an InputError naming the first such character, its position and the
    characters the tokenizer knows."""
    what = what or f"prompt {index}"
    if not isinstance(text, str):
        raise errors.ArgumentTypeError(f"{what} is a {type(text).__name__}, not text or token ids")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise errors.InputError(
            f"{what} is not valid UTF-8 text (a stray byte at position {e.start}, shown as "
            f"{text[e.start]!r}); re-encode the prompt as UTF-8") from None
    try:
        return encode()
    except Exception as e:  # noqa: BLE001 (tokenizers raise a bare Exception for unknown characters)
        pos, ch = _first_unencodable(tokenizer, text)
        if pos is None:
            raise errors.InputError(
                f"{what} cannot be tokenized ({type(e).__name__}: {' '.join(str(e).split())})") from None
        raise errors.InputError(
            f"{what} has {ch!r} (U+{ord(ch):04X}) at position {pos}, which the tokenizer cannot "
            f"encode (it has no usable unknown token){_alphabet(tokenizer)}; remove or replace it") from None


def _first_unencodable(tokenizer, text: str):
    for pos, ch in enumerate(text):
        try:
            tokenizer.encode(ch, add_special_tokens=False)
        except Exception:  # noqa: BLE001
            return pos, ch
    return None, None


def _alphabet(tokenizer, limit: int = 256) -> str:
    """', it knows: <characters>' for a small character-level vocabulary, else ''."""
    try:
        vocab = tokenizer.get_vocab()
        special = set(getattr(tokenizer, "all_special_tokens", ()))
    except Exception:  # noqa: BLE001
        return ""
    chars = sorted(t for t in vocab if len(t) == 1 and t not in special)
    if not chars or len(vocab) > limit:
        return ""
    return ", it knows only " + repr("".join(chars))


# --------------------------------------------------------------------------- config fields
def normalize_fields(config, *, ints=(), reals=(), flags=(), optional=()) -> None:
    """The type rule of a frozen config's numeric and boolean fields (`jdllm.Sampling`, the
    paradigms), run before their range checks and applied in place, so equal configs compare and
    hash equal (they are jit static arguments):

    - `ints`: a Python or numpy integer, or an integral float (4.0), becomes an int; a fraction, NaN
      or an infinity is a DecodingConfigError;
    - `reals`: any real number becomes a float; NaN or an infinity is a DecodingConfigError;
    - `flags`: True / False (or a numpy bool) only; anything else is a DecodingConfigError;
    - a bool where a number belongs, or a non-number, is an ArgumentTypeError naming the field;
    - a field in `optional` may also be None.
    """
    owner = type(config).__name__
    for name in (*ints, *reals):
        v = getattr(config, name)
        if v is None and name in optional:
            continue
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
            what = "an integer" if name in ints else "a number"
            raise errors.ArgumentTypeError(f"{owner}({name}={v!r}): expected {what}"
                                           f"{' or None' if name in optional else ''}, got {type(v).__name__}")
        if not np.isfinite(v):
            raise errors.DecodingConfigError(f"{name}={v} must be finite")
        if name in ints:
            if int(v) != v:
                raise errors.DecodingConfigError(f"{name}={v} must be an integer")
            v = int(v)
        else:
            v = float(v)
        object.__setattr__(config, name, v)
    for name in flags:
        v = getattr(config, name)
        if not isinstance(v, (bool, np.bool_)):
            raise errors.DecodingConfigError(f"{name}={v!r} must be True or False")
        object.__setattr__(config, name, bool(v))


# --------------------------------------------------------------------------- generate()
def check_temperature(temperature) -> None:
    """The one temperature rule (`jdllm.Sampling`, so `generate`, `jdllm generate --temperature` and
    the server's `temperature` alike): a finite number in [0, MAX_TEMPERATURE], 0 = greedy."""
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise errors.DecodingConfigError(
            f"temperature={temperature} must be finite and in [0, {MAX_TEMPERATURE}] (0 = greedy; above "
            f"{MAX_TEMPERATURE} a token is close to a uniform draw from the vocabulary)")


def check_top_p(top_p) -> None:
    """The one top_p rule (`jdllm.Sampling` and the server's `top_p`): in (0, 1], 1 = off."""
    if not 0 < top_p <= 1:
        raise errors.DecodingConfigError(f"top_p={top_p} must be in (0, 1] (1 = off)")


def check_sampling(sampling):
    """`sampling` is a jdllm.Sampling (not a dict of its fields)."""
    from jdllm.sampling import Sampling  # noqa: PLC0415 (startup: inputs checks CLI arguments before JAX loads)

    if not isinstance(sampling, Sampling):
        hint = f"jdllm.Sampling(**{sampling!r})" if isinstance(sampling, dict) else "jdllm.Sampling(...)"
        raise errors.ArgumentTypeError(
            f"sampling={sampling!r} is a {type(sampling).__name__}; pass {hint}")


def validate_paradigm(decoding, cfg) -> None:
    """`decoding.validate(cfg)`, its warnings attributed to the user's call rather than to jdllm."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoding.validate(cfg)
    for w in caught:
        errors.warn(str(w.message), w.category)


def check_prompts(ids: list[list[int]], cfg, settings: list):
    """Prompts and stop ids against the model; returns the settings (one `Sampling` per prompt),
    a default max_new_tokens clipped to what the model's context leaves. The clip is silent here:
    `note_context_end` says so after decoding, for the outputs it cut short."""
    check_stop_ids(settings, cfg)
    for i, p in enumerate(ids):
        check_no_mask_token(p, cfg, f"prompt {i}")
    out = list(settings)
    for i, (p, s) in enumerate(zip(ids, settings)):
        default = next(f.default for f in dataclasses.fields(s) if f.name == "max_new_tokens")
        room = cfg.max_position_embeddings - len(p)
        if s.max_new_tokens == default and 1 <= room < default:
            out[i] = dataclasses.replace(s, max_new_tokens=room)
    return out


def check_stop_ids(settings: list, cfg) -> None:
    """Every setting's stop ids inside the vocabulary."""
    for s in settings:
        if s.stop_token_ids:
            check_id_range(np.asarray(s.stop_token_ids), cfg.vocab_size, what="stop token id")


def check_no_mask_token(ids, cfg, what: str) -> None:
    """InputError when token-id row `ids` (named `what`) holds the model's mask token."""
    if cfg.mask_token_id is None:
        return
    hits = np.flatnonzero(np.asarray(ids) == cfg.mask_token_id)
    if hits.size:
        raise errors.InputError(
            f"{what} holds the mask token id {cfg.mask_token_id} at position {int(hits[0])}; "
            "a diffusion model would treat it as a blank to fill, not as text: remove it")


def clipped_rows(before: list, after: list) -> dict[int, int]:
    """{row: its max_new_tokens} for the rows `check_prompts` clipped (settings before -> after)."""
    return {i: a.max_new_tokens for i, (b, a) in enumerate(zip(before, after)) if a.max_new_tokens != b.max_new_tokens}


def note_context_end(outs, clipped: dict[int, int], context: int) -> None:
    """One note for a call in which the default max_new_tokens, clipped to the context, cut outputs short.

    The clip itself is the documented default (as many tokens as the context leaves, at most 256), so a call
    whose outputs stopped on their own says nothing; an output that ran to the end of the context (finish
    "length" after all the tokens its clipped budget allowed) gets this note, since a longer context or a
    shorter prompt would have let it go on."""
    from jdllm.sampling import Sampling  # noqa: PLC0415 (startup: inputs checks CLI arguments before JAX loads)

    cut = [(i, n) for i, n in sorted(clipped.items())
           if i < len(outs) and outs[i].finish_reason == "length" and len(outs[i].token_ids) >= n]
    if not cut:
        return
    default = next(f.default for f in dataclasses.fields(Sampling) if f.name == "max_new_tokens")
    which = (f"output {cut[0][0]} ran to the end of the model's context after {cut[0][1]} tokens" if len(cut) == 1
             else f"outputs {', '.join(str(i) for i, _ in cut)} ran to the end of the model's context after "
                  f"{', '.join(str(n) for _, n in cut)} tokens")
    errors.warn(f"max_new_tokens: the default {default} does not fit the model's context "
                f"(max_position_embeddings={context}); {which}, without a stop token. "
                "Set max_new_tokens (--max-new-tokens) to choose, or shorten the prompt.")


# --------------------------------------------------------------------------- output paths
def check_output_path(path: str, what: str, create_parents: bool, directory: bool = False) -> None:
    """Fail before any work if `path` (a file, or a `directory` to create) cannot be written: a file
    path that is a directory, its parent missing (when not `create_parents`), a regular file where
    a directory must be, or a read-only location."""

    path = os.path.abspath(os.fspath(path))
    if not directory and os.path.isdir(path):
        raise errors.OutputPathError(
            f"{what} {path} is a directory; give a file name, e.g. {os.path.join(path, 'out.json')}")
    parent = os.path.dirname(path)
    if not create_parents and not os.path.isdir(parent):
        raise errors.OutputPathError(
            f"{what} {path}: the directory {parent} does not exist; create it first or choose another path")
    existing = parent
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise errors.OutputPathError(
            f"{what} {path}: {existing} is a file, not a directory; choose another path")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise errors.OutputPathError(
            f"{what} {path}: cannot write in {existing} ({e.strerror or e}); choose a writable location") from None


def to_device(x, dtype=None):
    """Host data (a NumPy array, a list, a scalar) as a jax array on the default device, moved by a
    transfer. `jnp.asarray` of a NumPy array is a `lax.stage`, which compiles an XLA program per
    shape and dtype (of a list with a dtype, a conversion program): a first `generate` compiled 10
    such programs besides its decode (an XLA:GPU compile each, then a persistent-cache load each in
    a later process) and `jdllm.load` one per distinct weight shape. Integers and floats canonicalise as `jnp.asarray` does (int64 -> int32
    without x64). A jax array passes through (converted to `dtype` if given)."""
    import jax  # noqa: PLC0415 (startup: input checks run before any array library loads)

    if isinstance(x, jax.Array):
        return x if dtype is None or x.dtype == dtype else x.astype(dtype)
    return jax.device_put(np.asarray(x, dtype))


def np_dtype(dtype) -> np.dtype | None:
    """'bfloat16' | 'float16' | 'float32' | a NumPy/JAX dtype | None -> NumPy dtype (None keeps)."""
    if dtype is None:
        return None
    import ml_dtypes  # noqa: PLC0415 (startup: input checks run before any array library loads)
    names = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
             "float32": np.dtype(np.float32)}
    if isinstance(dtype, str):
        if dtype not in names:
            raise errors.ConfigError(f"dtype={dtype!r} is not one of {DTYPES}")
        return names[dtype]
    try:
        d = np.dtype(dtype)
    except TypeError as e:
        raise errors.ConfigError(f"dtype={dtype!r} is not one of {DTYPES}") from e
    if d.name not in names:
        raise errors.ConfigError(f"dtype={d.name!r} is not one of {DTYPES}")
    return d
