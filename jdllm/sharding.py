"""Logical axes -> device mesh: where every weight, the KV cache and the decode state live.

Each weight names its logical axes once, in `jdllm.model.param_specs`
(`("layers", "embed", "q_heads", "head_dim")`, ...). A rules table maps each
logical axis to a mesh axis (`data`, `model`) or to None (replicated):

    DEFAULT_RULES = {"batch": "data", "q_heads": "model", "kv_heads": "model",
                     "mlp": "model", "vocab": "model", others: None}

so batch rows split over `data` and attention heads / MLP columns / the
vocabulary over `model` (Megatron-style tensor parallelism: XLA inserts the
all-reduce after the attention output and the MLP down projection). The KV
cache `[layers, B, S, kv_heads, head_dim]` follows `batch` and `kv_heads`; every
decode-state array whose leading axis is the batch follows `batch`.

A `Placement` (mesh + rules, hashable: it rides in the static decode context)
derives every `NamedSharding` from those names. `jdllm.load(path, mesh=...)`
places the parameters with it (each device receives only its slices), and
`generate` / `prepare` / `decode` run the whole loop under it.

Bad input raises `jdllm.errors.ShardingError`:
  - a rules table naming a logical axis jdllm does not know, or a mesh axis the
    mesh does not have;
  - a mesh axis that does not divide the dimension it splits (e.g. `model=8`
    with 4 KV heads): the error names the parameter and the axis. jdllm does
    not silently replicate; map that logical axis to None in the rules
    (`rules={"kv_heads": None}`) to replicate it on purpose.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdllm import errors
from jdllm.device_memory import check_placement_fits
from jdllm.model import default_layout, is_param_spec, layer_layout, param_specs, to_layout
from pallas_kernels import ShardedAttention, resolve_impl

MESH_AXES = ("data", "model")
# every logical axis name jdllm uses (weights: model.param_specs; cache and state: below)
LOGICAL_AXES = ("batch", "length", "layers", "embed", "q_heads", "kv_heads", "head_dim", "mlp", "vocab")
DEFAULT_RULES: dict[str, str | None] = {
    "batch": "data", "length": None, "layers": None, "embed": None, "head_dim": None,
    "q_heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model",
}
CACHE_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")  # KVCache.k / .v


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """'data=2,model=4' -> {'data': 2, 'model': 4} (the CLI's --mesh)."""
    out: dict[str, int] = {}
    for part in str(spec).split(","):
        name, eq, size = part.strip().partition("=")
        name = name.strip()
        if not eq or name not in MESH_AXES or not size.strip().isdigit() or int(size) < 1:
            raise errors.ShardingError(
                f"mesh spec {spec!r}: part {part.strip()!r} is not AXIS=SIZE with AXIS one of {MESH_AXES} "
                "and SIZE >= 1; write e.g. 'data=2,model=4'")
        if name in out:
            raise errors.ShardingError(f"mesh spec {spec!r} names axis {name!r} twice")
        out[name] = int(size)
    return out


def initialize_distributed(**kw) -> None:
    """`jax.distributed.initialize(**kw)` (once per process, before any other JAX call), with CPU
    collectives over gloo when the platform is the CPU (the multi-process tests, a CPU cluster)."""

    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kw)


def make_mesh(shape: str | Mapping[str, int] | None = None, devices=None) -> Mesh:
    """A ('data', 'model') mesh over `devices` (default: every device of every process).

    shape: {'data': 2, 'model': 4}, 'data=2,model=4', or None (all devices on
    `data`). A missing axis has size 1; the sizes must multiply to the number of
    devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": len(devices), "model": 1} if shape is None else dict(
        parse_mesh_spec(shape) if isinstance(shape, str) else shape)
    for name in sizes:
        if name not in MESH_AXES:
            raise errors.ShardingError(f"mesh axis {name!r} is not one of {MESH_AXES}")
    dims = tuple(int(sizes.get(a, 1)) for a in MESH_AXES)
    if math.prod(dims) != len(devices):
        raise errors.ShardingError(
            f"mesh {dict(zip(MESH_AXES, dims))} needs {math.prod(dims)} devices but {len(devices)} are "
            "available; choose sizes whose product is the device count")
    # Auto axes: XLA propagates shardings from the placed params and state (GSPMD)
    return jax.make_mesh(dims, MESH_AXES, devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def make_rules(rules: Mapping[str, Any] | None = None) -> tuple[tuple[str, Any], ...]:
    """DEFAULT_RULES updated with `rules` (logical axis -> mesh axis name, a tuple of them, or None),
    as a hashable tuple. Unknown logical axes raise ShardingError."""
    table = dict(DEFAULT_RULES)
    for name, target in dict(rules or {}).items():
        if name not in LOGICAL_AXES:
            raise errors.ShardingError(
                f"rules name logical axis {name!r}, which jdllm does not use; logical axes are {LOGICAL_AXES}")
        table[name] = tuple(target) if isinstance(target, list) else target
    return tuple(sorted(table.items()))



@dataclasses.dataclass(frozen=True)
class Placement:
    """A mesh and a rules table: every sharding jdllm uses derives from these two (hashable)."""

    mesh: Mesh
    rules: tuple[tuple[str, Any], ...] = make_rules()

    def __post_init__(self):
        names = set(self.mesh.axis_names)
        for logical, target in self.rules:
            for m in (target if isinstance(target, tuple) else (target,)):
                if m is not None and m not in names:
                    raise errors.ShardingError(
                        f"rules map logical axis {logical!r} to mesh axis {m!r}, which the mesh "
                        f"{dict(self.mesh.shape)} does not have")

    @classmethod
    def of(cls, mesh: Mesh, rules: Mapping[str, Any] | None = None) -> "Placement":
        if not isinstance(mesh, Mesh):
            raise errors.ArgumentTypeError(
                f"mesh={mesh!r}: expected a jax.sharding.Mesh (jdllm.sharding.make_mesh('data=2,model=4'))")
        return cls(mesh=mesh, rules=make_rules(rules))

    # ------------------------------------------------------------------ specs
    def axis(self, logical: str):
        return dict(self.rules).get(logical)

    def size(self, target) -> int:
        return math.prod(self.mesh.shape[m] for m in (target if isinstance(target, tuple) else (target,))
                         if m is not None)

    def spec(self, axes: tuple[str, ...], shape: tuple[int, ...] | None = None, what: str = "array") -> P:
        """PartitionSpec of an array with these logical axes; with `shape`, check divisibility."""
        out = []
        for i, a in enumerate(axes):
            target = self.axis(a)
            if target is not None and shape is not None and shape[i] % self.size(target):
                raise errors.ShardingError(
                    f"{what}: dimension {i} ({a!r}, size {shape[i]}) does not divide over mesh axis "
                    f"{target!r} of size {self.size(target)}; choose a mesh whose {target!r} axis divides "
                    f"{shape[i]}, or replicate it with rules={{{a!r}: None}}")
            out.append(target)
        return P(*out)

    def sharding(self, axes, shape=None, what="array") -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(tuple(axes), shape, what))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    # ------------------------------------------------------------------ params
    def param_shardings(self, cfg, layout: str = "stacked") -> Any:
        """NamedSharding per parameter of `layout` (the params pytree's structure, see
        `jdllm.model.param_specs`), checked for divisibility."""

        flat, treedef = jax.tree_util.tree_flatten_with_path(param_specs(cfg, layout), is_leaf=is_param_spec)
        return jax.tree.unflatten(treedef, [
            self.sharding(s.axes, s.shape, f"parameter {jax.tree_util.keystr(k)} {s.shape}") for k, s in flat])

    def fuses_projections(self) -> bool:
        """Whether the per-layer fused layout fits this placement: attention heads and MLP columns
        are not split over devices (a fused `qkv` split by rows would mix q, k and v heads)."""
        return all(self.size(self.axis(a)) == 1 for a in ("q_heads", "kv_heads", "mlp"))

    def place_params(self, params, cfg):
        """Params (host NumPy or jax Arrays, any layout) on the mesh in the layout jdllm runs under
        this placement (`jdllm.model.default_layout`), one weight at a time, after checking that each
        device's shards fit in its free memory (`jdllm.device_memory`)."""

        check_placement_fits(params, self.param_shardings(cfg, layer_layout(params)))
        layout, owned = default_layout(self), False
        if layer_layout(params) == "stacked":  # host arrays: each device receives only its slices
            placed = jax.tree.map(put, params, self.param_shardings(cfg))
            # free the placed stacked arrays as they are split only when they came from the host:
            # a jax Array's placed copy may share its buffers (device_put can alias a shard)
            owned = not any(isinstance(a, jax.Array) for a in jax.tree.leaves(params))
            params = placed
        # the stacked copies made here are freed as they are split: never two copies of the model
        return to_layout(params, cfg, layout, shardings=self.param_shardings(cfg, layout), consume=owned)

    # ------------------------------------------------------------------ decode state
    def batch_multiple(self) -> int:
        """The batch must be a multiple of this (the mesh size along `batch`)."""
        target = self.axis("batch")
        return 1 if target is None else self.size(target)

    def state_shardings(self, state) -> Any:
        """Shardings of a DecodeState: [B, ...] arrays over `batch`, the KV cache over batch and kv_heads,
        everything else replicated."""
        B = state.tokens.shape[0]
        batch = self.axis("batch")

        def one(path, x):
            keys = [getattr(k, "name", getattr(k, "key", None)) for k in path]
            shape = np.shape(x)
            if "cache" in keys and keys[-1] in ("k", "v"):
                return self.sharding(CACHE_AXES, shape, f"KV cache {keys[-1]} {shape}")
            if len(shape) and shape[0] == B:
                return NamedSharding(self.mesh, P(batch))
            return self.replicated()

        return jax.tree_util.tree_map_with_path(one, state)

    def place_state(self, state):
        return jax.tree.map(put, state, self.state_shardings(state))

    def constrain_state(self, state):
        """Inside jit: pin the state (and its KV cache) to its shardings."""
        return jax.lax.with_sharding_constraint(state, self.state_shardings(state))

    # ------------------------------------------------------------------ attention
    def attention_impl(self, impl: str):
        """The attention implementation to run under this mesh: the XLA path partitions itself;
        the Pallas / cuDNN kernels run per shard (`pallas_kernels.ShardedAttention`)."""

        if resolve_impl(impl) == "xla":
            return impl
        return ShardedAttention(impl=resolve_impl(impl), mesh=self.mesh, batch=self.axis("batch"),
                                heads=self.axis("q_heads"), kv_heads=self.axis("kv_heads"))


def put(x, sharding: NamedSharding):
    """A host or device array placed with `sharding`. Host data goes slice by slice
    (`make_array_from_callback`), so each device (and, on several hosts, each process)
    receives only its own slices; a jax Array is resharded by XLA."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        data = put(jax.random.key_data(x), NamedSharding(sharding.mesh, P(*sharding.spec, None)))
        return jax.random.wrap_key_data(data, impl=impl)
    if isinstance(x, jax.Array) and (sharding.is_fully_addressable or not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    x = np.asarray(x)  # host data (on several hosts every process holds the same values)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


__all__ = ["Placement", "make_mesh", "initialize_distributed", "make_rules", "parse_mesh_spec", "DEFAULT_RULES", "LOGICAL_AXES",
           "MESH_AXES", "CACHE_AXES", "put"]
