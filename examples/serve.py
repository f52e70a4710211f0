"""Continuous batching without HTTP: requests join a running pool of rows and stream what is final.

Two rows serve five requests arriving one after another on tiny-sdar (block diffusion): each is
admitted into a free row between scheduling rounds while the other row keeps decoding, streams the
left-contiguous revealed prefix of its answer, and ends exactly as `jdllm.generate` ends that
prompt alone. The HTTP server (`jdllm serve`, see the README) drives the same engine on a thread.

    python examples/serve.py
    # the same on a 2x2 device mesh (rows over `data`, heads / MLP over `model`), 4 fake CPU devices:
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/serve.py --mesh data=2,model=2
"""

from __future__ import annotations

import argparse
import os

import jdllm
from jdllm.serve import Engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default=None, help="serve on a device mesh, e.g. data=2,model=2")
    args = p.parse_args()
    mesh = None
    if args.mesh:
        from jdllm import sharding

        mesh = sharding.make_mesh(args.mesh)
    model = jdllm.load(os.path.join(ROOT, "models", "tiny-sdar"), mesh=mesh)
    tok = model.tokenizer
    decoding = jdllm.BlockDiffusion(block_length=4, denoising_steps=2)
    engine = Engine(model, decoding, max_batch=2, max_prompt_tokens=16, max_new_tokens=16, steps_per_round=1)
    prompts = ["sort:3 1 2=", "add:12+34=", "rev:abc=", "sort:9 4 7 1=", "add:5+5="]
    sampling = jdllm.Sampling(max_new_tokens=12)
    reqs = []
    for p in prompts:  # one arrival per round: later requests wait for a row to free up
        reqs.append(engine.submit(tok.encode(p, add_special_tokens=False), sampling,
                                  on_event=lambda ev, p=p: ev.kind == "tokens" and
                                  print(f"  {p!r} += {tok.decode(ev.token_ids)!r}  (steps {ev.step_map})")))
        engine.step_round()
    engine.run_until_idle()
    for p, r in zip(prompts, reqs):
        alone = jdllm.generate(model, [p], decoding, sampling)[0]
        print(f"{p!r} -> {r.output.text!r} ({r.output.finish_reason}, nfe {r.output.nfe}); "
              f"same as generate() alone: {r.output.token_ids == alone.token_ids}")


if __name__ == "__main__":
    main()
