"""Drive a decode from the host, one step at a time, with a token mask per step.

The default path (`jdllm.generate`) runs every step inside one compiled
`lax.while_loop`. A host that must see each step (a grammar matcher, a serving
scheduler) uses the same pieces from `jdllm.decode.loop`: `plan` names the
slots the next step chooses tokens for, the host builds a packed int32 bitmask
for exactly those slots while `forward` runs, and `reveal` applies it. (`step`
is plan + forward + reveal in one call; `step_n` runs n steps on the device
between host visits.)

Here the mask bans every digit except 0 and 1 for the first rows of tiny-sdar's
block diffusion, while the second prompt runs free at a temperature of its
own, in the same batch and the same compile.

    python examples/host_loop.py
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

import jdllm
from jdllm.api import outputs, prepare
from jdllm.decode import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def packed(allowed: np.ndarray) -> np.ndarray:
    """bool [V] -> packed int32 [ceil(V/32)] (bit j of word i allows token 32 i + j)."""
    V = allowed.shape[0]
    bits = np.zeros(-(-V // 32) * 32, bool)
    bits[:V] = allowed
    return np.packbits(bits.reshape(-1, 32), axis=-1, bitorder="little").view(np.int32)[:, 0]


def main() -> None:
    model = jdllm.load(os.path.join(ROOT, "models", "tiny-sdar"), dtype="float32")
    tok, V = model.tokenizer, model.config.vocab_size
    allowed = np.ones(V, bool)
    for d in "23456789":
        allowed[tok.convert_tokens_to_ids(d)] = False
    prompts = ["sort:3 1 2=", "add:12+34="]
    sampling = [jdllm.Sampling(max_new_tokens=12), jdllm.Sampling(max_new_tokens=12, temperature=0.7, seed=1)]
    prep = prepare(model, prompts, jdllm.BlockDiffusion(block_length=4, denoising_steps=4), sampling)
    fns = loop.compiled_steps()
    kw = dict(paradigm=prep.paradigm, ctx=prep.ctx)

    # the prefill also takes the first denoising step: mask it through the same plan
    # (plain `loop.plan`: the jitted one donates its input, and prep.state is still needed)
    _, plan = loop.plan(prep.state, **kw)
    full = np.broadcast_to(packed(np.ones(V, bool)), (plan.valid.shape[0], plan.width, len(packed(allowed))))
    mask = full.copy()
    mask[0] = packed(allowed)  # row 0 constrained, row 1 free
    state = fns["prefill"](model.params, prep.state, jnp.asarray(mask), **kw)
    steps = 1
    while not bool(np.all(np.asarray(state.done))):
        state, plan = fns["plan"](state, **kw)
        slots = np.asarray(plan.slots)
        print(f"step {steps + 1}: row 0 chooses among slots {slots[0][np.asarray(plan.valid)[0]].tolist()}")
        state, logits = fns["forward"](model.params, state, plan, **kw)  # runs while the host builds masks
        state = fns["reveal"](state, plan, logits, jnp.asarray(mask), **kw)
        steps += 1
    for p, o in zip(prompts, outputs(prep, fns["finalize"](state))):
        print(f"{p!r} -> {o.text!r} (finish {o.finish_reason}, nfe {o.nfe}, step_map {o.step_map})")


if __name__ == "__main__":
    main()
