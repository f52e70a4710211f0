"""The quantized few-row matmul against XLA's dots, and a sweep of its tiles (issue 29).

    python benchmarks/qmatmul.py              # 8B shape's matmuls at 1 and 32 rows, every variant (GPU)
    python benchmarks/qmatmul.py --quick      # the o-projection, down-projection and LM head, fewer variants
    python benchmarks/qmatmul.py --shape tiny --rows 1 --iters 1   # CPU self-check (interpret mode)
    python benchmarks/qmatmul.py --markdown   # print the table of benchmarks/results/qmatmul.json

At batch 1 a decode step's matmuls read every weight once, so each should run at the device's read
bandwidth: bf16 weights through XLA's dot (cuBLAS) are the reference, int8 weights through XLA's
dot (the convert fused into the GEMM XLA picks) are what jdllm ran before `pallas_kernels.qmatmul`,
and the kernel runs in several tilings (column tile, contraction tile, splits, warps, pipeline
stages, and for one row multiply-and-sum instead of a dot). For each matrix of the 8B shape (qkv,
o, gate_up, down, LM head) and row count: microseconds per matmul, the weight bytes over that time
(GB/s) and its fraction of the read bandwidth measured in the same run, and the ratio to bf16's
time. Each matmul reads its own copy of the weight, so the copies' bytes exceed the 50 MB L2 and no
figure is an L2 hit; a call runs the copies back to back (at least 1 GiB of int8 weights, so that the
host's dispatch hides behind the device's work) and calls are queued without waiting
(no host round trip between matmuls, as in a compiled decode). Every variant's output is checked
against the float32 product first (relative error <= 4e-3 for bf16 activations).

JSON to `--out` (default benchmarks/results/qmatmul.json; rows keyed by device, matrix, rows and
variant, later runs replace the same keys); a table per device at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

OUT = os.path.join(ROOT, "benchmarks", "results", "qmatmul.json")
# int8 weight bytes per call (each matmul on its own copy of the weight, so none is an L2 hit): at
# least 1 GiB, so that the device's work per call (~0.25 ms at an H100's read rate) outlasts the host's
# dispatch of the next one. The first sweep (H200, 2026-11-27) ran 200 MiB calls: XLA's bf16 dot came
# out at 0.53-0.80 of the read rate there, where the same GEMMs inside a compiled decode ran at
# 0.85-0.96, so its figures were partly the host's
CALL_BYTES = 1 << 30
MAX_COPIES = 64

# (name, K, N, transpose): the 8B shape's (LLaMA-3-8B / LLaDA-8B) matmuls; tiny for the CPU self-check
SHAPES = {
    "8b": [("qkv", 4096, 12288, False), ("o", 4096, 4096, False), ("gate_up", 4096, 24576, False),
           ("down", 12288, 4096, False), ("lm_head", 4096, 126464, False)],
    "4b": [("qkv", 2560, 6144, False), ("o", 4096, 2560, False), ("gate_up", 2560, 19456, False),
           ("down", 9728, 2560, False), ("lm_head (tied embed)", 2560, 151936, True)],
    "tiny": [("o", 256, 256, False), ("head (tied)", 256, 512, True)],
}
QUICK = {"8b": ("o", "down", "lm_head"), "4b": ("o", "down", "lm_head (tied embed)"), "tiny": ("o", "head (tied)")}

# (label, qmatmul keyword arguments); the first is jdllm's default
VARIANTS = [
    ("default (dot, k128 n128, auto splits, w4 s3)", {}),
    ("n64", dict(block_n=64)),
    ("n256", dict(block_n=256)),
    ("k64", dict(block_k=64)),
    ("k256", dict(block_k=256)),
    ("warps 8", dict(num_warps=8)),
    ("stages 2", dict(num_stages=2)),
    ("stages 4", dict(num_stages=4)),
    ("no split", dict(splits=1)),
    ("reduce k128 n128", dict(mode="reduce")),
    ("reduce k256 n64", dict(mode="reduce", block_k=256, block_n=64)),
    ("reduce k64 n256", dict(mode="reduce", block_k=64, block_n=256)),
    ("reduce k128 n128 w8", dict(mode="reduce", num_warps=8)),
    # bigger tiles: more bytes in flight per program (an H100 needs ~40 KB per multiprocessor in flight to
    # reach its read rate; k128 n128 int8 is 16 KB a stage)
    ("k256 n256", dict(block_k=256, block_n=256)),
    ("k512", dict(block_k=512)),
    ("k256 w8", dict(block_k=256, num_warps=8)),
    ("k256 n256 w8 s4", dict(block_k=256, block_n=256, num_warps=8, num_stages=4)),
    ("k256 s4", dict(block_k=256, num_stages=4)),
    # no split with narrow columns: as many programs as the default's split, no partials to sum (an
    # H100 sweep of 2026-11-27 timed "no split" at n128, 32 programs for the o projection: 2.5x slower)
    ("no split n32", dict(splits=1, block_n=32)),
    ("no split n32 s4", dict(splits=1, block_n=32, num_stages=4)),
    # one row's products into an accumulator of the tile's shape, summed once (no cross-thread sum per
    # step), int8 converted by integer ops: the one-row int8 attention window's reading
    ("accumulate k32", dict(mode="accumulate", block_k=32)),
    ("accumulate k64 n64", dict(mode="accumulate", block_k=64, block_n=64)),
    ("accumulate k16 n256", dict(mode="accumulate", block_k=16, block_n=256)),
    # the weight stored [N, K] (contraction last, `transpose=True`), as a tied LM head is: the dot's
    # operand then has its contraction axis contiguous. Stored [K, N] (jdllm's QArray layout today)
    # the compiled kernel reads the int8 tile out of shared memory one byte per instruction
    # (ld.shared.b8, 128 in its PTX); stored [N, K] it loads pairs with ldmatrix (deviceless H100
    # compile, 2026-11-27). Only for matrices stored [K, N] here.
    ("[N, K] storage", dict(nk=True)),
    ("[N, K] k64", dict(nk=True, block_k=64)),
    ("[N, K] k256", dict(nk=True, block_k=256)),
    ("[N, K] n64", dict(nk=True, block_n=64)),
    ("[N, K] stages 4", dict(nk=True, num_stages=4)),
    # the same [K, N] weight read as int32 words and unpacked in registers (`qmatmul(words=True)`): no
    # byte loads from shared memory without a change of storage (deviceless H100 compile, 2026-11-27)
    ("words", dict(words=True)),
    ("words k64", dict(words=True, block_k=64)),
    ("words n256", dict(words=True, block_n=256)),
    ("words stages 4", dict(words=True, num_stages=4)),
    ("bytes", dict(words=False)),
]
QUICK_VARIANTS = ("default (dot, k128 n128, auto splits, w4 s3)", "n64", "k256", "stages 4", "reduce k128 n128",
                  "reduce k256 n64", "[N, K] storage", "[N, K] k64", "accumulate k32", "words", "words k64")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32], help="rows (batch x tokens) per matmul")
    ap.add_argument("--quick", action="store_true", help="three matrices and six variants (about a minute)")
    ap.add_argument("--only", nargs="+", default=None, help="variant labels to run (default: all)")
    ap.add_argument("--iters", type=int, default=20, help="calls timed per figure (median of 3 rounds)")
    ap.add_argument("--scheme", choices=("int8", "fp8"), default="int8")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--markdown", action="store_true", help="only print the tables of --out")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.only or ()) - {v for v, _ in VARIANTS})
    if unknown:  # (a misspelt label used to drop its variant without a word)
        ap.error(f"--only: {unknown} are not VARIANTS labels ({', '.join(v for v, _ in VARIANTS)})")
    return args


def time_calls(fn, args, iters: int) -> float:
    """Seconds per call: `iters` calls queued back to back, one wait at the end; median of 3 rounds."""
    import jax  # noqa: PLC0415

    jax.block_until_ready(fn(*args))
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - t0) / iters)
    return statistics.median(rounds)


def run(args, save=None) -> list[dict]:
    """The figures of every matrix, row count and variant; save(rows) after each matrix (a run stopped
    by its time limit keeps the matrices it finished)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import device_limits as lim  # noqa: PLC0415
    from jdllm import quant  # noqa: PLC0415
    from pallas_kernels import qmatmul  # noqa: PLC0415
    from pallas_kernels.common import default_backend, plain_backend  # noqa: PLC0415

    dev = jax.devices()[0]
    gpu = jax.default_backend() == "gpu"
    device = getattr(dev, "device_kind", str(dev))
    read = lim.read_gbps((4 << 30) if gpu else (8 << 20), 5 if gpu else 2)
    backend = plain_backend(default_backend())
    print(f"# {device} ({jax.default_backend()}, kernels: {backend}), jax {jax.__version__}; read {read:.0f} GB/s; "
          f"scheme {args.scheme}", flush=True)
    matrices = [m for m in SHAPES[args.shape] if not args.quick or m[0] in QUICK[args.shape]]
    want = args.only or ([v for v, _ in VARIANTS if v in QUICK_VARIANTS] if args.quick else [v for v, _ in VARIANTS])
    variants = [(v, kw) for v, kw in VARIANTS if v in want]
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = []
    key = jax.random.key(0)
    for name, K, N, transpose in matrices:
        wshape = (N, K) if transpose else (K, N)
        q_bytes = K * N  # one byte per weight
        copies = max(2, min(MAX_COPIES, math.ceil(CALL_BYTES / q_bytes))) if gpu else 2
        ws, qs = [], []
        for c in range(copies):
            w = (jax.random.normal(jax.random.fold_in(key, c), wshape, jnp.float32) * 0.02).astype(jnp.bfloat16)
            qa = quant.quantize_array(w, args.scheme, (1,) if transpose else (0,))
            ws.append(w)
            qs.append((qa.q, qa.scale.reshape(N)))
            del w
        # the same quantized weights stored [N, K] (the "[N, K]" variants; a transposed copy each)
        qts = [] if transpose or not any(kw.get("nk") for _, kw in variants) else \
            [(jnp.transpose(q), s) for q, s in qs]  # (a new row-major array: q's elements in [N, K] order)
        contract = ((1,), (1,)) if transpose else ((1,), (0,))
        for M in args.rows:
            x = jax.random.normal(jax.random.fold_in(key, 1000 + M), (M, K), jnp.float32).astype(jnp.bfloat16)
            q0, s0 = qs[0]
            deq = q0.astype(jnp.float32) * (s0[:, None] if transpose else s0[None, :])
            ref = np.asarray(jax.lax.dot_general(x.astype(jnp.float32), deq, (contract, ((), ())),
                                                 precision=jax.lax.Precision.HIGHEST))

            def bf16_dot(x, *ws):
                return [jax.lax.dot_general(x, w, (contract, ((), ())), preferred_element_type=jnp.float32)
                        .astype(x.dtype) for w in ws]

            def xla_int8(x, *qs):
                out = []
                for q, s in zip(qs[::2], qs[1::2]):
                    y = jax.lax.dot_general(x, q.astype(x.dtype), (contract, ((), ())),
                                            preferred_element_type=jnp.float32)
                    out.append((y * s).astype(x.dtype))
                return out

            flat_q = [a for qs_ in qs for a in qs_]
            bf16_fn = jax.jit(bf16_dot)  # timed first: every row's "x bf16" divides by it
            t_bf16 = time_calls(bf16_fn, [x] + ws, args.iters) / copies
            base = dict(device=device, backend=jax.default_backend(), jax=jax.__version__, date=date,
                        shape=args.shape, matrix=name, K=K, N=N, transpose=transpose, rows=M, copies=copies,
                        scheme=args.scheme, read_gbs=read)
            cands = [("bf16, XLA's dot", None, bf16_fn, [x] + ws, 2 * K * N),
                     (f"{args.scheme}, XLA's dot", None, jax.jit(xla_int8), [x] + flat_q, q_bytes)]
            flat_qt = [a for qs_ in qts for a in qs_]
            for label, kw in variants:
                if qmatmul.plan(M, K, N, backend, **{k: v for k, v in kw.items()
                                                      if k in ("block_k", "block_n", "splits", "mode")}) is None:
                    continue
                nk = kw.get("nk", False)
                if nk and not qts:  # (a matrix stored [N, K] already: its plain variants are these)
                    continue
                if kw.get("words") and transpose:  # (words read a [K, N] weight only)
                    continue
                kk = {k: v for k, v in kw.items() if k != "nk"}

                def kern(x, *qs, kk=kk, tr=transpose or nk):
                    return [qmatmul.qmatmul(x, q, s, transpose=tr, **kk) for q, s in zip(qs[::2], qs[1::2])]

                cands.append((f"{args.scheme}, qmatmul {label}", kw, jax.jit(kern), [x] + (flat_qt if nk else flat_q),
                              q_bytes))
            for label, kw, fn, fargs, nbytes in cands:
                row = dict(base, impl=label, variant=kw)
                try:
                    out = np.asarray(jax.block_until_ready(fn(*fargs))[0]).astype(np.float32)
                    if label.startswith("bf16"):
                        rel = None  # other weights (bf16, not the quantized ones): no comparison
                    else:
                        rel = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                    sec = (t_bf16 * copies if label.startswith("bf16") else time_calls(fn, fargs, args.iters)) / copies
                    row.update(us=sec * 1e6, gbs=nbytes / sec / 1e9, frac_read=nbytes / sec / 1e9 / read,
                               vs_bf16=sec / t_bf16, rel_err=rel, ok=rel is None or rel <= 4e-3)
                    print(f"{name:>20} M={M:<3} {label:<58} {sec * 1e6:9.1f} us  {nbytes / sec / 1e9:7.0f} GB/s "
                          f"({nbytes / sec / 1e9 / read:4.2f} of read)  {sec / t_bf16:5.2f}x bf16"
                          + ("" if rel is None else f"  err {rel:.1e}{'' if rel <= 4e-3 else ' WRONG'}"), flush=True)
                except Exception as e:  # noqa: BLE001 (a variant that does not compile is a row, not the end)
                    row.update(error=f"{type(e).__name__}: {e}"[:400])
                    print(f"{name:>20} M={M:<3} {label:<58} FAILED: {row['error'][:200]}", flush=True)
                rows.append(row)
        del ws, qs
        if save is not None:
            save(rows)
    return rows


def row_key(r: dict) -> str:
    return "|".join(str(r.get(k)) for k in ("device", "shape", "matrix", "rows", "scheme", "impl"))


def render(db: dict) -> str:
    out = []
    by_dev: dict = {}
    for r in db.get("rows", {}).values():
        by_dev.setdefault(r["device"], []).append(r)
    for device, rs in sorted(by_dev.items()):
        r0 = rs[0]
        out.append(f"### {device}: {r0['scheme']} matmuls of the {r0['shape']} shape (jax {r0['jax']}, read "
                   f"{r0['read_gbs']:.0f} GB/s, {r0['date']})\n")
        out.append("| matrix | rows | impl | us | GB/s | of read | x bf16 | rel err |")
        out.append("|---|---:|---|---:|---:|---:|---:|---:|")
        for r in sorted(rs, key=lambda r: (r["matrix"], r["rows"], r["impl"])):
            if r.get("error"):
                out.append(f"| {r['matrix']} | {r['rows']} | {r['impl']} | FAILED: {r['error'][:80]} | | | | |")
                continue
            err = "-" if r.get("rel_err") is None else f"{r['rel_err']:.1e}" + ("" if r["ok"] else " WRONG")
            out.append(f"| {r['matrix']} | {r['rows']} | {r['impl']} | {r['us']:.1f} | {r['gbs']:.0f} | "
                       f"{r['frac_read']:.2f} | {r['vs_bf16']:.2f} | {err} |")
        out.append("")
    return "\n".join(out) if out else "no rows\n"


def main(argv=None) -> int:
    args = parse(argv)
    db = dict(rows={})
    if os.path.exists(args.out):
        with open(args.out) as f:
            db = json.load(f)
    if not args.markdown:
        def save(rows):
            for r in rows:
                db["rows"][row_key(r)] = r
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            tmp = f"{args.out}.tmp"  # written whole, then renamed: an interrupted save leaves the old file
            with open(tmp, "w") as f:
                json.dump(db, f, indent=1)
            os.replace(tmp, args.out)

        rows = run(args, save)
        print(f"\n# wrote {args.out}\n", flush=True)
        if any(r.get("error") or r.get("ok") is False for r in rows):
            print(render(db))
            return 1
    print(render(db))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
