"""Sliding-window and softcap masks in the Gluon Hopper forward (hopper_fwd, issue 11).

CPU: what a variant renders (no mask code without masks, the dense kernels' hashes unchanged;
the window's arithmetic the same as the generic template's; every schedule's calls match their
signatures), the block schedule the template encodes (a Python model over masks.window_range),
the launch plan's argument errors, the dispatcher's masked twin and explain(), and a forced
hopper variant's fallback carrying the masks. GPU (sm_90, the family forced): window, window +
causal, softcap, softcap + window against the float64 reference over every schedule the template
has, both dtypes, D=64/128/256, GQA, odd lengths and Nq != Nk (rows that see no key)."""
import ast
import dataclasses
import re

import pytest
import torch

import flashtune
from flashtune import dispatch
from flashtune.codegen import Variant, kernel_hash, render
from flashtune.codegen.render import template_text
from flashtune.families import get
from flashtune.launch import mask_args
from flashtune.masks import Masks, dense_mask, window_range
from flashtune.problem import Problem

from _check import ON_H100, code_lines, hopper_gpu, qkv

FAM = get("hopper_fwd")

# one variant per schedule: ping-pong + loader (D=64 default), ping-pong + loader + persistent
# (D=128 default), one 8-warp consumer + loader, ping-pong without a loader, one consumer without
# a loader, and D=256's default
SCHEDULES = {
    "pingpong": "hopper_fwd-m64-n64-w4-s4-pingpong=true-lr24",
    "persistent": "hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24",
    "one_consumer": "hopper_fwd-m128-n64-w8-s3-lr24",
    "noloader_pingpong": "hopper_fwd-m64-n128-w4-s3-pingpong=true",
    "noloader_one": "hopper_fwd-m128-n128-w8-s2",
    "d256": "hopper_fwd-m128-n64-w8-s2-lr24-early_k_release=true",
}
# their kernel hashes: the masks' code leaves the dense and causal renders as they were (the tuned
# records stay fresh). Changed on purpose once since (issue 10: P converted to the PV operand
# right after the softmax in every render, and causal_split's two key loops; no hopper_fwd
# records were shipped then) and once more (Q_BUFS: the tile's Q buffer indexed by t % Q_BUFS --
# with Q_BUFS 1 the sm_90 PTX of 54 renders, D=64/128/256, causal or not, window / block_sparse,
# three schedules, was byte-identical, so the shipped records were re-stamped)
DENSE_HASHES = {
    "hopper_fwd-m64-n64-w4-s4-pingpong=true-lr24": "7108a953b2ebab97",
    "hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24": "7108a953b2ebab97",
    "hopper_fwd-m128-n64-w8-s3-lr24": "f2df0dd425b25331",
    "hopper_fwd-m64-n128-w4-s3-pingpong=true": "95ee7243c9489b56",
    "hopper_fwd-m128-n128-w8-s2": "acaa3de85f804db6",
}
MASK_WORDS = ("win_left", "win_right", "cap_in", "_tanh", "_window_blocks", "_edge(", "softcap")
MASKS = ({"window": True}, {"softcap": True}, {"window": True, "softcap": True})


pytestmark = pytest.mark.usefixtures("reset_dispatch")


# -- CPU: rendering --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(set(SCHEDULES.values())))
def test_variant_without_masks_renders_no_mask_code(name):
    src = code_lines(render(Variant.parse(name)))
    assert not any(w in src for w in MASK_WORDS), name


@pytest.mark.parametrize("name", sorted(DENSE_HASHES))
def test_dense_kernel_hashes_unchanged(name):
    assert kernel_hash(Variant.parse(name)) == DENSE_HASHES[name]


@pytest.mark.parametrize("name", sorted(set(SCHEDULES.values())))
@pytest.mark.parametrize("masks", MASKS, ids=lambda m: "+".join(m))
def test_masked_render_carries_its_mask_code(name, masks):
    v = dataclasses.replace(Variant.parse(name), **masks)
    src = code_lines(render(v))
    # every masked render takes the window's bounds and loops; only softcap renders the tanh
    for w in ("win_left", "win_right", "cap_in", "_window_blocks(", "_edge("):
        assert w in src, (v.name, w)
    assert ("_tanh(" in src) == masks.get("softcap", False)
    assert ("softcap" in src.split("def attn_fwd_hopper")[1].split(")")[0]) == \
        masks.get("softcap", False)  # the kernel's own argument
    assert kernel_hash(v) != kernel_hash(Variant.parse(name))
    # line numbers still match the template (tracebacks point into it)
    assert len(render(v).splitlines()) == len(render(Variant.parse(name)).splitlines())


@pytest.mark.parametrize("name", sorted(set(SCHEDULES.values())))
@pytest.mark.parametrize("masks", ({},) + MASKS, ids=lambda m: "+".join(m) or "dense")
def test_every_call_matches_its_signature(name, masks):
    """Gluon does not run here: check that each render parses and that every call of a helper
    (direct, or a warp_specialize partition's argument tuple) passes as many arguments as the
    helper takes -- the masked renders add arguments in several places."""
    tree = ast.parse(render(dataclasses.replace(Variant.parse(name), **masks)))
    defs = {f.name: len(f.args.args) for f in tree.body if isinstance(f, ast.FunctionDef)}
    seen = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in defs:
            fn, n = node.func.id, len(node.args) + len(node.keywords)
        elif (isinstance(node, ast.Tuple) and len(node.elts) == 2
              and isinstance(node.elts[0], ast.Name) and node.elts[0].id in defs
              and isinstance(node.elts[1], ast.Tuple)):
            fn, n = node.elts[0].id, len(node.elts[1].elts)
        else:
            continue
        assert n == defs[fn], f"{fn}: called with {n} arguments, takes {defs[fn]}"
        seen.add(fn)
    assert "_consumer" in seen and "_softmax" in seen
    if masks:
        assert "_window_blocks" in seen


def test_window_arithmetic_is_the_generic_templates():
    """hopper's _window_blocks computes the generic template's _window_range (which tests hold
    equal to flashtune/masks.py:window_range) with its own names."""
    def body(text, fn):
        lines = text.split(f"def {fn}(")[1].split("    return ")[0].splitlines()
        return [s.strip() for s in lines if re.match(r"\s+(lo|hi|full_lo|full_hi) = ", s)]
    generic = body(template_text("fwd"), "_window_range")
    names = [("tl", "gl"), ("BLOCK_O", "BN"), ("BLOCK", "ROWS"), ("BN", "BLOCK_N"),
             ("before", "win_left"), ("after", "win_right"),
             ("n_even_o", "(Nk // BLOCK_N) * BLOCK_N"), ("n_o", "Nk")]
    for old, new in names:
        generic = [re.sub(rf"\b{old}\b", new, s) for s in generic]
    assert len(generic) == 6 and generic == body(template_text("hopper_fwd"), "_window_blocks")


# -- CPU: the block schedule the template encodes, modelled in Python -----------------------------

def _blocks(start, rows, bn, diag, left, right, nk):
    """The template's _window_blocks (the same arithmetic as masks.window_range)."""
    lo, full_lo, full_hi, hi = window_range(start, rows, bn, diag, left, right, nk,
                                            nk // bn * bn)
    first = lo // bn
    return first, max(-(-hi // bn), first), full_lo, full_hi


@pytest.mark.parametrize("bm,bn,consumers", [(64, 64, 2), (64, 128, 2), (128, 64, 1),
                                             (64, 32, 2)])
@pytest.mark.parametrize("nq,nk", [(300, 100), (113, 203), (515, 2051), (1000, 1000)])
@pytest.mark.parametrize("window,causal", [((8, 5), False), ((100, -1), False),
                                           ((-1, 30), False), ((64, 0), True), ((0, 0), False),
                                           (None, True), (None, False), ((3, 0), True)])
def test_block_schedule_covers_each_row_exactly(bm, bn, consumers, nq, nk, window, causal):
    """Per tile and consumer: the loader's blocks [kb0, n_load) cover the consumer's
    [first, n_mine); the second ping-pong consumer never has trailing blocks (no-loader
    schedules refill after its turn only in the leading ones); every key a row sees is in its
    consumer's blocks, and a block run without a mask is seen in full by every row."""
    left, right = mask_args(Masks(window, 1.0 if window is None else None), causal, "q", 1, 1)[:2]
    seen = dense_mask(nq, nk, causal, window)
    diag = nk - nq
    tile = bm * consumers
    for t0 in range(0, nq, tile):
        kb0, n_load, _, _ = _blocks(t0, tile, bn, diag, left, right, nk)
        for c in range(consumers):
            start = t0 + c * bm
            first, n_mine, full_lo, full_hi = _blocks(start, bm, bn, diag, left, right, nk)
            if n_mine == first:
                first = n_mine = n_load
            assert kb0 <= first <= n_mine <= n_load
            if c == consumers - 1:
                assert n_mine == n_load
            rows = seen[start:min(start + bm, nq)]
            if not len(rows):
                continue
            keys = rows.any(0).nonzero().flatten()
            if len(keys):
                assert first * bn <= keys.min() and keys.max() < n_mine * bn
            for j in range(first, n_mine):
                s = j * bn
                if not (s < full_lo or s + bn > full_hi):  # run unmasked
                    assert s + bn <= nk and rows[:, s:s + bn].all(), (t0, c, j)


# -- CPU: variants, plans, dispatch ---------------------------------------------------------------

def test_window_and_softcap_are_fields():
    # (block_sparse too: tests/test_hopper_block_sparse.py)
    assert {"window", "softcap"} <= set(FAM.fields)
    v = Variant.parse("hopper_fwd-m64-n64-w4-s3-pingpong=true-lr24-window=true-softcap=true")
    assert v.masks == ("window", "softcap") and Variant.parse(v.name) == v
    with pytest.raises(ValueError, match="varlen"):
        Variant.parse("hopper_fwd-m64-n64-w4-s3-pingpong=true-lr24-varlen=true")


def test_plan_refuses_a_variant_that_does_not_render_the_calls_masks():
    from flashtune.block_mask import BlockMask
    from flashtune.launch_hopper import HopperFwdPlan
    q, k, v = qkv(1, 2, 2, 64, 64, 64, torch.bfloat16, "cpu")
    dense = Variant.parse(SCHEDULES["pingpong"])
    win = dataclasses.replace(dense, window=True)
    with pytest.raises(ValueError, match="carries masks"):
        HopperFwdPlan(q, k, v, False, None, dense, Masks((4, 4)))
    with pytest.raises(ValueError, match="carries masks"):
        HopperFwdPlan(q, k, v, False, None, win)
    with pytest.raises(ValueError, match="carries masks"):
        HopperFwdPlan(q, k, v, False, None, win, Masks((4, 4), 30.0))
    bm = BlockMask.from_dense(torch.ones(1, 1, dtype=torch.bool), (64, 64), block_size=64)
    with pytest.raises(ValueError, match="carries masks"):  # a block mask needs block_sparse
        HopperFwdPlan(q, k, v, False, None, win, Masks((4, 4), None, bm))
    with pytest.raises(ValueError, match="num_stages=1 does not fit"):
        Variant.parse("hopper_fwd-m64-n64-w4-s1-window=true")


def test_mask_twin_follows_the_family_registry():
    from flashtune.block_mask import BlockMask
    hv = Variant.parse(SCHEDULES["persistent"])
    twin = dispatch.mask_twin(hv, Masks((100, 0), 20.0), 128, torch.bfloat16, "fwd")
    assert twin == dataclasses.replace(hv, window=True, softcap=True)
    bm = BlockMask.from_dense(torch.ones(1, 1, dtype=torch.bool), (128, 128), block_size=128)
    sparse = dispatch.mask_twin(hv, Masks(None, None, bm), 128, torch.bfloat16, "fwd")
    assert sparse == dataclasses.replace(hv, block_sparse=True)  # its tiles fit 128-blocks
    sk = Variant.parse("splitkv-m64-n64-w4-s3")  # serving a dense forward: its serve_masks
    assert dispatch.mask_twin(sk, Masks((8, 8)), 128, torch.bfloat16, "fwd") == \
        dataclasses.replace(sk, window=True)
    # a family whose served calls take no such mask gives way to the call family's default
    from flashtune import families
    reg = families._registry()
    real = reg["splitkv"]
    reg["splitkv"] = dataclasses.replace(real, serve_masks=())
    try:
        assert dispatch.mask_twin(sk, Masks((8, 8)), 128, torch.bfloat16, "fwd").family == "fwd"
    finally:
        reg["splitkv"] = real


def _masked(d=128, causal=True, **kw):
    return Problem("fwd", "bfloat16", d, causal, 1, 1, 16, 4096, 4096, **kw)


def test_heuristic_leaves_masked_calls_to_tuned_records():
    assert FAM.prefers(_masked(causal=False, softcap=True)) is False
    assert FAM.prefers(dataclasses.replace(_masked(causal=False), family="fwd")) is True


def test_dispatcher_serves_a_masked_call_with_the_hopper_twin(monkeypatch, tmp_path):
    from flashtune.families import hopper_fwd
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a GPU machine (no kernel runs here)
    monkeypatch.setattr(hopper_fwd, "prefer_for_dense", lambda p: True)
    # Gluon does not import where Triton's interpreter was on at import (a CPU test run)
    monkeypatch.setattr(hopper_fwd, "cannot_serve", lambda p: "")
    dispatch.configure(gpu="H100", db=f"sqlite:///{tmp_path}/none.db", tables_dir=tmp_path)
    ex = flashtune.explain(_masked(window=1024, softcap=True))
    assert ex.variant.family == "hopper_fwd" and ex.variant.masks == ("window", "softcap")
    assert any("with the call's masks rendered in" in n for n in ex.notes)
    # a block mask: hopper_fwd renders it too (tests/test_hopper_block_sparse.py); splitkv not
    ex = flashtune.explain(_masked(window=1024, block_density=0.1))
    assert ex.variant.family == "hopper_fwd" and ex.variant.masks == ("window", "block_sparse")


def test_explain_of_a_forced_variant_on_a_masked_call_names_the_twin():
    q, k, v = qkv(1, 2, 2, 64, 64, 64, torch.bfloat16, "cpu")
    with flashtune.force(SCHEDULES["pingpong"]):
        ex = flashtune.explain(q, k, v, causal=True, window=(16, 0), softcap=5.0)
    assert ex.level == "forced" and ex.variant.masks == ("window", "softcap")
    assert ex.problem.window and ex.problem.softcap


def test_search_pins_the_masks_in_hopper_spaces():
    from flashtune.search_space import Space
    from flashtune.targets import get as get_target
    p = dataclasses.replace(_masked(window=1024, softcap=True), family="hopper_fwd")
    space = Space.build("hopper_fwd", get_target("H100"), p)
    assert ("window", True) in space.pinned and ("softcap", True) in space.pinned


def test_forced_off_hopper_runs_the_generic_kernel_with_the_masks(device):
    """On a device that cannot run the Gluon kernel (the CPU here) the forced hopper variant's
    plan falls back to the generic default, masks included."""
    from flashtune.accuracy import compare
    from flashtune.reference import reference, same_dtype_math
    if ON_H100:
        pytest.skip("the H100 runs the Gluon kernel itself")
    q, k, v = qkv(1, 4, 2, 37, 53, 64, torch.float16, device)
    kw = dict(causal=True, window=(9, 0), softcap=4.0)
    with flashtune.force(SCHEDULES["pingpong"]):
        out = flashtune.attention(q, k, v, **kw)
    rep = compare(out, reference(q, k, v, **kw), same_dtype_math(q, k, v, **kw))
    assert rep.ok, str(rep)


@pytest.mark.slow
def test_masked_defaults_compile_for_sm90_without_spills():
    import json

    from test_compile_sm90 import kernels_check
    names = sorted({dataclasses.replace(FAM.default(d, "bfloat16"), window=True,
                                        softcap=True).name for d in (64, 128, 256)})
    r = kernels_check("--gpu", "H100", "--dtype", "bf16", "--head-dim", "64,128,256",
                      "--format", "json", *names)
    rows = json.loads(r.stdout) if r.stdout.startswith("[") else []
    assert rows, r.stdout[-2000:] + r.stderr[-2000:]
    for d in (64, 128, 256):
        want = dataclasses.replace(FAM.default(d, "bfloat16"), window=True, softcap=True).name
        x = next(x for x in rows if x["head_dim"] == d and x["variant"] == want)
        assert x["fits"] and not x["why"], x


# -- GPU: the kernels against the float64 reference, the family forced ----------------------------

SHAPES = [  # (B, H, Hk, Nq, Nk): odd lengths, GQA, Nq > Nk (rows that see no key), Nq < Nk
    (2, 3, 3, 37, 37), (1, 4, 2, 113, 203), (2, 2, 2, 300, 100), (1, 8, 2, 515, 2051),
    (1, 2, 2, 1000, 1000)]
CASES = {  # window alone (both sides, one side unbounded, 0), + causal, softcap, softcap + window
    "window": dict(window=(70, 20)),
    "window_left": dict(window=(100, -1)),
    "window_right": dict(window=(-1, 30)),
    "window_zero": dict(window=(0, 0)),
    "window_causal": dict(window=(64, 0), causal=True),
    "window_causal_narrow": dict(window=(3, 0), causal=True),
    "softcap": dict(softcap=5.0),
    "softcap_causal": dict(softcap=3.0, causal=True),
    "softcap_window": dict(softcap=4.0, window=(130, 10)),
    "softcap_window_causal": dict(softcap=10.0, window=(200, 0), causal=True),
}
_D = {"pingpong": 64, "persistent": 128, "one_consumer": 128, "noloader_pingpong": 64,
      "noloader_one": 128, "d256": 256}
# every other case per schedule (each case on two schedules or more, the lead-skipping windows on
# loader and no-loader ping-pong), shapes and dtypes rotating so each schedule meets every shape
# and both dtypes: 27 compiles, which fit one device call beside the timing
GPU_GRID = [(s, c, SHAPES[(i + j) % len(SHAPES)],
             (torch.bfloat16, torch.float16)[(i + j // 2) % 2])
            for i, s in enumerate(SCHEDULES) for j, c in enumerate(CASES)
            if (s != "d256" and (i + j) % 2 == 0)
            or (s == "d256" and c in ("window_causal", "softcap_window", "window_left",
                                      "softcap_causal"))]


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("schedule,case,shape,dtype", GPU_GRID,
                         ids=[f"{s}-{c}-{sh[3]}x{sh[4]}-{str(dt)[6:]}"
                              for s, c, sh, dt in GPU_GRID])
def test_matches_reference(schedule, case, shape, dtype):
    from flashtune.accuracy import compare
    from flashtune.reference import reference, same_dtype_math
    b, h, hk, nq, nk = shape
    d = _D[schedule]
    kw = CASES[case]
    q, k, v = qkv(b, h, hk, nq, nk, d, dtype, "cuda")
    with flashtune.force(SCHEDULES[schedule]):
        ex = flashtune.explain(q, k, v, **kw)
        o, lse = flashtune.attention(q, k, v, return_lse=True, **kw)
    assert ex.variant.family == "hopper_fwd" and ex.variant.masks
    ref_o, ref_lse = reference(q, k, v, return_lse=True, **kw)
    rep = compare(o, ref_o, same_dtype_math(q, k, v, **kw))
    assert rep.ok, str(rep)
    ref_lse, lse = ref_lse.cpu(), lse.double().cpu()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))  # -inf: rows that see no key
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max() < 1e-3
    seen = dense_mask(nq, nk, kw.get("causal", False), kw.get("window"), device="cuda")
    assert torch.all(o[:, :, ~seen.any(1)] == 0)  # O = 0 where a row sees nothing, no NaN


@pytest.mark.gpu
@hopper_gpu
def test_dispatched_masked_call_runs_the_hopper_twin(monkeypatch):
    """Without force: where the bucket's choice is hopper_fwd (the heuristic patched to say so,
    as a tuned record would), a windowed call runs its masked twin on the GPU."""
    from flashtune.accuracy import compare
    from flashtune.families import hopper_fwd
    from flashtune.reference import reference, same_dtype_math
    monkeypatch.setattr(hopper_fwd, "prefer_for_dense", lambda p: True)
    dispatch.configure(tuned=False)
    q, k, v = qkv(1, 4, 4, 1024, 1024, 128, torch.bfloat16, "cuda")
    ex = flashtune.explain(q, k, v, causal=True, window=(256, 0))
    assert ex.variant.family == "hopper_fwd" and ex.variant.window
    kw = dict(causal=True, window=(256, 0))
    o = flashtune.attention(q, k, v, **kw)
    rep = compare(o, reference(q, k, v, **kw), same_dtype_math(q, k, v, **kw))
    assert rep.ok, str(rep)


def test_cli_explain_takes_a_mask_spec(tmp_path):
    from click.testing import CliRunner

    from flashtune.cli import main
    args = ["dispatch", "explain", "--dtype", "bf16", "--causal", "--seqlen-q", "4096",
            "--gpu", "A100", "--tables", str(tmp_path), "--db", f"sqlite:///{tmp_path}/x.db"]
    res = CliRunner().invoke(main, args + ["--mask", "window=1024+softcap"])
    assert res.exit_code == 0, res.output
    assert "window=true-softcap=true" in res.output and "mask=window1024+softcap" in res.output
    bad = CliRunner().invoke(main, args + ["--mask", "window=-3"])
    assert bad.exit_code != 0 and "--mask" in bad.output
