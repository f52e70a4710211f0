"""Synthetic tasks with verifiable answers, and the character tokenizer they use.

The shipped tiny models (`models/`) are trained on these tasks so that
decoding strategies can be compared on accuracy, not only speed:

    sort:3 1 2=   -> 1 2 3      (sort 3-5 digits)
    add:12+34=    -> 46         (add two numbers in [0, 99])
    rev:abc=      -> cba        (reverse 3-6 lowercase letters)

and five long-answer tasks, kept out of the default `TASKS` (so the default
sets above never change) and asked for by name (`LONG_TASKS`, `ALL_TASKS`):

    rep:abcd=     -> abcd abcd abcd abcd abcd abcd abcd abcd   (a 4-letter word 8 times: 39 tokens)
    cumsum:314159265358979323846264=  (24 digits)
                  -> 348954625831965825376848   (24 tokens: 3489 5462 5831 9658 2537 6848)
    jumble:abcd=  -> bdac cabd abdc dcba acbd bacd dbca cdab   (without the spaces: 32 tokens)
    oneof:abcd efgh=  -> abcd efgh efgh abcd abcd efgh abcd efgh   (without the spaces: 32 tokens)
    either:abcd=  -> abcd ---- ---- abcd abcd ---- abcd ----   (without the spaces: 32 tokens)

Their answers are long enough for several decoding blocks to be in flight at
once, which the short tasks (answers of ~6 tokens) never allow. (A first version of rep drew
words of 4-8 letters, 5 times; the tiny models did not learn its variable period in the CPU
budget, see benchmarks/RESULTS.md.)

`cumsum` is built so that pipelined decoding (`jdllm.MultiBlock`) has something to gain:
the 24 input digits form 6 groups of 4 (`CUMSUM_GROUP`), and each answer group holds the
running sums mod 10 of its own input group (3 1 4 1 -> 3 4 8 9), restarting at every
group. Inside a group each digit is the previous one plus one input digit, easy once the
previous one is known and hard from the prompt alone, so a block takes several forwards;
different groups are independent, so later blocks can be decoded before earlier ones
settle. Its prompt is 32 tokens, a multiple of 4 and 8: on a block grid of 4 (tiny-sdar's)
or 8, every decoding block holds whole groups. (The tiny models did not learn it in the CPU
budget: 0 % after 100 fine-tuning steps, see benchmarks/RESULTS.md.)

`jumble` has the same shape with ambiguity instead of computation: 8 groups, each ANY
ordering of the prompt's 4 distinct letters, so it has many correct answers (`is_correct`
checks every group; the example's `answer` is one of them, the training target). A group's
first letter is a free choice among 4, the next among the 3 left, ...: a block decoded on its
own takes about 4 forwards, however well the model is trained, while groups are independent
of each other. Its prompt is 12 tokens (a multiple of 4: 4-slot blocks hold whole groups).

`oneof` keeps rep's easy skill (copying a word of the prompt) with jumble's ambiguity: the
prompt gives two 4-letter words with 8 distinct letters, and each of the 8 answer groups is
EITHER word, drawn independently (`is_correct` accepts any such answer). A group's first letter
is a coin flip (confidence 1/2, entropy ln 2 = 0.69, above the usual thresholds) and, once one
letter is in, the other three are determined: block diffusion takes about 2 forwards per 4-slot
block however well the model is trained, and groups do not depend on each other, so a
pipelined decoder can start block k+1 while block k completes. Its prompt is 16 tokens, so
4-slot (and 8-slot) blocks hold whole groups. (tiny-sdar did not learn it in 400 fine-tuning
steps: finding which prompt word holds a revealed letter, then copying that word, is a two-hop
lookup; see benchmarks/RESULTS.md.)

`either` is the same shape with a one-hop copy: each group is the prompt's word or the filler
`----` (EITHER_FILL), a coin flip per group; a revealed letter or dash settles its group. Its
prompt is 12 tokens (block-aligned).

and one structured task (`STRUCTURED_TASKS`, also asked for by name), whose answer is a
small JSON object, for measuring grammar-constrained decoding:

    json:abc 7=   -> {"w":"abc","n":7}     (a 2-3 letter word, a number in [0, 99])

Its characters `{`, `}` and `"` are not in the shipped models' alphabet: it has its own
(`JSON_CHARS`: `(`, `)` and `+` give their ids to `{`, `}` and `"`; `chars_for(tasks)`
picks it), used by the models trained on it (models/tiny-json-*). `JSON_SCHEMA` is the
answer's schema.

A prompt ends with "="; the answer follows and ends with EOS. Train and
held-out test sets are deterministic functions of a seed and never share a
prompt. The tokenizer is character level (one token per character) and is
saved as a real Hugging Face `tokenizer.json` with pad, EOS and mask tokens.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Iterable, Sequence

from jdllm import errors

TASKS = ("sort", "add", "rev")  # the default sets
LONG_TASKS = ("rep", "cumsum", "jumble", "oneof", "either")  # long answers; only when asked for by name
STRUCTURED_TASKS = ("json",)  # JSON answers, own alphabet (JSON_CHARS); only when asked for by name
ALL_TASKS = TASKS + LONG_TASKS + STRUCTURED_TASKS
REP_TIMES = 8  # "rep" repeats its word this many times
REP_WORD_LEN = 4  # ... a word of this many letters
CUMSUM_DIGITS, CUMSUM_GROUP = 24, 4  # "cumsum": 24 input digits, running sums restart every 4
JUMBLE_TIMES, JUMBLE_WORD_LEN = 8, 4  # "jumble": 8 orderings of a word of 4 distinct letters
ONEOF_TIMES, ONEOF_WORD_LEN = 8, 4  # "oneof": 8 groups, each one of two 4-letter words (8 distinct letters)
EITHER_FILL = "----"  # "either": 8 groups, each the prompt's 4-letter word or this filler
PAD, EOS, MASK = "<pad>", "<eos>", "<mask>"
SPECIALS = (PAD, EOS, MASK)  # ids 0, 1, 2
# Printable characters, one token each; padded so the vocabulary is 48 ids in all.
CHARS = tuple("0123456789abcdefghijklmnopqrstuvwxyz :+=-,.()*/?#")[:48 - len(SPECIALS)]
VOCAB_SIZE = len(SPECIALS) + len(CHARS)
# the json task's alphabet: the same ids, with "(", ")", "+" replaced by "{", "}", '"'
JSON_CHARS = tuple({"(": "{", ")": "}", "+": '"'}.get(c, c) for c in CHARS)
JSON_SCHEMA = {"type": "object", "properties": {"w": {"type": "string", "pattern": "^[a-z]{2,3}$"},
                                                "n": {"type": "integer", "minimum": 0, "maximum": 99}},
               "required": ["w", "n"], "additionalProperties": False}
PAD_ID, EOS_ID, MASK_ID = 0, 1, 2
MAX_PROMPT_LEN = 15  # "sort:d d d d d="
MAX_ANSWER_LEN = 9  # "d d d d d"
LONG_MAX_PROMPT_LEN = 32  # "cumsum:" + 24 digits + "="
LONG_MAX_ANSWER_LEN = 39  # rep: 8 x 4 letters + 7 spaces (cumsum: 24 digits)
# longest answer of each task in characters (= tokens), EOS not counted
MAX_ANSWER = {"sort": MAX_ANSWER_LEN, "add": 3, "rev": 6, "rep": REP_TIMES * (REP_WORD_LEN + 1) - 1,
              "cumsum": CUMSUM_DIGITS, "jumble": JUMBLE_TIMES * JUMBLE_WORD_LEN,
              "oneof": ONEOF_TIMES * ONEOF_WORD_LEN, "either": ONEOF_TIMES * ONEOF_WORD_LEN, "json": 18}


@dataclasses.dataclass(frozen=True)
class Example:
    """One task instance: the prompt (ends with "=") and its exact answer."""

    task: str
    prompt: str
    answer: str


def make_example(task: str, rng: random.Random) -> Example:
    """Draw one instance of `task` from `rng`."""
    if task == "sort":
        digits = [rng.randrange(10) for _ in range(rng.randint(3, 5))]
        return Example(task, "sort:" + " ".join(map(str, digits)) + "=",
                       " ".join(map(str, sorted(digits))))
    if task == "add":
        a, b = rng.randrange(100), rng.randrange(100)
        return Example(task, f"add:{a}+{b}=", str(a + b))
    if task == "rev":
        s = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
        return Example(task, f"rev:{s}=", s[::-1])
    if task == "rep":
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(REP_WORD_LEN))
        return Example(task, f"rep:{w}=", " ".join([w] * REP_TIMES))
    if task == "cumsum":
        digits = [rng.randrange(10) for _ in range(CUMSUM_DIGITS)]
        return Example(task, "cumsum:" + "".join(map(str, digits)) + "=", cumsum_answer(digits))
    if task == "jumble":
        w = rng.sample("abcdefghijklmnopqrstuvwxyz", JUMBLE_WORD_LEN)
        return Example(task, "jumble:" + "".join(w) + "=",
                       "".join("".join(rng.sample(w, len(w))) for _ in range(JUMBLE_TIMES)))
    if task == "oneof":
        letters = rng.sample("abcdefghijklmnopqrstuvwxyz", 2 * ONEOF_WORD_LEN)
        a, b = "".join(letters[:ONEOF_WORD_LEN]), "".join(letters[ONEOF_WORD_LEN:])
        return Example(task, f"oneof:{a} {b}=", "".join(rng.choice((a, b)) for _ in range(ONEOF_TIMES)))
    if task == "either":
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(ONEOF_WORD_LEN))
        return Example(task, f"either:{w}=", "".join(rng.choice((w, EITHER_FILL)) for _ in range(ONEOF_TIMES)))
    if task == "json":
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 3)))
        n = rng.randrange(100)
        return Example(task, f"json:{w} {n}=", json.dumps({"w": w, "n": n}, separators=(",", ":")))
    raise errors.InputError(f"task {task!r} is not one of {ALL_TASKS}")


def cumsum_answer(digits: Sequence[int], group: int = CUMSUM_GROUP) -> str:
    """Running sums mod 10 of each group of `group` digits, restarting at every group, concatenated."""
    out, acc = [], 0
    for i, d in enumerate(digits):
        acc = (0 if i % group == 0 else acc) + int(d)
        out.append(str(acc % 10))
    return "".join(out)


def max_new_tokens(task_names: Sequence[str]) -> int:
    """Generation budget for a task mix: its longest answer + EOS, rounded up to a multiple of 4."""
    _check_tasks(task_names)
    return -(-(max(MAX_ANSWER[t] for t in task_names) + 1) // 4) * 4


def _draw(n: int, seed: int, exclude: frozenset[str], tasks: Sequence[str]) -> list[Example]:
    """`n` distinct examples, tasks interleaved; a task whose prompt space runs out drops out."""
    rng = random.Random(seed)
    out, seen, live, misses = [], set(exclude), list(tasks), 0
    while len(out) < n:
        if not live:
            raise errors.InputError(f"only {len(out)} distinct prompts exist for tasks={list(tasks)}; ask for fewer")
        task = live[len(out) % len(live)]
        ex = make_example(task, rng)
        if ex.prompt in seen:
            misses += 1
            if misses > 2000:  # this task's space is (nearly) used up
                live.remove(task)
                misses = 0
            continue
        seen.add(ex.prompt)
        out.append(ex)
        misses = 0
    return out


def test_set(n: int = 300, seed: int = 0, tasks: Sequence[str] = TASKS) -> list[Example]:
    """Held-out set: `n` distinct prompts, tasks interleaved, fixed by `seed` (a smaller n gives a prefix)."""
    _check_tasks(tasks)
    return _draw(n, seed * 2 + 1, frozenset(), tuple(tasks))


def train_set(n: int, seed: int = 0, tasks: Sequence[str] = TASKS,
              n_test: int = 1000) -> list[Example]:
    """Training set: `n` distinct prompts drawn from `seed`, none in `test_set(n_test, seed, t)` for t
    = `tasks`, the default `TASKS` or one long task alone (a mixed set never trains on a standard test item)."""
    _check_tasks(tasks)
    sets = {tuple(tasks), TASKS} | {(t,) for t in LONG_TASKS}
    held = frozenset(ex.prompt for ts in sets for ex in test_set(n_test, seed, ts))
    return _draw(n, seed * 2 + 2, held, tuple(tasks))


def _check_tasks(tasks: Sequence[str]) -> None:
    bad = [t for t in tasks if t not in ALL_TASKS]
    if bad or not tasks:
        raise errors.InputError(f"tasks={list(tasks)!r}: choose a non-empty subset of {ALL_TASKS}")


def normalize(text: str) -> str:
    """The answer part of a decoded completion: up to the first EOS, pads dropped, stripped.

    A leftover mask token stays, so an unfinished answer never matches.
    """
    return text.split(EOS, 1)[0].replace(PAD, "").strip()


def is_correct(prediction: str, ex: Example) -> bool:
    """Whether a decoded completion answers `ex`: its normalized text equals the answer, or, for
    "jumble" (many correct answers), it is JUMBLE_TIMES groups each ordering the prompt's letters,
    for "oneof", ONEOF_TIMES groups each equal to one of the prompt's two words (for "either", to the
    prompt's word or EITHER_FILL)."""
    text = normalize(prediction)
    if ex.task in ("oneof", "either"):
        words = ex.prompt[len("oneof:"):-1].split(" ") if ex.task == "oneof" else [ex.prompt[len("either:"):-1],
                                                                                    EITHER_FILL]
        n = ONEOF_WORD_LEN
        return len(text) == n * ONEOF_TIMES and all(text[i:i + n] in words for i in range(0, len(text), n))
    if ex.task != "jumble":
        return text == ex.answer
    word = sorted(ex.prompt[len("jumble:"):-1])
    n = len(word)
    return len(text) == n * JUMBLE_TIMES and all(sorted(text[i:i + n]) == word for i in range(0, len(text), n))


def exact_match(predictions: Iterable[str], examples: Sequence[Example]) -> float:
    """Fraction of predictions that are correct (`is_correct`: the exact answer; any valid one for jumble)."""
    preds = list(predictions)
    if len(preds) != len(examples):
        raise errors.InputError(f"{len(preds)} predictions for {len(examples)} examples")
    if not preds:
        return 0.0
    return sum(is_correct(p, ex) for p, ex in zip(preds, examples)) / len(preds)


# --------------------------------------------------------------------------- tokenizer
def chars_for(task_mix: Sequence[str]) -> tuple[str, ...]:
    """The alphabet of a training mix: JSON_CHARS when it has the json task (alone), else CHARS."""
    if any(t in STRUCTURED_TASKS for t in task_mix):
        if any(t not in STRUCTURED_TASKS for t in task_mix):
            raise errors.InputError(f"tasks={list(task_mix)!r}: the json task has its own alphabet; train it alone")
        return JSON_CHARS
    return CHARS


def _char_vocab(chars: Sequence[str] = CHARS) -> dict[str, int]:
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({c: len(SPECIALS) + i for i, c in enumerate(chars)})
    return vocab


def build_tokenizer(chars: Sequence[str] = CHARS):
    """A `tokenizers.Tokenizer`: one token per character, specials <pad>, <eos>, <mask>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415 (startup: the task generators need no tokenizer library)
    tok = Tokenizer(models.WordLevel(vocab=_char_vocab(chars), unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def save_tokenizer(out_dir: str | os.PathLike, chars: Sequence[str] = CHARS) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to `out_dir`."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    build_tokenizer(chars).save(os.path.join(out_dir, "tokenizer.json"))
    added = {str(i): {"content": s, "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False, "special": True} for i, s in enumerate(SPECIALS)}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": PAD, "eos_token": EOS, "mask_token": MASK,
        "added_tokens_decoder": added,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"pad_token": PAD, "eos_token": EOS, "mask_token": MASK}, f, indent=2)


def load_tokenizer(path: str | os.PathLike | None = None):
    """A `transformers.PreTrainedTokenizerFast` from `path` (a dir or tokenizer.json), or built fresh."""
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 (startup: the task generators need no tokenizer library)
    if path is None:
        return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), pad_token=PAD,
                                       eos_token=EOS, mask_token=MASK)
    path = os.fspath(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise errors.InputError(f"{file} does not exist: save one with jdllm.tasks.save_tokenizer")
    return PreTrainedTokenizerFast(tokenizer_file=file, pad_token=PAD, eos_token=EOS, mask_token=MASK)


def encode(text: str, chars: Sequence[str] = CHARS) -> list[int]:
    """Token ids of plain task text (no specials), without loading `transformers`."""
    vocab = _char_vocab(chars)
    try:
        return [vocab[c] for c in text]
    except KeyError as e:
        raise errors.InputError(f"character {e.args[0]!r} is not in the task vocabulary {chars}") from None


def decode(ids: Iterable[int], chars: Sequence[str] = CHARS) -> str:
    """Text of token ids; EOS/pad/mask render as their names."""
    inv = {i: s for s, i in _char_vocab(chars).items()}
    return "".join(inv.get(int(i), "?") for i in ids)
