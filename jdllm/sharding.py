"""Logical axes -> device mesh: where every weight, the KV cache and the decode state live.

Each weight names its logical axes once, in `jdllm.model.param_specs`
(`("layers", "embed", "q_heads", "head_dim")`, ...). A rules table maps each
logical axis to a mesh axis (`data`, `model`) or to None (replicated):

    DEFAULT_RULES = {"batch": "data", "q_heads": "model", "kv_heads": "model",
                     "mlp": "model", "vocab": "model", others: None}

so batch rows split over `data` and attention heads / MLP columns / the
vocabulary over `model` (Megatron-style tensor parallelism: XLA inserts the
all-reduce after the attention output and the MLP down projection). A rule may
name several mesh axes (`rules={"batch": ("data", "fsdp")}`: rows split over
both). The KV cache `[layers, B, S, kv_heads, head_dim]` follows `batch` and
`kv_heads`; every decode-state array whose leading axis is the batch follows `batch`.

Meshes that training code brings: any `jax.sharding.Mesh` works, made by
`jax.make_mesh` (Explicit axes by default in current JAX) or by hand, with Auto
or Explicit axis types. A default rule whose mesh axis the mesh lacks (a
`("data",)` mesh has no `model`) replicates; every mesh axis of size > 1 must be
named by some rule (an `fsdp` axis: `rules={"batch": ("data", "fsdp")}`), else
jdllm would copy the whole computation along it. jdllm places arrays on the
mesh as given (so they meet the user's own arrays in the user's `jax.jit`) and
runs its computations with the Explicit axes treated as Auto (`auto_axes`):
XLA propagates the shardings of the placed params and state (GSPMD), and the
outputs come back typed on the user's mesh.

A `Placement` (mesh + rules, hashable: it rides in the static decode context)
derives every `NamedSharding` from those names. `jdllm.load(path, mesh=...)`
places the parameters with it (each device receives only its slices), and
`generate` / `prepare` / `decode` run the whole loop under it.

Bad input raises `jdllm.errors.ShardingError`:
  - a rules table naming a logical axis jdllm does not know, or a mesh axis the
    mesh does not have;
  - a mesh axis of size > 1 that no rule names (the error names the axis, the
    rules table and the rule to pass);
  - a mesh axis that does not divide the dimension it splits (e.g. `model=8`
    with 4 KV heads): the error names the parameter and the axis. jdllm does
    not silently replicate; map that logical axis to None in the rules
    (`rules={"kv_heads": None}`) to replicate it on purpose.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdllm import errors
from jdllm.quant import shardings_like
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
        """The placement of `mesh` under DEFAULT_RULES updated with `rules`. A default rule whose mesh
        axis `mesh` lacks replicates (a `("data",)` mesh: heads and MLP whole on every device); every
        mesh axis of size > 1 must be named by some rule."""
        if not isinstance(mesh, Mesh):
            raise errors.ArgumentTypeError(
                f"mesh={mesh!r}: expected a jax.sharding.Mesh (jax.make_mesh((4, 2), ('data', 'model')) or "
                "jdllm.sharding.make_mesh('data=2,model=4'))")
        given = dict(rules or {})
        table = dict(make_rules(given))
        for name, target in table.items():
            if name not in given and target is not None and any(m not in mesh.axis_names for m in _axes(target)):
                kept = tuple(m for m in _axes(target) if m in mesh.axis_names)
                table[name] = None if not kept else kept[0] if len(kept) == 1 else kept
        placement = cls(mesh=mesh, rules=tuple(sorted(table.items())))
        placement.check_axes_named()
        return placement

    def check_axes_named(self) -> None:
        """Every mesh axis of size > 1 is the target of some rule (else jdllm would run the same
        computation on every slice along it)."""
        named = {m for _, target in self.rules for m in _axes(target)}
        for axis, size in self.mesh.shape.items():
            if size > 1 and axis not in named:
                table = {k: v for k, v in self.rules if v is not None}
                raise errors.ShardingError(
                    f"mesh axis {axis!r} (size {size}) is named by no sharding rule, so jdllm would repeat "
                    f"the whole computation along it; the rules map {table}. Pass rules= naming it, e.g. "
                    f"jdllm.load(path, mesh=mesh, rules={{'batch': {_suggest(self.axis('batch'), axis)!r}}}) "
                    f"to split rows over it too, or make the mesh without it")

    @functools.cached_property
    def auto_mesh(self) -> Mesh:
        """The mesh with every axis Auto: what jdllm's computations run under (`auto_axes`)."""
        if all(t == AxisType.Auto for t in self.mesh.axis_types):
            return self.mesh
        return Mesh(self.mesh.devices, self.mesh.axis_names, axis_types=(AxisType.Auto,) * len(self.mesh.axis_names))

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

        check_placement_fits(params, shardings_like(params, self.param_shardings(cfg, layer_layout(params))))
        layout, owned = default_layout(self), False
        if layer_layout(params) == "stacked":  # host arrays: each device receives only its slices
            placed = jax.tree.map(put, params, shardings_like(params, self.param_shardings(cfg)))
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

    def tree_shardings(self, tree, rows: int, mesh: Mesh | None = None) -> Any:
        """Shardings of a pytree of batch arrays (a DecodeState, a Rollout, logits): [rows, ...] arrays
        over `batch` (when it divides them), a KV cache over batch and kv_heads, everything else
        replicated; on `mesh` (default: the placement's)."""
        mesh = self.mesh if mesh is None else mesh
        batch = self.axis("batch") if rows % self.batch_multiple() == 0 else None

        def one(path, x):
            keys = [getattr(k, "name", getattr(k, "key", None)) for k in path]
            shape = np.shape(x)
            if "cache" in keys and keys[-1] in ("k", "v", "k_scale", "v_scale"):
                return NamedSharding(mesh, self.spec(CACHE_AXES, shape, f"KV cache {keys[-1]} {shape}"))
            if len(shape) and shape[0] == rows:
                return NamedSharding(mesh, P(batch))
            return NamedSharding(mesh, P())

        return jax.tree_util.tree_map_with_path(one, tree)

    def state_shardings(self, state, mesh: Mesh | None = None) -> Any:
        """Shardings of a DecodeState: [B, ...] arrays over `batch`, the KV cache over batch and kv_heads,
        everything else replicated."""
        return self.tree_shardings(state, state.tokens.shape[0], mesh)

    def place_state(self, state):
        return jax.tree.map(put, state, self.state_shardings(state))

    def constrain_state(self, state):
        """Inside jit: pin the state (and its KV cache) to its shardings (of the Auto mesh: jdllm's
        computations run with every axis Auto, see `auto_axes`)."""
        return jax.lax.with_sharding_constraint(state, self.state_shardings(state, self.auto_mesh))

    # ------------------------------------------------------------------ attention
    def attention_impl(self, impl: str):
        """The attention implementation to run under this mesh: the XLA path partitions itself;
        the Pallas / cuDNN kernels run per shard (`pallas_kernels.ShardedAttention`)."""

        if resolve_impl(impl) == "xla":
            return impl
        return ShardedAttention(impl=resolve_impl(impl), mesh=self.auto_mesh, batch=self.axis("batch"),
                                heads=self.axis("q_heads"), kv_heads=self.axis("kv_heads"))


def _axes(target) -> tuple:
    """A rule's target as a tuple of mesh axis names (None: none)."""
    return () if target is None else tuple(target) if isinstance(target, tuple) else (target,)


def _suggest(target, axis: str):
    """`target` with `axis` added (the rule that splits rows over it too)."""
    both = (*_axes(target), axis)
    return both if len(both) > 1 else axis


def _mesh_api(name: str):
    """`jax.sharding.<name>`, or `jax.<name>` where a JAX release moved it (None when neither has it)."""
    return getattr(jax.sharding, name, None) or getattr(jax, name, None)


def explicit_mesh(tree):
    """The (abstract) mesh of the first array in `tree` whose type names Explicit mesh axes, else None."""
    for x in jax.tree.leaves(tree):
        if not isinstance(x, jax.Array):  # tracers too
            continue
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and any(t == AxisType.Explicit for t in mesh.axis_types):
            return mesh
    return None


def _placement_in(kwargs: Mapping[str, Any]):
    """The Placement a jdllm function's static arguments carry (ctx=, spec=, placement=), or None."""
    for v in (kwargs.get("placement"), getattr(kwargs.get("ctx"), "placement", None),
              getattr(getattr(kwargs.get("spec"), "ctx", None), "placement", None)):
        if v is not None:
            return v
    return None


def _row_shardings(tree, mesh, rows: int, row_axis) -> Any:
    """Without a placement: [rows, ...] leaves split like the input rows were, the rest replicated."""
    return jax.tree.map(lambda x: NamedSharding(mesh, P(row_axis) if np.ndim(x) and np.shape(x)[0] == rows
                                                else P()), tree)


def auto_axes(fn, placement=None):
    """`fn` (a jdllm computation: params, decode state, rollout, rewards -> pytree of batch arrays)
    that also takes arrays typed on a mesh with Explicit axes (`jax.make_mesh`'s default).

    With such an input, `fn` runs with those axes treated as Auto (as `jax.sharding.auto_axes`
    does: XLA's sharding propagation from the placed arrays, jdllm's `with_sharding_constraint`s
    on the Auto mesh) and its outputs come back typed on that mesh: under the rules of the
    placement its `ctx=` / `spec=` / `placement=` argument carries (or `placement`) by
    `Placement.tree_shardings` ([B, ...] over `batch`, the KV cache over batch and kv_heads);
    with none, [B, ...] outputs split like the first explicit input's rows and the rest replicated.
    Without Explicit inputs it is `fn` itself. Usable inside the user's `jax.jit`, where the inputs
    are tracers typed on the user's mesh, and differentiable."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        mesh = explicit_mesh((args, kwargs))
        if mesh is None:
            return fn(*args, **kwargs)
        use, reshard = _mesh_api("use_abstract_mesh"), _mesh_api("reshard")
        if use is None or reshard is None:  # pragma: no cover (JAX releases without them)
            raise errors.ShardingError(
                f"this JAX ({jax.__version__}) lacks use_abstract_mesh / reshard, which jdllm needs for a mesh with "
                f"Explicit axes {mesh.explicit_axes}; make the mesh with Auto axes: jax.make_mesh(shape, names, "
                "axis_types=(jax.sharding.AxisType.Auto,) * len(names))")
        auto = mesh.update_axis_types({a: AxisType.Auto for a in mesh.explicit_axes})
        rows = next((a.tokens.shape[0] for a in list(args) + list(kwargs.values()) if hasattr(a, "tokens")), None)
        first = next(x for x in jax.tree.leaves((args, kwargs)) if explicit_mesh([x]) is not None)

        def to_auto(x):
            return reshard(x, P()) if explicit_mesh([x]) is not None else x

        with use(auto):
            out = fn(*jax.tree.map(to_auto, args), **jax.tree.map(to_auto, kwargs))
        where = placement if placement is not None else _placement_in(kwargs)
        if where is None:
            spec = jax.typeof(first).sharding.spec
            rows = np.shape(first)[0] if np.ndim(first) else -1
            return reshard(out, _row_shardings(out, mesh, rows, spec[0] if len(spec) else None))
        if rows is None:  # no state or rollout among the inputs: the outputs' leading axis is the batch
            rows = next((np.shape(x)[0] for x in jax.tree.leaves(out) if np.ndim(x)), 0)
        return reshard(out, where.tree_shardings(out, rows))

    return call


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


__all__ = ["Placement", "make_mesh", "auto_axes", "explicit_mesh", "initialize_distributed", "make_rules",
           "parse_mesh_spec", "DEFAULT_RULES", "LOGICAL_AXES", "MESH_AXES", "CACHE_AXES", "put"]
