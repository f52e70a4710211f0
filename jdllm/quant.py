"""Weight-only quantization: int8 and fp8 (e4m3) with one scale per output channel.

At batch 1 a decode step reads every weight once, so the weights' bytes set its floor; storing
them in 8 bits halves it (bf16 -> int8 / fp8). Activations stay in the model's dtype.

A quantized weight is a `QArray` pytree {q, scale}: `q` the weight's shape in int8 or
float8_e4m3fn, `scale` float32 with the weight's shape but size 1 on the axes the matmul
contracts (one scale per output channel; for the embedding, one per vocabulary row, which is
also its output channel when it serves as the tied LM head). `jdllm.model.mm` multiplies by
`q` converted to the activation dtype (exact: int8 and e4m3 values are exact in bf16) and
scales the product's output channels, so XLA fuses the convert into the dot and the weight is
read in 8 bits; an unquantized weight takes exactly the path it took before (a trace-time
`isinstance`), so the bf16 program is unchanged.

fp8: the weights are *stored* in e4m3 and converted to the activation dtype inside the dot on
every backend (weight-only: the matmul itself never runs in fp8), so every device runs it; a
GPU without fp8 units (compute capability < 8.9) gets a warning that the bytes are saved but
nothing runs natively in fp8. The CPU runs it without a warning (it is the exactness tier).

Why not qwix (google/qwix, PyPI `qwix` 0.1.8): its PTQ path (`qwix.quantize_model` with a
`qwix.PtqProvider` and `qwix.QtRule(module_path=..., weight_qtype=...)`) intercepts the
einsum / dot_general calls *inside flax linen / nnx modules*, selected by module path; jdllm's
forward is a pure function over a dict of arrays with no modules to intercept (its nnx view,
`jdllm.nnx`, wraps the same dict for training, not the forward), and qwix's QArray / quantize
helpers live under `qwix._src` (private). So the ~150 lines here do it by hand: same math as
qwix's weight-only channelwise int8 / fp8 (absmax scale over the contracted axes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdllm import errors

SCHEMES = ("int8", "fp8", "int4")
KV_CACHE_DTYPES = (None, "int8")  # load(kv_cache=): the KV cache in the activation dtype, or int8 (jdllm.model.KVCache)
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}  # largest magnitude: symmetric ints, float8_e4m3fn's max
STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.int4}
DEFAULT_GROUP = 128  # int4: contraction elements sharing a scale

# the axes each weight's matmul contracts (per-layer layout; a stacked weight has `layers` first)
CONTRACTED = {"q": (0,), "k": (0,), "v": (0,), "qkv": (0,), "o": (0, 1), "gate": (0,), "up": (0,),
              "gate_up": (0,), "down": (0,), "lm_head": (0,), "embed": (1,)}


@dataclasses.dataclass(frozen=True)
class Quantization:
    """What `jdllm.load(..., quantize=)` quantizes. scheme: "int8" | "fp8" (one scale per output
    channel) | "int4" (one scale per `group_size` contraction elements and output channel, groups
    along each weight's last contracted axis; the weight is dequantized before its dot).
    embed / lm_head: also quantize the embedding and the LM head (a tied head is the embedding:
    `embed` decides). A string `quantize="int8"` means Quantization("int8") (everything quantized)."""

    scheme: str = "int8"
    embed: bool = True
    lm_head: bool = True
    group_size: int = DEFAULT_GROUP  # int4 only

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise errors.QuantizationError(f"quantize scheme {self.scheme!r} is not one of {SCHEMES}")
        for name in ("embed", "lm_head"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise errors.QuantizationError(f"{name}={getattr(self, name)!r} must be True or False")
            object.__setattr__(self, name, bool(getattr(self, name)))
        g = self.group_size
        if isinstance(g, (bool, np.bool_)) or not isinstance(g, (int, np.integer)) or g < 1:
            raise errors.QuantizationError(f"group_size={g!r}: give a positive int (int4's default: "
                                           f"{DEFAULT_GROUP})")
        object.__setattr__(self, "group_size", int(g))
        if self.scheme != "int4" and self.group_size != DEFAULT_GROUP:
            raise errors.QuantizationError(
                f"group_size={self.group_size} applies to int4 only (got scheme {self.scheme!r}); int8 and fp8 "
                "keep one scale per output channel")

    def axes_for(self, name: str, shape, lead: int = 0):
        """(axes the scale reduces, group size or None) of weight `name` of `shape` (a stacked one
        has `lead` = 1 leading layers axis); int4: QuantizationError when the group size does not
        divide the last contracted axis."""
        axes = tuple(a + lead for a in CONTRACTED[name])
        if self.scheme != "int4":
            return axes, None
        n = shape[axes[-1]]
        if n % self.group_size:
            raise errors.QuantizationError(
                f"int4 group_size={self.group_size} does not divide the contracted axis of size {n} of "
                f"weight {name!r} (shape {tuple(shape)}); pick a group size that divides it (e.g. "
                f"{math.gcd(n, self.group_size)}) or quantize with int8")
        return (axes[-1],), self.group_size

    def wants(self, name: str) -> bool:
        if name == "embed":
            return self.embed
        if name == "lm_head":
            return self.lm_head
        return name in CONTRACTED


def as_quantization(quantize) -> Quantization | None:
    """`quantize=` as load / the CLIs take it (None, a scheme name or a Quantization) -> Quantization or None."""
    if quantize is None or isinstance(quantize, Quantization):
        return quantize
    if isinstance(quantize, str):
        return Quantization(quantize)
    raise errors.QuantizationError(
        f"quantize={quantize!r}: pass None, one of {SCHEMES} or a jdllm.quant.Quantization")


def quantization_arg(scheme: str | None, group_size: int | None):
    """The command lines' `--quantize SCHEME [--group-size N]` as `quantize=` takes it; a group
    size without int4 (which alone has groups) is a QuantizationError naming it."""
    if group_size is None:
        return scheme
    if scheme != "int4":
        raise errors.QuantizationError(
            f"--group-size {group_size} applies to --quantize int4 only (got --quantize {scheme}); "
            "int8 and fp8 keep one scale per output channel")
    return Quantization("int4", group_size=group_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """A weight stored quantized: q [weight shape] int8 / float8_e4m3fn, scale float32 [weight
    shape with the contracted axes of size 1]; `dtype` is the activation dtype it dequantizes to."""

    q: Any
    scale: Any
    dtype_name: str = dataclasses.field(metadata=dict(static=True), default="bfloat16")

    @property
    def shape(self):
        return self.q.shape

    @property
    def ndim(self):
        return self.q.ndim

    @property
    def dtype(self):
        return jnp.dtype(self.dtype_name)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    @property
    def scheme(self) -> str:
        return {"int8": "int8", "int4": "int4"}.get(jnp.dtype(self.q.dtype).name, "fp8")

    def __getitem__(self, idx) -> "QArray":
        """The same index on q and scale: a layer of a stacked weight, or a slice of
        non-contracted axes (a fused qkv's heads)."""
        return QArray(self.q[idx], self.scale[idx], self.dtype_name)


def is_quantized(x) -> bool:
    return isinstance(x, QArray)


def quantize_array(x, scheme: str, axes: tuple[int, ...], xp=jnp, group: int | None = None) -> QArray:
    """x (any float array, numpy with xp=np or jax) -> QArray with one absmax scale per slice over
    `axes`, or (group) per `group` consecutive elements of the one axis in `axes` (the scale then
    has that axis's size / group there). Rounds to nearest (int8, int4) / the nearest e4m3 value (fp8)."""
    dtype_name = jnp.dtype(x.dtype).name
    xf = x.astype(np.float32)
    shape = xf.shape
    if group is not None:  # [.., n, ..] -> [.., n / group, group, ..]: reduce the group axis
        (a,) = axes
        xf = xf.reshape(shape[:a] + (shape[a] // group, group) + shape[a + 1:])
        axes = (a + 1,)
    amax = xp.max(xp.abs(xf), axis=axes, keepdims=True)
    scale = xp.where(amax > 0, amax / QMAX[scheme], 1.0).astype(np.float32)
    y = xp.clip(xf / scale, -QMAX[scheme], QMAX[scheme])
    if scheme != "fp8":
        y = xp.round(y)
    if group is not None:
        y, scale = y.reshape(shape), scale.reshape(scale.shape[:a + 1] + scale.shape[a + 2:])
    return QArray(y.astype(STORAGE[scheme]), scale, dtype_name)


HOST_SLAB_BYTES = 16 << 20  # quantize_numpy widens this much of a weight to float32 at a time


def quantize_numpy(x: np.ndarray, scheme: str, axes: tuple[int, ...], group: int | None = None) -> QArray:
    """`quantize_array` with NumPy, a slab of output channels at a time, so its float32
    temporaries are a slab's, not the weight's (the embedding of a 150k vocabulary: ~16 MB, not
    several copies of 0.6 GB). The same values: each scale reduces within one slab."""
    free = [a for a in range(x.ndim) if a not in axes]
    a = max(free, key=lambda i: x.shape[i]) if free else None
    n = 0 if a is None else x.shape[a]
    step = max(1, HOST_SLAB_BYTES // max(1, x.size // max(n, 1) * 4)) if n else 0
    if a is None or step >= n:
        return quantize_array(x, scheme, axes, xp=np, group=group)
    q = scale = None
    for i in range(0, n, step):
        index = (slice(None),) * a + (slice(i, min(i + step, n)),)
        part = quantize_array(x[index], scheme, axes, xp=np, group=group)
        if q is None:
            q = np.empty(x.shape, part.q.dtype)
            scale = np.empty(part.scale.shape[:a] + (n,) + part.scale.shape[a + 1:], np.float32)
        q[index], scale[index] = part.q, part.scale
        del part
    return QArray(q, scale, jnp.dtype(x.dtype).name)


def full_scale(w: QArray):
    """w's scale repeated to q's shape where it is grouped (int4); broadcastable elsewhere."""
    s = w.scale
    for i, (n, m) in enumerate(zip(w.q.shape, s.shape)):
        if m not in (1, n):
            s = jnp.repeat(s, n // m, axis=i)
    return s


def dequantize(w) -> Any:
    """A QArray as a plain array in its dtype (anything else unchanged): the reference the
    fused path is tested against, and what code that needs plain weights (training) calls."""
    if not isinstance(w, QArray):
        return w
    return (w.q.astype(jnp.float32) * full_scale(w)).astype(w.dtype)


def dequantize_params(params):
    return jax.tree.map(dequantize, params, is_leaf=is_quantized)


@jax.jit(static_argnames=("scheme", "axes", "group"))
def _quantize_jit(x, *, scheme, axes, group):
    return quantize_array(x, scheme, axes, group=group)


def quantize_params(params, quantize, consume: bool = False):
    """params (any layout, on any device) with the matmul weights `quantize` selects replaced by
    QArrays, one weight at a time (consume: delete each source array once quantized, so the
    peak is the model plus one weight). Raises QuantizationError on params already quantized."""
    qc = as_quantization(quantize)
    if qc is None:
        return params
    if any(is_quantized(x) for x in jax.tree.leaves(params, is_leaf=is_quantized)):
        raise errors.QuantizationError(
            f"quantize={qc.scheme!r}: these weights are already quantized "
            f"({describe(params)}); load the unquantized checkpoint, or drop quantize=")
    stacked = not isinstance(params["layers"], (tuple, list))

    def one(name, x, lead):
        return quantize_weight(name, x, qc, lead, consume=consume)

    out = {k: one(k, v, 0) if k != "layers" else v for k, v in params.items()}
    if stacked:
        out["layers"] = {k: one(k, v, 1) for k, v in params["layers"].items()}
    else:
        out["layers"] = tuple({k: one(k, v, 0) for k, v in lp.items()} for lp in params["layers"])
    return out


def quantize_weight(name: str, x, qc: Quantization, lead: int = 0, consume: bool = False):
    """One weight (a jax Array, `lead` leading layers axes) as `qc` stores it: a QArray computed
    where it lives (on a mesh: the scale sharded beside its weight's shards), or x itself where
    `qc` leaves it plain. consume: delete x once quantized."""
    if not qc.wants(name) or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    axes, group = qc.axes_for(name, x.shape, lead)
    out = _quantize_jit(x, scheme=qc.scheme, axes=axes, group=group)
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):  # on a mesh: the scale beside its weight's shards
        out = jax.block_until_ready(put(out, sharding))  # one at a time: see the note below
    if consume and isinstance(x, jax.Array) and not x.is_deleted():
        x.delete()
    return out


# On a CPU mesh of more devices than cores, a quantization whose scale reduces over a split axis
# (the attention output's heads) is an all-reduce, and XLA:CPU runs each device's part on a shared
# thread pool: with many such programs dispatched at once, the devices' parts of different programs
# can take every thread while waiting for each other, until XLA aborts the process ("Termination
# timeout for all reduce ... of 40 seconds exceeded"; seen loading a Qwen3-0.6B shape with
# quantize="int8" on 8 CPU devices of 2 cores). Waiting for each weight keeps one in flight.


def quantize_host(x: np.ndarray, name: str, qc: Quantization, device=None):
    """One weight read on the host (NumPy), quantized there with NumPy and put on `device` (None:
    the default device, uncommitted): its full-precision copy never reaches the device. A weight
    `qc` leaves plain goes as it is."""
    def place(a):  # a transfer (device None: the default device, uncommitted); `jnp.asarray` of a
        return jax.device_put(a, device)  # NumPy array would compile a program per shape (`inputs.to_device`)
    if not qc.wants(name) or not jnp.issubdtype(x.dtype, jnp.floating):
        return place(x)
    axes, group = qc.axes_for(name, x.shape)
    qa = quantize_numpy(x, qc.scheme, axes, group=group)
    return QArray(place(qa.q), place(qa.scale), qa.dtype_name)


def describe(params) -> str | None:
    """'int8' / 'fp8' (the scheme of the first quantized weight) or None for plain params."""
    for x in jax.tree.leaves(params, is_leaf=is_quantized):
        if is_quantized(x):
            return x.scheme
    return None


def config_of(params) -> Quantization | None:
    """The Quantization that made `params` (scheme and whether the embedding / LM head are
    quantized), or None for plain params: what re-quantizing new weights (RL's `update_params`)
    must repeat."""
    scheme = describe(params)
    if scheme is None:
        return None
    head = params.get("lm_head")
    group = DEFAULT_GROUP
    for x in jax.tree.leaves(params, is_leaf=is_quantized):
        if is_quantized(x) and scheme == "int4":
            group = next(n // m for n, m in zip(x.q.shape, x.scale.shape) if m not in (1, n)) \
                if any(m not in (1, n) for n, m in zip(x.q.shape, x.scale.shape)) else group
            break
    return Quantization(scheme, embed=is_quantized(params["embed"]), lm_head=head is None or is_quantized(head),
                        group_size=group)


# --------------------------------------------------------------------------- placement and checkpoints
def scale_sharding(sharding, q_shape, scale_shape):
    """The sharding of a scale whose weight has `sharding`: the same mesh axes, except the
    axes the scale reduced (size 1 there), which are replicated."""
    from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415

    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (len(q_shape) - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*[None if n == 1 and m != 1 else a
                                                        for a, n, m in zip(spec, scale_shape, q_shape)]))


def put(x: QArray, sharding) -> QArray:
    """A QArray on `sharding` (its weight's): q split as the weight is, the scale along the same
    output axes."""
    return QArray(jax.device_put(x.q, sharding),
                  jax.device_put(x.scale, scale_sharding(sharding, x.q.shape, x.scale.shape)), x.dtype_name)


def shardings_like(params, shardings):
    """`shardings` (one per plain weight) with each quantized weight's entry split into a QArray
    of shardings: q's the weight's, the scale's from `scale_sharding`. Plain params: unchanged."""
    def one(x, s):
        if isinstance(x, QArray):
            return QArray(s, scale_sharding(s, x.q.shape, x.scale.shape), x.dtype_name)
        return s

    return jax.tree.map(one, params, shardings, is_leaf=is_quantized)


def checkpoint_parts(path: tuple[str, ...], x, qc: Quantization | None):
    """One slice of a weight as a checkpoint stores it: [(path, x)] plain, or [(path + ("q",), q),
    (path + ("scale",), scale)] quantized with NumPy (convert's per-tensor step: no JAX array, one
    slice at a time; int4: q in int4, one scale per group). `x` is one layer's slice or a whole
    non-layer weight."""
    name = path[-1]
    if qc is None or not qc.wants(name):
        return [(path, x)]
    axes, group = qc.axes_for(name, x.shape)
    qa = quantize_numpy(np.asarray(x), qc.scheme, axes, group=group)
    return [(path + ("q",), qa.q), (path + ("scale",), qa.scale)]


def check_shapes(qc: Quantization | None, specs: dict) -> None:
    """QuantizationError (naming the weight and the group size) when `qc` cannot quantize a weight of
    `specs` (`jdllm.model.flat_param_specs`, stacked): int4's group size must divide each weight's
    last contracted axis. Called before any weight is read or written."""
    if qc is None:
        return
    for path, spec in specs.items():
        if qc.wants(path[-1]):
            qc.axes_for(path[-1], spec.shape, 1 if spec.axes[:1] == ("layers",) else 0)


def checkpoint_specs(specs: dict, qc: Quantization | None) -> dict:
    """`jdllm.model.flat_param_specs` (stacked) with each weight `qc` quantizes split into its q
    (the weight's shape) and scale (size 1 on the contracted axes; int4: the group count on the
    grouped axis) entries; int4's group size is checked on the way (`Quantization.axes_for`, as
    `check_shapes` does)."""
    if qc is None:
        return specs
    out = {}
    for path, spec in specs.items():
        if not qc.wants(path[-1]):
            out[path] = spec
            continue
        lead = 1 if spec.axes[:1] == ("layers",) else 0
        axes, group = qc.axes_for(path[-1], spec.shape, lead)
        out[path + ("q",)] = spec
        out[path + ("scale",)] = dataclasses.replace(
            spec, shape=tuple((n // group if group else 1) if i in axes else n for i, n in enumerate(spec.shape)))
    return out


def to_meta(qc: Quantization | None):
    return None if qc is None else dataclasses.asdict(qc)


def from_meta(meta) -> Quantization | None:
    return None if not meta else Quantization(**meta)


def is_quantized_entry(x) -> bool:
    """A checkpoint tree's node for a quantized weight: a dict holding exactly q and scale."""
    return isinstance(x, dict) and set(x) == {"q", "scale"} and not isinstance(x["q"], dict)


def plain_view(tree):
    """A checkpoint tree (metadata or arrays) with each quantized {q, scale} node replaced by its
    q: the shapes `jdllm.model.shape_mismatch` checks against the config."""
    if is_quantized_entry(tree):
        return tree["q"]
    if isinstance(tree, dict):
        return {k: plain_view(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(plain_view(v) for v in tree)
    return tree


def from_checkpoint(tree, dtype_name: str):
    """Restored arrays with each {q, scale} node as a QArray dequantizing to `dtype_name`."""
    if is_quantized_entry(tree):
        return QArray(tree["q"], tree["scale"], dtype_name)
    if isinstance(tree, dict):
        return {k: from_checkpoint(v, dtype_name) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(from_checkpoint(v, dtype_name) for v in tree)
    return tree


def checkpoint_shardings(shardings, stored):
    """Shardings (of the plain params) laid over a checkpoint tree that may hold {q, scale} nodes."""
    if is_quantized_entry(stored):
        return {"q": shardings, "scale": scale_sharding(shardings, tuple(stored["q"].shape),
                                                        tuple(stored["scale"].shape))}
    if isinstance(stored, dict):
        return {k: checkpoint_shardings(shardings[k], v) for k, v in stored.items()}
    return shardings


# --------------------------------------------------------------------------- in the forward
def concat(parts, axis: int):
    """jnp.concatenate that also joins QArrays (fusing q / k / v or gate / up along a
    non-contracted axis: the scales join along the same axis)."""
    if isinstance(parts[0], QArray):
        return QArray(jnp.concatenate([p.q for p in parts], axis=axis),
                      jnp.concatenate([p.scale for p in parts], axis=axis), parts[0].dtype_name)
    return jnp.concatenate(parts, axis=axis)


def stack(parts):
    """jnp.stack that also stacks QArrays (the checkpoint layout: a leading `layers` axis)."""
    if isinstance(parts[0], QArray):
        return QArray(jnp.stack([p.q for p in parts]), jnp.stack([p.scale for p in parts]), parts[0].dtype_name)
    return jnp.stack(parts)


def output_scale(spec: str, scale, out_ndim: int):
    """A weight's scale [weight shape, contracted axes 1] laid out to broadcast against the
    output of `einsum(spec, x, w)` (its non-contracted axes in the output's order)."""
    ins, out = spec.replace(" ", "").split("->")
    wsub = ins.split(",")[1]
    if "..." in wsub:
        raise ValueError(f"quantized weights take explicit subscripts, not {spec!r}")
    osub = out.replace("...", "")
    keep = [i for i, c in enumerate(wsub) if c in osub]
    s = jnp.squeeze(scale, axis=tuple(i for i in range(len(wsub)) if i not in keep))
    letters = [wsub[i] for i in keep]
    order = sorted(range(len(letters)), key=lambda j: osub.index(letters[j]))
    s = jnp.transpose(s, order)
    shape = [1] * (out_ndim - len(osub)) + [s.shape[[letters[j] for j in order].index(c)] if c in letters else 1
                                            for c in osub]
    return s.reshape(shape)


def as_matrices(spec: str, x_shape, w_shape):
    """(M, K, N, transpose, out_shape) when `einsum(spec, x, w)` is a plain matrix product
    x [M, K] . w [K, N] (transpose: w [N, K]) reshaped to out_shape: x's trailing axes are the
    contracted ones, in w's order, and the output is x's other axes then w's; else None."""
    ins, out = spec.replace(" ", "").split("->")
    xsub, wsub = ins.split(",")
    out, xs = out.replace("...", ""), xsub.replace("...", "")
    con = "".join(c for c in wsub if c not in out)
    keep = "".join(c for c in wsub if c in out)
    if "..." in xsub and not xsub.startswith("..."):
        return None
    if not con or not keep or not xs.endswith(con) or ("..." not in xsub and len(xs) != len(x_shape)):
        return None
    lead = xs[: len(xs) - len(con)]
    if out != lead + keep or wsub not in (con + keep, keep + con):
        return None
    nc = len(con)
    kept = tuple(w_shape[wsub.index(c)] for c in keep)
    M = math.prod(x_shape[: len(x_shape) - nc])
    K = math.prod(x_shape[len(x_shape) - nc:])
    return M, K, math.prod(kept), wsub == keep + con, tuple(x_shape[: len(x_shape) - nc]) + kept


def einsum(spec: str, x, w: QArray, precision=None, preferred_element_type=None, kernel: bool = False):
    """einsum(spec, x, dequantize(w)) computed as einsum(spec, x, q) * scale per output channel:
    q converts to x's dtype exactly and the product accumulates in float32.

    kernel=True: a product of at most `pallas_kernels.qmatmul.MAX_ROWS` rows that tiles runs as that
    Pallas kernel (the weight read in 8 bits, converted on chip); the rest stays on this path."""
    ins, out = spec.replace(" ", "").split("->")
    wsub = ins.split(",")[1]
    if any(c not in out and m != 1 for c, m in zip(wsub, w.scale.shape)):  # int4 groups: dequantize, then the dot
        return jnp.einsum(spec, x, dequantize(w).astype(x.dtype), precision=precision,
                          preferred_element_type=preferred_element_type)
    # int8 and fp8 only; fp8 in the kernel converts in Triton, which takes e4m3 only on GPUs with fp8 units
    kernel = kernel and (w.scheme == "int8" or (w.scheme == "fp8" and gpu_has_fp8() is not False))
    mats = as_matrices(spec, x.shape, w.shape) if kernel else None
    if mats is not None:
        from pallas_kernels import qmatmul  # noqa: PLC0415
        M, K, N, transpose, out_shape = mats
        if qmatmul.fits(M, K, N):
            y = qmatmul.qmatmul(x.reshape(M, K), w.q.reshape((N, K) if transpose else (K, N)), w.scale.reshape(N),
                                transpose=transpose, out_dtype=preferred_element_type or x.dtype)
            return y.reshape(out_shape)
    y = jnp.einsum(spec, x, w.q.astype(x.dtype), precision=precision, preferred_element_type=jnp.float32)
    y = y * output_scale(spec, w.scale, y.ndim)
    return y.astype(preferred_element_type or x.dtype)


def take_rows(table, ids):
    """jnp.take(table, ids, axis=0) for a plain or quantized [V, D] table."""
    if not isinstance(table, QArray):
        return jnp.take(table, ids, axis=0)
    return dequantize(QArray(jnp.take(table.q, ids, axis=0), jnp.take(table.scale, ids, axis=0), table.dtype_name))


def gpu_has_fp8() -> bool | None:
    """On a GPU: whether it has fp8 units (compute capability >= 8.9); None off a GPU or when the
    device does not say."""
    if jax.default_backend() != "gpu":
        return None
    try:
        major, minor = (int(v) for v in str(getattr(jax.devices()[0], "compute_capability", None)).split(".")[:2])
    except ValueError:
        return None
    return (major, minor) >= (8, 9)


def check_fp8_device(quantize) -> None:
    """Warn when fp8 weights go to a GPU without fp8 units: they still run (converted to the
    activation dtype inside each dot), only the bytes are saved."""
    qc = as_quantization(quantize)
    if qc is None or qc.scheme != "fp8" or jax.default_backend() != "gpu":
        return
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if gpu_has_fp8() is False:
        errors.warn(f"quantize='fp8' on a GPU of compute capability {cc} (no fp8 units): the weights are "
                    "stored in fp8 and converted to the activation dtype in each matmul (emulated); "
                    "int8 saves the same bytes")


__all__ = ["Quantization", "QArray", "SCHEMES", "quantize_array", "quantize_params", "dequantize",
           "dequantize_params", "describe", "is_quantized", "config_of"]
