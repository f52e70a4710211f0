"""benchmarks/gpu_program.py's reading of an optimized HLO module: what one decode step launches.

The script itself compiles for a GPU target deviceless, which needs the CUDA plugin of jax (not in
the test extra); its HLO reading runs here on a module written by hand in the layout of
`compiled.as_text()`: an entry computation with a while loop, whose body launches kernels, copies
the cache and takes one branch of a conditional.
"""

from __future__ import annotations

import pytest

from scripts import load_script

gp = load_script("benchmarks/gpu_program.py")

HLO = """HloModule jit_run, entry_computation_layout={()->()}

%fused_add (p0: bf16[4,4096]) -> bf16[4,4096] {
  %p0 = bf16[4,4096]{1,0} parameter(0)
  ROOT %add.1 = bf16[4,4096]{1,0} add(%p0, %p0)
}

%refresh (arg: (bf16[2,1,384,8,128], f32[4])) -> (bf16[2,1,384,8,128], f32[4]) {
  %arg = (bf16[2,1,384,8,128]{4,3,2,1,0}, f32[4]{0}) parameter(0)
  %get-tuple-element.1 = bf16[2,1,384,8,128]{4,3,2,1,0} get-tuple-element(%arg), index=0
  %copy.7 = bf16[2,1,384,8,128]{4,3,2,1,0} copy(%get-tuple-element.1)
  %loop_add_fusion.2 = bf16[4,4096]{1,0} fusion(%x), kind=kLoop, calls=%fused_add
  %gemm_fusion_dot.3 = bf16[4,4096]{1,0} fusion(%x, %y), kind=kCustom, calls=%fused_add
  ROOT %tuple.2 = (bf16[2,1,384,8,128]{4,3,2,1,0}, f32[4]{0}) tuple(%copy.7, %z)
}

%keep (arg.1: (bf16[2,1,384,8,128], f32[4])) -> (bf16[2,1,384,8,128], f32[4]) {
  %arg.1 = (bf16[2,1,384,8,128]{4,3,2,1,0}, f32[4]{0}) parameter(0)
  %loop_add_fusion.9 = bf16[4,4096]{1,0} fusion(%x), kind=kLoop, calls=%fused_add
  ROOT %tuple.3 = (bf16[2,1,384,8,128]{4,3,2,1,0}, f32[4]{0}) tuple(%a, %b)
}

%body (state: (s32[], bf16[2,1,384,8,128])) -> (s32[], bf16[2,1,384,8,128]) {
  %state = (s32[], bf16[2,1,384,8,128]{4,3,2,1,0}) parameter(0)
  %input_reduce_fusion.1 = f32[] fusion(%a), kind=kInput, calls=%fused_add
  %wrapped_slice.4 = bf16[1,1,384,8,128]{4,3,2,1,0} fusion(%c), kind=kLoop, calls=%fused_add
  %loop_pad_fusion.2 = bf16[1,16,8,128]{3,2,1,0} fusion(%q), kind=kLoop, calls=%fused_add
  %pallas_call.5 = (f32[1,8,2,16,128]{4,3,2,1,0}) custom-call(%q), custom_call_target="__gpu$xla.gpu.triton"
  %cond.1 = (bf16[2,1,384,8,128]{4,3,2,1,0}, f32[4]{0}) conditional(%p, %t, %t), true_computation=%refresh, false_computation=%keep
  %copy.9 = bf16[2,1,384,8,128]{4,3,2,1,0} copy(%g)
  ROOT %tuple.9 = (s32[], bf16[2,1,384,8,128]{4,3,2,1,0}) tuple(%i, %copy.9)
}

%cond (state.1: (s32[], bf16[2,1,384,8,128])) -> pred[] {
  %state.1 = (s32[], bf16[2,1,384,8,128]{4,3,2,1,0}) parameter(0)
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

ENTRY %main.7 (p: bf16[2,1,384,8,128]) -> bf16[2,1,384,8,128] {
  %p = bf16[2,1,384,8,128]{4,3,2,1,0} parameter(0)
  %copy.1 = bf16[2,1,384,8,128]{4,3,2,1,0} copy(%p)
  %while.2 = (s32[], bf16[2,1,384,8,128]{4,3,2,1,0}) while(%t), condition=%cond, body=%body
  ROOT %gte = bf16[2,1,384,8,128]{4,3,2,1,0} get-tuple-element(%while.2), index=1
}
"""


def test_a_decode_step_is_read_from_the_optimized_hlo():
    """The loop body's kernels (fusions, custom calls, copies; the conditional itself is not one),
    its copies of >= 1 MiB (the whole 1.5 MiB cache; a 768 KiB layer slice is below the line, a
    32 KiB pad too), and the worst branch added for the step: 3 kernels and 1.5 MiB for `refresh`."""
    cache_mib = 2 * 384 * 8 * 128 * 2 / 2**20  # 1.5 MiB
    step = gp.decode_step(HLO)
    assert step["body_kernels"] == 5  # reduce, slice, pad, pallas call, copy
    assert step["body_kinds"] == {"fusion kInput": 1, "fusion kLoop": 2, "custom-call __gpu$xla.gpu.triton": 1,
                                  "copy": 1}
    assert step["body_copy_mib"] == cache_mib and step["body_copies"] == [("copy", 1)]
    (branches,) = step["branches"]
    assert [(b["name"], b["kernels"], b["copy_mib"]) for b in branches] == [("refresh", 3, cache_mib), ("keep", 1, 0)]
    assert step["step_kernels_max"] == 5 + 3 and step["step_copy_mib_max"] == 2 * cache_mib
    assert step["entry_kernels"] == 1 and step["entry_copy_mib"] == cache_mib
    assert gp.shape_bytes("(bf16[2,3]{1,0}, f32[4]{0}, s4[8])") == 12 + 16 + 4


def test_rows_render_with_their_labels():
    row = dict(target="h100", shape="8b", case="ar_b1", prompt=128, gen=256, label="before", compile_s=17.4,
               memory=dict(temp_bytes=2**28, output_bytes=2**30), step=gp.decode_step(HLO), jax="0.10.2",
               commit="abc")
    md = gp.table([row, dict(row, label="after"), dict(row, case="mb_exact_b1", error="RuntimeError: boom")])
    assert "| h100 | 8b | ar_b1 | 128/256 | before | 5 (8) | 2 (3) | copy x1 | 0.25 | 1.00 | 17.4 | 0.10.2 | abc |" in md
    assert "| after |" in md
    assert "| mb_exact_b1 | 128/256 | before | FAILED: RuntimeError: boom" in md
    assert md.index("| after |") > md.index("| before |")  # a shape's rows in the order they were made
    assert gp.row_key(row) != gp.row_key(dict(row, label="after"))
    int8 = dict(row, kv_cache="int8")  # `--kv-cache int8`: a row of its own, named
    assert gp.row_key(int8) != gp.row_key(row) and "| ar_b1 (int8 KV) | 128/256 | before |" in gp.table([int8])


def test_without_the_cuda_plugin_it_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    """No jax CUDA plugin (as in the test extra): exit 2 and the install line, no traceback, no file."""
    real = gp.importlib.util.find_spec
    monkeypatch.setattr(gp.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("jax_plugins") else real(name, *a))
    out = tmp_path / "gpu_program.json"
    assert gp.main(["--conditionals", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "jax CUDA plugin is not installed" in err and 'pip install "jax[cuda12]==' in err
    assert not out.exists()


def test_cases_at_another_batch():
    """`--cases NAME_bN`: gpu.py's b1 case NAME at batch N (the copies of switches that keep more
    widths at larger batches); gpu.py's own ids as they are; anything else an error naming it."""
    G = load_script("benchmarks/gpu.py")
    assert gp.case_of(G, "ar_b16") == {c.id: c for c in G.all_cases()}["ar_b16"]
    four = gp.case_of(G, "mb_approx_b4")
    assert (four.id, four.batch, four.paradigm) == ("mb_approx_b4", 4, "multi_block")
    for bad in ("mb_approx", "nothing_b4", "mb_approx_bx"):
        with pytest.raises(ValueError, match=bad):
            gp.case_of(G, bad)
