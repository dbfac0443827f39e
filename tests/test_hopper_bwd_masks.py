"""Sliding-window and softcap masks in the Gluon Hopper backward (hopper_bwd, issue 11).

CPU: what a variant renders (no mask code without masks, the dense kernel's hash unchanged; the
window's arithmetic the same as the generic bwd template's; every call matches its signature),
the step schedule the template encodes (a Python model over masks.window_range and the kernel's
mask formula against masks.dense_mask), the launch plan's argument errors, the dispatcher's masked
twin (forced, and chosen by tuned records: no branch on family names) and explain(), and a forced
hopper_bwd variant's fallback carrying the masks. GPU (sm_90, the family forced): dQ, dK, dV
against the float64 reference for window, window + causal, softcap, softcap + window, GQA, odd
lengths, Nq != Nk (rows that see no key, keys no row sees), bf16 and fp16, D=64 and 128."""
import ast
import dataclasses
import re

import pytest
import torch

import flashtune
from flashtune import dispatch, gluon_compat, ops
from flashtune.codegen import Variant, kernel_hash, render
from flashtune.codegen.render import template_text
from flashtune.families import get
from flashtune.launch import mask_args
from flashtune.masks import Masks, check_softcap, check_window, dense_mask, window_range
from flashtune.problem import Bucket, Problem

from _check import ON_H100, code_lines, hopper_gpu, qkv

FAM = get("hopper_bwd")
# Gluon imported first here, under the interpreter setting the session started with (as
# tests/test_hopper_bwd.py: imported later, inside a test that sets TRITON_INTERPRET=0, it fails)
gluon_compat.missing()

DEFAULT = "hopper_bwd-m64-n128-w8-s2"   # the D=64 and D=128 default
SMALL = "hopper_bwd-m64-n64-w4-s2"      # one warpgroup, 64 keys per program
# the kernel hash of the dense/causal render (tiles are constexprs: every hopper_bwd variant
# renders the same source); a change here makes every tuned hopper_bwd record stale. The D=256
# split (2026-11-24) changed the source but not the D=64/128 PTX (72 renders compared), and the
# shipped records were re-stamped
DENSE_HASH = "a5ef7f218e069254"
MASK_WORDS = ("win_left", "win_right", "cap_in", "_tanh", "_window_range", "below", "above",
              "softcap")
MASKS = ({"window": True}, {"softcap": True}, {"window": True, "softcap": True})


pytestmark = pytest.mark.usefixtures("reset_dispatch")


def _masks(causal=False, window=None, softcap=None) -> Masks:
    return Masks(check_window(window, causal), check_softcap(softcap))


# -- CPU: rendering --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [DEFAULT, SMALL, "hopper_bwd-m128-n128-w8-s1"])
def test_variant_without_masks_renders_no_mask_code(name):
    v = Variant.parse(name)
    assert not any(w in code_lines(render(v)) for w in MASK_WORDS)
    assert kernel_hash(v) == DENSE_HASH


@pytest.mark.parametrize("masks", MASKS, ids=lambda m: "+".join(m))
def test_masked_render_carries_its_mask_code(masks):
    v = dataclasses.replace(Variant.parse(DEFAULT), **masks)
    src = code_lines(render(v))
    # every masked render takes the window's bounds and steps; only softcap renders the tanh
    for w in ("win_left", "win_right", "_window_range(", "below", "above"):
        assert w in src, (v.name, w)
    assert ("_tanh(" in src) == ("cap_in" in src) == masks.get("softcap", False)
    signature = src.split("def attn_bwd_hopper(")[1].split(")")[0]
    assert ("softcap" in signature) == masks.get("softcap", False)
    assert "win_left, win_right" in signature
    assert kernel_hash(v) != DENSE_HASH
    # line numbers still match the template (tracebacks point into it)
    assert len(render(v).splitlines()) == len(render(Variant.parse(DEFAULT)).splitlines())


@pytest.mark.parametrize("masks", ({},) + MASKS, ids=lambda m: "+".join(m) or "dense")
def test_every_call_matches_its_signature(masks):
    """Gluon does not run here: each render parses, and every call of a helper of the module
    passes as many arguments as the helper takes."""
    seen = helper_calls(render(dataclasses.replace(Variant.parse(DEFAULT), **masks)))
    assert {"_load_step", "_step_coords"} <= seen
    assert ("_window_range" in seen) == bool(masks)
    assert ("_tanh" in seen) == masks.get("softcap", False)


@pytest.mark.parametrize("masks", ({},) + MASKS, ids=lambda m: "+".join(m) or "dense")
def test_gluon_dq_kernel_renders_the_masks_it_takes(masks):
    """dq="gluon"'s dQ kernel takes the window's bounds (and the softcap) after sm_scale, as the
    dK/dV kernel; its masked render walks the window's key blocks from `lo` (_load_kv_step_at)."""
    g = dataclasses.replace(Variant.parse("hopper_bwd-m64-n64-w4-s2-dq=gluon"), **masks)
    src = render(g)
    seen = helper_calls(src)
    assert ("_load_kv_step_at" in seen) == bool(masks)
    assert ("_load_kv_step" in seen) == (not masks)
    tree = ast.parse(src)
    args = {f.name: [a.arg for a in f.args.args] for f in tree.body
            if isinstance(f, ast.FunctionDef)}
    dq_args, dkdv_args = args["attn_bwd_dq_hopper"], args["attn_bwd_hopper"]
    want = ["win_left", "win_right"] * bool(masks) + ["softcap"] * masks.get("softcap", False)
    assert dq_args[dq_args.index("sm_scale") + 1:dq_args.index("H")] == want
    assert dkdv_args[dkdv_args.index("sm_scale") + 1:dkdv_args.index("H")] == want
    # windowed / soft-capped problems' spaces propose it (its masked render passed on the H100,
    # session 24); block-masked ones do not (it walks no block mask)
    from flashtune import targets
    from flashtune.problem import Problem
    from flashtune.search_space import Space
    for kw, gluon in ((dict(window=256), True), (dict(softcap=True), True),
                      (dict(block_density=0.25), False)):
        p = Problem("hopper_bwd", "bfloat16", 128, True, 1, 4, 16, 4096, 4096, **kw)
        space = Space.build("hopper_bwd", targets.get("H100"), p)
        assert space.feasible and any(v.dq == "gluon" for v in space.feasible) == gluon, kw


def test_forced_masked_gluon_plan_passes_the_window_to_the_dq_kernel():
    from flashtune.launch_hopper_bwd import HopperBwdPlan
    q = torch.empty(1, 4, 300, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 2, 300, 128, dtype=torch.bfloat16, device="meta")
    g = Variant.parse("hopper_bwd-m64-n64-w4-s2-dq=gluon-window=true-softcap=true")
    plan = HopperBwdPlan(q, k, k, True, None, g, _masks(True, (40, 0), 5.0))
    assert plan.dq_kernel is not None and plan.dq_mask_args == plan.mask_args
    assert len(plan.dq_mask_args) == 3 and plan.dq_mask_args[2] == 5.0


def helper_calls(source: str) -> set:
    """The module's helpers that `source` calls, each call asserted to pass as many arguments
    as the helper takes (Gluon does not run here)."""
    tree = ast.parse(source)
    defs = {f.name: len(f.args.args) for f in tree.body if isinstance(f, ast.FunctionDef)}
    seen = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in defs:
            n = len(node.args) + len(node.keywords)
            assert n == defs[node.func.id], f"{node.func.id}: called with {n}, takes " \
                                            f"{defs[node.func.id]}"
            seen.add(node.func.id)
    return seen


def test_window_arithmetic_is_the_generic_bwd_templates():
    """hopper_bwd's _window_range is the generic bwd template's (which tests hold equal to
    flashtune/masks.py:window_range), in Gluon."""
    def body(text):
        lines = text.split("def _window_range(")[1].split("    return ")[0].splitlines()
        return [s.strip() for s in lines if re.match(r"\s+(lo|hi|full_lo|full_hi) = ", s)]
    generic = [re.sub(r"\btl\b", "gl", s) for s in body(template_text("bwd"))]
    assert len(generic) == 6 and generic == body(template_text("hopper_bwd"))


def test_kernel_passes_the_key_axis_to_window_range_as_the_generic_dkdv():
    """Per key block the query rows come from _window_range with the axes swapped (diag ->
    -diag, before = win_right, after = win_left), as attn_bwd.py.tmpl's dK/dV kernel."""
    call = ("_window_range(start_n, BLOCK_N, BLOCK_M, -diag, win_right,\n"
            "                                                 win_left, Nq, Nq)")
    assert call in template_text("hopper_bwd")
    generic = re.sub(r"\s+", " ", template_text("bwd"))
    assert "_window_range(start_n, BLOCK_N, BLOCK_M, -diag, win_right, win_left, Nq, Nq)" in \
        generic


# -- CPU: the step schedule the template encodes, modelled in Python ------------------------------

def _schedule(start_n, bn, bm, nq, nk, left, right):
    """The kernel's query steps for key block start_n: (lo, per_head, full_lo, full_hi)."""
    lo_w, full_lo, full_hi, hi_w = window_range(start_n, bn, bm, -(nk - nq), right, left, nq, nq)
    lo = lo_w // bm
    return lo, max(-(-hi_w // bm) - lo, 0), full_lo, full_hi


def _kernel_keep(start_n, bn, start_m, bm, nq, nk, left, right) -> torch.Tensor:
    """The edge steps' mask as the kernel computes it: [keys, rows] of the step."""
    keys = torch.arange(start_n, start_n + bn)
    kk = torch.where(keys < nk, keys - start_m, torch.tensor(-(1 << 30)))[:, None]
    dist = kk - torch.arange(bm)[None, :]
    diag = nk - nq
    return (dist >= max(diag - left, -nq)) & (dist <= diag + right)


@pytest.mark.parametrize("bm,bn", [(64, 128), (64, 64), (128, 128)])
@pytest.mark.parametrize("nq,nk", [(300, 100), (113, 203), (515, 2051), (1000, 1000), (1, 130)])
@pytest.mark.parametrize("window,causal,softcap", [
    ((8, 5), False, None), ((100, -1), False, None), ((-1, 30), False, None), ((64, 0), True, None),
    ((0, 0), False, None), ((3, 0), True, None), (None, True, 5.0), (None, False, 5.0),
    ((130, 10), False, 4.0)])
def test_step_schedule_covers_each_key_exactly(bm, bn, nq, nk, window, causal, softcap):
    """Per key block: every (row, key) pair the window keeps lies in the program's steps; an
    unmasked step is seen in full by every row of it (no key tail); an edge step's mask is
    exactly the window's (rows past Nq have P = 0 anyway: LSE2 = +inf)."""
    left, right = mask_args(_masks(causal, window, softcap), causal, "kv", 1, 1)[:2]
    seen = dense_mask(nq, nk, causal, window)
    for start_n in range(0, nk, bn):
        lo, per_head, full_lo, full_hi = _schedule(start_n, bn, bm, nq, nk, left, right)
        cols = seen[:, start_n:start_n + bn]
        rows = cols.any(1).nonzero().flatten()
        if len(rows):
            assert lo * bm <= rows.min() and rows.max() < (lo + per_head) * bm, start_n
        else:
            assert per_head == 0 or not seen[lo * bm:(lo + per_head) * bm,
                                             start_n:start_n + bn].any()
        tail = start_n + bn > nk
        for m in range(lo, lo + per_head):
            start_m = m * bm
            want = torch.zeros(bn, bm, dtype=torch.bool)
            part = seen[start_m:start_m + bm, start_n:start_n + bn].T
            want[:part.shape[0], :part.shape[1]] = part
            live = torch.arange(start_m, start_m + bm) < nq  # rows past Nq: P = 0 regardless
            if start_m < full_lo or start_m + bm > full_hi or tail:
                got = _kernel_keep(start_n, bn, start_m, bm, nq, nk, left, right)
                assert torch.equal(got[:, live], want[:, live]), (start_n, start_m)
            else:
                assert start_n + bn <= nk and start_m + bm <= nq and want.all(), (start_n, m)


# -- CPU: variants, plans, dispatch ---------------------------------------------------------------

def test_masks_are_fields():
    # dq: none, separate or gluon; dq_overlap: the atomics under a product; block_m2 ..
    # num_stages2: the tiles of dq="gluon"'s dQ kernel; varlen: packed sequences
    # (tests/test_hopper_bwd_varlen.py)
    assert FAM.fields == ("dq", "dq_overlap", "window", "softcap", "block_sparse", "block_m2",
                          "block_n2", "num_warps2", "num_stages2", "varlen")
    assert FAM.mask_fields("bwd") == ("window", "softcap", "block_sparse")
    v = Variant.parse(DEFAULT + "-window=true-softcap=true")
    assert v.masks == ("window", "softcap") and Variant.parse(v.name) == v
    v = Variant.parse(DEFAULT + "-block_sparse=true")
    assert v.masks == ("block_sparse",) and Variant.parse(v.name) == v


def test_plan_refuses_a_variant_that_does_not_render_the_calls_masks():
    from flashtune.block_mask import BlockMask
    from flashtune.launch_hopper_bwd import HopperBwdPlan
    q, k, v = qkv(1, 2, 2, 64, 64, 64, torch.bfloat16, "cpu")
    dense = Variant.parse(DEFAULT)
    win = dataclasses.replace(dense, window=True)
    with pytest.raises(ValueError, match="carries masks"):
        HopperBwdPlan(q, k, v, False, None, dense, Masks((4, 4)))
    with pytest.raises(ValueError, match="carries masks"):
        HopperBwdPlan(q, k, v, False, None, win)
    with pytest.raises(ValueError, match="carries masks"):
        HopperBwdPlan(q, k, v, False, None, win, Masks((4, 4), 30.0))
    bm = BlockMask.from_dense(torch.ones(1, 1, dtype=torch.bool), (64, 64), block_size=64)
    with pytest.raises(ValueError, match="carries masks"):  # block_sparse not rendered in
        HopperBwdPlan(q, k, v, False, None, win, Masks((4, 4), None, bm))
    with pytest.raises(ValueError, match="hopper_bwd"):
        HopperBwdPlan(q, k, v, False, None, Variant.parse("bwd-m16-n32-w4-s1-dq=atomic"))


def test_forced_select_bwd_renders_the_masks_in():
    from flashtune.block_mask import BlockMask
    q, k, _ = qkv(1, 2, 2, 16, 16, 64, torch.float16, "cpu")
    with flashtune.force(DEFAULT):
        assert ops.select_bwd(q, k, False, False).name == DEFAULT
        assert ops.select_bwd(q, k, False, False, _masks(window=(4, 0))).name == \
            DEFAULT + "-window=true"
        assert ops.select_bwd(q, k, True, False, _masks(True, softcap=3.0)).name == \
            DEFAULT + "-softcap=true"
        both = ops.select_bwd(q, k, True, False, _masks(True, (8, 0), 3.0))
        assert both.family == "hopper_bwd" and both.masks == ("window", "softcap")
        # deterministic: its dQ is atomic -- the generic bwd
        det = ops.select_bwd(q, k, False, True, _masks(window=(4, 0)))
        assert det.family == "bwd" and det.dq == "separate" and det.window
        # block masks: its block_sparse twin, tiles fitted (tests/test_hopper_bwd_block_sparse.py);
        # blocks below its 64 x 64 tiles: the generic bwd
        bm = BlockMask.from_dense(torch.ones(1, 1, dtype=torch.bool), (16, 16), block_size=128)
        sparse = ops.select_bwd(q, k, False, False, Masks(None, None, bm))
        assert sparse.name == DEFAULT + "-block_sparse=true"
        bm = BlockMask.from_dense(torch.ones(1, 1, dtype=torch.bool), (16, 16), block_size=16)
        sparse = ops.select_bwd(q, k, False, False, Masks(None, None, bm))
        assert sparse.family == "bwd" and sparse.block_sparse


def test_explain_of_a_forced_variant_on_a_masked_backward_names_the_twin():
    q, k, v = qkv(1, 2, 2, 64, 64, 64, torch.bfloat16, "cpu")
    with flashtune.force(DEFAULT):
        ex = flashtune.explain(q, k, v, causal=True, family="bwd", window=(16, 0), softcap=5.0)
    assert ex.level == "forced" and ex.variant.family == "hopper_bwd"
    assert ex.variant.masks == ("window", "softcap") and ex.problem.window and ex.problem.softcap
    assert any("with the call's masks rendered in" in n for n in ex.notes)
    from flashtune.block_mask import BlockMask
    # a dq="gluon" variant keeps its dQ kernel under a window; under a block mask its twin adds
    # dQ by atomics, and the note names the change
    g = "hopper_bwd-m64-n64-w4-s2-dq=gluon-mq64-nq64-wq4-sq2"
    with flashtune.force(g):
        ex = flashtune.explain(q, k, v, causal=True, family="bwd", window=(16, 0))
        assert any(f"runs {g}-window=true:" in n for n in ex.notes), ex.notes
        assert not any("dq='none'" in n for n in ex.notes), ex.notes
        bm = BlockMask.from_dense(torch.ones(1, 1, dtype=torch.bool), (64, 64), block_size=64)
        ex = flashtune.explain(q, k, v, causal=True, family="bwd", block_mask=bm)
    assert any("and dq='none'" in n and "block_m2=0" in n for n in ex.notes), ex.notes


def _masked_problem(family="bwd"):
    return Problem(family, "bfloat16", 128, True, 1, 1, 16, 4096, 4096, window=1024,
                   softcap=True)


def _ship(tables, gpu, *recs):
    from flashtune.tuned_db.io import table_path, write_table
    write_table(table_path(gpu, tables), gpu,
                [dataclasses.replace(r, gpu=table_path(gpu).stem) for r in recs])


def _records(problem, hopper_ms, bwd_ms, more=""):
    """Tuned records of both families for the masked problem's exact bucket (tests only)."""
    from test_db import make_record
    mine = make_record(variant="bwd-m64-n64-w4-s2-dq=atomic-window=true-softcap=true" + more,
                       ms=bwd_ms, family="bwd")
    hp = dataclasses.replace(problem, family="hopper_bwd")
    theirs = make_record(variant=DEFAULT + "-window=true-softcap=true" + more, ms=hopper_ms,
                         family="hopper_bwd")
    return (dataclasses.replace(mine, bucket=Bucket.of(problem)),
            dataclasses.replace(theirs, bucket=Bucket.of(hp)))


@pytest.mark.parametrize("faster", ["hopper_bwd", "bwd"])
def test_tuned_records_pick_the_masked_hopper_twin(faster, monkeypatch, tmp_path):
    """A masked backward whose bucket has tuned records of both families: the faster one runs,
    hopper_bwd as its masked twin (Family.serve_masks through dispatch._compete and
    mask_twin; no branch on family names), and explain() names it."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a GPU machine (no kernel runs here)
    p = _masked_problem()
    ms = (0.5, 1.0) if faster == "hopper_bwd" else (1.0, 0.5)
    _ship(tmp_path, "H100", *_records(p, *ms))
    dispatch.configure(gpu="H100", db=f"sqlite:///{tmp_path}/none.db", tables_dir=tmp_path)
    ex = flashtune.explain(p)
    assert ex.variant.family == faster and ex.variant.masks == ("window", "softcap"), str(ex)
    assert any("competed" in n and "tuned records" in n for n in ex.notes)
    # the same from tensors of that bucket, through the op's selection
    q = torch.empty(1, 16, 4096, 128, dtype=torch.bfloat16)
    k = torch.empty(1, 16, 4096, 128, dtype=torch.bfloat16)
    masks = _masks(True, (1023, 0), 50.0)
    assert Bucket.of(Problem.of_call("bwd", q, k, True, masks)) == Bucket.of(p)
    chosen = ops.select_bwd(q, k, True, False, masks)
    assert chosen.family == faster and chosen.masks == ("window", "softcap")
    ex = flashtune.explain(q, k, k, causal=True, family="bwd", window=(1023, 0), softcap=50.0)
    assert ex.variant == chosen


def test_untuned_masked_backward_stays_generic(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dispatch.configure(gpu="H100", db=f"sqlite:///{tmp_path}/none.db", tables_dir=tmp_path)
    ex = flashtune.explain(_masked_problem())
    assert ex.variant.family == "bwd" and ex.variant.masks == ("window", "softcap")


@pytest.mark.parametrize("faster", ["hopper_bwd", "bwd", None])
def test_block_masked_backward_competes_like_the_other_masks(faster, monkeypatch, tmp_path):
    """A block-masked backward: untuned, the generic bwd (hopper_bwd has no heuristic); with
    tuned records of both families for its bucket, the faster one's block_sparse twin."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = dataclasses.replace(_masked_problem(), block_density=0.1)
    if faster:
        ms = (0.5, 1.0) if faster == "hopper_bwd" else (1.0, 0.5)
        _ship(tmp_path, "H100", *_records(p, *ms, "-block_sparse=true"))
    dispatch.configure(gpu="H100", db=f"sqlite:///{tmp_path}/none.db", tables_dir=tmp_path)
    ex = flashtune.explain(p)
    assert ex.variant.family == (faster or "bwd"), str(ex)
    assert ex.variant.masks == ("window", "softcap", "block_sparse")
    assert not any("skipped" in n for n in ex.notes), ex.notes


def test_a_dense_gluon_record_does_not_compete_for_a_block_masked_backward(monkeypatch,
                                                                           tmp_path):
    """A block-masked call of a dq="gluon" record runs its atomic twin, which that record never
    timed: the record does not compete (dispatch._runs_as_timed), however fast it was, and the
    generic bwd serves. Under a window the same record runs as timed and competes."""
    from test_db import make_record
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dense = Problem("bwd", "bfloat16", 128, False, 1, 1, 16, 16384, 16384)
    gluon = "hopper_bwd-m64-n128-w8-s2-dq=gluon-mq64-nq64-wq4-sq2"
    recs = [dataclasses.replace(make_record(variant=name, ms=ms, family=name.split("-")[0]),
                                bucket=Bucket.of(dataclasses.replace(dense, family=fam)))
            for name, fam, ms in ((gluon, "hopper_bwd", 0.5),
                                  ("bwd-m64-n64-w4-s2-dq=atomic", "bwd", 1.0))]
    _ship(tmp_path, "H100", *recs)
    dispatch.configure(gpu="H100", db=f"sqlite:///{tmp_path}/none.db", tables_dir=tmp_path)
    assert flashtune.explain(dense).variant.name == gluon
    blocked = flashtune.explain(dataclasses.replace(dense, block_density=0.25))
    assert blocked.variant.family == "bwd", str(blocked)
    assert blocked.variant.masks == ("block_sparse",)
    windowed = flashtune.explain(dataclasses.replace(dense, window=256))
    assert windowed.variant.name == gluon + "-window=true", str(windowed)


def test_search_pins_the_masks_in_hopper_bwd_spaces():
    from flashtune.search_space import Space
    from flashtune.targets import get as get_target
    p = dataclasses.replace(_masked_problem(), family="hopper_bwd")
    space = Space.build("hopper_bwd", get_target("H100"), p)
    assert ("window", True) in space.pinned and ("softcap", True) in space.pinned
    assert space.feasible and all(v.masks == ("window", "softcap") for v in space.feasible)


def _ref_grads(q, k, v, do, kw):
    """(float64 reference, PyTorch's same-dtype math) gradients of q, k, v for upstream `do`."""
    from flashtune.reference import reference, same_dtype_math

    def grads(dtype, fn):
        xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*xs, **kw), xs, do.to(dtype))
    return grads(torch.float64, reference), grads(q.dtype, same_dtype_math)


def _assert_grads(got, q, k, v, do, kw):
    from flashtune.accuracy import compare
    ref, base = _ref_grads(q, k, v, do, kw)
    for gname, g, x, r, b in zip(("dq", "dk", "dv"), got, (q, k, v), ref, base):
        assert g.dtype == x.dtype and g.shape == x.shape and torch.isfinite(g).all(), gname
        if not r.any():
            # exactly zero (window (0, 0): one key per row, P = 1, dS = dP - Delta = 0), which
            # PyTorch's same-dtype math also hits exactly, so compare's tolerance is 1e-12; the
            # kernel's dP (wgmma) and Delta (rowsum dO * O) are two float32 sums of D products
            # in different orders: allow their rounding, carried through K and the scale
            d = q.shape[-1]
            noise = (16 * 2.0 ** -24 * d * do.abs().max() * v.abs().max() * k.abs().max()
                     * kw.get("scale", d ** -0.5)).item()
            assert g.abs().max().item() <= noise, f"{gname}: {g.abs().max().item():.3e} > {noise:.3e}"
            continue
        rep = compare(g, r, b)
        assert rep.ok, f"{gname}: {rep}"


def no_generic(monkeypatch) -> None:
    """A backward plan of the generic bwd family fails the test (a call the Gluon kernel was to
    run fell back); plans kept from earlier calls are dropped first, so each call builds its own."""
    real = ops._bwd_plan

    def plan(q, k, v, causal, scale, variant, masks):
        if variant.family == "bwd":
            pytest.fail(f"generic fallback: {variant.name}")
        return real(q, k, v, causal, scale, variant, masks)
    monkeypatch.setattr(ops, "_bwd_plan", plan)
    ops._bwd_plans.clear()


def backward_alone(name, q, k, v, masks: Masks, kw: dict, monkeypatch, as_given=False) -> tuple:
    """The backward alone (ops.run_backward, as autograd calls it) with `name` forced, on the
    float64 reference's O and LSE (kw: the reference's masks): no forward kernel compiles, the
    Gluon kernel must run (no generic fallback), and its gradients match the reference.
    as_given: `name` with the call's masks rendered in runs as it is (ops.run_backward's
    variant), where the dispatcher would pick a twin. Returns (the variant run, dq, dk, dv)."""
    from flashtune.reference import reference
    causal = kw.get("causal", False)
    do = torch.randn_like(q)
    ref_o, ref_lse = reference(q, k, v, return_lse=True, **kw)
    o, lse = ref_o.to(q.dtype), ref_lse.float()
    no_generic(monkeypatch)
    if as_given:
        chosen = dataclasses.replace(Variant.parse(name), window="window" in kw,
                                     softcap="softcap" in kw)
        grads = ops.run_backward(do, q, k, v, o, lse, causal, None, variant=chosen, masks=masks)
    else:
        with flashtune.force(name):
            chosen = ops.select_bwd(q, k, causal, False, masks)
            grads = ops.run_backward(do, q, k, v, o, lse, causal, None, masks=masks)
    _assert_grads(grads, q, k, v, do, kw)
    return (chosen, *grads)


def _autograd_check(q, k, v, variant, **kw):
    """flashtune.attention with gradients, `variant` forced around the forward (a bwd-only
    family does not serve it: the forward is dispatched) and so carried to the backward. A
    block_mask reaches the reference as its dense mask."""
    from flashtune.accuracy import compare
    from flashtune.reference import reference, same_dtype_math
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with flashtune.force(variant):
        out = flashtune.attention(*xs, **kw)
    bm = kw.pop("block_mask", None)
    if bm is not None:
        kw["mask"] = bm.to_dense_mask()
    rep = compare(out, reference(q, k, v, **kw), same_dtype_math(q, k, v, **kw))
    assert rep.ok, f"out: {rep}"
    do = torch.randn_like(out)
    _assert_grads(torch.autograd.grad(out, xs, do), q, k, v, do, kw)


def test_forced_off_hopper_runs_the_generic_kernel_with_the_masks(device):
    """On a device that cannot run the Gluon kernel (the CPU here) the forced hopper_bwd
    variant's plan falls back to the generic default, masks included."""
    if ON_H100:
        pytest.skip("the H100 runs the Gluon kernel itself")
    q, k, v = qkv(1, 4, 2, 37, 53, 32, torch.float16, device)
    _autograd_check(q, k, v, DEFAULT, causal=True, window=(9, 0), softcap=4.0)


# -- the sm_90 compile of the masked defaults, with this Triton (3.9 in CI), no GPU ---------------

@pytest.mark.slow
def test_masked_defaults_compile_for_sm90():
    """The masked renders of each D's default fit; D=64 spills nothing. D=128 sits at the
    255-register cap and spills (the template header quotes how much): reported, not failed."""
    import json

    from test_compile_sm90 import kernels_check
    names = sorted({dataclasses.replace(FAM.default(d, "bfloat16"), **m).name
                    for d in (64, 128) for m in MASKS})
    r = kernels_check("--gpu", "H100", "--dtype", "bf16,fp16", "--head-dim", "64,128",
                      "--format", "json", *names)
    rows = json.loads(r.stdout) if r.stdout.startswith("[") else []
    assert rows, r.stdout[-2000:] + r.stderr[-2000:]
    for d in (64, 128):
        for m in MASKS:
            want = dataclasses.replace(FAM.default(d, "bfloat16"), **m).name
            for x in (x for x in rows if x["head_dim"] == d and x["variant"] == want):
                assert x["smem"] <= 232448 and x["regs"] <= 255, x
                if d == 64:
                    assert x["fits"] and not x["why"] and not x["spill_bytes"], x


# -- GPU: dQ, dK, dV against the float64 reference, the family forced -----------------------------

CASES = {
    "window": dict(window=(50, 20)),
    "window_left": dict(window=(100, -1)),
    "window_right": dict(window=(-1, 30)),
    "window_zero": dict(window=(0, 0)),
    "window_causal": dict(window=(64, 0), causal=True),
    "softcap": dict(softcap=5.0),
    "softcap_causal": dict(softcap=3.0, causal=True),
    "softcap_window": dict(softcap=4.0, window=(130, 10)),
    "softcap_window_causal": dict(softcap=10.0, window=(200, 0), causal=True),
}
SHAPES = [  # (B, H, Hk, Nq, Nk): odd lengths, GQA 2 and 4, Nq > Nk (rows that see no key),
    # Nq < Nk (keys no row sees: whole key blocks with no step)
    (2, 3, 3, 37, 37), (1, 4, 2, 113, 203), (2, 2, 2, 300, 100), (1, 8, 2, 515, 2051),
    (1, 4, 1, 1000, 1000)]
# each case at D=64 and D=128 on the default, shapes and dtypes rotating, plus the one-warpgroup
# variant on four cases and D=256 on four: 26 kernels (tests/ counts them below)
GPU_GRID = ([(DEFAULT, d, c, SHAPES[(i + j) % len(SHAPES)],
              (torch.bfloat16, torch.float16)[(i + j // 2) % 2])
             for j, d in enumerate((64, 128)) for i, c in enumerate(CASES)]
            + [(SMALL, 128, c, SHAPES[i], torch.bfloat16)
               for i, c in enumerate(("window_causal", "softcap", "softcap_window", "window"))]
            # D=256: the two-warpgroup split of D (its one tile)
            + [("hopper_bwd-m64-n64-w8-s2", 256, c, SHAPES[i + 1], (torch.bfloat16,
                                                                   torch.float16)[i % 2])
               for i, c in enumerate(("window", "softcap_causal", "softcap_window_causal",
                                      "window_right"))])


# dq="gluon" with its dQ kernel's window / softcap render (session 23; passed on the H100 in
# session 24): the shipped dense records' tiles with the masks, which the dispatcher runs for a
# windowed / soft-capped call of a dq="gluon" record (a block mask: its atomic twin)
GLUON_GRID = ([("hopper_bwd-m64-n64-w4-s1-dq=gluon", 64, c, SHAPES[i % len(SHAPES)],
                (torch.bfloat16, torch.float16)[i % 2]) for i, c in enumerate(CASES)]
              + [("hopper_bwd-m64-n64-w4-s2-dq=gluon-mq64-nq64-wq4-sq2", 128, c, SHAPES[i + 1],
                  torch.bfloat16)
                 for i, c in enumerate(("window", "window_causal", "softcap_window",
                                        "window_zero"))]
              + [("hopper_bwd-m64-n64-w8-s2-dq=gluon-mq64-nq64-wq4-sq2", 256, c, SHAPES[i],
                  torch.float16)
                 for i, c in enumerate(("window_left", "softcap_causal", "window_right"))])


def _compile_key(name, d, case, shape, dtype):
    kw = CASES[case]
    v = dataclasses.replace(Variant.parse(name), window="window" in kw, softcap="softcap" in kw)
    return (v.block_m, v.block_n, v.num_warps, v.num_stages, v.masks, d, dtype,
            shape[1] // shape[2], kw.get("causal", False))


def test_gpu_grid_compiles_few_kernels():
    """Every (tiles, masks, D, dtype, GROUP, IS_CAUSAL) is its own compile: keep the GPU run
    of this file near two minutes."""
    assert len({_compile_key(*g) for g in GPU_GRID}) <= 30
    assert {c for _, _, c, _, _ in GPU_GRID} == set(CASES)
    assert {sh for _, _, _, sh, _ in GPU_GRID} == set(SHAPES)


def _grid_ids(grid) -> list:
    return [f"{n[11:]}-d{d}-{c}-{sh[3]}x{sh[4]}g{sh[1] // sh[2]}-{str(dt)[6:]}"
            for n, d, c, sh, dt in grid]


# GPU_GRID: the dispatcher's masked twin of each variant (the dK/dV kernel's atomic dQ);
# GLUON_GRID: dq="gluon" run as given (dQ from the Gluon dQ kernel's window / softcap code)
@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("name,d,case,shape,dtype,as_given",
                         [g + (False,) for g in GPU_GRID] + [g + (True,) for g in GLUON_GRID],
                         ids=_grid_ids(GPU_GRID) + [f"gluon_dq_kernel-{i}"
                                                    for i in _grid_ids(GLUON_GRID)])
def test_grads_match_reference(name, d, case, shape, dtype, as_given, monkeypatch):
    """The backward alone (ops.run_backward, as autograd calls it) on the float64 reference's O
    and LSE: no forward kernel compiles, and the Gluon kernel must run (no generic fallback)."""
    b, h, hk, nq, nk = shape
    kw = CASES[case]
    causal = kw.get("causal", False)
    q, k, v = qkv(b, h, hk, nq, nk, d, dtype, "cuda")
    masks = _masks(causal, kw.get("window"), kw.get("softcap"))
    chosen, dq, dk, dv = backward_alone(name, q, k, v, masks, kw, monkeypatch, as_given)
    assert chosen.masks == tuple(m for m in ("window", "softcap") if m in kw)
    seen = dense_mask(nq, nk, causal, kw.get("window"), device="cuda")
    assert torch.all(dq[:, :, ~seen.any(1)] == 0)  # rows that see no key: nothing, no NaN
    assert torch.all(dk[:, :, ~seen.any(0)] == 0) and torch.all(dv[:, :, ~seen.any(0)] == 0)


@pytest.mark.gpu
@hopper_gpu
def test_autograd_through_attention_runs_the_hopper_twin(monkeypatch):
    """flashtune.attention(..., window, softcap) with gradients, hopper_bwd forced: the masked
    twin runs the backward (no generic fallback) and matches the reference."""
    forced_autograd(monkeypatch, (2, 4, 2, 333, 517), causal=True, window=(96, 0), softcap=30.0)


def forced_autograd(monkeypatch, shape, **kw) -> None:
    """_autograd_check of the default at D=128, bf16, `shape` (B, H, Hk, Nq, Nk) on the GPU, the
    Gluon backward required (no generic fallback)."""
    no_generic(monkeypatch)
    q, k, v = qkv(*shape, 128, torch.bfloat16, "cuda")
    _autograd_check(q, k, v, DEFAULT, **kw)
