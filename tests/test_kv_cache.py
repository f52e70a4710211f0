"""KV-cache consistency: prefill + chunked windows through the cache == one full forward.

For causal and block-causal attention the chunked logits equal the plain full
forward (chunks on block boundaries for block-causal). For bidirectional
attention a chunked pass is, by construction, the model in which each chunk
sees every key up to its own end (the prefix cache of masked diffusion); the
reference is the full forward under that explicit mask. Rows are left-padded
and the cache starts out filled with garbage, so stale slots must stay unseen.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdllm.config import ModelConfig
from jdllm.model import KVCache, default_positions, forward, init_params
from tests.quick import slow, slow_except

B, T, S_MAX = 2, 16, 20
START = np.array([0, 3], np.int32)

CONFIGS = {
    "causal": dict(qkv_bias=True),
    "block_causal": dict(qk_norm=True, block_size=4),
    "bidirectional": dict(),
}
CHUNKS = {"causal": [5, 3, 1, 7], "block_causal": [8, 4, 4], "bidirectional": [8, 4, 4]}


def _cfg(kind: str) -> ModelConfig:
    return ModelConfig(model_type="test", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, attention=kind,
                       **CONFIGS[kind])


def _setup(kind: str, seed: int = 0):
    cfg = _cfg(kind)
    params = init_params(cfg, jax.random.key(seed), std=0.15)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    return cfg, params, tokens


def _garbage_cache(cfg: ModelConfig, seed: int = 1) -> KVCache:
    c = KVCache.empty(cfg, B, S_MAX)
    k1, k2 = jax.random.split(jax.random.key(seed))
    return KVCache(k=3.0 * jax.random.normal(k1, c.k.shape), v=3.0 * jax.random.normal(k2, c.v.shape),
                   length=c.length)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _window(params, tokens, cache, offset, *, cfg):
    pos = default_positions(START, offset, tokens.shape[1])
    return forward(params, cfg, tokens, pos, start=START, cache=cache, offset=offset, attn_impl="xla")


def _full(params, cfg, tokens, mask=None):
    return _full_jit(params, tokens, mask, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _full_jit(params, tokens, mask, *, cfg):
    pos = default_positions(START, 0, tokens.shape[1])
    return forward(params, cfg, tokens, pos, start=START, attn_impl="xla", attn_mask=mask)[0]


def _chunk_mask(chunks: list[int]) -> jnp.ndarray:
    """[B, T, T]: a query in chunk c sees keys start[b] <= s < end of chunk c."""
    ends = np.concatenate([[e] * n for n, e in zip(chunks, np.cumsum(chunks))])  # [T]
    s = np.arange(T)
    m = (s[None, :] < ends[:, None])[None] & (s[None, None, :] >= START[:, None, None])
    return jnp.asarray(m)


def _real(x):
    """Logits of real (non-padding) slots only, as one flat array."""
    x = np.asarray(x)
    return np.concatenate([x[b, START[b]:] for b in range(B)])


@slow
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_prefill_then_chunks_equals_full_forward(kind):
    cfg, params, tokens = _setup(kind)
    chunks = CHUNKS[kind]
    assert sum(chunks) == T
    if kind == "block_causal":
        assert all(n % cfg.block_size == 0 for n in chunks)
    cache = _garbage_cache(cfg)
    outs, offset = [], 0
    for n in chunks:
        logits, cache = _window(params, tokens[:, offset:offset + n], cache, offset, cfg=cfg)
        assert np.asarray(cache.length).tolist() == [offset] * B  # forward never commits on its own
        offset += n
        cache = cache.commit(offset)
        outs.append(logits)
    chunked = jnp.concatenate(outs, axis=1)

    if kind == "bidirectional":
        ref = _full(params, cfg, tokens, _chunk_mask(chunks))
        # The prefix-complete window is exact: the last chunk sees every key, like the full forward
        # does for every query, so a 1-chunk pass is the plain bidirectional forward.
        whole, _ = _window(params, tokens, _garbage_cache(cfg), 0, cfg=cfg)
        np.testing.assert_allclose(_real(whole), _real(_full(params, cfg, tokens)), atol=1e-5, rtol=0)
    else:
        ref = _full(params, cfg, tokens)
    np.testing.assert_allclose(_real(chunked), _real(ref), atol=1e-5, rtol=0)
    # The comparison can fail: chunking without the cache (each chunk alone) gives other logits.
    lone = _window(params, tokens[:, 8:], _garbage_cache(cfg), 8, cfg=cfg)[0]
    assert np.max(np.abs(np.asarray(lone) - np.asarray(ref)[:, 8:])) > 1e-3


@slow
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_rewritten_window_replaces_stale_keys(kind):
    """Denoising re-runs one window at the same offset; the earlier attempt's K/V must not leak."""
    cfg, params, tokens = _setup(kind, seed=2)
    P, W = 8, 4
    cache = _garbage_cache(cfg)
    _, cache = _window(params, tokens[:, :P], cache, 0, cfg=cfg)
    cache = cache.commit(P)
    draft = jnp.asarray(np.random.default_rng(9).integers(0, cfg.vocab_size, (B, W)), jnp.int32)
    first, cache = _window(params, draft, cache, P, cfg=cfg)
    again, cache = _window(params, tokens[:, P:P + W], cache, P, cfg=cfg)

    fresh_cache = _garbage_cache(cfg, seed=5)
    _, fresh_cache = _window(params, tokens[:, :P], fresh_cache, 0, cfg=cfg)
    fresh, _ = _window(params, tokens[:, P:P + W], fresh_cache.commit(P), P, cfg=cfg)
    np.testing.assert_allclose(np.asarray(again), np.asarray(fresh), atol=1e-6, rtol=0)
    assert np.max(np.abs(np.asarray(first) - np.asarray(again))) > 1e-3
    if kind != "bidirectional":
        ref = _full(params, cfg, tokens[:, :P + W])
        np.testing.assert_allclose(np.asarray(again), np.asarray(ref)[:, P:], atol=1e-5, rtol=0)


@slow
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_keep_below_keeps_each_rows_cached_prefix(impl):
    """forward(keep_below=[B]): one window for rows whose cache edges differ. Row 0 keeps its
    (stale) cached K/V below slot 8 and equals a window from slot 8 against that cache; row 1
    (keep_below 0) equals the plain window forward, its K/V all rewritten. On the Pallas kernels
    (interpret mode) the kept slots are dropped from the write instead of read back."""
    cfg, params, tokens = _setup("bidirectional", seed=3)
    edge = 8
    stale_tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    _, stale = _window(params, stale_tokens, _garbage_cache(cfg), 0, cfg=cfg)  # K/V of other tokens
    stale = stale.commit(edge)
    pos = default_positions(START, 0, T)
    logits, cache = forward(params, cfg, tokens, pos, start=START, cache=stale, offset=0, attn_impl=impl,
                            kv_len=T, keep_below=jnp.asarray([edge, 0], jnp.int32))
    # row 0: the suffix [edge, T) against the stale prefix
    pos8 = default_positions(START, edge, T - edge)
    suffix, suffix_cache = forward(params, cfg, tokens[:, edge:], pos8, start=START, cache=stale, offset=edge,
                                   attn_impl="xla", kv_len=T)
    np.testing.assert_allclose(np.asarray(logits)[0, edge:], np.asarray(suffix)[0], atol=1e-5, rtol=0)
    for c, o in ((cache.k, stale.k), (cache.v, stale.v)):  # kept below the edge; past the window untouched
        np.testing.assert_array_equal(np.asarray(c)[:, 0, :edge], np.asarray(o)[:, 0, :edge])
        np.testing.assert_array_equal(np.asarray(c)[:, :, T:], np.asarray(o)[:, :, T:])
    np.testing.assert_allclose(np.asarray(cache.v)[:, 0, edge:T], np.asarray(suffix_cache.v)[:, 0, edge:T],
                               atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(cache.k)[:, 0, edge:T], np.asarray(suffix_cache.k)[:, 0, edge:T],
                               atol=1e-5, rtol=0)
    # row 1: everything fresh
    plain, plain_cache = _window(params, tokens, _garbage_cache(cfg), 0, cfg=cfg)
    np.testing.assert_allclose(np.asarray(logits)[1], np.asarray(plain)[1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(cache.k)[:, 1, :T], np.asarray(plain_cache.k)[:, 1, :T], atol=1e-5, rtol=0)
    # the stale prefix matters: row 0 differs from the fresh forward
    assert np.max(np.abs(np.asarray(logits)[0, edge:] - np.asarray(plain)[0, edge:])) > 1e-3


@functools.partial(jax.jit, static_argnames=("cfg",))
def _window_at(params, tokens, cache, start, offset, *, cfg):
    pos = default_positions(start, offset, tokens.shape[1])
    return forward(params, cfg, tokens, pos, start=start, cache=cache, offset=offset, attn_impl="xla")


@slow
@pytest.mark.parametrize("kind,S,cuts,ends", [("causal", 160, (32, 64, 128, 160), (64, 68, 116)),
                                             ("block_causal", 160, (32, 64, 128, 160), (64, 68, 116)),
                                             ("block_causal", 320, (64, 128, 192, 256, 320), (192, 196, 116))])
def test_attention_cut_to_the_live_length(kind, S, cuts, ends):
    """On a long cache (kv_buckets splits it) the XLA path attends only over the bucket holding the
    live keys: windows whose key range ends exactly at a bucket edge (64; 192, a 1.5x step), past
    it (68; 196) and deep in the canvas give the cacheless forward's logits; the garbage slots past
    the live length and before `start` stay unseen, and a cut one bucket too short would drop keys."""
    from jdllm.model import kv_buckets  # noqa: PLC0415

    cfg, params, tokens = _setup(kind, seed=4)
    n = 16
    assert kv_buckets(S) == cuts
    tokens = tokens[:, :n]
    ref = np.asarray(_full(params, cfg, tokens))  # rows start at START: slot - start is the position
    big = KVCache.empty(cfg, B, S)
    k1, k2 = jax.random.split(jax.random.key(7))
    big = KVCache(k=3.0 * jax.random.normal(k1, big.k.shape), v=3.0 * jax.random.normal(k2, big.v.shape),
                  length=big.length)
    for p in (e - n for e in ends):  # the sequence at slots [p, p + 16) (block-aligned)
        start = jnp.asarray(START + p)
        outs, cache = [], big
        for lo in (0, 8):
            logits, cache = _window_at(params, tokens[:, lo:lo + 8], cache, start, p + lo, cfg=cfg)
            cache = cache.commit(p + lo + 8)
            outs.append(np.asarray(logits))
        np.testing.assert_allclose(_real(np.concatenate(outs, axis=1)), _real(ref), atol=1e-5, rtol=0)
    # the comparison can fail: the last window without the 8 keys before it
    cut = np.asarray(_window_at(params, tokens[:, 8:], cache, jnp.asarray(START + 108), 108, cfg=cfg)[0])
    assert np.max(np.abs(cut - ref[:, 8:])) > 1e-3


@slow
def test_unstacked_layers_run_the_same_forward():
    """`unstack_layers` (what the CPU decode loop runs: layers unrolled, per-layer weights) gives the
    scanned forward's logits and cache; a wrong layer order would not."""
    from jdllm.model import unstack_layers  # noqa: PLC0415

    cfg, params, tokens = _setup("causal", seed=6)
    split = unstack_layers(params)
    assert isinstance(split["layers"], tuple) and len(split["layers"]) == cfg.num_layers
    assert {"qkv", "gate_up"} <= set(split["layers"][0]) and "q" not in split["layers"][0]  # fused (GQA + bias)
    a, ca = _window(params, tokens[:, :8], _garbage_cache(cfg), 0, cfg=cfg)
    for view in (split, unstack_layers(params, fuse=False)):  # fused: other f32 rounding (~2e-6)
        b, cb = _window(view, tokens[:, :8], _garbage_cache(cfg), 0, cfg=cfg)
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(cb.k), np.asarray(ca.k), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(cb.v), np.asarray(ca.v), atol=1e-5, rtol=0)
    swapped = dict(split, layers=split["layers"][::-1])
    assert np.max(np.abs(np.asarray(_window(swapped, tokens[:, :8], _garbage_cache(cfg), 0, cfg=cfg)[0])
                         - np.asarray(a))) > 1e-3


@pytest.mark.parametrize("kind,T,H,KV", slow_except([("causal", 1, 4, 2), ("block_causal", 3, 4, 4), ("bidirectional", 2, 6, 3)],
                                                 ("causal", 1, 4, 2)))
def test_window_attention_is_the_reference_attention(kind, T, H, KV):
    """`window_reference` (the XLA path's one-query windows) against the reference attention, rows at
    their own offsets and starts; a head reading another kv head's values would not match."""
    from pallas_kernels.reference import window_reference  # noqa: PLC0415
    from pallas_kernels import attention_reference  # noqa: PLC0415

    r = np.random.default_rng(T)
    q, k, v = (jnp.asarray(r.normal(size=s), jnp.float32) for s in ((3, T, H, 8), (3, 24, KV, 8), (3, 24, KV, 8)))
    kw = dict(start=jnp.asarray([0, 5, 2]), q_offset=jnp.asarray([6, 12, 24 - T]),
              kv_len=jnp.asarray([6 + T, 12 + T, 24]), kind=kind, block_size=4)
    ref = np.asarray(attention_reference(q, k, v, **kw))
    np.testing.assert_allclose(np.asarray(window_reference(q, k, v, **kw)), ref, atol=1e-5, rtol=0)
    if KV > 1:  # the check can fail: every head reading kv head 0
        k0 = jnp.broadcast_to(k[:, :, :1], k.shape)
        v0 = jnp.broadcast_to(v[:, :, :1], v.shape)
        assert np.max(np.abs(np.asarray(attention_reference(q, k0, v0, **kw)) - ref)) > 1e-3


@pytest.mark.parametrize("kind", ["bidirectional", pytest.param("block_causal", marks=slow)])
def test_write_cache_false_attends_alike_and_leaves_the_cache(kind):
    """forward(write_cache=False) (the denoising windows whose K/V nobody reads later) gives the logits
    of the writing forward and returns the cache untouched; a kv_len known at trace time (one bucket, no
    switch) gives those of a traced one (the bucket switch). The cache is long enough for kv buckets."""
    cfg, params, _ = _setup(kind)
    S = 160  # >= KV_BUCKETS_FROM: the XLA path cuts the keys to a bucket
    big = KVCache.empty(cfg, B, S)
    k1, k2 = jax.random.split(jax.random.key(3))
    cache = KVCache(k=jax.random.normal(k1, big.k.shape), v=jax.random.normal(k2, big.v.shape), length=big.length)
    toks = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (B, 8)), jnp.int32)
    off = 40  # a block boundary (block_causal: block_size 4)

    # one program per (write, kv_len) with the weights, cache and tokens as arguments (not baked in
    # as constants): the traced kv_len (the bucket switch) compiles once for both values below
    run = jax.jit(functools.partial(_forward_at, cfg=cfg, off=off), static_argnames=("write", "static_kv"))
    for kv in (S, off + 8):  # the whole cache (dual cache), the window end (a bucket below S)
        ref, written = run(params, cache, toks, jnp.int32(kv), write=True, static_kv=None)  # traced: the switch
        got, kept = run(params, cache, toks, None, write=False, static_kv=kv)  # static kv_len: one bucket
        static_w, _ = run(params, cache, toks, None, write=True, static_kv=kv)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(static_w), np.asarray(ref), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(kept.k), np.asarray(cache.k))
        np.testing.assert_array_equal(np.asarray(kept.v), np.asarray(cache.v))
        assert not np.array_equal(np.asarray(written.k), np.asarray(cache.k))


@pytest.mark.parametrize("kind", ["bidirectional", pytest.param("block_causal", marks=slow)])
def test_write_cache_false_windows_past_the_cut(kind):
    """On the XLA path a non-writing window copies only its bucket's cut of each layer's cache (with
    8 spare slots) and writes itself there (`forward`'s `attend_merged`): windows inside the cut,
    straddling its end, wholly past it (kv_len below the window: its write lands clamped in the
    spare slots) and one per row give the logits of the forward that writes the whole cache."""
    cfg, params, _ = _setup(kind)
    S = 160  # kv_buckets: 32, 64, 128, 160
    big = KVCache.empty(cfg, B, S)
    k1, k2 = jax.random.split(jax.random.key(5))
    cache = KVCache(k=jax.random.normal(k1, big.k.shape), v=jax.random.normal(k2, big.v.shape), length=big.length)
    toks = jnp.asarray(np.random.default_rng(6).integers(0, cfg.vocab_size, (B, 8)), jnp.int32)
    run = jax.jit(lambda p, c, t, off, kv, write: _forward_at(p, c, t, kv, cfg=cfg, off=off, write=write,
                                                             static_kv=None), static_argnames=("write",))
    cases = [(40, 48), (60, 62), (40, 24), (156, 160), ([60, 8], [62, 24]), ([40, 120], [64, 128])]
    for off, kv in cases:
        off, kv = jnp.asarray(off, jnp.int32), jnp.asarray(kv, jnp.int32)
        ref, _ = run(params, cache, toks, off, kv, write=True)
        got, kept = run(params, cache, toks, off, kv, write=False)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5, err_msg=str((off, kv)))
        np.testing.assert_array_equal(np.asarray(kept.k), np.asarray(cache.k))


def _forward_at(params, cache, toks, kv_len, *, cfg, off, write, static_kv):
    pos = default_positions(START, off, toks.shape[1])
    return forward(params, cfg, toks, pos, start=START, cache=cache, offset=off, attn_impl="xla",
                   kv_len=kv_len if static_kv is None else static_kv, write_cache=write)


@pytest.mark.parametrize("layer", [None, 1])
def test_one_rows_cache_write_is_the_scatters_write(layer):
    """`write_rows` writes a lone row (offset [1]) with one dynamic_update_slice, not the per-row
    scatter (which XLA turned into a read, a select and an update on the GPU). It must write what
    the scatter writes for that row, a start past either end clamped the same way (the window kept
    inside S), with or without the stacked layer axis."""
    from jdllm.model import write_rows

    S, T = 10, 3
    lead = () if layer is None else (3,)
    buf = jnp.asarray(np.random.default_rng(0).standard_normal((*lead, 2, S, 4)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, T, 4)), jnp.float32)
    for off in (-5, 0, 4, S - T, S - 1, S + 7):
        pair = write_rows(buf, x, jnp.array([off, off]), layer=layer)  # two rows: the scatter
        one = write_rows(buf[..., :1, :, :], x[:1], jnp.array([off]), layer=layer)  # one row: the update
        np.testing.assert_array_equal(np.asarray(one), np.asarray(pair[..., :1, :, :]))
        assert not np.array_equal(np.asarray(one), np.asarray(buf[..., :1, :, :]))  # it wrote something
    hlo = jax.jit(lambda b, x, o: write_rows(b, x, o, layer=layer)).lower(buf[..., :1, :, :], x[:1],
                                                                            jnp.array([2])).as_text()
    assert "dynamic_update_slice" in hlo and "scatter" not in hlo
