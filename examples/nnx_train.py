"""Fine-tune a jdllm model through its flax nnx view (nnx.Optimizer + optax), then generate with it.

    python examples/nnx_train.py --steps 30

`jdllm.nnx.Model(model)` is an `nnx.Module` whose state is the model's own parameter pytree
(the same arrays, at jdllm's names) and whose `__call__` is jdllm's forward. Here it learns a
task models/tiny-ar was never trained on (`rep:abcd=` -> `abcd abcd ...`, 8 times) with a
plain next-token loss on the answers, under `nnx.jit`; `jdllm.generate` then decodes with
the trained weights (`view.as_model()`), no conversion in between. A few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jdllm  # noqa: E402
import jdllm.nnx  # noqa: E402
from jdllm import tasks  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def batch_of(examples):
    """tokens [B, T] (prompt, answer, EOS, right-padded) and the loss mask of the answer + EOS slots."""
    rows = [(tasks.encode(ex.prompt), tasks.encode(ex.answer) + [tasks.EOS_ID]) for ex in examples]
    T = max(len(p) + len(a) for p, a in rows)
    tokens = np.full((len(rows), T), tasks.PAD_ID, np.int32)
    mask = np.zeros((len(rows), T), bool)
    for b, (p, a) in enumerate(rows):
        tokens[b, :len(p) + len(a)] = p + a
        mask[b, len(p):len(p) + len(a)] = True
    return jnp.asarray(tokens), jnp.asarray(mask)


def loss_fn(view, tokens, mask):
    """Mean next-token cross-entropy over the answer slots (the view's forward: causal, as the model)."""
    logits, _ = view(tokens)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    m = mask[:, 1:]
    return jnp.sum(nll * m) / jnp.sum(m)


@nnx.jit
def train_step(view, optimizer, tokens, mask):
    loss, grads = nnx.value_and_grad(loss_fn)(view, tokens, mask)
    optimizer.update(view, grads)
    return loss


def accuracy(model, examples) -> float:
    outs = jdllm.generate(model, [ex.prompt for ex in examples], jdllm.AR(),
                          jdllm.Sampling(max_new_tokens=tasks.MAX_ANSWER["rep"] + 1))
    return tasks.exact_match([o.text for o in outs], examples)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "tiny-ar"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)

    model = jdllm.load(args.model, dtype="float32")
    view = jdllm.nnx.Model(model)
    assert view.params()["embed"] is model.params["embed"]  # a view: the model's own arrays
    optimizer = nnx.Optimizer(view, optax.adam(args.lr), wrt=nnx.Param)
    train = tasks.train_set(args.batch * args.steps, seed=0, tasks=("rep",))
    held_out = tasks.test_set(16, seed=0, tasks=("rep",))
    print(f"before: exact match on 16 held-out rep prompts {accuracy(model, held_out):.2f}")

    t0, losses = time.perf_counter(), []
    for s in range(args.steps):
        tokens, mask = batch_of(train[s * args.batch:(s + 1) * args.batch])
        losses.append(float(train_step(view, optimizer, tokens, mask)))
    print(f"{args.steps} optimizer steps in {time.perf_counter() - t0:.1f} s (the first compiles): "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    trained = view.as_model()  # the same config and tokenizer, the view's current weights
    print(f"after:  exact match on 16 held-out rep prompts {accuracy(trained, held_out):.2f}")
    out = jdllm.generate(trained, [held_out[0].prompt], jdllm.AR(), jdllm.Sampling(max_new_tokens=40))[0]
    print(f"{held_out[0].prompt} -> {out.text!r} (expected {held_out[0].answer!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
