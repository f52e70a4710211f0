"""Masked-diffusion decoding (LLaDA / Dream / Fast-dLLM) with jdllm.

    python examples/masked_diffusion.py                       # a tiny random LLaDA-like model
    python examples/masked_diffusion.py --model models/tiny-llada --prompt "sort 3 1 2 ="

A LLaDA or Dream directory (Hugging Face or a jdllm checkpoint) works the same
way; Dream's shifted logits are handled from its config. The script decodes
with LLaDA's schedule, Fast-dLLM's confidence threshold (no cache, prefix
cache, dual cache) and, for Dream-style use, `alg="maskgit_plus"`, and prints
each answer, the forward passes it took (NFE), tokens per forward and which
tokens were revealed together.
"""

from __future__ import annotations

import argparse
import time

import jax

import jdllm
from jdllm.model import init_params


def tiny_model() -> jdllm.Model:
    """A random 2-layer LLaDA-like (bidirectional) model; peaked weights so decoding is not all ties."""
    cfg = jdllm.ModelConfig(model_type="llada", vocab_size=128, hidden_size=64, intermediate_size=128,
                            num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, attention="bidirectional",
                            mask_token_id=127, max_position_embeddings=512)
    return jdllm.Model(cfg, init_params(cfg, jax.random.key(0), std=0.5))


def show_steps(out) -> str:
    groups: dict[int, list[int]] = {}
    for t, s in zip(out.token_ids, out.step_map):
        groups.setdefault(s, []).append(t)
    return " ".join(f"[{s}:{' '.join(map(str, ids))}]" for s, ids in sorted(groups.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="LLaDA / Dream directory (default: a tiny random model)")
    ap.add_argument("--prompt", action="append", default=None)
    ap.add_argument("--gen-length", type=int, default=32)
    ap.add_argument("--block-length", type=int, default=8)
    args = ap.parse_args()

    model = tiny_model() if args.model is None else jdllm.load(args.model, dtype="float32")
    prompts = args.prompt or ([[3, 14, 15, 92, 65], [35, 89]] if model.tokenizer is None else ["Hello"])
    G, Bl = args.gen_length, args.block_length
    sampling = jdllm.Sampling(max_new_tokens=G, temperature=0.0)
    configs = {
        "LLaDA low_confidence, 2 tokens/step": jdllm.MaskedDiffusion(steps=G // 2, block_length=Bl),
        "Fast-dLLM threshold 0.9": jdllm.MaskedDiffusion(block_length=Bl, confidence_threshold=0.9),
        "  + prefix cache": jdllm.MaskedDiffusion(block_length=Bl, confidence_threshold=0.9, cache="prefix"),
        "  + dual cache": jdllm.MaskedDiffusion(block_length=Bl, confidence_threshold=0.9, cache="dual"),
        "Dream-style maskgit_plus": jdllm.MaskedDiffusion(steps=G // 2, block_length=Bl, alg="maskgit_plus"),
    }
    for label, dec in configs.items():
        jdllm.generate(model, prompts, dec, sampling)  # compile
        t = time.perf_counter()
        outs = jdllm.generate(model, prompts, dec, sampling)
        dt = time.perf_counter() - t
        print(f"\n== {label}  ({dt * 1e3:.0f} ms after compile)")
        for out in outs:
            shown = out.text if out.text is not None else out.token_ids
            print(f"  NFE {out.nfe:3d}  TPF {len(out.token_ids) / out.nfe:4.1f}  {out.finish_reason}: {shown}")
            print(f"    steps: {show_steps(out)}")


if __name__ == "__main__":
    main()
