"""Attention kernels against the XLA reference, forward and gradient.

    python examples/attention.py                              # default Pallas backend
    python examples/attention.py --backend mosaic_interpret   # the Hopper kernels, on the CPU: the
                                  # warp-specialised prefill (loader + two compute warpgroups)
                                  # and the Mosaic backward, the defaults there
    python examples/attention.py --backend mosaic_interpret --one-warpgroup --triton-backward
                                  # the one-warpgroup prefill and the Triton backward kernels

On the CPU the Pallas kernels run in interpret mode (slow, exact); on a GPU the
default backend compiles them (Mosaic GPU on Hopper, Triton elsewhere).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels import attention_reference, flash  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=flash.BACKENDS, default=None,
                    help=f"Pallas backend (default: {flash.default_backend()} here)")
    ap.add_argument("--kind", default="block_causal", choices=("causal", "block_causal",
                                                              "bidirectional"))
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--one-warpgroup", action="store_true",
                    help="the Mosaic prefill's one-warpgroup kernel, not the warp-specialised default "
                         "(flash.Tiles(mosaic_warp_specialized=False))")
    ap.add_argument("--triton-backward", action="store_true",
                    help="the Triton backward kernels on the mosaic backends, not the Mosaic ones "
                         "(flash.Tiles(mosaic_backward=False))")
    ap.add_argument("--warp-specialized-backward", action="store_true",
                    help="the Mosaic backward's warp-specialised variant "
                         "(flash.Tiles(mosaic_backward_warp_specialized=True))")
    args = ap.parse_args(argv)
    tiles = flash.Tiles(mosaic_warp_specialized=not args.one_warpgroup, mosaic_backward=not args.triton_backward,
                        mosaic_backward_warp_specialized=args.warp_specialized_backward)

    B, T, H, KV, D = 2, 96, 4, 2, 64
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
               for shape in ((B, T, H, D), (B, T, KV, D), (B, T, KV, D)))
    # row 1 is left-padded by 10 slots: its queries never see them
    kw = dict(start=jnp.array([0, 10]), kind=args.kind, block_size=args.block_size)

    def loss(fn, q):
        return jnp.sum(fn(q, k, v, **kw).astype(jnp.float32) ** 2)

    kernel = lambda q, k, v, **kw: flash.attention(q, k, v, **kw, backend=args.backend, tiles=tiles)  # noqa: E731
    for name, fn in (("pallas", kernel), ("xla", attention_reference)):
        out = fn(q, k, v, **kw).astype(jnp.float32)
        grad = jax.grad(lambda q: loss(fn, q))(q).astype(jnp.float32)
        if name == "pallas":
            got = (out, grad)
        else:
            for what, a, b in (("output", got[0], out), ("dq", got[1], grad)):
                err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                print(f"{what:>6}: max |pallas - xla| / max |xla| = {err:.2e}")
                if not err <= 2e-2:
                    print("mismatch beyond bfloat16 tolerance")
                    return 1
    print(f"backend {args.backend or flash.default_backend()}, {args.kind} "
          f"(block {args.block_size}): Pallas matches the XLA reference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
