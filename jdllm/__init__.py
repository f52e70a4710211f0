"""jdllm: diffusion (and autoregressive) language models on JAX/XLA.

Public names are resolved lazily so `import jdllm` stays cheap and a CLI
`--help` does not initialise JAX.
"""

from __future__ import annotations

import importlib

from jdllm import host_memory as _host_memory

__version__ = "0.1.0"

_host_memory.tune()  # large host buffers kept between XLA:CPU calls (see jdllm.host_memory; JDLLM_MALLOC=off)

_EXPORTS = {
    # loading and the model handle
    "Model": "jdllm.loading",
    "load": "jdllm.checkpoint",
    "logits": "jdllm.loading",
    "score": "jdllm.scoring",  # each token's log-prob given its prefix (causal models), top alternatives
    "Scores": "jdllm.scoring",
    "loglikelihood": "jdllm.likelihood",  # log p(continuation | context): exact (causal) or LLaDA's MC ELBO
    "ModelConfig": "jdllm.config",
    # generation
    "generate": "jdllm.generation",
    "Output": "jdllm.api",
    "Sampling": "jdllm.sampling",
    "prepare": "jdllm.api",  # inputs -> initial DecodeState + static context (no compile)
    "DecodeState": "jdllm.state",
    "compiler_options": "jdllm.decode.loop",  # XLA options for jdllm's own compiles in a `with` block
    # paradigm configs: each lives beside its paradigm
    "AR": "jdllm.decode.ar",
    "BlockDiffusion": "jdllm.decode.block_diffusion",
    "MultiBlock": "jdllm.decode.multi_block",
    "MaskedDiffusion": "jdllm.decode.masked_diffusion",
    "Speculative": "jdllm.decode.ar_spec",
    "errors": "jdllm.errors",
    "constraints": "jdllm.constraints",
    "rl": "jdllm.rl",  # rollouts, trajectory log-likelihoods, RL losses
    "sharding": "jdllm.sharding",  # device meshes: make_mesh, rules, Placement
    "nnx": "jdllm.nnx",  # a flax nnx view of a model, for training loops
    "quant": "jdllm.quant",  # weight-only int8 / fp8: load(path, quantize="int8")
    "Quantization": "jdllm.quant",
}

# Named in the design's public contract but not built yet: a clear error, not an ImportError.
_PLANNED: dict[str, str] = {}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if name in _PLANNED:
        raise AttributeError(f"jdllm.{name}: {_PLANNED[name]} is not implemented yet")
    if mod is None:
        raise AttributeError(f"module 'jdllm' has no attribute {name!r}")
    if name in ("errors", "constraints", "rl", "sharding", "nnx", "quant"):
        return importlib.import_module(mod)
    return getattr(importlib.import_module(mod), name)


def __dir__():
    return __all__
