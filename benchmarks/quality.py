"""Accuracy against parallelism on the shipped tiny models (models/tiny-*).

For each model and each paradigm / strategy that applies to it, sweeping
thresholds, on the held-out set of `jdllm.tasks`: exact-match accuracy,
tokens per forward (TPF = generated tokens / forward passes, prefill and KV
commits included), forward passes (NFE) per item and tokens/s; then the AUP
score of d3LLM per (model, paradigm, strategy) curve. Prints a markdown
table, writes benchmarks/out/quality.json and an accuracy-vs-TPF PNG.

A paradigm that is not importable yet (or rejects its settings) is reported
as skipped, with the reason, instead of failing the run.

    python benchmarks/quality.py                 # full sweep, 256 items
    python benchmarks/quality.py --n 64 --quick  # a few settings per paradigm

The long-answer tasks (`rep`, 39 tokens; `jumble` and `cumsum`, 32 / 24 tokens whose blocks take
several forwards: several blocks in flight), multi_block under both forced-progress rules, results
in benchmarks/out/quality-<task>.{json,md} ("exact match" is `jdllm.tasks.exact_match`: any valid
answer for jumble):

    python benchmarks/quality.py --tasks rep --only tiny-sdar --forced-progress first every --figure ''
    python benchmarks/quality.py --tasks jumble --only tiny-sdar --forced-progress first every --figure ''
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEN_TOKENS = 12  # answers are <= 9 characters + EOS
LONG_GEN_TOKENS = 48  # rep's answers are 39 characters + EOS (others: tasks.max_new_tokens)


# --------------------------------------------------------------------------- AUP
def aup(points: Sequence[tuple[float, float]], y_max: float | None = None, alpha: float = 3.0,
        drop: float = 5.0) -> float:
    """d3LLM's Accuracy Under Parallelism of (TPF, accuracy %) points.

    Points are sorted by TPF; points more than `drop` accuracy points below the
    lowest-TPF point are discarded; then
    AUP = rho_1 y_1 + sum_i (rho_i - rho_{i-1}) (y_i W(y_i) + y_{i-1} W(y_{i-1})) / 2,
    W(y) = min(exp(-alpha (1 - y / y_max)), 1), y_max defaulting to the best
    accuracy among the points.
    """
    if not points:
        raise ValueError("aup() needs at least one (tpf, accuracy) point")
    if any(r <= 0 for r, _ in points):
        raise ValueError(f"every TPF must be > 0, got {[r for r, _ in points]}")
    pts = sorted(points, key=lambda p: p[0])
    floor = pts[0][1] - drop
    pts = [p for p in pts if p[1] >= floor]
    top = max(y for _, y in points) if y_max is None else y_max
    if top <= 0:
        return 0.0

    def w(y):
        return min(math.exp(-alpha * (1.0 - y / top)), 1.0)

    total = pts[0][0] * pts[0][1]
    for (r0, y0), (r1, y1) in zip(pts, pts[1:]):
        total += 0.5 * (r1 - r0) * (y1 * w(y1) + y0 * w(y0))
    return total


# --------------------------------------------------------------------------- sweep
@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of the sweep: a paradigm config built lazily from the public jdllm name."""

    paradigm: str  # public class name: AR, BlockDiffusion, MultiBlock, MaskedDiffusion
    strategy: str  # curve the point belongs to (AUP is per curve)
    label: str  # the swept value(s), for the table
    kwargs: tuple[tuple[str, Any], ...]


def _s(paradigm: str, curve: str, label: str, **kw) -> Setting:
    return Setting(paradigm, curve, label, tuple(sorted(kw.items())))


def sweep(attention: str, block_size: int, quick: bool, forced: Sequence[str] = ("first",),
          gen: int = GEN_TOKENS, long: bool = False) -> list[Setting]:
    """The settings that apply to a model with this attention kind; multi_block once per forced-progress
    rule in `forced` (curve "entropy" for d3LLM's default "first", "entropy/every" for jdllm's variant).
    `long` (a long-answer task): the block-causal comparison multi_block vs block_diffusion."""

    def fp(curve, f):
        return curve if f == "first" else f"{curve}/{f}"

    B = block_size
    if attention == "causal":
        return [_s("AR", "greedy", "-")]
    if attention == "block_causal" and long and not quick:  # long answers: the comparison
        # multi_block vs block_diffusion at equal accuracy, with one token per step as the reference;
        # multi_block also with earlier block addition (a block joins once its predecessor has 1 of 4)
        out = [_s("BlockDiffusion", "low_confidence_static", f"steps={B}", block_length=B, denoising_steps=B,
                  strategy="low_confidence_static")]
        out += [_s("BlockDiffusion", "low_confidence_dynamic", f"conf>={c}", block_length=B, denoising_steps=B,
                   strategy="low_confidence_dynamic", confidence_threshold=c) for c in (0.95, 0.9, 0.8, 0.7, 0.5)]
        out += [_s("MultiBlock", fp("entropy", f), f"H<={e}", block_size=B, entropy_threshold=e,
                   **({} if f == "first" else {"forced_progress": f}))
                for f in forced for e in (0.2, 0.5, 1.0)]
        out += [_s("MultiBlock", fp("entropy/add0.25", f), f"H<={e}", block_size=B, entropy_threshold=e,
                   block_add_threshold=0.25, **({} if f == "first" else {"forced_progress": f}))
                for f in forced for e in (0.2, 0.5, 1.0)]
        # ... and made Fully-Activated at once (decoded 0.25): block k+1 can take its forced token in
        # the forward that completes block k (oneof: a block's first letter is a coin flip, H = ln 2)
        out += [_s("MultiBlock", fp("entropy/add0.25/dec0.25", f), f"H<={e}", block_size=B, entropy_threshold=e,
                   block_add_threshold=0.25, decoded_token_threshold=0.25,
                   **({} if f == "first" else {"forced_progress": f}))
                for f in forced for e in (0.2, 0.3, 0.4, 0.5, 1.0)]
        return out
    if attention == "block_causal":
        confs = [0.95, 0.7] if quick else [0.95, 0.9, 0.8, 0.7, 0.5]
        out = [_s("BlockDiffusion", "low_confidence_static", f"steps={s}", block_length=B, denoising_steps=s,
                  strategy="low_confidence_static") for s in ([B, 1] if quick else [B, B // 2, 1])]
        out += [_s("BlockDiffusion", "low_confidence_dynamic", f"conf>={c}", block_length=B, denoising_steps=B,
                   strategy="low_confidence_dynamic", confidence_threshold=c) for c in confs]
        if not quick:
            out += [_s("BlockDiffusion", "sequential", f"steps={B}", block_length=B, denoising_steps=B,
                       strategy="sequential")]
            out += [_s("BlockDiffusion", "entropy_bounded", f"eb<={e}", block_length=B, denoising_steps=B,
                       strategy="entropy_bounded", eb_threshold=e) for e in (0.5, 1.5)]
        out += [_s("MultiBlock", fp("entropy", f), f"H<={e}", block_size=B, entropy_threshold=e,
                   **({} if f == "first" else {"forced_progress": f}))
                for f in forced for e in ([0.1, 0.6] if quick else [0.2, 0.5, 1.0, 1.5])]
        return out
    if attention == "bidirectional":
        G = gen
        out = []
        for cache in ("none",) if quick else ("none", "prefix", "dual"):
            out += [_s("MaskedDiffusion", f"low_confidence/cache={cache}", f"steps={s}", gen_length=G,
                       block_length=4, steps=s, remasking="low_confidence", cache_mode=cache) for s in (G, G // 2)]
            out += [_s("MaskedDiffusion", f"threshold/cache={cache}", f"conf>={c}", gen_length=G, block_length=4,
                       steps=G, remasking="low_confidence", cache_mode=cache, confidence_threshold=c)
                    for c in ((0.9,) if quick or cache == "prefix" else (0.9, 0.7, 0.5))]
        if not quick:
            out += [_s("MaskedDiffusion", "random/cache=none", f"steps={G}", gen_length=G, block_length=4,
                       steps=G, remasking="random", cache_mode="none")]
        for cache in ("none",) if quick else ("none", "approx", "window"):
            out += [_s("MultiBlock", fp(f"entropy/cache={cache}", f), f"H<={e}", block_size=4, entropy_threshold=e,
                       cache=cache, **({} if f == "first" else {"forced_progress": f}))
                    for f in forced for e in ([0.5] if quick else [0.5, 1.0])]
        return out
    raise ValueError(attention)


def paradigm_class(name: str):
    """The public jdllm paradigm config class, or raise ImportError/AttributeError with the reason."""
    import jdllm  # noqa: PLC0415

    return getattr(jdllm, name)


# --------------------------------------------------------------------------- measurement
def run_setting(model, examples, setting: Setting, batch: int = 128, gen: int = GEN_TOKENS) -> dict[str, Any]:
    """Decode every example under `setting`; accuracy, TPF, NFE, tokens/s (compile excluded)."""
    import jdllm  # noqa: PLC0415
    from jdllm import tasks  # noqa: PLC0415

    decoding = paradigm_class(setting.paradigm)(**dict(setting.kwargs))
    sampling = jdllm.Sampling(temperature=0.0, max_new_tokens=gen, seed=0)
    prompts = [ex.prompt for ex in examples]
    t0 = time.perf_counter()
    jdllm.generate(model, prompts[:batch], decoding=decoding, sampling=sampling)  # compile + warm
    compile_s = time.perf_counter() - t0
    outs, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += jdllm.generate(model, prompts[i:i + batch], decoding=decoding, sampling=sampling)
    wall = time.perf_counter() - t0
    preds = [tasks.decode(o.token_ids) for o in outs]
    tokens = sum(len(o.token_ids) for o in outs)
    nfe = sum(o.nfe for o in outs)
    by_task = {}
    for t in tasks.ALL_TASKS:
        idx = [i for i, ex in enumerate(examples) if ex.task == t]
        if idx:
            by_task[t] = 100.0 * tasks.exact_match([preds[i] for i in idx], [examples[i] for i in idx])
    return {
        "accuracy": 100.0 * tasks.exact_match(preds, examples),
        "by_task": by_task,
        "tpf": tokens / max(nfe, 1),
        "nfe_per_item": nfe / len(outs),
        "tokens_per_item": tokens / len(outs),
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "compile_s": compile_s,
    }


def measure(models_dir: str, n: int, quick: bool, only: Sequence[str] = (), seed: int = 0,
            log: Callable[[str], None] = print, task_names: Sequence[str] | None = None,
            forced: Sequence[str] = ("first",), curves: Sequence[str] = ()) -> dict[str, Any]:
    """Run the sweep on every shipped model; rows for measured points and for skipped ones.
    `curves`: only the settings whose strategy (curve name) is listed (default: all)."""
    import jdllm  # noqa: PLC0415
    from jdllm import tasks  # noqa: PLC0415

    task_names = tuple(task_names or tasks.TASKS)
    long = bool(set(task_names) & set(tasks.LONG_TASKS))
    gen = LONG_GEN_TOKENS if "rep" in task_names else tasks.max_new_tokens(task_names)
    examples = tasks.test_set(n, seed, task_names)
    rows, skipped = [], []
    names = sorted(d for d in os.listdir(models_dir) if os.path.isfile(os.path.join(models_dir, d, "config.json")))
    for name in names:
        if only and name not in only:
            continue
        model = jdllm.load(os.path.join(models_dir, name), dtype="float32")
        cfg = model.config
        for st in sweep(cfg.attention, cfg.block_size, quick, forced, gen, long):
            if curves and st.strategy not in curves:
                continue
            base = {"model": name, "paradigm": st.paradigm, "strategy": st.strategy, "setting": st.label,
                    "kwargs": dict(st.kwargs)}
            try:
                paradigm_class(st.paradigm)
            except (ImportError, AttributeError) as e:
                if not any(s["model"] == name and s["paradigm"] == st.paradigm for s in skipped):
                    skipped.append({**base, "reason": f"not importable: {type(e).__name__}: {e}"})
                    log(f"skip {name} {st.paradigm}: not importable ({e})")
                continue
            try:
                res = run_setting(model, examples, st, gen=gen)
            except (TypeError, ValueError, jdllm.errors.JdllmError) as e:  # settings this paradigm rejects
                skipped.append({**base, "reason": f"{type(e).__name__}: {e}"})
                log(f"skip {name} {st.paradigm} {st.strategy} {st.label}: {type(e).__name__}: {e}")
                continue
            rows.append({**base, **res})
            log(f"{name:11s} {st.paradigm:15s} {st.strategy:24s} {st.label:12s} acc {res['accuracy']:5.1f}%  "
                f"TPF {res['tpf']:.2f}  NFE {res['nfe_per_item']:.1f}  {res['tokens_per_s']:.0f} tok/s")
    return {"items": n, "seed": seed, "tasks": list(task_names), "gen_tokens": gen, "rows": rows,
            "skipped": skipped, "aup": aup_table(rows)}


def aup_table(rows: list[dict]) -> list[dict]:
    """AUP per (model, paradigm, strategy) curve; y_max is the model's best accuracy over all its rows."""
    out = []
    curves: dict[tuple, list] = {}
    for r in rows:
        curves.setdefault((r["model"], r["paradigm"], r["strategy"]), []).append((r["tpf"], r["accuracy"]))
    for (m, p, s), pts in curves.items():
        y_max = max(r["accuracy"] for r in rows if r["model"] == m)
        out.append({"model": m, "paradigm": p, "strategy": s, "points": len(pts),
                    "max_tpf": max(t for t, _ in pts), "aup": aup(pts, y_max=y_max) if y_max > 0 else 0.0})
    return out


# --------------------------------------------------------------------------- reporting
def markdown(result: dict[str, Any], machine: str) -> str:
    names = result.get("tasks", ["sort", "add", "rev"])
    lines = [f"{result['items']} held-out items of `jdllm.tasks` ({' / '.join(names)}, seed {result['seed']}), "
             f"greedy, max {result.get('gen_tokens', GEN_TOKENS)} new tokens, float32, {machine}. TPF = generated "
             "tokens (up to and including EOS) / forward passes (prefill and KV-commit passes count); tokens/s "
             "excludes compilation.", "",
             f"| model | paradigm | strategy | setting | exact match % | {' / '.join(names)} % | TPF | NFE/item | tok/s |",
             "|---|---|---|---|---:|---|---:|---:|---:|"]
    for r in result["rows"]:
        bt = " / ".join(f"{r['by_task'].get(t, float('nan')):.0f}" for t in names)
        lines.append(f"| {r['model']} | {r['paradigm']} | {r['strategy']} | {r['setting']} | {r['accuracy']:.1f} | "
                     f"{bt} | {r['tpf']:.2f} | {r['nfe_per_item']:.1f} | {r['tokens_per_s']:.0f} |")
    lines += ["", "AUP (d3LLM definition: alpha = 3, points more than 5 accuracy points below the lowest-TPF "
              "point dropped, y_max = the model's best accuracy over every setting):", "",
              "| model | paradigm | strategy | points | max TPF | AUP |", "|---|---|---|---:|---:|---:|"]
    for a in result["aup"]:
        lines.append(f"| {a['model']} | {a['paradigm']} | {a['strategy']} | {a['points']} | {a['max_tpf']:.2f} | "
                     f"{a['aup']:.1f} |")
    if result["skipped"]:
        lines += ["", "Skipped:", ""]
        for s in result["skipped"]:
            what = s["paradigm"] if s["reason"].startswith("not importable") else \
                f"{s['paradigm']} {s['strategy']} {s['setting']}"
            lines.append(f"- {s['model']} {what}: {s['reason']}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    models = sorted({r["model"] for r in result["rows"]})
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(5 * max(1, len(models)), 4), dpi=80, squeeze=False)
    for ax, m in zip(axes[0], models):
        curves: dict[str, list] = {}
        for r in result["rows"]:
            if r["model"] == m:
                curves.setdefault(f"{r['paradigm']} {r['strategy']}", []).append((r["tpf"], r["accuracy"]))
        for label, pts in sorted(curves.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=4, lw=1, label=label)
        ax.set_title(m)
        ax.set_xlabel("tokens per forward (TPF)")
        ax.set_ylabel("exact match %")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=os.path.join(ROOT, "models"))
    ap.add_argument("--only", nargs="*", default=(), help="model directory names to run (default all)")
    ap.add_argument("--n", type=int, default=256, help="held-out items")
    ap.add_argument("--quick", action="store_true", help="a few settings per paradigm")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out"))
    ap.add_argument("--figure", default=os.path.join(ROOT, "benchmarks", "quality.png"),
                    help="accuracy-vs-TPF plot referenced by RESULTS.md ('' to skip)")
    ap.add_argument("--machine", default="CPU (2 shared cores)")
    ap.add_argument("--tasks", nargs="+", default=None,
                    help="jdllm.tasks names (default: the short tasks sort add rev); rep decodes "
                         f"{LONG_GEN_TOKENS} new tokens, others jdllm.tasks.max_new_tokens; other than the "
                         "default, the outputs are named "
                         "quality-<tasks>.{json,md,png}")
    ap.add_argument("--forced-progress", nargs="+", default=["first"], choices=["first", "every"],
                    help="multi_block forced-progress rules to sweep (default: d3LLM's 'first' only)")
    ap.add_argument("--curves", nargs="+", default=(),
                    help="only these curves (the table's strategy column, e.g. low_confidence_dynamic "
                         "entropy/add0.25/dec0.25/every); default: every curve of the sweep")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from jdllm import tasks  # noqa: PLC0415

    stem = "quality" if not args.tasks or tuple(args.tasks) == tasks.TASKS else "quality-" + "-".join(args.tasks)
    result = measure(args.models, args.n, args.quick, args.only, task_names=args.tasks,
                     forced=args.forced_progress, curves=args.curves)
    result["machine"] = args.machine
    previous = os.path.join(args.out, f"{stem}.json")
    if args.only and os.path.exists(previous):  # keep the other models' rows from an earlier run
        with open(previous) as f:
            old = json.load(f)
        if old.get("items") == args.n:
            keep = [m for m in {r["model"] for r in old["rows"] + old["skipped"]} if m not in args.only]
            result["rows"] = [r for r in old["rows"] if r["model"] in keep] + result["rows"]
            result["skipped"] = [r for r in old["skipped"] if r["model"] in keep] + result["skipped"]
            result["aup"] = aup_table(result["rows"])
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(args.out, f"{stem}.png"))
    if args.figure:
        plot(result, args.figure)
    table = markdown(result, args.machine)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
