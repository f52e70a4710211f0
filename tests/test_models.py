"""Every family's jdllm float32 logits against the Hugging Face `transformers` reference.

Qwen2 / Qwen3 / LLaMA: real transformers models saved with save_pretrained,
compared with transformers' own causal forward. SDAR, Fast-dLLM v2, LLaDA and
Dream: directories in each family's own config keys and weight names, compared
with the equivalent transformers model run under an explicit 4D mask of the
family's attention kind. Both through `jdllm.load(hf_dir)` and through
`convert` + `jdllm.load(jdllm_dir)`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_fixtures as fx
import jdllm
from convert.io import convert_checkpoint
from jdllm.config import ModelConfig
from jdllm.model import aligned_logits
from tests.quick import slow, slow_except

TOL = 1e-4

BASE_CASES = {
    "qwen2-gqa-untied": ("qwen2", dict(kv_heads=2, tied=False)),
    "qwen2-mha-tied": ("qwen2", dict(kv_heads=None, tied=True)),
    "qwen3-gqa-untied-head_dim16": ("qwen3", dict(kv_heads=2, head_dim=16)),
    "qwen3-mha-tied": ("qwen3", dict(kv_heads=None, tied=True)),
    "llama-gqa-llama3-rope": ("llama", dict(kv_heads=2, head_dim=16, rope_theta=500000.0,
                                            rope_scaling=fx.LLAMA3_SCALING)),
    "llama-mha-tied-linear-rope": ("llama", dict(kv_heads=None, tied=True, rope_scaling=fx.LINEAR_SCALING)),
}


def _rand_tokens(seed, shape, vocab):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def _maxdiff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


@pytest.mark.parametrize("case", slow_except(sorted(BASE_CASES), "qwen3-gqa-untied-head_dim16"))
def test_base_family_logits_match_transformers(case, tmp_path):
    family, kw = BASE_CASES[case]
    hf_dir, model = fx.build_transformers_model(family, str(tmp_path / "hf"), seed=1, **kw)
    V = model.config.vocab_size
    tokens = _rand_tokens(2, (2, 24), V)
    with torch.no_grad():  # transformers' own causal mask, no jdllm-side construction
        ref = model(input_ids=torch.as_tensor(tokens)).logits.float().numpy()

    m = jdllm.load(hf_dir, dtype="float32")
    assert m.config.attention == "causal" and not m.config.logit_shift
    assert m.config.tie_word_embeddings == bool(kw.get("tied", False))
    assert m.config.num_kv_heads == (kw["kv_heads"] or 4)
    got = np.asarray(jdllm.logits(m, tokens))
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert _maxdiff(got, ref) <= TOL

    ck = convert_checkpoint(hf_dir, str(tmp_path / "ck"), dtype="float32", progress=False)
    m2 = jdllm.load(ck, dtype="float32")
    assert m2.config == m.config
    assert _maxdiff(jdllm.logits(m2, tokens), ref) <= TOL


def test_rope_scaling_changes_logits(tmp_path):
    """The scaled-RoPE cases above are not vacuous: scaling moves the logits."""
    _, scaled = fx.build_transformers_model("llama", str(tmp_path / "a"), seed=1, kv_heads=2, head_dim=16,
                                            rope_theta=500000.0, rope_scaling=fx.LLAMA3_SCALING)
    _, plain = fx.build_transformers_model("llama", str(tmp_path / "b"), seed=1, kv_heads=2, head_dim=16,
                                           rope_theta=500000.0)
    tokens = torch.as_tensor(_rand_tokens(3, (1, 24), 128))
    with torch.no_grad():
        assert _maxdiff(scaled(input_ids=tokens).logits, plain(input_ids=tokens).logits) > 1e-3


@slow
@pytest.mark.parametrize("family", fx.BASE_FAMILIES)
def test_left_padded_rows_match_reference_and_row_alone(family, tmp_path):
    hf_dir, model = fx.build_transformers_model(family, str(tmp_path / "hf"), seed=4)
    m = jdllm.load(hf_dir, dtype="float32")
    lens = [16, 11, 5]
    full = _rand_tokens(5, (3, 16), model.config.vocab_size)
    rows = [full[b, 16 - n:] for b, n in enumerate(lens)]
    start = np.array([16 - n for n in lens])
    got = np.asarray(jdllm.logits(m, rows))
    ref = fx.reference_logits(model, full, start, "causal")
    for b, n in enumerate(lens):
        assert _maxdiff(got[b, 16 - n:], ref[b, 16 - n:]) <= TOL
        alone = np.asarray(jdllm.logits(m, [rows[b]]))[0]
        assert _maxdiff(got[b, 16 - n:], alone) <= 1e-5


@pytest.mark.parametrize("family", slow_except(fx.DIFFUSION_FAMILIES, "sdar"))
def test_diffusion_family_logits(family, tmp_path):
    kw = dict(kv_heads=None) if family == "llada" else dict(kv_heads=2)
    if family == "Dream":
        kw["tied"] = True
    # SDAR's config.json carries no block size: the default (4) applies; Fast-dLLM v2 has bd_size=4.
    hf_dir, model = fx.build_family_dir(family, str(tmp_path / "hf"), seed=6,
                                        shards=2 if family == "llada" else 1, **kw)
    V = model.config.vocab_size
    kind = fx.FAMILY_ATTENTION[family]
    m = jdllm.load(hf_dir, dtype="float32")
    cfg = m.config
    # Family traits come from the family's own config.json keys.
    assert cfg.attention == kind
    assert cfg.block_size == (4 if kind == "block_causal" else 1)
    assert cfg.mask_token_id == V - 1
    assert cfg.logit_shift == (family in ("Dream", "Fast_dLLM_Qwen"))
    assert cfg.qk_norm == (family == "sdar")
    assert cfg.qkv_bias == (family in ("Dream", "Fast_dLLM_Qwen"))

    # Left padding by whole blocks: the block grid is on slots (DESIGN's masking rule).
    full = _rand_tokens(7, (2, 16), V)
    start = np.array([0, 4])
    rows = [full[0], full[1, 4:]]
    ref = fx.reference_logits(model, full, start, kind, cfg.block_size)
    # The mask matters: a causal reading of the same weights disagrees.
    assert _maxdiff(ref[0], fx.reference_logits(model, full[:1], None, "causal")[0]) > 1e-3

    for mm in (m, jdllm.load(convert_checkpoint(hf_dir, str(tmp_path / "ck"), dtype="float32",
                                                progress=False), dtype="float32")):
        assert mm.config == cfg
        got = np.asarray(jdllm.logits(mm, rows))
        assert _maxdiff(got[0], ref[0]) <= TOL
        assert _maxdiff(got[1, 4:], ref[1, 4:]) <= TOL
        alone = np.asarray(jdllm.logits(mm, [rows[1]]))[0]
        assert _maxdiff(got[1, 4:], alone) <= 1e-5

    # Logit shift: aligned logits at p are the raw logits at p - 1 for Dream / Fast-dLLM v2.
    al = np.asarray(aligned_logits(got, cfg))
    if cfg.logit_shift:
        assert _maxdiff(al[:, 1:], ref_shift := got[:, :-1]) == 0.0 and ref_shift.shape[1] == 15
        assert np.all(al[:, 0] == 0)
    else:
        assert np.array_equal(al, got)


@pytest.mark.parametrize("family,key,default", [
    ("sdar", "mask_token_id", 151669), ("Fast_dLLM_Qwen", "mask_token_id", 151665),
    ("Dream", "mask_token_id", 151666), ("llada", "mask_token_id", 126336),
    ("Fast_dLLM_Qwen", "bd_size", 32),
])
def test_family_defaults_when_config_omits_them(family, key, default):
    """mask_token_id / bd_size fall back to the family's published default."""
    base = fx.tiny_hf_config(fx.FAMILY_BASE[family])
    d = fx.family_config_json(family, base)
    d.pop(key)
    cfg = ModelConfig.from_hf(d)
    assert (cfg.block_size if key == "bd_size" else cfg.mask_token_id) == default


@pytest.mark.parametrize("dtype,exact", [("float32", True), ("bfloat16", False)])
def test_float32_model_matmuls_ask_for_full_precision(dtype, exact):
    """Every matmul of a float32 forward (projections, MLP, LM head, XLA attention) carries
    precision HIGHEST, so XLA:GPU cannot run it in TF32 whatever `jax_default_matmul_precision`
    says; a bfloat16 forward leaves it to the backend (the tensor cores)."""
    import os  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    import jdllm  # noqa: PLC0415
    from jdllm.model import default_positions, forward  # noqa: PLC0415

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model = jdllm.load(os.path.join(root, "models", "tiny-ar"), dtype=dtype, attn_impl="xla")
    tokens = jnp.zeros((1, 4), jnp.int32)
    start = jnp.zeros((1,), jnp.int32)
    with jax.default_matmul_precision("tensorfloat32"):
        closed = jax.make_jaxpr(lambda p: forward(p, model.config, tokens, default_positions(start, 0, 4),
                                                  start=start, attn_impl="xla")[0])(model.params)

    def dots(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                yield eqn.params["precision"]
            for v in eqn.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                    if hasattr(sub, "eqns"):
                        yield from dots(sub)

    found = list(dots(closed.jaxpr))
    assert len(found) >= 4 * model.config.num_layers + 1
    highest = [p for p in found if p is not None and jax.lax.Precision.HIGHEST in tuple(p)]
    assert (len(highest) == len(found)) if exact else not highest


def test_rotary_tables_are_evaluated_once_per_forward(monkeypatch):
    """The compiled forward evaluates the rotary cos / sin once for all layers' q and k: XLA had
    fused them into each of the 2 x layers rotations, evaluated for every element of every head
    (a 512-query window: 0.76 ms per layer on the CPU). The formula evaluated inside each rotation
    gives the same logits (to float32 rounding: XLA compiles the two programs' fusions apart)."""
    import os  # noqa: PLC0415
    import re  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jdllm import model as model_mod  # noqa: PLC0415

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model = jdllm.load(os.path.join(root, "models", "tiny-ar"), dtype="float32", attn_impl="xla")
    cfg = model.config
    assert cfg.num_layers >= 2
    tokens = jnp.asarray(_rand_tokens(0, (2, 16), cfg.vocab_size), jnp.int32)
    start = jnp.zeros((2,), jnp.int32)
    pos = model_mod.default_positions(start, 0, 16)

    def runner():  # a new function per call: jit's trace cache keys on the function
        return lambda p: model_mod.forward(p, cfg, tokens, pos, start=start, attn_impl="xla")[0]

    text = jax.jit(runner()).lower(model.params).compile().as_text()
    assert len(re.findall(r"= f32\[[^\]]*\]\{[^}]*\} cosine\(", text)) == 1, "cos evaluated per layer"
    assert len(re.findall(r"= f32\[[^\]]*\]\{[^}]*\} sine\(", text)) == 1, "sin evaluated per layer"

    inv_freq, scale = model_mod.rope_frequencies(cfg)

    rotate = model_mod.apply_rope

    def per_layer_rope(x, cos, sin):  # the old way: the tables rebuilt from the angles in each rotation
        ang = pos.astype(jnp.float32)[..., None] * inv_freq
        emb = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]
        return rotate(x, jnp.cos(emb) * scale, jnp.sin(emb) * scale)

    got = np.asarray(jax.jit(runner())(model.params))
    monkeypatch.setattr(model_mod, "apply_rope", per_layer_rope)
    ref = np.asarray(jax.jit(runner())(model.params))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["qwen2-gqa-untied", "qwen3-mha-tied"])
def test_norms_folded_into_the_matmuls_match_transformers(case, tmp_path, monkeypatch):
    """`JDLLM_NORM_INTO_MATMUL=1`: every RMS norm goes into the matmul it feeds (x·w in, the output
    scaled by the row's 1 / rms; the GPU's default for one row) and the logits still match
    transformers: q / k / v biases added after the scale (qwen2), q / k norms after it (qwen3), the
    final norm folded into a tied LM head."""
    from jdllm import model as model_mod  # noqa: PLC0415

    family, kw = BASE_CASES[case]
    hf_dir, model = fx.build_transformers_model(family, str(tmp_path / "hf"), seed=3, **kw)
    tokens = _rand_tokens(4, (2, 12), model.config.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    monkeypatch.setenv(model_mod.NORM_INTO_MATMUL_ENV, "1")
    folded, normed = [], []
    monkeypatch.setattr(model_mod, "rms_fold", lambda x, *a, f=model_mod.rms_fold: (folded.append(x.shape), f(x, *a))[1])
    monkeypatch.setattr(model_mod, "rms_norm", lambda x, *a, f=model_mod.rms_norm: (normed.append(x.shape), f(x, *a))[1])
    m = jdllm.load(hf_dir, dtype="float32")
    got = np.asarray(jdllm.logits(m, tokens))
    # both norms of the layer body (traced once for every layer) and the final one; no plain norm left
    # (qwen3's q / k norms come after the scale and are not folded)
    assert len(folded) >= 3 and all(s[-1] != m.config.hidden_size for s in normed)
    assert _maxdiff(got, ref) <= TOL


def test_norm_into_matmul_is_chosen_for_one_row_on_the_gpu(monkeypatch):
    """Unset, the fold is on for a single row on a GPU whose attention runs the Pallas kernels, and off
    for more rows (XLA fuses their norms already), float16, the XLA attention and the CPU; "0" / "1"
    force it; any other value is a ConfigError naming the variable."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jdllm import errors  # noqa: PLC0415
    from jdllm.model import NORM_INTO_MATMUL_ENV, norm_into_matmul  # noqa: PLC0415

    one, two = jnp.zeros((1, 1, 8), jnp.bfloat16), jnp.zeros((1, 2, 8), jnp.bfloat16)
    monkeypatch.delenv(NORM_INTO_MATMUL_ENV, raising=False)
    assert not norm_into_matmul(one, "auto")  # the CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert norm_into_matmul(one, "auto") and norm_into_matmul(one, "pallas")
    assert not norm_into_matmul(two, "auto") and not norm_into_matmul(one, "xla")
    assert not norm_into_matmul(one.astype(jnp.float16), "auto")
    monkeypatch.setenv(NORM_INTO_MATMUL_ENV, "0")
    assert not norm_into_matmul(one, "auto")
    monkeypatch.setenv(NORM_INTO_MATMUL_ENV, "1")
    assert norm_into_matmul(two, "xla")
    monkeypatch.setenv(NORM_INTO_MATMUL_ENV, "yes")
    with pytest.raises(errors.ConfigError, match=NORM_INTO_MATMUL_ENV):
        norm_into_matmul(one, "auto")


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_ar_decodes_the_same_tokens_with_the_norms_folded(quantize, monkeypatch):
    """Greedy AR on the shipped tiny-ar, float32, with every norm folded into its matmul (prefill and
    one-row steps) gives the plain forward's tokens, also with int8 weights on the Pallas kernels
    (their few-row matmul takes x·w)."""
    import os  # noqa: PLC0415

    import jax  # noqa: PLC0415

    from jdllm import model as model_mod  # noqa: PLC0415

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    impl = "xla" if quantize is None else "pallas"
    m = jdllm.load(os.path.join(root, "models", "tiny-ar"), dtype="float32", attn_impl=impl, quantize=quantize)
    prompts = [[5, 9, 13, 2], [7, 3]]
    sampling = jdllm.Sampling(max_new_tokens=6, stop_token_ids=())
    calls = {"rms_fold": 0, "rms_norm": 0}
    for name in calls:
        monkeypatch.setattr(model_mod, name, lambda *a, n=name, f=getattr(model_mod, name): (
            calls.__setitem__(n, calls[n] + 1), f(*a))[1])
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(model_mod.NORM_INTO_MATMUL_ENV, switch)
        jax.clear_caches()  # the switch is read when the program is traced
        runs[switch] = jdllm.generate(m, prompts, jdllm.AR(), sampling)
        assert calls["rms_fold" if switch == "1" else "rms_norm"] > 0
    for a, b in zip(runs["1"], runs["0"]):
        assert a.token_ids == b.token_ids
