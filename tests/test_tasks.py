"""Synthetic tasks, scorer and the character tokenizer."""

import json
import os

import pytest

from jdllm import errors, tasks


def _check_answer(ex: tasks.Example) -> bool:
    """Independent solver of each task format."""
    head, body = ex.prompt.rstrip("=").split(":", 1)
    if head == "sort":
        return ex.answer == " ".join(sorted(body.split(" "), key=int))
    if head == "add":
        a, b = body.split("+")
        return int(ex.answer) == int(a) + int(b)
    if head == "rev":
        return ex.answer == "".join(reversed(body))
    if head == "rep":
        return ex.answer.split(" ") == [body] * 8 and body.isalpha() and len(body) == 4
    if head == "cumsum":  # digit k of group g = (sum of the group's input digits 0..k) mod 10
        groups = [body[i:i + 4] for i in range(0, len(body), 4)]
        want = "".join(str(sum(int(c) for c in g[:k + 1]) % 10) for g in groups for k in range(len(g)))
        return len(body) == 24 and body.isdigit() and ex.answer == want
    if head == "jumble":  # 8 groups of 4, each a rearrangement of the word's distinct letters
        groups = [ex.answer[i:i + 4] for i in range(0, 32, 4)]
        return (len(ex.answer) == 32 and len(set(body)) == 4 == len(body)
                and all(sorted(g) == sorted(body) for g in groups))
    if head == "oneof":  # 8 groups of 4, each one of the prompt's two words; 8 distinct letters in all
        a, b = body.split(" ")
        groups = [ex.answer[i:i + 4] for i in range(0, len(ex.answer), 4)]
        return (len(ex.answer) == 32 and len(a) == len(b) == 4 and len(set(a + b)) == 8
                and all(g in (a, b) for g in groups))
    if head == "either":  # 8 groups of 4, each the prompt's word or four dashes
        groups = [ex.answer[i:i + 4] for i in range(0, len(ex.answer), 4)]
        return len(ex.answer) == 32 and len(body) == 4 and body.isalpha() and all(g in (body, "----") for g in groups)
    return False


def test_answers_are_correct_and_formats_fixed():
    exs = tasks.test_set(120, seed=3)
    assert {ex.task for ex in exs} == set(tasks.TASKS)
    for ex in exs:
        assert ex.prompt.startswith(ex.task + ":") and ex.prompt.endswith("=")
        assert _check_answer(ex), ex
        assert len(ex.prompt) <= tasks.MAX_PROMPT_LEN and len(ex.answer) <= tasks.MAX_ANSWER_LEN


def test_sets_deterministic_disjoint_and_prefix():
    test = tasks.test_set(300, seed=0)
    assert test == tasks.test_set(300, seed=0)
    assert test[:100] == tasks.test_set(100, seed=0)
    assert test != tasks.test_set(300, seed=1)
    train = tasks.train_set(5000, seed=0)
    assert train == tasks.train_set(5000, seed=0)
    assert len({ex.prompt for ex in train}) == len(train)
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in tasks.test_set(1000, seed=0)}


def test_exhausted_task_drops_out_and_impossible_size_raises():
    train = tasks.train_set(3000, seed=0, tasks=("add", "rev"))
    assert len(train) == 3000
    with pytest.raises(errors.InputError, match="distinct prompts"):
        tasks.train_set(20000, seed=0, tasks=("add",))
    with pytest.raises(errors.InputError, match="tasks"):
        tasks.test_set(10, tasks=("mul",))


def test_exact_match_scorer():
    exs = [tasks.Example("add", "add:1+2=", "3"), tasks.Example("rev", "rev:ab=", "ba")]
    assert tasks.exact_match(["3<eos><eos>", "ba"], exs) == 1.0
    assert tasks.exact_match([" 3 ", "ab<eos>"], exs) == 0.5
    assert tasks.exact_match(["34<eos>", "b<mask>a"], exs) == 0.0
    with pytest.raises(errors.InputError):
        tasks.exact_match(["3"], exs)


def test_tokenizer_roundtrip_saved_and_loaded_offline(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tasks.save_tokenizer(tmp_path)
    with open(os.path.join(tmp_path, "tokenizer.json")) as f:
        assert json.load(f)["model"]["type"] == "WordLevel"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (auto.pad_token_id, auto.eos_token_id, auto.mask_token_id) == (tasks.PAD_ID, tasks.EOS_ID, tasks.MASK_ID)
    assert len(auto) == tasks.VOCAB_SIZE
    for ex in tasks.test_set(30, seed=2):
        text = ex.prompt + ex.answer
        ids = tok(text)["input_ids"]
        assert ids == tasks.encode(text) and len(ids) == len(text)  # one token per character
        assert auto(text)["input_ids"] == ids
        assert tok.decode(ids) == text and tasks.decode(ids) == text
    ids = auto("sort:1 2=<eos><mask>")["input_ids"]
    assert ids[-2:] == [tasks.EOS_ID, tasks.MASK_ID]
    assert auto.decode(ids, skip_special_tokens=True) == "sort:1 2="


def test_encode_rejects_unknown_character():
    with pytest.raises(errors.InputError, match="'Z'"):
        tasks.encode("rev:Z=")


def test_long_task_outside_default_sets():
    """"rep" has 39-token answers, is asked for by name, and never enters the default sets."""
    exs = tasks.test_set(60, seed=1, tasks=("rep",))
    assert {ex.task for ex in exs} == {"rep"}
    for ex in exs:
        assert _check_answer(ex), ex
        assert len(ex.answer) == 39 == tasks.LONG_MAX_ANSWER_LEN and len(ex.prompt) <= tasks.LONG_MAX_PROMPT_LEN
    assert not set(tasks.LONG_TASKS) & {ex.task for ex in tasks.test_set(300)}
    mixed = tasks.train_set(2000, seed=0, tasks=tasks.ALL_TASKS[:-1])  # json trains alone (own alphabet)
    held = {ex.prompt for ts in (tasks.TASKS, *((t,) for t in tasks.LONG_TASKS))
            for ex in tasks.test_set(1000, 0, ts)}
    assert {ex.task for ex in mixed} == set(tasks.ALL_TASKS[:-1]) and not {ex.prompt for ex in mixed} & held


def test_cumsum_task_groups_block_aligned_and_scored():
    """cumsum: 24 digits -> running sums mod 10 restarting every 4 digits (checked by an independent
    solver); 32-token prompts, so on a block grid of 4 or 8 every block holds whole groups; the scorer
    rejects an answer with one wrong group."""
    exs = tasks.test_set(50, seed=2, tasks=("cumsum",))
    assert len({ex.prompt for ex in exs}) == 50 and {ex.task for ex in exs} == {"cumsum"}
    for ex in exs:
        assert _check_answer(ex), ex
        assert len(ex.prompt) == 32 == tasks.LONG_MAX_PROMPT_LEN and len(ex.answer) == 24
    assert tasks.cumsum_answer([3, 1, 4, 1, 5, 9, 2, 6]) == "34895462"
    assert tasks.max_new_tokens(("cumsum",)) == 28 and tasks.max_new_tokens(tasks.TASKS) == 12
    assert len(exs[0].prompt) + tasks.max_new_tokens(("cumsum",)) <= 64  # the tiny models' context
    ex = exs[0]
    wrong = ex.answer[:4] + str((int(ex.answer[4]) + 1) % 10) + ex.answer[5:]
    assert tasks.exact_match([ex.answer + "<eos>", wrong], [ex, ex]) == 0.5
    with pytest.raises(errors.InputError, match="tasks"):
        tasks.max_new_tokens(("cumsums",))


def test_json_task_answers_parse_and_own_alphabet(tmp_path):
    """json: answers are JSON objects with the prompt's word and number (checked with json.loads, not
    with llguidance); its alphabet replaces ( ) + by { } " at the same ids; it trains alone."""
    exs = tasks.test_set(50, seed=0, tasks=("json",))
    assert len({e.prompt for e in exs}) == 50
    for e in exs:
        word, num = e.prompt[len("json:"):-1].split(" ")
        v = json.loads(e.answer)
        assert v == {"w": word, "n": int(num)} and list(v) == ["w", "n"]
        assert 2 <= len(word) <= 3 and 0 <= v["n"] <= 99 and len(e.prompt) + len(e.answer) <= 31
        ids = tasks.encode(e.answer, tasks.JSON_CHARS)
        assert tasks.decode(ids, tasks.JSON_CHARS) == e.answer and max(ids) < tasks.VOCAB_SIZE
    assert tasks.chars_for(("json",)) == tasks.JSON_CHARS and tasks.chars_for(tasks.TASKS) == tasks.CHARS
    assert [c for c, d in zip(tasks.CHARS, tasks.JSON_CHARS) if c != d] == ["+", "(", ")"]
    with pytest.raises(errors.InputError, match="alone"):
        tasks.chars_for(("json", "add"))
    with pytest.raises(errors.InputError):
        tasks.encode('{"w"', tasks.CHARS)  # the shipped alphabet has no braces or quotes
    tasks.save_tokenizer(tmp_path, tasks.JSON_CHARS)
    tok = tasks.load_tokenizer(tmp_path)
    assert tok.encode(exs[0].answer, add_special_tokens=False) == tasks.encode(exs[0].answer, tasks.JSON_CHARS)


def test_jumble_task_accepts_any_valid_ordering():
    """jumble: 12-token prompts (4-slot blocks hold whole groups), 32-token answers; the scorer takes
    any answer whose 8 groups each rearrange the word, and nothing else (checked against hand cases)."""
    exs = tasks.test_set(40, seed=4, tasks=("jumble",))
    assert {ex.task for ex in exs} == {"jumble"} and len({ex.answer for ex in exs}) == 40
    for ex in exs:
        assert _check_answer(ex), ex
        assert len(ex.prompt) == 12 and ex.prompt.startswith("jumble:")
    assert tasks.max_new_tokens(("jumble",)) == 36
    ex = tasks.Example("jumble", "jumble:abcd=", "abcd" * 8)
    good = "dcba" * 4 + "badc" * 3 + "abcd"
    cases = {good: True, good + "<eos><eos>": True, " " + good + " ": True,
             "abcd" * 7: False,  # a group short
             "abcd" * 8 + "a": False,  # a letter too many
             "abcd" * 7 + "abca": False,  # a repeated letter
             "abcd" * 7 + "abce": False,  # a foreign letter
             "abcd" * 7 + "ab<mask>d": False}  # unfinished
    for text, want in cases.items():
        assert tasks.is_correct(text, ex) is want, text
    assert tasks.exact_match(list(cases), [ex] * len(cases)) == 3 / len(cases)
    # single-answer tasks stay exact
    assert tasks.is_correct("cba<eos>", tasks.Example("rev", "rev:abc=", "cba"))
    assert not tasks.is_correct("bca", tasks.Example("rev", "rev:abc=", "cba"))


def test_oneof_task_accepts_either_word_per_group():
    """oneof: 16-token prompts (4-slot blocks hold whole groups), 32-token answers drawing each group
    from both words (checked by an independent solver); the scorer takes any answer whose 8 groups are
    each one of the two words, and nothing else (hand cases)."""
    exs = tasks.test_set(60, seed=5, tasks=("oneof",))
    assert {ex.task for ex in exs} == {"oneof"} and len({ex.prompt for ex in exs}) == 60
    for ex in exs:
        assert _check_answer(ex), ex
        assert len(ex.prompt) == 16 and tasks.is_correct(ex.answer + "<eos>", ex)
    both = sum(len({ex.answer[i:i + 4] for i in range(0, 32, 4)}) == 2 for ex in exs)
    assert both >= 55  # each group is a fair coin: all 8 the same word has probability 2 / 256
    assert tasks.max_new_tokens(("oneof",)) == 36
    ex = tasks.Example("oneof", "oneof:abcd efgh=", "abcd" * 8)
    good = "efgh" * 3 + "abcd" * 4 + "efgh"
    cases = {good: True, "abcd" * 8 + "<eos>": True, " " + good + " ": True,
             "abcd" * 7: False,  # a group short
             "abcd" * 8 + "e": False,  # a letter too many
             "abcd" * 7 + "abgh": False,  # a group mixing the two words
             "abcd" * 7 + "dcba": False,  # the right letters, wrong order
             "abcd" * 7 + "ab<mask>d": False}  # unfinished
    for text, want in cases.items():
        assert tasks.is_correct(text, ex) is want, text


def test_either_task_accepts_word_or_filler_per_group():
    """either: 12-token prompts, 32-token answers whose groups are the word or "----" (independent
    solver); the scorer takes any such answer, not a group mixing the two."""
    exs = tasks.test_set(60, seed=6, tasks=("either",))
    assert {ex.task for ex in exs} == {"either"} and len({ex.prompt for ex in exs}) == 60
    for ex in exs:
        assert _check_answer(ex), ex
        assert len(ex.prompt) == 12 and tasks.is_correct(ex.answer, ex)
    assert sum(len({ex.answer[i:i + 4] for i in range(0, 32, 4)}) == 2 for ex in exs) >= 55
    ex = tasks.Example("either", "either:abcd=", "abcd" * 8)
    cases = {"----" * 8: True, "abcd----" * 4 + "<eos>": True, "abcd" * 7: False, "abcd" * 7 + "ab--": False,
             "abcd" * 7 + "dcba": False, "abcd" * 7 + "---": False}
    for text, want in cases.items():
        assert tasks.is_correct(text, ex) is want, text
