"""hopper_bwd (Gluon, sm_90): GPU tests force the family and compare dQ, dK, dV against the
float64 reference's gradients; CPU tests cover what runs without one -- the registry entry,
rendering, variant names, that the dispatcher never picks it untuned, the generic fallbacks
(off-Hopper, deterministic) and the sm_90 compile of the defaults (no Gluon code runs
in Triton's interpreter)."""
import json

import pytest
import torch

import flashtune
from flashtune import dispatch, gluon_compat, ops
from flashtune.codegen import Variant, render
from flashtune.families import get
from flashtune.masks import Masks
from flashtune.problem import Problem

from _check import ON_H100, hopper_gpu, qkv
from test_backward import assert_grads_match

FAM = get("hopper_bwd")
pytestmark = pytest.mark.usefixtures("reset_dispatch")  # nothing forced or configured after a test
# Gluon imported first here, under the interpreter setting the session started with: imported
# later inside a test that sets TRITON_INTERPRET=0, its import asserts on Triton's already
# interpreted standard library (gluon_compat.missing() caches the answer either way)
gluon_compat.missing()


def _problem(d=128, dtype="bfloat16", causal=False, n=4096, family="bwd"):
    return Problem(family, dtype, d, causal, 1, 4, 16, n, n)


# -- CPU: registry, rendering, names, dispatch, fallbacks -----------------------------------------

def test_registered_as_a_gluon_family_serving_backwards_without_a_heuristic():
    assert FAM.serves == ("bwd",) and not FAM.interpreter and not FAM.heuristic
    assert FAM.min_capability == FAM.max_capability == 90 and FAM.flops_factor == 2.5
    assert not FAM.prefers(_problem())  # never chosen untuned
    for d in (64, 128, 256):
        for dt in ("bfloat16", "float16"):
            v = FAM.default(d, dt)
            assert v.family == "hopper_bwd" and v.name in VARIANTS[d]


def test_dense_tiles_render_one_source():
    a = render(Variant.parse("hopper_bwd-m64-n128-w8-s2"))
    b = render(Variant.parse("hopper_bwd-m64-n64-w4-s3"))
    assert a.splitlines()[1:] == b.splitlines()[1:]  # tiles are constexprs: same source
    assert "def attn_bwd_hopper(" in a and "from flashtune.gluon_compat import" in a
    assert "#%" not in a


def test_variant_names_round_trip_and_rules():
    v = Variant.parse("hopper_bwd-m64-n128-w8-s3")
    assert (v.block_m, v.block_n, v.num_warps, v.num_stages) == (64, 128, 8, 3)
    assert Variant.parse(v.name) == v and Variant.from_dict(json.loads(v.to_json())) == v
    with pytest.raises(ValueError, match="num_warps"):
        Variant.parse("hopper_bwd-m64-n128-w2-s2")
    with pytest.raises(ValueError, match="block_m"):
        Variant.parse("hopper_bwd-m32-n128-w8-s2")
    with pytest.raises(ValueError, match="dq"):  # its dQ is "none" (atomics here) or "separate"
        Variant.parse("hopper_bwd-m64-n128-w8-s2-dq=atomic")
    sep = Variant.parse("hopper_bwd-m64-n128-w8-s2-dq=separate")
    assert sep.dq == "separate" and Variant.parse(sep.name) == sep
    ov = Variant.parse("hopper_bwd-m64-n64-w8-s2-dq_overlap=true")
    assert ov.dq_overlap and Variant.parse(ov.name) == ov
    with pytest.raises(ValueError, match="dq_overlap"):  # hopper_bwd's field only
        Variant.parse("bwd-m64-n64-w4-s2-dq_overlap=true")


def test_dq_overlap_issues_dq_before_the_product_its_atomics_run_under():
    """The overlap render issues dQ's wgmma, then dK's or dV's, waits for dQ's alone and adds it
    while the other runs; the default render's code (so its records' kernel hash) has none of
    it; the space proposes the field only with dq="none"."""
    import dataclasses

    from flashtune import targets
    from flashtune.codegen.render import _code_lines
    from flashtune.search_space import Space
    base = Variant.parse("hopper_bwd-m64-n64-w8-s2")
    ov = dataclasses.replace(base, dq_overlap=True)
    code = "\n".join(_code_lines(render(ov)))
    assert "p_smem" not in "\n".join(_code_lines(render(base))) and "p_smem" in code
    i_dq = code.index("dq = warpgroup_mma(ds_smem.permute")
    i_wait = code.index("dq = warpgroup_mma_wait(1, deps=(dq,))", i_dq)
    i_add = code.index("gl.atomic_add(dq_base", i_wait)
    assert i_dq < code.index("dk = warpgroup_mma(", i_dq) < i_wait < i_add
    assert i_dq < code.index("dv = warpgroup_mma(p_smem", i_dq) < i_wait
    p = dataclasses.replace(_problem(d=256), family="hopper_bwd")
    space = Space.build("hopper_bwd", targets.get("H100"), p)
    assert space.contains(ov) and space.check(ov).ok
    sep = Variant.parse("hopper_bwd-m64-n64-w8-s2-dq=separate")
    assert space.contains(sep) and not space.contains(dataclasses.replace(sep, dq_overlap=True))


def test_the_ablation_bench_edits_every_atomic_render_and_refuses_others():
    """bench/bwd_ablation.py's no-atomics edit takes every dQ atomic out of the plain and the
    dq_overlap renders (their wgmmas stay), and refuses a render it does not match, so an
    ablation never times the unedited kernel under its name."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / "bwd_ablation.py"
    spec = importlib.util.spec_from_file_location("bwd_ablation", path)
    abl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(abl)
    for name in ("hopper_bwd-m64-n64-w8-s2", "hopper_bwd-m64-n64-w8-s2-dq_overlap=true",
                 "hopper_bwd-m64-n128-w8-s1-dq_overlap=true"):
        src = render(Variant.parse(name))
        out = abl.ablated_source(src, "no-atomics")
        assert "gl.atomic_add(" not in out and "(sm_scale < 0)" in out
        assert out.count("warpgroup_mma(") == src.count("warpgroup_mma(")
    with pytest.raises(ValueError, match="no-atomics"):
        abl.ablated_source(render(Variant.parse("hopper_bwd-m64-n64-w8-s2-dq=separate")),
                           "no-atomics")


def test_separate_dq_renders_no_dq_and_its_plan_runs_the_generic_dq_kernel():
    """dq="separate": the kernel computes dK and dV only (no dS^T buffer, no dQ atomics), and
    the plan runs the generic bwd's dQ kernel (built on meta tensors, as the search's
    compile-ahead builds it); the default render keeps both."""
    from flashtune.launch_hopper_bwd import HopperBwdPlan
    sep = Variant.parse("hopper_bwd-m64-n128-w8-s2-dq=separate")
    base = Variant.parse("hopper_bwd-m64-n128-w8-s2")
    assert "atomic_add" not in render(sep) and "ds_smem" not in render(sep)
    assert "atomic_add" in render(base) and "ds_smem" in render(base)
    q = torch.empty(1, 4, 300, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 2, 300, 128, dtype=torch.bfloat16, device="meta")
    plan = HopperBwdPlan(q, k, k, True, None, sep)
    assert not plan.why and plan.dq_plan.variant.family == "bwd"
    assert plan.dq_plan.variant.dq == "separate" and plan.dq_plan.kernels[2] is not None
    assert HopperBwdPlan(q, k, k, True, None, base).dq_plan is None
    win = Variant.parse("hopper_bwd-m64-n128-w8-s2-dq=separate-window=true-softcap=true")
    masked = HopperBwdPlan(q, k, k, True, None, win, Masks((64, 0), 30.0))
    assert masked.dq_plan.variant.window and masked.dq_plan.variant.softcap


def test_gluon_dq_renders_its_own_dq_kernel_and_no_atomics():
    """dq="gluon": the dK/dV kernel computes no dQ (as "separate") and the plan launches the
    template's attn_bwd_dq_hopper over query blocks (built on meta tensors, as the search's
    compile-ahead builds it); it walks no block mask, so such a call is refused by name (the
    dispatcher runs a block-masked call's dq="none" twin: hopper_bwd.mask_changes)."""
    import dataclasses

    from flashtune import targets
    from flashtune.codegen.render import _code_lines
    from flashtune.launch_hopper_bwd import HopperBwdPlan
    from flashtune.search_space import Space
    g = Variant.parse("hopper_bwd-m64-n64-w8-s2-dq=gluon")
    code = "\n".join(_code_lines(render(g)))
    assert "def attn_bwd_dq_hopper(" in code and "atomic_add" not in code
    assert "def attn_bwd_dq_hopper(" not in render(Variant.parse("hopper_bwd-m64-n64-w8-s2"))
    q = torch.empty(2, 4, 300, 256, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 2, 300, 256, dtype=torch.bfloat16, device="meta")
    plan = HopperBwdPlan(q, k, k, True, None, g)
    assert not plan.why and plan.dq_plan is None and plan.dq_kernel is not None
    assert plan.dq_grid == (5, 8)  # cdiv(300, 64) query blocks, batch * q heads
    with pytest.raises(ValueError, match="walks no block mask"):
        from flashtune.block_mask import BlockMask
        bm = BlockMask.from_dense(torch.ones(3, 3, dtype=torch.bool), (300, 300), block_size=128)
        HopperBwdPlan(q, k, k, True, None, Variant.parse(g.name + "-block_sparse=true"),
                      Masks(None, None, bm))
    # the space proposes it (H100, session 23: 1.17-1.24x dq_overlap at D=256) with the dQ
    # kernel's own tiles, never beside dq_overlap (an atomics schedule)
    p = dataclasses.replace(_problem(d=256), family="hopper_bwd")
    space = Space.build("hopper_bwd", targets.get("H100"), p)
    tiled = Variant.parse(g.name + "-mq64-nq64-wq8-sq2")
    assert space.contains(tiled)
    assert not space.contains(Variant.parse(tiled.name + "-dq_overlap=true"))


def test_gluon_dq_kernel_takes_its_own_tiles():
    """block_m2 / block_n2 / num_warps2 / num_stages2 tile dq="gluon"'s dQ kernel (0: the dK/dV
    kernel's); other dQ schemes refuse them, and a masked call's dq="none" twin drops them."""
    from flashtune.families.hopper_bwd import dq_smem_bytes, dq_tiles
    from flashtune.launch_hopper_bwd import HopperBwdPlan
    g = Variant.parse("hopper_bwd-m64-n64-w4-s2-dq=gluon-mq128-nq64-wq8-sq3")
    assert dq_tiles(g) == (128, 64, 8, 3)
    assert dq_tiles(Variant.parse("hopper_bwd-m64-n128-w4-s2-dq=gluon")) == (64, 128, 4, 2)
    # Q, dO, the 3-stage K/V ring and dS of the dQ kernel, at D=128 (+ 1 KB)
    assert dq_smem_bytes(g, 128) == 2 * (2 * 128 * 128 + 2 * 3 * 64 * 128 + 128 * 64) + 1024
    with pytest.raises(ValueError, match="block_m2"):
        Variant.parse("hopper_bwd-m64-n64-w4-s2-mq128")
    with pytest.raises(ValueError, match="block_n2"):
        Variant.parse("hopper_bwd-m64-n64-w4-s2-dq=separate-nq32")
    q = torch.empty(2, 4, 300, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 2, 300, 128, dtype=torch.bfloat16, device="meta")
    plan = HopperBwdPlan(q, k, k, False, None, g)
    assert plan.dq_grid == (3, 8)  # cdiv(300, 128) query blocks of the dQ kernel's rows
    assert plan.dq_kernel.kwargs["BLOCK_M"] == 128 and plan.dq_kernel.kwargs["STAGES"] == 3
    resources = dict(FAM.resources(g, _problem(d=128), None))
    assert resources["attn_bwd_dq_hopper"].threads == 256
    with flashtune.force(g.name):  # a window keeps the dQ kernel and its tiles
        masked = ops.select_bwd(q, k, True, False, Masks(window=(4, 0)))
    assert masked.name == g.name + "-window=true"


@pytest.mark.slow
def test_gluon_dq_compiles_for_sm90():
    from test_compile_sm90 import kernels_check
    for d, name in ((128, "hopper_bwd-m64-n128-w8-s2-dq=gluon"),
                    (256, "hopper_bwd-m64-n64-w8-s2-dq=gluon"),
                    (128, "hopper_bwd-m64-n64-w4-s2-dq=gluon-mq128-nq64-wq8-sq2"),
                    (256, "hopper_bwd-m64-n64-w8-s2-dq=gluon-mq64-nq128-wq8-sq1"),
                    # the dQ kernel's window / softcap render (session 23)
                    (64, "hopper_bwd-m64-n64-w4-s1-dq=gluon-window=true-softcap=true"),
                    (256, "hopper_bwd-m64-n64-w8-s2-dq=gluon-mq64-nq64-wq4-sq2-window=true"
                          "-softcap=true")):
        r = kernels_check("--gpu", "H100", "--dtype", "bf16", "--head-dim", str(d), "--causal",
                          "--format", "json", name)
        rows = json.loads(r.stdout) if r.stdout.startswith("[") else []
        assert len(rows) == 2 and all(x["fits"] and not x["why"] for x in rows), rows or r.stderr


def test_search_space_admits_the_defaults():
    import dataclasses

    from flashtune import targets
    from flashtune.search_space import Space
    for d in (64, 128, 256):
        p = dataclasses.replace(_problem(d=d), family="hopper_bwd")
        space = Space.build("hopper_bwd", targets.get("H100"), p)
        assert space.check(FAM.default(d, "bfloat16")).ok
        assert space.feasible  # and more than the default
        assert all(v.family == "hopper_bwd" for v in space.feasible)


def test_search_grid_leaves_out_what_the_kernel_cannot_compute():
    # else a search would time the generic fallback under hopper_bwd's name
    assert FAM.grid_of("float32", 128, True) == []
    for d in (128, 256):
        grid = FAM.grid_of("float16", d, True)
        assert grid and all(p.family == "hopper_bwd" and p.head_dim == d for p in grid)


def test_d256_space_is_the_one_tile_two_warpgroups_can_hold():
    # dK and dV of 64 keys at D=256 fill one warpgroup's registers: two warpgroups split D
    import dataclasses

    from flashtune import targets
    from flashtune.search_space import Space
    p = dataclasses.replace(_problem(d=256), family="hopper_bwd")
    names = {v.name for v in Space.build("hopper_bwd", targets.get("H100"), p).feasible}
    # each with dQ by atomics here (dq none, its adds overlapped or not), by the generic dQ
    # kernel (dq separate) or by the template's Gluon dQ kernel (dq gluon) on its own tiles:
    # those whose shared memory fits and whose registers do not spill (sm_90 compile, session 23)
    assert names == {f"hopper_bwd-m64-n64-w8-s{s}{dq}" for s in (1, 2)
                     for dq in ("", "-dq_overlap=true", "-dq=separate")} | {
        f"hopper_bwd-m64-n64-w8-s{s}-dq=gluon-{t}" for s in (1, 2)
        for t in ("mq64-nq64-wq4-sq1", "mq64-nq64-wq4-sq2", "mq64-nq64-wq8-sq1",
                  "mq64-nq64-wq8-sq2", "mq64-nq128-wq8-sq1")}


@pytest.mark.parametrize("arch,problem,why", [
    ("sm_80", _problem(), "need sm_90"),
    ("", _problem(), "no GPU"),
    ("sm_90", _problem(d=192), "head dim 192"),
    ("sm_90", _problem(d=96), "head dim 96"),
    ("sm_90", _problem(dtype="float32"), "float32"),
])
def test_cannot_run_says_why(arch, problem, why, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert why in FAM.cannot_run(problem, arch)


def test_dispatcher_keeps_the_generic_bwd_untuned_on_h100(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a GPU machine (no kernel runs here)
    dispatch.configure(gpu="H100", db=f"sqlite:///{tmp_path}/none.db", tables_dir=tmp_path)
    for d in (64, 128):
        for causal in (False, True):
            p = _problem(d=d, causal=causal)
            assert flashtune.explain(p).variant.family == "bwd"
            assert dispatch.select(p).family == "bwd"
    # the forward is not its business
    assert dispatch.select(_problem(family="fwd")).family != "hopper_bwd"


def test_forced_serves_bwd_but_not_fwd():
    with flashtune.force("hopper_bwd-m64-n128-w8-s2"):
        assert dispatch.select(_problem()).family == "hopper_bwd"
        assert dispatch.select(_problem(family="fwd")).family != "hopper_bwd"


def test_deterministic_calls_go_to_the_generic_bwd_windowed_ones_to_the_masked_twin():
    q, k, _ = qkv(1, 2, 2, 16, 16, 64, torch.float16, "cpu")
    with flashtune.force("hopper_bwd-m64-n128-w8-s2"):
        assert ops.select_bwd(q, k, False, False).family == "hopper_bwd"
        det = ops.select_bwd(q, k, False, True)
        assert det.family == "bwd" and det.dq == "separate"
        # window / softcap: its own render (tests/test_hopper_bwd_masks.py)
        masked = ops.select_bwd(q, k, False, False, Masks(window=(4, 0)))
        assert masked.family == "hopper_bwd" and masked.window
    # dq="gluon" writes dQ without atomics: deterministic calls keep it, windowed / soft-capped
    # ones too (its dQ kernel renders them); its atomic twin goes to the generic
    gluon = "hopper_bwd-m64-n128-w8-s2-dq=gluon"
    with flashtune.force(gluon):
        assert ops.select_bwd(q, k, False, True).name == gluon
        masked = ops.select_bwd(q, k, True, False, Masks(window=(4, 0), softcap=2.0))
        assert masked.name == gluon + "-window=true-softcap=true"
        det = ops.select_bwd(q, k, False, True, Masks(window=(4, 0)))
        assert det.name == gluon + "-window=true"
    with flashtune.force("hopper_bwd-m64-n128-w8-s2"):
        det = ops.select_bwd(q, k, False, True, Masks(window=(4, 0)))
        assert det.family == "bwd" and det.dq == "separate" and det.window


def test_a_batch_past_the_grid_axis_runs_the_generic_bwd(monkeypatch):
    """B x H over 65,535 (a grid axis's limit) leaves the call to the generic bwd, whose grid is
    one axis (meta tensors: built as for a GPU, nothing launched)."""
    from flashtune.launch_hopper_bwd import HopperBwdPlan
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for b, why in ((4095, ""), (4096, "65,535")):  # 65,520 and 65,536 programs
        q = torch.empty(b, 16, 64, 128, dtype=torch.bfloat16, device="meta")
        plan = HopperBwdPlan(q, q, q, True, None, Variant.parse("hopper_bwd-m64-n64-w4-s2"))
        assert (why in plan.why) if why else plan.why == "", plan.why


def test_plan_falls_back_to_the_generic_default_off_hopper(device):
    """A forced hopper_bwd on a device that cannot run it (the CPU here, any non-sm_90 GPU)
    computes the gradients with the generic bwd family's default."""
    if ON_H100:
        pytest.skip("the H100 runs the Gluon kernel itself")
    q, k, v = qkv(1, 4, 2, 37, 45, 64, torch.float16, device)
    with flashtune.force("hopper_bwd-m64-n128-w8-s2"):
        assert_grads_match(q, k, v, causal=True)


# -- the sm_90 compile of every default, with this Triton (3.9 in CI), no GPU ------------------

@pytest.mark.slow
@pytest.mark.parametrize("causal", ["--causal", "--no-causal"])
def test_defaults_compile_for_sm90(causal):
    from test_compile_sm90 import kernels_check
    names = {FAM.default(d, "bfloat16").name for d in (64, 128)}
    r = kernels_check("--gpu", "H100", "--dtype", "bf16,fp16", "--head-dim", "64,128", causal,
                      "--format", "json", *sorted(names))
    rows = json.loads(r.stdout) if r.stdout.startswith("[") else []
    assert rows, r.stdout[-2000:] + r.stderr[-2000:]
    mine = {(x["dtype"], x["head_dim"], x["variant"]): x for x in rows}
    for dt in ("bfloat16", "float16"):
        for d in (64, 128):
            x = mine[(dt, d, FAM.default(d, dt).name)]  # each D's own default: fits, no spills
            assert x["fits"] and not x["why"], x


@pytest.mark.slow
def test_separate_dq_compiles_for_sm90():
    from test_compile_sm90 import kernels_check
    r = kernels_check("--gpu", "H100", "--dtype", "bf16", "--head-dim", "64,128", "--causal",
                      "--format", "json", "hopper_bwd-m64-n128-w8-s2-dq=separate")
    rows = json.loads(r.stdout) if r.stdout.startswith("[") else []
    assert len(rows) == 2 and all(x["fits"] and not x["why"] for x in rows), rows or r.stderr


# -- GPU: the kernel against the float64 reference, the family forced -----------------------------

SHAPES = [  # (B, H, Hk, Nq, Nk): odd lengths, one query, GQA, Nq > Nk (rows that see no key)
    (1, 2, 2, 1, 1), (2, 3, 3, 37, 37), (1, 4, 2, 113, 203), (1, 4, 1, 1000, 1000),
    (2, 2, 2, 300, 100), (1, 8, 2, 515, 2051), (1, 2, 2, 1, 130)]
VARIANTS = {64: ["hopper_bwd-m64-n128-w8-s2", "hopper_bwd-m64-n64-w4-s3",
                 "hopper_bwd-m64-n128-w4-s1"],
            128: ["hopper_bwd-m64-n128-w8-s2", "hopper_bwd-m64-n64-w4-s2"],
            256: ["hopper_bwd-m64-n64-w8-s2", "hopper_bwd-m64-n64-w8-s1",
                  "hopper_bwd-m64-n64-w8-s2-dq_overlap=true"]}


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("d,name", [(d, n) for d, ns in VARIANTS.items() for n in ns])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_grads_match_reference(d, name, dtype, causal, shape):
    b, h, hk, nq, nk = shape
    q, k, v = qkv(b, h, hk, nq, nk, d, dtype, "cuda")
    with flashtune.force(name):
        assert_grads_match(q, k, v, causal=causal)


SEPARATE = {64: "hopper_bwd-m64-n128-w8-s2-dq=separate",
            128: "hopper_bwd-m64-n128-w8-s2-dq=separate",
            256: "hopper_bwd-m64-n64-w8-s2-dq=separate"}
OVERLAP = {64: "hopper_bwd-m64-n128-w8-s2-dq_overlap=true",
           128: "hopper_bwd-m64-n64-w4-s2-dq_overlap=true",
           256: "hopper_bwd-m64-n64-w8-s1-dq_overlap=true"}
GLUON = {64: "hopper_bwd-m64-n128-w8-s2-dq=gluon",
         128: "hopper_bwd-m64-n128-w8-s2-dq=gluon",
         256: "hopper_bwd-m64-n64-w8-s2-dq=gluon"}
# its dQ kernel on tiles of its own (block_m2, block_n2, num_warps2, num_stages2)
GLUON_TILES = {64: "hopper_bwd-m64-n64-w4-s1-dq=gluon-mq128-nq128-wq8-sq1",
               128: "hopper_bwd-m64-n64-w4-s2-dq=gluon-mq128-nq64-wq8-sq2",
               256: "hopper_bwd-m64-n64-w8-s2-dq=gluon-mq64-nq128-wq8-sq1"}
# structural choices beside the defaults: dq="separate" (the generic dQ kernel), dq_overlap
# (dQ's atomics under dK's / dV's products; D=256's s2 render is in VARIANTS), dq="gluon" (the
# template's own dQ kernel; its masked render has its own grid in test_hopper_bwd_masks.py, so
# it is not in the window test below)
FIELDS = {"separate": SEPARATE, "overlap": OVERLAP, "gluon": GLUON, "gluon_tiles": GLUON_TILES}


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("field", sorted(FIELDS))
@pytest.mark.parametrize("d", sorted(SEPARATE))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[3], SHAPES[4], SHAPES[5]])
def test_field_variants_match_reference(field, d, causal, shape):
    b, h, hk, nq, nk = shape
    q, k, v = qkv(b, h, hk, nq, nk, d, torch.bfloat16, "cuda")
    with flashtune.force(FIELDS[field][d]):
        assert_grads_match(q, k, v, causal=causal)


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("field", sorted(set(FIELDS) - {"gluon", "gluon_tiles"}))
def test_field_variants_with_a_window_and_softcap(field):
    q, k, v = qkv(1, 4, 2, 515, 700, 128, torch.float16, "cuda")
    with flashtune.force(FIELDS[field][128] + "-window=true-softcap=true"):
        assert_grads_match(q, k, v, causal=True, window=(200, 0), softcap=30.0)


@pytest.mark.gpu
@hopper_gpu
def test_runs_the_gluon_kernel_not_the_fallback(monkeypatch):
    """On the H100 the plan launches attn_bwd_hopper (the generic bwd is not called)."""
    from flashtune import ops
    q, k, v = qkv(2, 4, 2, 300, 300, 128, torch.bfloat16, "cuda")
    built = []  # the variant of each backward plan built
    real = ops._bwd_plan
    monkeypatch.setattr(ops, "_bwd_plan", lambda *a: built.append(a[5]) or real(*a))
    ops._bwd_plans.clear()
    with flashtune.force("hopper_bwd-m64-n128-w8-s2"):
        assert_grads_match(q, k, v, causal=True)
    assert built and all(b.family == "hopper_bwd" for b in built), built


@pytest.mark.gpu
@hopper_gpu
def test_strided_layout_and_scale():
    """(B, N, H, D) views go through the descriptors' merged strides; a custom scale."""
    q, k, v = qkv(2, 4, 2, 300, 257, 64, torch.float16, "cuda", layout="bnhd")
    with flashtune.force("hopper_bwd-m64-n128-w8-s2"):
        assert_grads_match(q, k, v, causal=True, scale=0.3)


@pytest.mark.gpu
@hopper_gpu
def test_misaligned_call_runs_the_generic_kernel():
    base = torch.randn(2 * 4 * 64 * 128 + 8, dtype=torch.bfloat16, device="cuda")
    q = base[1:1 + 2 * 4 * 64 * 128].view(2, 4, 64, 128)  # 2-byte offset: no TMA descriptor
    k, v = torch.randn_like(q), torch.randn_like(q)
    with flashtune.force("hopper_bwd-m64-n128-w8-s2"):
        assert_grads_match(q, k, v)
