"""jdllm against the PyTorch code a user has without it, on the same weights, side by side.

One random-weight `transformers` model per architecture (Qwen3 for AR and
SDAR-style block diffusion, LLaMA for LLaDA-style masked diffusion), saved with
`save_pretrained` and loaded into jdllm from that directory, so both engines
run the same float32 weights. The PyTorch baselines are plain loops written
here from the published algorithms (not copied from their repositories):

- AR: `transformers` `generate()`, greedy, batch 1, 4 and 8.
- LLaDA `generate()` without cache: every step one forward over prompt +
  gen_length (bidirectional), the linear transfer schedule per block, top-k
  confidence inside the current block.
- Fast-dLLM threshold decoding (prefix / dual cache): the block's first step
  is one full forward whose K/V become the cache; later steps run [block
  start, end) against the cached prefix (prefix) or only the block against
  cached prefix and suffix (dual); every masked position with confidence >=
  threshold plus the most confident one is revealed.
- SDAR `block_diffusion_generate`: the prompt's whole blocks are prefilled
  into a `DynamicCache`; each denoising step runs the current block against
  the cache and drops its K/V again (`crop`); a full block costs one more
  forward that commits its K/V. `low_confidence_static` (k = block / steps
  per step) and SDAR's `low_confidence_dynamic` (all > threshold if at least
  k, else the top k).
- d3LLM multi-block (`generate_multi_block`, LLaDA family, no cache): several
  blocks in flight (Inactive -> Activated -> Fully-Activated -> Completed, one
  block added per step once the newest reaches block_add_threshold), one
  bidirectional forward over prompt + gen per step, the lowest-entropy mask
  plus every one with entropy <= threshold, forced progress in the first
  Fully-Activated block. `d3llm_kv`: the same with d3LLM's delayed prefix KV
  cache (`generate_multi_block_kv_cache`, delay 1): each forward runs the
  suffix from the cache edge against the cached K/V, or a full refresh while a
  complete block waits to be cached (jdllm: `MultiBlock(cache_mode="approx")`).
- `sdar_dynamic_t1`: SDAR dynamic at temperature 1 (a draw from softmax(logits)
  and its probability as confidence): sampled, so tokens and NFE differ between
  the engines; compare time per forward.

Every pair is run interleaved (jdllm, baseline, jdllm, baseline, ...) after a
warm-up / compile call of each, medians are compared (speed-up = baseline
median / jdllm median, > 1: jdllm faster) and the greedy tokens are compared.
Times are this process's CPU time (both engines run on one thread), with the
wall-clock ratio beside it: on a shared, oversubscribed machine wall time
mostly measures the neighbours.
Pin both engines to one thread and one core so the shared machine matters
less: this script sets XLA_FLAGS and torch threads itself and, with --cpu N,
its own CPU affinity.

    python benchmarks/vs_pytorch.py --quick          # a few minutes
    python benchmarks/vs_pytorch.py                  # gen 128 and 256, AR batch 1/4/8
    python benchmarks/vs_pytorch.py --only fastdllm_dual sdar_dynamic sdar_dynamic_t1 d3llm_kv --gens 128 256 512
    python benchmarks/vs_pytorch.py --large --quick   # hidden 1024, 16 layers, vocab 32k
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jdllm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- models
def build(tmp: str, family: str, args, seed: int):
    """A random transformers model of `family` saved to tmp/family; (torch model, jdllm Model)."""
    import torch  # noqa: PLC0415

    from tests.hf_fixtures import make_transformers_model  # noqa: PLC0415

    hf = make_transformers_model(family, seed=seed, vocab_size=args.vocab, hidden_size=args.hidden,
                                 intermediate_size=args.mlp, layers=args.layers, heads=args.heads,
                                 kv_heads=args.heads, head_dim=args.hidden // args.heads,
                                 max_position_embeddings=4096)
    with torch.no_grad():  # weights ~ N(0, 1/D): activations stay O(1) at any width
        for name, p in hf.named_parameters():
            if "norm" not in name and p.ndim == 2:
                p.mul_(args.weight_scale / (0.1 * np.sqrt(p.shape[1])))
    d = os.path.join(tmp, family)
    hf.save_pretrained(d)
    return hf.eval(), jdllm.load(d, dtype="float32")


def diffusion_model(m, attention: str, block: int, mask: int):
    cfg = m.config.replace(attention=attention, block_size=block, mask_token_id=mask, logit_shift=False)
    return jdllm.Model(cfg, m.params, attn_impl=m.attn_impl)


# --------------------------------------------------------------------------- torch helpers
def _mask4d(rows_visible):
    """Bool [T, S] (True = visible) -> additive float mask [1, 1, T, S]."""
    import torch  # noqa: PLC0415
    return torch.where(rows_visible, 0.0, torch.finfo(torch.float32).min)[None, None]


def _pick(logits, mask_id):
    """Greedy token, confidence (softmax prob, mask token excluded) of logits [..., V] (float64 softmax)."""
    import torch  # noqa: PLC0415
    z = logits.double()
    z[..., mask_id] = -torch.inf
    p = torch.softmax(z, dim=-1)
    conf, tok = torch.max(p, dim=-1)
    return tok, conf


def _topk_stable(conf, k):
    """Indices of the k largest (ties: lowest index), as jdllm and the references rank."""
    import torch  # noqa: PLC0415
    order = torch.argsort(-conf, stable=True)
    return order[:k]


# --------------------------------------------------------------------------- PyTorch baselines
def torch_ar(hf, prompts, new):
    import torch  # noqa: PLC0415
    x = torch.tensor(prompts)
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, len(prompts[0]):].tolist()


def torch_llada(hf, prompt, *, gen, steps, block, mask_id, threshold=None, cache="none"):
    """LLaDA generate() (threshold None, cache none) or Fast-dLLM threshold decoding with a prefix /
    dual cache; batch 1, greedy. Returns the generated tokens."""
    import torch  # noqa: PLC0415
    from transformers import DynamicCache  # noqa: PLC0415

    n = len(prompt)
    x = torch.tensor([list(prompt) + [mask_id] * gen])
    T = n + gen
    nb = gen // block
    spb = steps // nb
    full = _mask4d(torch.ones(T, T, dtype=torch.bool))
    with torch.no_grad():
        for b in range(nb):
            b0, b1 = n + b * block, n + (b + 1) * block
            base, rem = block // spb, block % spb
            sched = [base + (1 if j < rem else 0) for j in range(spb)]
            i = 0
            kv = None
            while bool((x[0, b0:b1] == mask_id).any()):
                if cache == "none" or kv is None:
                    if cache == "none":
                        logits = hf(input_ids=x, attention_mask=full, use_cache=False).logits[0]
                        lo = 0
                    else:  # first step of the block: full forward, its K/V become the cache
                        kv = DynamicCache(config=hf.config)
                        logits = hf(input_ids=x, attention_mask=full, past_key_values=kv, use_cache=True).logits[0]
                        lo = 0
                else:
                    hi = T if cache == "prefix" else b1
                    # the window sees the prefix (and for dual the cached suffix); K/V of [b0, hi) recomputed
                    ks = [(layer.keys, layer.values) for layer in kv.layers]
                    step_kv = DynamicCache(config=hf.config)
                    for li, (k_, v_) in enumerate(ks):
                        step_kv.update(k_[:, :, :b0], v_[:, :, :b0], li)
                    if cache == "dual":
                        # dual cache: keys = [prefix | window | suffix]; a custom forward would splice the
                        # suffix in. Here: run the window against prefix, then attend to the cached suffix
                        # by feeding prefix+suffix as the past and positions of the window explicitly.
                        step_kv = DynamicCache(config=hf.config)
                        for li, (k_, v_) in enumerate(ks):
                            step_kv.update(torch.cat([k_[:, :, :b0], k_[:, :, b1:]], dim=2),
                                           torch.cat([v_[:, :, :b0], v_[:, :, b1:]], dim=2), li)
                    past = step_kv.get_seq_length()
                    W = hi - b0
                    m = _mask4d(torch.ones(W, past + W, dtype=torch.bool))
                    pos = torch.arange(b0, hi)[None]
                    logits = hf(input_ids=x[:, b0:hi], attention_mask=m, position_ids=pos, past_key_values=step_kv,
                                use_cache=True).logits[0]
                    lo = b0
                blk = logits[b0 - lo:b1 - lo]
                tok, conf = _pick(blk, mask_id)
                masked = x[0, b0:b1] == mask_id
                conf = torch.where(masked, conf, -torch.inf)
                if threshold is None:
                    k = sched[i] if i < len(sched) else int(masked.sum())
                    sel = _topk_stable(conf, k)
                    sel = sel[masked[sel]]
                else:
                    best = _topk_stable(conf, 1)
                    sel = torch.nonzero(masked & (conf >= threshold))[:, 0]
                    sel = torch.unique(torch.cat([best, sel]))
                x[0, b0 + sel] = tok[sel]
                i += 1
    return x[0, n:].tolist()


def torch_sdar(hf, prompt, *, gen, block, steps, mask_id, strategy="static", threshold=0.9, temperature=0.0):
    """SDAR block_diffusion_generate, batch 1, greedy: KV-cached prefix, denoising steps that do not
    keep their K/V, one commit forward per filled block. Returns the generated tokens."""
    import torch  # noqa: PLC0415
    from transformers import DynamicCache  # noqa: PLC0415

    n = len(prompt)
    k = block // steps
    pre = n // block * block
    x = torch.tensor([list(prompt)])
    kv = DynamicCache(config=hf.config)
    torch.manual_seed(0)
    with torch.no_grad():
        if pre:
            m = torch.arange(pre)
            vis = (m[None, :] // block) <= (m[:, None] // block)
            hf(input_ids=x[:, :pre], attention_mask=_mask4d(vis), past_key_values=kv, use_cache=True)
        b0 = pre
        limit = n + gen
        while b0 < limit:
            cur = x[0, b0:b0 + block].tolist()
            cur += [mask_id] * (block - len(cur))
            cur = torch.tensor([cur])
            vis = _mask4d(torch.ones(block, b0 + block, dtype=torch.bool))
            pos = torch.arange(b0, b0 + block)[None]
            while True:
                masked = (cur[0] == mask_id) & (torch.arange(b0, b0 + block) < limit)
                if not bool(masked.any()):
                    break
                logits = hf(input_ids=cur, attention_mask=vis, position_ids=pos, past_key_values=kv,
                            use_cache=True).logits[0]
                kv.crop(-block)  # store_kv=False: the step's K/V are dropped
                if temperature > 0:  # SDAR's sampler: a draw from softmax(logits / T), its probability
                    z = logits.double() / temperature
                    z[..., mask_id] = -torch.inf
                    p = torch.softmax(z, dim=-1)
                    tok = torch.multinomial(p, 1)[:, 0]
                    conf = p.gather(-1, tok[:, None])[:, 0]
                else:
                    tok, conf = _pick(logits, mask_id)
                conf = torch.where(masked, conf, -torch.inf)
                if strategy == "static":
                    sel = _topk_stable(conf, k)
                else:  # SDAR dynamic: all > threshold if at least k of them, else the top k
                    high = torch.nonzero(masked & (conf > threshold))[:, 0]
                    sel = high if len(high) >= k else _topk_stable(conf, k)
                sel = sel[masked[sel]]
                cur[0, sel] = tok[sel]
            if b0 + block < limit:  # commit the clean block's K/V
                hf(input_ids=cur, attention_mask=vis, position_ids=pos, past_key_values=kv, use_cache=True)
            x = torch.cat([x[:, :b0], cur], dim=1)
            b0 += block
    return x[0, n:limit].tolist()


def torch_multi_block(hf, prompt, *, gen, block, mask_id, entropy_threshold, add_threshold=0.5,
                      decoded_threshold=0.5, cache_delay=None):
    """d3LLM multi-block decoding (`generate_multi_block`, LLaDA family, no cache), batch 1, greedy,
    no stop token: blocks Inactive -> Activated -> Fully-Activated -> Completed; each step one
    bidirectional forward over prompt + gen_length; among the masks before the active end, the
    lowest-entropy one plus every one with entropy <= threshold; if the first Fully-Activated block
    with masks got none, its lowest-entropy mask. Returns the generated tokens.

    cache_delay (an int): d3LLM's delayed prefix KV cache (`generate_multi_block_kv_cache`, LLaDA
    version, no refresh interval): the prompt, then each block once it has been complete for
    `cache_delay` forwards, joins a prefix cache (the scan over the blocks stops at the first one
    that has masks or is not ripe); each forward then runs only the suffix [cache edge, end) against
    the cached K/V (the edge's K/V from the forward that cached them), or, while a complete block
    waits to be cached, a full forward whose K/V up to the edge replace the cached ones."""
    import torch  # noqa: PLC0415
    from transformers import DynamicCache  # noqa: PLC0415

    INACTIVE, ACTIVATED, FULLY, COMPLETED = range(4)
    n = len(prompt)
    T = n + gen
    x = torch.tensor([list(prompt) + [mask_id] * gen])
    starts = list(range(n, T, block))
    state = [INACTIVE] * len(starts)
    state[0] = FULLY
    full = _mask4d(torch.ones(T, T, dtype=torch.bool))

    def span(k):
        return starts[k], min(starts[k] + block, T)

    def progress(k):
        a, b = span(k)
        return float((x[0, a:b] != mask_id).float().mean())

    # delayed prefix cache (cache_delay set): the prompt is pseudo-block -1, complete at forward 0
    kv = {"edge": 0, "keys": None, "nfe": 0, "done_at": {-1: 0}, "cached": set()}

    def spans_scanned():
        yield -1, 0, n
        for k, st in enumerate(state):
            if st != INACTIVE:
                yield (k, *span(k))

    def run(lo, keep):
        """Forward over [lo, T) against the cached K/V of [0, lo); K/V of [0, keep) returned."""
        past = None
        if lo:
            past = DynamicCache(config=hf.config)
            for li, (k_, v_) in enumerate(kv["keys"]):
                past.update(k_, v_, li)
        W = T - lo
        out = hf(input_ids=x[:, lo:], attention_mask=_mask4d(torch.ones(W, lo + W, dtype=torch.bool)),
                 position_ids=torch.arange(lo, T)[None], past_key_values=past if lo else DynamicCache(config=hf.config),
                 use_cache=True)
        kept = [(layer.keys[:, :, :keep], layer.values[:, :, :keep]) for layer in out.past_key_values.layers]
        return out.logits[0], kept

    def cached_logits(end):
        kv["nfe"] += 1
        t = kv["nfe"]
        ripe_end = None
        for k, a, b in spans_scanned():  # the caching scan
            if b <= kv["edge"]:
                continue
            if bool((x[0, a:b] == mask_id).any()):
                break
            kv["done_at"].setdefault(k, t)
            if t - kv["done_at"][k] >= cache_delay and k not in kv["cached"]:
                kv["cached"].add(k)
                ripe_end = b
            elif t - kv["done_at"][k] < cache_delay:
                break
        stabilising = any(k not in kv["cached"] and k in kv["done_at"] for k, _, _ in spans_scanned())
        edge = kv["edge"]
        if ripe_end is not None:  # the suffix from the old edge; its K/V up to the new edge join the cache
            logits, kv["keys"] = run(edge, ripe_end)
            kv["edge"] = ripe_end
        elif kv["keys"] is not None and not stabilising:
            logits, _ = run(edge, 0)
        elif kv["keys"] is not None:  # refresh: a full forward, its K/V up to the edge replace the cache
            logits, kv["keys"] = run(0, edge)
            edge = 0
        else:
            logits, _ = run(0, 0)
            edge = 0
        out = torch.zeros(end - n, logits.shape[-1])  # slots before the edge: complete, never chosen
        out[max(edge - n, 0):] = logits[max(n - edge, 0):end - edge].float()
        return out

    with torch.no_grad():
        while bool((x[0, n:] == mask_id).any()):
            for k, st in enumerate(state):  # activation
                if st == ACTIVATED and (k == 0 or progress(k - 1) >= decoded_threshold):
                    state[k] = FULLY
            last = max(k for k, st in enumerate(state) if st != INACTIVE)
            if last + 1 < len(state) and progress(last) >= add_threshold:  # add one block
                state[last + 1] = FULLY if progress(last) >= decoded_threshold else ACTIVATED
            live = [k for k, st in enumerate(state) if st in (ACTIVATED, FULLY)]
            end = span(max(live))[1]
            if cache_delay is None:
                logits = hf(input_ids=x, attention_mask=full, use_cache=False).logits[0, n:end].float()
            else:
                logits = cached_logits(end)
            logits[:, mask_id] = -torch.inf
            logp = torch.log_softmax(logits, dim=-1)
            ent = -(logp.exp() * torch.where(torch.isfinite(logp), logp, 0.0)).sum(-1)
            tok = logits.argmax(-1)
            masked = x[0, n:end] == mask_id
            ent = torch.where(masked, ent, torch.inf)
            chosen = masked & (ent <= entropy_threshold)
            chosen[int(torch.argmin(ent))] = True  # first minimum: ties go to the leftmost
            for k in live:  # forced progress in the first Fully-Activated block with masks
                a, b = span(k)
                if state[k] == FULLY and bool(masked[a - n:b - n].any()):
                    if not bool(chosen[a - n:b - n].any()):
                        chosen[a - n + int(torch.argmin(ent[a - n:b - n]))] = True
                    break
            x[0, n:end] = torch.where(chosen, tok, x[0, n:end])
            for k in live:
                a, b = span(k)
                if not bool((x[0, a:b] == mask_id).any()):
                    state[k] = COMPLETED
    return x[0, n:].tolist()


# --------------------------------------------------------------------------- timing
def interleaved(fns: dict, pairs: int):
    """Warm each fn once, then call them in turn `pairs` times.

    {name: (median CPU s, all CPU s, last output, median wall s)}. CPU time of this
    process (both engines single-threaded) is the primary figure: on a shared,
    oversubscribed machine wall time mostly measures the neighbours."""
    out = {}
    for name, fn in fns.items():
        fn()
    times = {name: [] for name in fns}
    walls = {name: [] for name in fns}
    for _ in range(pairs):
        for name, fn in fns.items():
            t, w = time.process_time(), time.perf_counter()
            out[name] = fn()
            times[name].append(time.process_time() - t)
            walls[name].append(time.perf_counter() - w)
    return {name: (statistics.median(ts), ts, out[name], statistics.median(walls[name])) for name, ts in times.items()}


def jd_tokens(model, prompts, dec, new, temperature=0.0):
    outs = jdllm.generate(model, prompts, dec, jdllm.Sampling(max_new_tokens=new, stop_token_ids=(),
                                                              temperature=temperature))
    return [list(o.token_ids) for o in outs], [o.nfe for o in outs]


def compare(name, gen, batch, jd, pt, pairs, nfe=None):
    (tj, tsj, (jt, jn), wj), (tp, tsp, ptok, wp) = jd, pt
    same = jt == ptok
    match = float(np.mean([np.mean(np.asarray(a[:len(b)]) == np.asarray(b)) for a, b in zip(jt, ptok)]))
    row = dict(comparison=name, gen=gen, batch=batch, jdllm_s=tj, pytorch_s=tp, speedup=tp / tj, jdllm_wall_s=wj, pytorch_wall_s=wp,
               wall_speedup=wp / wj,
               identical_tokens=same, token_match=match, jdllm_nfe=float(np.mean(jn)), nfe_ref=nfe,
               jdllm_runs=tsj, pytorch_runs=tsp, pairs=pairs)
    print(f"{name:44s} gen {gen:4d} batch {batch}: jdllm {tj:7.3f}s  pytorch {tp:7.3f}s  "
          f"speed-up {tp / tj:5.2f} (wall {wp / wj:5.2f})  identical {same} ({match:.3f})  jdllm NFE {np.mean(jn):.1f}", flush=True)
    return row


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The benchmark model's shape and run-size options (shared with ab_revision.py)."""
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--mlp", type=int, default=1376)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--steps-per-block", type=int, default=8, help="denoising steps per block (LLaDA, SDAR)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="gen 128 only, AR batch 1, 4 and 8")
    ap.add_argument("--large", action="store_true",
                    help="the larger shape: hidden 1024, 16 layers, 16 heads, MLP 2816, vocab 32768")
    ap.add_argument("--gens", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--ar-batches", type=int, nargs="+", default=[1, 4, 8])
    add_shape_args(ap)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--entropy-threshold", type=float, default=0.9, help="d3LLM multi-block entropy threshold")
    ap.add_argument("--weight-scale", type=float, default=1.0,
                    help="weight std times sqrt(fan-in): > 1 gives peaked (confident) distributions")
    ap.add_argument("--only", nargs="*", default=None,
                    help="subset of: ar llada fastdllm_prefix fastdllm_dual sdar_static sdar_dynamic "
                         "sdar_dynamic_t1 d3llm d3llm_kv")
    ap.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU core")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "vs_pytorch.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.gens = [128]
    if args.large:
        args.hidden, args.layers, args.heads, args.mlp, args.vocab = 1024, 16, 16, 2816, 32768
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    import torch  # noqa: PLC0415
    torch.set_num_threads(1)
    want = set(args.only or ["ar", "llada", "fastdllm_prefix", "fastdllm_dual", "sdar_static", "sdar_dynamic",
                             "sdar_dynamic_t1", "d3llm", "d3llm_kv"])
    rng = np.random.default_rng(0)
    V, mask = args.vocab, args.vocab - 1
    rows = []
    t_start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        qwen_hf, qwen = build(tmp, "qwen3", args, seed=0)
        sdar = diffusion_model(qwen, "block_causal", args.block, mask)
        llama_hf, llama = build(tmp, "llama", args, seed=1)
        llada = diffusion_model(llama, "bidirectional", args.block, mask)
        for gen in args.gens:
            prompt = rng.integers(0, V - 2, size=args.prompt).tolist()
            if "ar" in want:
                for b in args.ar_batches:
                    ps = rng.integers(0, V - 2, size=(b, args.prompt)).tolist()
                    r = interleaved({"jd": lambda: jd_tokens(qwen, ps, jdllm.AR(), gen),
                                     "pt": lambda: torch_ar(qwen_hf, ps, gen)}, args.pairs)
                    rows.append(compare("transformers generate() (Qwen3, greedy)", gen, b, r["jd"], r["pt"],
                                        args.pairs, nfe=gen))
            steps = gen // args.block * args.steps_per_block
            if "llada" in want:
                dec = jdllm.MaskedDiffusion(gen_length=gen, steps=steps, block_length=args.block)
                r = interleaved({"jd": lambda: jd_tokens(llada, [prompt], dec, gen),
                                 "pt": lambda: [torch_llada(llama_hf, prompt, gen=gen, steps=steps, block=args.block,
                                                            mask_id=mask)]}, args.pairs)
                rows.append(compare(f"LLaDA generate() no cache, steps {steps}", gen, 1, r["jd"], r["pt"],
                                    args.pairs, nfe=steps))
            for cache in ("prefix", "dual"):
                if f"fastdllm_{cache}" not in want:
                    continue
                dec = jdllm.MaskedDiffusion(gen_length=gen, block_length=args.block,
                                            confidence_threshold=args.threshold, cache_mode=cache)
                r = interleaved({"jd": lambda: jd_tokens(llada, [prompt], dec, gen),
                                 "pt": lambda: [torch_llada(llama_hf, prompt, gen=gen, steps=gen, block=args.block,
                                                            mask_id=mask, threshold=args.threshold,
                                                            cache=cache)]}, args.pairs)
                rows.append(compare(f"Fast-dLLM {cache} cache, threshold {args.threshold}", gen, 1, r["jd"],
                                    r["pt"], args.pairs))
            for strat, temp in (("static", 0.0), ("dynamic", 0.0), ("dynamic", 1.0)):
                if f"sdar_{strat}" + ("_t1" if temp else "") not in want:
                    continue
                dec = jdllm.BlockDiffusion(
                    block_length=args.block, denoising_steps=args.steps_per_block,
                    strategy="low_confidence_static" if strat == "static" else "low_confidence_dynamic",
                    confidence_threshold=args.threshold, dynamic_minimum="sdar")
                r = interleaved({"jd": lambda: jd_tokens(sdar, [prompt], dec, gen, temperature=temp),
                                 "pt": lambda: [torch_sdar(qwen_hf, prompt, gen=gen, block=args.block,
                                                           steps=args.steps_per_block, mask_id=mask,
                                                           strategy=strat, threshold=args.threshold,
                                                           temperature=temp)]},
                                args.pairs)
                label = f", temperature {temp:g} (sampled: tokens differ)" if temp else ""
                rows.append(compare(f"SDAR block_diffusion_generate {strat}, {args.steps_per_block} steps{label}",
                                    gen, 1, r["jd"], r["pt"], args.pairs))
            if "d3llm" in want:
                dec = jdllm.MultiBlock(block_size=args.block, entropy_threshold=args.entropy_threshold,
                                       cache_mode="none")
                r = interleaved({"jd": lambda: jd_tokens(llada, [prompt], dec, gen),
                                 "pt": lambda: [torch_multi_block(llama_hf, prompt, gen=gen, block=args.block,
                                                                  mask_id=mask,
                                                                  entropy_threshold=args.entropy_threshold)]},
                                args.pairs)
                rows.append(compare(f"d3LLM multi-block (LLaDA, no cache), entropy {args.entropy_threshold}", gen, 1,
                                    r["jd"], r["pt"], args.pairs))
            if "d3llm_kv" in want:
                dec = jdllm.MultiBlock(block_size=args.block, entropy_threshold=args.entropy_threshold,
                                       cache_mode="approx", cache_delay_iter=1)
                r = interleaved({"jd": lambda: jd_tokens(llada, [prompt], dec, gen),
                                 "pt": lambda: [torch_multi_block(llama_hf, prompt, gen=gen, block=args.block,
                                                                  mask_id=mask, cache_delay=1,
                                                                  entropy_threshold=args.entropy_threshold)]},
                                args.pairs)
                rows.append(compare(f"d3LLM multi-block KV cache (approx, delay 1), entropy {args.entropy_threshold}",
                                    gen, 1, r["jd"], r["pt"], args.pairs))
    load = os.getloadavg()
    result = dict(machine=f"{platform.machine()} CPU, {os.cpu_count()} cores", load_average=load,
                  backend=jax.default_backend(), jax=jax.__version__, torch=torch.__version__,
                  threads="1 (XLA_FLAGS=" + os.environ.get("XLA_FLAGS", "") + "; torch.set_num_threads(1))",
                  cpu_affinity=sorted(os.sched_getaffinity(0)),
                  model=dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                             mlp=args.mlp, dtype="float32", block=args.block),
                  prompt_len=args.prompt, seconds=time.time() - t_start, rows=rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("\n| comparison | gen | batch | jdllm CPU s | PyTorch CPU s | speed-up (CPU) | speed-up (wall) | "
          "identical tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['comparison']} | {r['gen']} | {r['batch']} | {r['jdllm_s']:.3f} | {r['pytorch_s']:.3f} | "
              f"{r['speedup']:.2f} | {r['wall_speedup']:.2f} | {r['identical_tokens']} ({r['token_match']:.2f}) |")
    print(f"\nload average {load}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
