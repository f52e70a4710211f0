"""Train the three tiny models jdllm ships (models/tiny-ar, tiny-sdar, tiny-llada) on the CPU.

Same size (~0.6M parameters), same data (jdllm.tasks: sort / add / rev),
three families and objectives, plus a small draft for speculative decoding:

    ar     Qwen3 layout, causal           next-token cross-entropy
    sdar   SDAR layout, block-causal (4)  BD3-LM block-diffusion loss
    llada  LLaDA layout, bidirectional    LLaDA masked-diffusion loss
    ar-draft  Qwen3 layout, causal, 1 layer, hidden 64: tiny-ar's draft (jdllm.Speculative)

Each is saved as a Hugging Face directory (config.json in the family's own
keys, model.safetensors with its published weight names, tokenizer.json) and
a loss curve PNG. Deterministic from --seed. The AR model trains from
scratch; the diffusion models start from its weights (RECIPES).

    python examples/train_tiny.py                               # the shipped recipes, into a scratch folder
    python examples/train_tiny.py --model all --out models      # ... over the shipped models themselves
    python examples/train_tiny.py --model sdar --steps 20 --smoke --out /tmp/tiny

--tasks json trains the structured task alone (its own alphabet: jdllm.tasks.JSON_CHARS), e.g.
the shipped models/tiny-json-ar and tiny-json-sdar:
    python examples/train_tiny.py --model ar --tasks json --name tiny-json-ar --steps 600 --out models
    python examples/train_tiny.py --model sdar --tasks json --name tiny-json-sdar --steps 300 --lr 1e-3 \
        --init-from models/tiny-json-ar --out models
--tasks mixes in the long-answer task "rep" (jdllm.tasks.LONG_TASKS; rows of 64 slots), e.g. the
fine-tune of the shipped tiny-sdar measured in benchmarks/RESULTS.md (rep 78.7%, old tasks -2.3
points: not shipped over models/tiny-sdar; ~18 min on 2 shared cores):

    python examples/train_tiny.py --model sdar --tasks sort add rev rep --weights 1 1 1 1 \
        --init-from models/tiny-sdar --steps 240 --lr 4e-4 --eval-every 60 --out /tmp/tiny-long

The long tasks whose blocks take several forwards (jumble, cumsum) were tried the same way, with
--noisy-context (a second block-diffusion term whose earlier blocks are noisy too, as multi_block
decodes them); neither was learned in a ~25 min CPU budget (benchmarks/RESULTS.md), e.g.

    python examples/train_tiny.py --model sdar --tasks sort add rev jumble --weights 1 1 1 1 \
        --init-from models/tiny-sdar --steps 180 --lr 5e-4 --eval-every 45 --out /tmp/tiny-jumble

The shipped models/tiny-sdar-long learned the long task "either" (a block's first token is a coin
flip, so block diffusion needs ~2 forwards per block; ~24 min on one core), with a constant learning
rate after a 10-step warmup (--warmup, --constant-lr: a long warmup back to the full rate cost
earlier warm starts old-task accuracy):

    python examples/train_tiny.py --model sdar --tasks sort add rev either --weights 1 1 1 1 \
        --init-from models/tiny-sdar --steps 320 --lr 4e-4 --warmup 10 --constant-lr \
        --noisy-context 0.5 --name stage1 --out /tmp/long
    python examples/train_tiny.py --model sdar --tasks sort add rev either --weights 1 1 1 1 \
        --init-from /tmp/long/stage1 --steps 100 --lr 2e-4 --warmup 5 --constant-lr \
        --noisy-context 1.0 --name tiny-sdar-long --out models
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jdllm import objectives, tasks  # noqa: E402
from jdllm.config import ModelConfig  # noqa: E402
from jdllm.model import default_positions, forward, init_params  # noqa: E402

NAMES = {"ar": "tiny-ar", "sdar": "tiny-sdar", "llada": "tiny-llada", "ar-draft": "tiny-ar-draft"}
# The shipped models' recipes. The diffusion models start from the trained AR model (as SDAR and Dream
# adapt Qwen checkpoints): from scratch, a LLaDA model reached ~2% exact match in the same CPU budget.
RECIPES = {
    "ar": dict(steps=1500, lr=3e-3, init_from=None),
    "sdar": dict(steps=600, lr=1e-3, init_from="ar"),
    "llada": dict(steps=700, lr=1.5e-3, init_from="ar"),
    # the speculative-decoding draft for tiny-ar (jdllm.Speculative): 1 layer, hidden 64, same tokenizer
    "ar-draft": dict(steps=1500, lr=3e-3, init_from=None),
}
SEQ_LEN = 32  # training row length: left padding | prompt | answer | EOS fill
LONG_SEQ_LEN = 64  # ... when a long-answer task is in the mix
EVAL_PROMPT, EVAL_GEN = 16, 12  # eval layout: prompt left-padded to 16 slots (or more), 12 generated
LONG_EVAL_GEN = 48  # generated slots when scoring "rep" (other long tasks: tasks.max_new_tokens)
JSON_EVAL_GEN = 24  # ... the json task (answers of up to 18 characters)


def model_config(kind: str, hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                 intermediate: int = 256, block_size: int = 4) -> ModelConfig:
    """The ModelConfig of one shipped family; all three share every size."""
    common = dict(vocab_size=tasks.VOCAB_SIZE, hidden_size=hidden, intermediate_size=intermediate,
                  num_layers=layers, num_heads=heads, head_dim=hidden // heads,
                  max_position_embeddings=64, rope_theta=10000.0, eos_token_ids=(tasks.EOS_ID,),
                  pad_token_id=tasks.PAD_ID)
    if kind == "ar":
        return ModelConfig(model_type="qwen3", num_kv_heads=kv_heads, qk_norm=True, **common)
    if kind == "ar-draft":  # a quarter of the layers, half the width: drafting costs a fraction of tiny-ar
        return model_config("ar", hidden=hidden // 2, layers=1, intermediate=intermediate // 2)
    if kind == "sdar":
        return ModelConfig(model_type="sdar", num_kv_heads=kv_heads, qk_norm=True, attention="block_causal",
                           block_size=block_size, mask_token_id=tasks.MASK_ID, **common)
    if kind == "llada":
        return ModelConfig(model_type="llada", num_kv_heads=kv_heads, attention="bidirectional",
                           mask_token_id=tasks.MASK_ID, rms_norm_eps=1e-5, weight_layout="llada", **common)
    raise SystemExit(f"--model {kind!r}: choose ar, sdar, llada, ar-draft or all")


# --------------------------------------------------------------------------- data
class Batches:
    """Training rows drawn with a seeded numpy RNG: [pad | prompt | answer | EOS x fill].

    The EOS fill length is random (>= 1), so the left padding and hence the
    alignment of the answer on the block grid vary, as they do at inference.
    Tasks are drawn uniformly (the addition space is smaller than the others), or with
    `weights` ({task: weight}).
    """

    def __init__(self, examples, seed: int, seq_len: int = SEQ_LEN, chars=tasks.CHARS, weights=None):
        self.seq_len = seq_len
        self.prompts = [tasks.encode(ex.prompt, chars) for ex in examples]
        self.answers = [tasks.encode(ex.answer, chars) for ex in examples]
        self.by_task = [np.array([i for i, ex in enumerate(examples) if ex.task == t]) for t in tasks.ALL_TASKS]
        w = np.ones(len(tasks.ALL_TASKS)) if weights is None else np.asarray(
            [weights.get(t, 0.0) for t in tasks.ALL_TASKS], float)
        keep = [i for i, ix in enumerate(self.by_task) if len(ix) and w[i] > 0]
        self.by_task = [self.by_task[i] for i in keep]
        self.p = None if weights is None else w[keep] / w[keep].sum()
        self.rng = np.random.default_rng(seed)

    def __call__(self, batch: int):
        which = (self.rng.integers(0, len(self.by_task), batch) if self.p is None  # the shipped recipes' stream
                 else self.rng.choice(len(self.by_task), batch, p=self.p))
        idx = [self.by_task[w][self.rng.integers(0, len(self.by_task[w]))] for w in which]
        T = self.seq_len
        tokens = np.full((batch, T), tasks.PAD_ID, np.int32)
        target = np.zeros((batch, T), bool)
        start = np.zeros((batch,), np.int32)
        for b, i in enumerate(idx):
            p, a = self.prompts[i], self.answers[i]
            fill = int(self.rng.integers(1, T - len(p) - len(a) + 1))
            row = p + a + [tasks.EOS_ID] * fill
            s = T - len(row)
            tokens[b, s:] = row
            target[b, s + len(p):] = True
            start[b] = s
        return jnp.asarray(tokens), jnp.asarray(target), jnp.asarray(start)


# --------------------------------------------------------------------------- eval
def prompt_width(examples) -> int:
    """Prompt slots of the eval layout: EVAL_PROMPT, or the longest prompt rounded up to 8 (block-aligned)."""
    return max(EVAL_PROMPT, -(-max(len(ex.prompt) for ex in examples) // 8) * 8)


def eval_rows(examples, gen: int = EVAL_GEN, chars=tasks.CHARS, width: int = EVAL_PROMPT):
    """Prompts left-padded to `width` slots, followed by `gen` mask slots."""
    n = len(examples)
    tokens = np.full((n, width + gen), tasks.MASK_ID, np.int32)
    start = np.zeros((n,), np.int32)
    for b, ex in enumerate(examples):
        p = tasks.encode(ex.prompt, chars)
        tokens[b, :width] = tasks.PAD_ID
        tokens[b, width - len(p):width] = p
        start[b] = width - len(p)
    return jnp.asarray(tokens), jnp.asarray(start)


@jax.jit(static_argnames=("cfg", "gen"))
def greedy_decode(params, tokens, start, *, cfg: ModelConfig, gen: int = EVAL_GEN):
    """A plain full-recompute decoder for the training report (the harness uses jdllm.generate).

    causal: one token per step, left to right. block_causal: the first block
    holding a mask reveals its most confident masked slot per step.
    bidirectional: the most confident masked slot of the whole answer per step.
    """
    B, T = tokens.shape
    width = T - gen  # prompt slots
    pos = default_positions(start, 0, T)
    slots = jnp.arange(T)

    def step(i, toks):
        logits, _ = forward(params, cfg, toks, pos, start=start, attn_impl="xla")
        if cfg.attention == "causal":
            nxt = jnp.argmax(logits[:, width + i - 1], -1)
            return toks.at[:, width + i].set(nxt.astype(toks.dtype))
        probs = jax.nn.softmax(logits, -1)
        pred, conf = jnp.argmax(probs, -1), jnp.max(probs, -1)
        masked = toks == tasks.MASK_ID
        if cfg.attention == "block_causal":
            blk = slots // cfg.block_size
            first = jnp.min(jnp.where(masked, blk[None], T), axis=1)  # [B]
            masked = masked & (blk[None] == first[:, None])
        pick = jnp.argmax(jnp.where(masked, conf, -1.0), -1)  # [B]
        hit = (slots[None] == pick[:, None]) & masked
        return jnp.where(hit, pred.astype(toks.dtype), toks)

    return jax.lax.fori_loop(0, gen, step, tokens)


def evaluate(params, cfg, examples, batch: int = 100, gen: int = EVAL_GEN, chars=tasks.CHARS) -> float:
    preds, width = [], prompt_width(examples)
    for i in range(0, len(examples), batch):
        chunk = examples[i:i + batch]
        toks, start = eval_rows(chunk, gen, chars, width)
        out = np.asarray(greedy_decode(params, toks, start, cfg=cfg, gen=gen))
        preds += [tasks.decode(r[width:], chars).replace("<eos>", "\x00").split("\x00")[0] for r in out]
    return tasks.exact_match(preds, examples)


def evaluate_long(params, cfg, long, n: int, seed: int) -> dict[str, float]:
    """Exact match of the script's greedy decoder on `n` held-out items of each long task alone."""
    return {t: evaluate(params, cfg, tasks.test_set(n, seed, (t,)),
                        gen=LONG_EVAL_GEN if t == "rep" else tasks.max_new_tokens((t,))) for t in long}


def noisy_context_loss(params, cfg: ModelConfig, tokens, target, start, key, *, low_discrepancy: bool = False):
    """Block diffusion with NOISY earlier blocks as context (one block-causal pass over the noisy row).

    BD3-LM (`objectives.block_diffusion_loss`) always shows a block clean earlier blocks, as block
    diffusion decodes; multi_block decodes a block while earlier ones still hold masks. Same per-block
    noise and 1/t-weighted CE, only the context differs.
    """
    noisy, masked, p_mask = objectives.mask_noise(key, tokens, target, cfg.mask_token_id, block_size=cfg.block_size,
                                                  low_discrepancy=low_discrepancy)
    logits, _ = forward(params, cfg, noisy, default_positions(start, 0, tokens.shape[1]), start=start,
                        attn_impl="xla")
    return objectives._weighted_masked_ce(logits, tokens, masked, p_mask, target)


# --------------------------------------------------------------------------- training
def lr_schedule(lr: float, steps: int, warmup: int | None = None, constant: bool = False):
    """The optax schedule: a linear warmup over `warmup` steps (default min(100, steps / 10)), then a
    cosine decay to lr / 10 at `steps` (the shipped recipes), or `constant` lr (0 warmup: lr from step 0)."""
    import optax  # noqa: PLC0415

    n_warm = min(100, max(1, steps // 10)) if warmup is None else warmup
    if constant:
        return optax.linear_schedule(0.0, lr, n_warm) if n_warm else optax.constant_schedule(lr)
    return optax.warmup_cosine_decay_schedule(0.0, lr, max(1, n_warm), max(steps, 2), end_value=lr * 0.1)


def warm_start(params, cfg: ModelConfig, path: str):
    """Copy every weight of the model at `path` whose name and shape match (AR -> diffusion adaptation,
    as SDAR and Dream start from Qwen checkpoints); the rest keeps its fresh initialisation."""
    from jdllm.checkpoint import load_model  # noqa: PLC0415

    from jdllm.model import stack_layers  # noqa: PLC0415

    src = stack_layers(load_model(path, dtype="float32").params, cfg)  # training runs the stacked layout

    def pick(new, old):
        return {k: pick(v, old.get(k)) if isinstance(v, dict) else
                (jnp.asarray(old[k]) if k in old and old[k].shape == v.shape else v)
                for k, v in new.items()} if isinstance(old, dict) else new

    return pick(params, src)


def train(kind: str, steps: int, batch: int, lr: float, seed: int, out: str, n_train: int, n_eval: int,
          quiet: bool = False, init_from: str | None = None, task_mix=tasks.TASKS, name: str | None = None,
          weights=None, eval_every: int = 0, block_size: int = 4, noisy_context: float = 0.0,
          warmup: int | None = None, constant_lr: bool = False) -> dict:
    import functools  # noqa: PLC0415

    import optax  # noqa: PLC0415
    from tqdm import tqdm  # noqa: PLC0415

    cfg = model_config(kind, block_size=block_size)
    key = jax.random.key(seed)
    params = init_params(cfg, jax.random.fold_in(key, 0))
    if init_from:
        params = warm_start(params, cfg, init_from)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    sched = lr_schedule(lr, steps, warmup, constant_lr)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b2=0.98, weight_decay=0.01))
    opt_state = opt.init(params)
    loss_fn = objectives.loss_for(cfg)
    if not kind.startswith("ar"):  # stratified noise levels: the 1/t-weighted loss has far lower variance
        loss_fn = functools.wraps(loss_fn)(functools.partial(loss_fn, low_discrepancy=True))
    if noisy_context:
        if cfg.attention != "block_causal":
            raise SystemExit("--noisy-context applies to block-causal models (--model sdar)")
        bd3 = loss_fn

        @functools.wraps(bd3)
        def loss_fn(params, cfg, tokens, target, start, k):  # BD3-LM + w * the noisy-context term
            return bd3(params, cfg, tokens, target, start, k) + noisy_context * noisy_context_loss(
                params, cfg, tokens, target, start, jax.random.fold_in(k, 7), low_discrepancy=True)

    @jax.jit
    def update(params, opt_state, tokens, target, start, k):
        loss, grads = jax.value_and_grad(loss_fn)(params, cfg, tokens, target, start, k)
        upd, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    long = [t for t in task_mix if t in tasks.LONG_TASKS]
    chars = tasks.chars_for(task_mix)  # the json task has its own alphabet
    data = Batches(tasks.train_set(n_train, seed, task_mix), seed, LONG_SEQ_LEN if long else SEQ_LEN, chars, weights)
    name = name or NAMES[kind]
    losses = []
    out_dir = os.path.join(out, name)
    t0 = time.time()
    bar = tqdm(range(steps), desc=name, disable=quiet, mininterval=5.0)
    for i in bar:
        tokens, target, start = data(batch)
        params, opt_state, loss = update(params, opt_state, tokens, target, start, jax.random.fold_in(key, i + 1))
        losses.append(float(loss))
        if i % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")
        if eval_every and (i + 1) % eval_every == 0 and i + 1 < steps:  # progress: small scores + a checkpoint
            a = evaluate(params, cfg, tasks.test_set(n_eval, seed)) if n_eval else None
            la = evaluate_long(params, cfg, long, min(n_eval, 100), seed) if n_eval and long else None
            ck = os.path.join(out_dir + "-ckpt", f"step{i + 1}")
            save(ck, params, cfg)
            print(json.dumps({"step": i + 1, "elapsed_s": round(time.time() - t0, 1),
                              "loss": float(np.mean(losses[-50:])), f"old_tasks_{n_eval}": a,
                              "long_100": la, "checkpoint": ck}), flush=True)
    train_s = time.time() - t0
    structured = chars is tasks.JSON_CHARS
    acc = evaluate(params, cfg, tasks.test_set(n_eval, seed, task_mix if structured else tasks.TASKS),
                   gen=JSON_EVAL_GEN if structured else EVAL_GEN, chars=chars) if n_eval else None  # null: not evaluated
    long_acc = evaluate_long(params, cfg, long, n_eval, seed) if n_eval and long else None

    save(out_dir, params, cfg, chars)
    plot_losses(losses, os.path.join(out_dir, "loss.png"), f"{name} ({cfg.model_type}, {loss_fn.__name__})")
    info = {"model": name, "model_type": cfg.model_type, "objective": loss_fn.__name__,
            "params": n_params, "init_from": init_from and os.path.basename(os.path.normpath(init_from)),
            "steps": steps, "batch": batch, "lr": lr, "seed": seed,
            "train_examples": n_train, "train_seconds": round(train_s, 1),
            "final_loss": float(np.mean(losses[-50:])), "eval_items": n_eval,
            "eval_exact_match": acc}
    if structured:
        info.update(tasks=list(task_mix))
    if weights:
        info["task_weights"] = {t: weights[t] for t in task_mix if t in weights}
    if noisy_context:
        info["noisy_context"] = noisy_context
    if warmup is not None or constant_lr:
        info.update(warmup_steps=warmup, lr_schedule="constant" if constant_lr else "cosine")
    if long:
        info.update(tasks=list(task_mix), seq_len=data.seq_len, eval_long_tasks=long,
                    eval_long_exact_match=long_acc and sum(long_acc.values()) / len(long_acc),
                    eval_long_by_task=long_acc)
    with open(os.path.join(out_dir, "training.json"), "w") as f:
        json.dump(info, f, indent=2)
    print(json.dumps(info), flush=True)
    return info


def save(out_dir: str, params, cfg: ModelConfig, chars=tasks.CHARS) -> None:
    """Hugging Face directory: config.json, model.safetensors (float32), tokenizer files."""
    from convert.hf import save_hf_dir  # noqa: PLC0415

    save_hf_dir(out_dir, jax.tree.map(np.asarray, params), cfg)
    tasks.save_tokenizer(out_dir, chars)


def plot_losses(losses, path: str, title: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    x = np.asarray(losses)
    w = max(1, len(x) // 50)
    smooth = np.convolve(x, np.ones(w) / w, mode="valid")
    fig, ax = plt.subplots(figsize=(5, 3), dpi=80)
    ax.plot(x, alpha=0.3, lw=0.8, label="loss")
    ax.plot(np.arange(len(smooth)) + w - 1, smooth, lw=1.5, label=f"mean of {w}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="all", choices=["ar", "sdar", "llada", "ar-draft", "all"])
    ap.add_argument("--steps", type=int, default=None, help="default: the shipped recipe (RECIPES)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=None, help="default: the shipped recipe (RECIPES)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-size", type=int, default=60000)
    ap.add_argument("--eval", type=int, default=300, help="held-out items scored after training (0: skip)")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "jdllm-tiny"),
                    help="where the model directories go (default: a scratch folder, so a bare run never "
                         "overwrites the shipped models; `--out models` reproduces them)")
    ap.add_argument("--smoke", action="store_true", help="tiny run for tests: small data, batch 8, no eval")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--init-from", default=None,
                    help="warm start from a trained model directory (weights with matching names and shapes); "
                         "default: the recipe's (diffusion models start from OUT/tiny-ar when it exists)")
    ap.add_argument("--scratch", action="store_true", help="no warm start, whatever the recipe says")
    ap.add_argument("--tasks", nargs="+", default=list(tasks.TASKS), choices=list(tasks.ALL_TASKS),
                    help="training mix (default: the short tasks); a long-answer task lengthens rows to "
                         f"{LONG_SEQ_LEN} slots and adds its own score to training.json")
    ap.add_argument("--name", default=None, help="output directory name (default: the family's tiny-* name)")
    ap.add_argument("--weights", nargs="+", type=float, default=None,
                    help="sampling weight of each --tasks entry, in order (default: uniform)")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="every N steps: score --eval old-task items (+ 100 items of each long task) and save a "
                         "checkpoint under OUT/<model>-ckpt/stepN (0: never)")
    ap.add_argument("--block-size", type=int, default=4,
                    help="sdar attention block grid (default 4, the shipped tiny-sdar's)")
    ap.add_argument("--noisy-context", type=float, default=0.0,
                    help="sdar: add this weight times a block-diffusion term whose context blocks are noisy too "
                         "(as multi_block decodes), to the BD3-LM loss (default 0: BD3-LM alone)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="learning-rate warmup steps (default: min(100, steps/10)); warm-start fine-tunes "
                         "lose old-task accuracy while a long warmup climbs back to the full rate")
    ap.add_argument("--constant-lr", action="store_true",
                    help="hold the learning rate after the warmup (default: cosine decay to lr/10)")
    args = ap.parse_args(argv)
    if args.weights is not None and len(args.weights) != len(args.tasks):
        ap.error(f"--weights needs one value per --tasks entry ({len(args.tasks)})")
    weights = dict(zip(args.tasks, args.weights)) if args.weights else None
    if args.smoke:
        args.batch, args.train_size, args.eval = 8, 200, 0
    kinds = ["ar", "sdar", "llada", "ar-draft"] if args.model == "all" else [args.model]
    for kind in kinds:
        recipe = RECIPES[kind]
        init = args.init_from
        if init is None and recipe["init_from"] and not args.scratch:
            cand = os.path.join(args.out, NAMES[recipe["init_from"]])
            init = cand if os.path.isfile(os.path.join(cand, "config.json")) else None
        train(kind, args.steps or recipe["steps"], args.batch, args.lr or recipe["lr"], args.seed, args.out,
              args.train_size, args.eval, args.quiet, None if args.scratch else init, tuple(args.tasks),
              name=args.name, weights=weights, eval_every=args.eval_every, block_size=args.block_size,
              noisy_context=args.noisy_context, warmup=args.warmup, constant_lr=args.constant_lr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
