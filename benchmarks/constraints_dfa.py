"""The "dfa" constraint backend: table sizes, per-step DP cost, and what a constraint costs in quality
and parallelism on the shipped diffusion models.

Three parts (prints markdown tables, writes benchmarks/out/constraints_dfa.json):

  tables   a 32k byte-level BPE trained here with `tokenizers` on local text (this
           repository's sources and Python's standard library; no hub): token DFA
           states Q, token classes C, device table bytes and compile seconds for a
           few regexes and JSON schemas.
  dp       the jitted DP of one step (mask a W-slot window + the joint check) on the
           CPU, against canvas length S, window W and states Q (random tables, V=32k).
  quality  held-out `jdllm.tasks` prompts on tiny-sdar (block diffusion) and
           tiny-llada (masked diffusion), each task with a regex describing its answer
           format (sort `\\d( \\d)*`, add `\\d+`, rev `[a-z]+`): valid %, exact %,
           tokens per forward (TPF) and wall time, for free decoding, the DFA rule,
           and a left-to-right rule (the same DFA, but one token per step, leftmost
           first: what a left-to-right matcher can judge; the llguidance backend
           itself is not on this branch). Plus a random-weight block-diffusion model
           with a small JSON schema (the task models' alphabet has no braces/quotes).

    python benchmarks/constraints_dfa.py            # all parts
    python benchmarks/constraints_dfa.py --quick    # fewer items / sizes
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
import sysconfig
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "out")

SCHEMA_SMALL = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
                "required": ["a", "b"]}
SCHEMA_MEDIUM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "tags", "ok"]}
SCHEMA_NESTED = {"type": "object", "properties": {
    "id": {"type": "string", "format": "uuid"}, "when": {"type": "string", "format": "date"},
    "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
              "required": ["x", "y"]}}, "required": ["id", "when", "point"]}


# --------------------------------------------------------------------------- part 1: table sizes
def bpe_32k():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    path = os.path.join(OUT, "bpe32k.json")
    if os.path.exists(path):
        return Tokenizer.from_file(path), 0.0
    files = sorted(glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)
                   + glob.glob(os.path.join(ROOT, "**", "*.md"), recursive=True))
    files = [f for f in files if ".venv" not in f]
    files += sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    def utf8(f):
        try:
            with open(f, encoding="utf-8") as fh:
                fh.read()
            return True
        except (UnicodeDecodeError, OSError):
            return False

    files = [f for f in files if utf8(f)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    t0 = time.perf_counter()
    tok.train(files, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<eos>", "<mask>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    secs = time.perf_counter() - t0
    os.makedirs(OUT, exist_ok=True)
    tok.save(path)
    return tok, secs


def part_tables(quick: bool):
    from jdllm.constraints import dfa_compile  # noqa: PLC0415

    tok, train_s = bpe_32k()
    V = tok.get_vocab_size()
    specials = {tok.token_to_id("<eos>"), tok.token_to_id("<mask>")}
    strings = []
    for i in range(V):
        if i in specials:
            strings.append(None)
            continue
        s = tok.decoder.decode([tok.id_to_token(i)])
        strings.append(None if "\ufffd" in s else s)
    cases = [("regex", r"\d( \d)*"), ("regex", r"[a-z]+@[a-z]+\.(com|org)"),
             ("json_schema", SCHEMA_SMALL), ("json_schema", SCHEMA_MEDIUM)]
    if not quick:
        cases.append(("json_schema", SCHEMA_NESTED))
    rows = []
    for kind, src in cases:
        pattern = dfa_compile.regex_of(kind, json.dumps(src, sort_keys=True) if kind == "json_schema" else src)
        t0, c0 = time.perf_counter(), time.process_time()
        d = dfa_compile.compile_pattern(pattern, strings, stop_ids=[tok.token_to_id("<eos>")],
                                        mask_id=tok.token_to_id("<mask>"))
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        import interegular  # noqa: PLC0415

        char_states = len(interegular.parse_pattern(pattern).to_fsm().states)
        Q, C = d.num_states, d.num_classes
        dev = Q * C * 4 + V * 4 + Q + Q * Q * 4  # next_state, token_class, accepting, any_step
        name = src if kind == "regex" else "schema:" + ",".join(src["properties"])
        rows.append(dict(constraint=name, kind=kind, regex_chars=len(pattern), char_states=char_states,
                         Q=Q, C=C, V=V, device_bytes=dev, dense_QxV_bytes=Q * V * 4, compile_s=round(secs, 2),
                         compile_cpu_s=round(cpu, 2)))
    print(f"\n## token DFA tables on a {V}-token byte-level BPE (trained here in {train_s:.0f} s; 0 = cached)\n")
    print("| constraint | regex chars | char-DFA states | token states Q | token classes C | device tables | dense Q x V | compile wall s / CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| `{r['constraint']}` | {r['regex_chars']} | {r['char_states']} | {r['Q']} | {r['C']} | "
              f"{r['device_bytes'] / 1024:.0f} KiB | {r['dense_QxV_bytes'] / 1024:.0f} KiB | {r['compile_s']} / {r['compile_cpu_s']} |")
    return rows


# --------------------------------------------------------------------------- part 2: DP cost per step
def _timeit(fn, *args, reps=20):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def part_dp(quick: bool):
    import types  # noqa: PLC0415

    from jdllm.constraints import dfa_device  # noqa: PLC0415
    from jdllm.constraints.dfa_compile import TokenDFA  # noqa: PLC0415

    V, C, B = 32000, 32, 1
    rng = np.random.default_rng(0)

    def tables(Q):
        nxt = rng.integers(1, Q, size=(Q, C)).astype(np.int32)
        nxt[0] = 0
        nxt[:, 0] = 0
        acc = rng.random(Q) < 0.3
        acc[0] = False
        d = TokenDFA(next_state=nxt, token_class=rng.integers(0, C, size=V).astype(np.int32),
                     accepting=acc, live=np.ones(Q, bool), start=1, min_tokens=1)
        return dfa_device.stack([d] * B, V)

    def state(S):
        tokens = jnp.asarray(rng.integers(3, V, size=(B, S)), jnp.int32)
        revealed = jnp.asarray(np.arange(S)[None] < S // 2).repeat(B, 0)  # first half revealed
        return dict(tokens=tokens, revealed=revealed, gen_start=jnp.zeros((B,), jnp.int32),
                    limit=jnp.full((B,), S, jnp.int32))

    @jax.jit
    def mask_only(tab, st, logits, offset):
        ns = types.SimpleNamespace(**st, slots=st["tokens"].shape[1])
        return dfa_device.DFATables.mask_logits(tab, ns, logits, offset)[1]

    @jax.jit
    def joint(tab, st, tok, score, offset):
        ns = types.SimpleNamespace(**st, slots=st["tokens"].shape[1])
        return dfa_device.joint_select(tab, ns, offset, jnp.ones(tok.shape, bool), tok, score)

    grid = []
    Ss = (64, 256) if quick else (64, 256, 1024)
    Qs = (8, 32) if quick else (8, 32, 128)
    for S in Ss:
        for Q in Qs:
            for W in (4, 32):
                tab, st = tables(Q), state(S)
                logits = jnp.asarray(rng.standard_normal((B, W, V)), jnp.float32)
                off = jnp.int32(S // 2)
                tok = jnp.argmax(mask_only(tab, st, logits, off), axis=-1).astype(jnp.int32)
                score = jnp.asarray(rng.random((B, W)), jnp.float32)
                ms_mask = _timeit(mask_only, tab, st, logits, off)
                # one token per slot, each allowed alone: with random tables most sets are not jointly
                # completable, so this times the one-by-one pass (the worst case; a consistent set costs
                # one window pass)
                ms_joint = _timeit(joint, tab, st, tok, score, off)
                grid.append(dict(S=S, Q=Q, W=W, C=C, V=V, mask_ms=round(ms_mask, 3), joint_worst_ms=round(ms_joint, 3)))
    print(f"\n## DP per step on the CPU (B={B}, C={C}, V={V}; median of 20 jitted calls; "
          "half the canvas revealed)\n")
    print("| canvas S | states Q | window W | mask (fwd+bwd DP + token mask) ms | joint check, worst case ms |")
    print("|---|---|---|---|---|")
    for g in grid:
        print(f"| {g['S']} | {g['Q']} | {g['W']} | {g['mask_ms']} | {g['joint_worst_ms']} |")
    return grid


# --------------------------------------------------------------------------- part 3: quality / TPF
TASK_REGEX = {"sort": r"\d( \d)*", "add": r"\d+", "rev": r"[a-z]+"}


def _run(model, prompts, dec, samp, cons):
    import jdllm  # noqa: PLC0415

    t0 = time.perf_counter()
    outs = jdllm.generate(model, prompts, decoding=dec, sampling=samp, constraint=cons)
    return outs, time.perf_counter() - t0


def part_quality(quick: bool):
    import jdllm  # noqa: PLC0415
    from jdllm import constraints, tasks  # noqa: PLC0415

    n = 24 if quick else 64
    exs = tasks.test_set(n * 3)
    prompts = [e.prompt for e in exs]
    cons = [constraints.regex(TASK_REGEX[e.task], backend="dfa") for e in exs]
    G = 12
    setups = [
        ("tiny-sdar", "block_diffusion (threshold 0.9)", jdllm.BlockDiffusion(block_length=4),
         jdllm.BlockDiffusion(block_length=4, denoising_steps=4, strategy="sequential")),
        ("tiny-llada", "masked_diffusion (3 blocks x 2 steps)", jdllm.MaskedDiffusion(block_length=4, steps=6),
         jdllm.MaskedDiffusion(block_length=1, steps=G)),
    ]
    rows = []
    for path, label, dec, l2r in setups:
        model = jdllm.load(os.path.join(ROOT, "models", path), dtype="float32")
        samp = jdllm.Sampling(max_new_tokens=G)
        modes = [("free", dec, None), ("dfa", dec, cons), ("left-to-right rule", l2r, cons)]
        for _, d, c in modes:  # compile each once, then interleave timed repeats
            _run(model, prompts[:2], d, samp, None if c is None else c[:2])
        times = {m: [] for m, _, _ in modes}
        res = {}
        for _ in range(3):
            for m, d, c in modes:
                outs, secs = _run(model, prompts, d, samp, c)
                times[m].append(secs)
                res[m] = outs
        for m, _, _ in modes:
            outs = res[m]
            texts = [tasks.normalize(model.tokenizer.decode(o.token_ids, skip_special_tokens=True)) for o in outs]
            valid = np.mean([re.fullmatch(TASK_REGEX[e.task], t) is not None for e, t in zip(exs, texts)])
            exact = np.mean([t == e.answer for e, t in zip(exs, texts)])
            toks = sum(len(o.token_ids) for o in outs)
            nfe = sum(o.nfe for o in outs)
            rows.append(dict(model=path, paradigm=label, mode=m, items=len(exs), valid=round(100 * valid, 1),
                             exact=round(100 * exact, 1), tpf=round(toks / nfe, 3), nfe_per_item=round(nfe / len(exs), 2),
                             seconds=round(statistics.median(times[m]), 3)))
    rows += _json_random_model(quick)
    print(f"\n## constrained vs free decoding ({n} held-out items per task, greedy, max_new_tokens={G}; "
          "wall: median of 3 interleaved runs)\n")
    print("| model | paradigm | rule | valid % | exact % | TPF | NFE / item | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['paradigm']} | {r['mode']} | {r['valid']} | {r['exact']} | {r['tpf']} | "
              f"{r['nfe_per_item']} | {r['seconds']} |")
    return rows


def _json_random_model(quick: bool):
    """A random-weight SDAR-like model whose character vocabulary can spell JSON, SCHEMA_SMALL."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    import jdllm  # noqa: PLC0415
    from jdllm import constraints  # noqa: PLC0415
    from jdllm.config import ModelConfig  # noqa: PLC0415
    from jdllm.loading import Model  # noqa: PLC0415

    chars = list('{}[]":, 0123456789-abxyz')
    vocab = {"<pad>": 0, "<eos>": 1, "<mask>": 2, **{c: 3 + i for i, c in enumerate(chars)}}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(["<pad>", "<eos>", "<mask>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", mask_token="<mask>")
    cfg = ModelConfig(model_type="sdar", vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, attention="block_causal", block_size=4,
                      mask_token_id=2, max_position_embeddings=128, eos_token_ids=(1,))
    model = Model.random(cfg, seed=0, std=0.7, tokenizer=tok, attn_impl="xla")
    n = 16 if quick else 48
    prompts = [[3 + (i % len(chars)), 3 + (7 * i % len(chars))] for i in range(n)]
    pattern_c = constraints.json_schema(SCHEMA_SMALL, backend="dfa")
    dec = jdllm.BlockDiffusion(block_length=4)
    rows = []
    for m, c in (("free", None), ("dfa", pattern_c)):
        samp = jdllm.Sampling(temperature=1.0, max_new_tokens=32)
        _run(model, prompts[:2], dec, samp, c)
        ts, outs = [], None
        for _ in range(3):
            outs, secs = _run(model, prompts, dec, samp, c)
            ts.append(secs)
        valid = 0
        for o in outs:
            text = tok.decode(o.token_ids, skip_special_tokens=True)
            try:
                obj = json.loads(text)
                valid += isinstance(obj, dict) and set(obj) == {"a", "b"} and isinstance(obj["a"], int) \
                    and obj["b"] in ("x", "y")
            except ValueError:
                pass
        toks = sum(len(o.token_ids) for o in outs)
        nfe = sum(o.nfe for o in outs)
        rows.append(dict(model="random 2-layer (JSON chars)", paradigm="block_diffusion, temperature 1",
                         mode=m + " (schema a:int, b:x|y)", items=n, valid=round(100 * valid / n, 1), exact=float("nan"),
                         tpf=round(toks / nfe, 3), nfe_per_item=round(nfe / n, 2), seconds=round(statistics.median(ts), 3)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", default="tables,dp,quality")
    a = ap.parse_args()
    out = dict(device=str(jax.devices()[0]), jax=jax.__version__, quick=a.quick)
    for p in a.parts.split(","):
        out[p] = {"tables": part_tables, "dp": part_dp, "quality": part_quality}[p](a.quick)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "constraints_dfa.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
