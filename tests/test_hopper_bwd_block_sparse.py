"""Block-sparse attention (flashtune.BlockMask) in the Gluon Hopper backward (hopper_bwd, issue 11).

CPU: what a variant renders (no block-sparse code without the field, the other renders' kernel
hashes unchanged, every helper call matching its signature, the kernel's arguments in
launch.mask_args' order), the walk the template encodes (a Python model over the transposed
lists: each key block's steps for every q head of its group, which run unmasked), the tile
fitting (fit_block_mask through dispatch.mask_twin), the plan's errors. GPU (sm_90, the family
forced): dQ, dK, dV against the float64 reference for random block patterns at ~10% and ~60%
density, every block, a row of empty blocks, with and without an element mask, the mask shared
across heads or batches, causal or not, with a window and softcap, GQA, odd lengths, Nq != Nk,
bf16 and fp16, D=64, 128 and 256, block sizes from 64 to 256."""
import ast
import dataclasses
import json

import pytest
import torch

import flashtune
from flashtune import BlockMask, dispatch, gluon_compat, ops
from flashtune.codegen import Variant, kernel_hash, render
from flashtune.families import get
from flashtune.launch import mask_args
from flashtune.masks import Masks, check_softcap, check_window, dense_mask, window_range

from _check import code_lines, hopper_gpu, qkv
from test_hopper_bwd_masks import (DEFAULT, DENSE_HASH, SMALL, backward_alone, forced_autograd,
                                   helper_calls)

FAM = get("hopper_bwd")
gluon_compat.missing()  # Gluon imported under the session's interpreter setting (as its siblings)
D256 = "hopper_bwd-m64-n64-w8-s2"  # the D=256 default: two warpgroups split D
BIG = "hopper_bwd-m128-n128-w8-s1"
SPARSE_WORDS = ("_sparse_step", "_sparse_count", "BM_NUM", "BM_FULL_IDX", "ELEM", "stride_em",
                "BS_KV", "BS_Q")
# the window/softcap renders' kernel hashes (the dense one is test_hopper_bwd_masks.DENSE_HASH):
# block_sparse's code leaves them as they were, so the shipped masked records stay fresh
MASKED_HASHES = {"window": "3465c4eb645ede13", "softcap": "9a958dffecfb91ed"}

pytestmark = pytest.mark.usefixtures("reset_dispatch")


def _v(name=DEFAULT, **masks) -> Variant:
    return dataclasses.replace(Variant.parse(name), **masks)


# -- CPU: rendering --------------------------------------------------------------------------------

@pytest.mark.parametrize("masks", ({}, {"window": True}, {"softcap": True},
                                   {"window": True, "softcap": True}),
                         ids=lambda m: "+".join(m) or "dense")
def test_no_block_sparse_code_without_the_field(masks):
    src = code_lines(render(_v(**masks)))
    assert not any(w in src for w in SPARSE_WORDS), masks
    if not masks:
        assert kernel_hash(_v()) == DENSE_HASH


@pytest.mark.parametrize("mask", sorted(MASKED_HASHES))
def test_masked_kernel_hashes_unchanged(mask):
    assert kernel_hash(_v(**{mask: True})) == MASKED_HASHES[mask]


@pytest.mark.parametrize("masks", ({"block_sparse": True},
                                   {"block_sparse": True, "window": True, "softcap": True}),
                         ids=lambda m: "+".join(m))
def test_block_sparse_renders_match_their_signatures(masks):
    """Gluon does not run here: each render parses, every helper call passes as many arguments
    as the helper takes, and the steps come from the lists (never the window's block range)."""
    v = _v(**masks)
    text = render(v)
    seen = helper_calls(text)
    assert {"_load_step", "_sparse_step", "_sparse_count", "_window_range"} <= seen
    assert "_step_coords" not in seen and ("_tanh" in seen) == masks.get("softcap", False)
    src = code_lines(text)
    for w in SPARSE_WORDS:
        assert w in src, (v.name, w)
    assert "per_head" not in src.split("def attn_bwd_hopper(")[1]
    # line numbers still match the template (tracebacks point into it)
    assert len(text.splitlines()) == len(render(_v()).splitlines())


def test_block_sparse_arguments_follow_mask_args():
    """The kernel takes launch.mask_args(..., "kv") in their order after sm_scale: the
    transposed lists (rows are key blocks), n_kb rows per head, n_qb entries per row."""
    fn = next(f for f in ast.parse(render(_v(block_sparse=True, softcap=True))).body
              if isinstance(f, ast.FunctionDef) and f.name == "attn_bwd_hopper")
    names = [a.arg for a in fn.args.args]
    i = names.index("sm_scale")
    bm = BlockMask.from_dense(torch.rand(1, 2, 2, 3) < 0.5, (256, 384), (128, 128))
    args = mask_args(Masks(None, 5.0, bm), False, "kv", 1, 2)
    assert names[i + 1:i + 1 + len(args)] == [
        "win_left", "win_right", "softcap", "BM_NUM", "BM_IDX", "BM_FULL_NUM", "BM_FULL_IDX",
        "EM", "mask_sb", "mask_sh", "n_kb", "n_qb", "stride_emb", "stride_emh", "stride_emq",
        "stride_emk"]
    assert args[3] is bm.q_num_blocks and args[6] is bm.full_q_indices
    assert args[10:12] == (3, 2)  # 3 key blocks (rows per head), 2 query blocks (per row)
    assert names[i + 1 + len(args):i + 4 + len(args)] == ["H", "Nq", "Nk"]
    assert {"BS_Q", "BS_KV", "ELEM"} <= set(names)


# -- CPU: the walk the template encodes, modelled in Python ---------------------------------------

def _model_visible(bm, b, hk, group, nq, nk, block_m, block_n, causal, window):
    """Which (query, key) pairs of batch b and the q heads of kv head hk the kernel lets
    through: per program (BLOCK_N keys in one BS_KV key block) the walk of _sparse_step over the
    GROUP heads' rows of the transposed lists -- full query blocks, then (element mask) the
    partial ones, SUB steps each -- a step masked at a window edge, a tail or a partial block
    (element mask too), else asserted to be fully visible. Returns [group, nq, nk] counts."""
    left, right = mask_args(Masks(window, None if window else 1.0), causal, "kv", 1, 1)[:2]
    bq, bk = bm.block_size
    sub, elem = bq // block_m, bm.mask is not None
    assert bk % block_n == 0 and bq % block_m == 0
    truth = dense_mask(nq, nk, causal, window)
    out = torch.zeros(group, nq, nk, dtype=torch.int64)

    def row(t, h):  # the lists' row of q head h for this key block (broadcast dims clamp)
        return t[min(b, t.shape[0] - 1), min(h, t.shape[1] - 1), kb]
    for start_n in range(0, nk, block_n):
        kb = start_n // bk
        _, full_lo, full_hi, _ = window_range(start_n, block_n, block_m, -(nk - nq), right, left,
                                              nq, nq)
        tail = start_n + block_n > nk
        keys = slice(start_n, min(start_n + block_n, nk))
        for g in range(group):
            h = hk * group + g
            nf = int(row(bm.full_q_num_blocks, h)) * sub
            n = nf + (int(row(bm.q_num_blocks, h)) * sub if elem else 0)
            for t in range(n):
                part = t >= nf
                blk = int(row(bm.q_indices, h)[(t - nf) // sub] if part
                          else row(bm.full_q_indices, h)[t // sub])
                start_m = blk * bq + (t % sub) * block_m
                rows = slice(start_m, min(start_m + block_m, nq))
                if not (start_m < full_lo or start_m + block_m > full_hi or tail or part):
                    assert start_m + block_m <= nq and truth[rows, keys].all(), (start_n, t)
                    out[g, rows, keys] += 1
                    continue
                keep = truth[rows, keys]
                if part:
                    em = bm.mask[min(b, bm.mask.shape[0] - 1), min(h, bm.mask.shape[1] - 1)]
                    keep = keep & em[rows, keys]
                out[g, rows, keys] += keep
    return out


def _random_mask(nq, nk, bs, density, batch=1, heads=1, elem=False, empty_row=None, seed=0):
    """Random kept blocks per (batch, head) of the mask (1 = shared); elem: an element mask that
    is True but for random bits in about a third of the blocks (full, partial and dropped)."""
    g = torch.Generator().manual_seed(seed)
    nqb, nkb = -(-nq // bs[0]), -(-nk // bs[1])
    blocks = torch.rand(batch, heads, nqb, nkb, generator=g) < density
    if empty_row is not None:
        blocks[..., min(empty_row, nqb - 1), :] = False
    m = None
    if elem:
        m = torch.ones(batch, heads, nq, nk, dtype=torch.bool)
        noisy = torch.rand(batch, heads, nqb, nkb, generator=g) < 0.35
        noisy = noisy.repeat_interleave(bs[0], 2).repeat_interleave(bs[1], 3)[..., :nq, :nk]
        m &= ~noisy | (torch.rand(batch, heads, nq, nk, generator=g) < 0.5)
    return BlockMask.from_dense(blocks, (nq, nk), bs, mask=m)


@pytest.mark.parametrize("block_m,block_n,bs", [(64, 128, (128, 128)), (64, 64, (256, 64)),
                                                (128, 128, (128, 256))])
@pytest.mark.parametrize("nq,nk,causal,window", [(300, 517, False, None), (517, 300, True, None),
                                                 (257, 257, True, (40, 0)),
                                                 (200, 390, False, (30, 70))])
@pytest.mark.parametrize("elem", [False, True])
@pytest.mark.parametrize("batch,heads,group", [(1, 4, 2), (2, 1, 1)])
def test_walk_covers_exactly_the_visible_pairs(block_m, block_n, bs, nq, nk, causal, window,
                                               elem, batch, heads, group):
    bm = _random_mask(nq, nk, bs, 0.6, batch, heads, elem, empty_row=1, seed=nq + nk)
    h = max(heads, group)
    want = (bm.to_dense_mask() & dense_mask(nq, nk, causal, window)).expand(batch, h, nq, nk)
    for b in range(batch):
        for hk in range(h // group):
            seen = _model_visible(bm, b, hk, group, nq, nk, block_m, block_n, causal, window)
            assert seen.max() <= 1  # no pair counted twice
            got, exp = seen.bool(), want[b, hk * group:(hk + 1) * group]
            assert torch.equal(got, exp), (b, hk, (got != exp).nonzero()[:5])


# -- CPU: tiles, plans, dispatch ---------------------------------------------------------------

def _bm(bs=(128, 128), elem=False, n=256):
    return _random_mask(n, n, bs, 0.5, elem=elem)


@pytest.mark.parametrize("name,bs,elem,want", [
    (DEFAULT, (128, 128), False, DEFAULT),
    (DEFAULT, (128, 128), True, DEFAULT),
    (DEFAULT, (256, 64), False, "hopper_bwd-m64-n64-w4-s2"),  # 64 keys: one warpgroup
    (DEFAULT, (64, 64), True, "hopper_bwd-m64-n64-w4-s2"),
    (BIG, (128, 128), False, BIG),
    (BIG, (128, 128), True, "hopper_bwd-m64-n128-w8-s1"),  # the element tile: 32 a thread
    (BIG, (64, 256), False, "hopper_bwd-m64-n128-w8-s1"),
    (D256, (128, 128), True, D256),  # D=256's n64-w8 stays (its warpgroups split D)
    (DEFAULT, (32, 128), False, "bwd"),  # below the wgmma's 64 rows
    (DEFAULT, (128, 16), False, "bwd"),
])
def test_mask_twin_fits_hopper_tiles_or_falls_back(name, bs, elem, want):
    hv = Variant.parse(name)
    masks = Masks(None, None, _bm(bs, elem))
    twin = dispatch.mask_twin(hv, masks, 256 if name == D256 else 128, torch.bfloat16, "bwd")
    if want == "bwd":
        assert twin.family == "bwd" and twin.block_sparse
        assert twin.block_m <= bs[0] and twin.block_n <= bs[1]
        _, why = dispatch.mask_fit(hv, masks, "bwd")
        assert "at least 64 x 64" in why, why
    else:
        assert twin == _v(want, block_sparse=True), twin.name
        FAM.check_variant(twin)


def test_block_sparse_is_a_field_and_a_served_mask():
    assert "block_sparse" in FAM.fields and "block_sparse" in FAM.mask_fields("bwd")
    v = Variant.parse(DEFAULT + "-window=true-block_sparse=true")
    assert v.masks == ("window", "block_sparse") and Variant.parse(v.name) == v


def test_plan_errors():
    from flashtune.launch_hopper_bwd import HopperBwdPlan
    q, k, v = qkv(1, 2, 2, 256, 256, 64, torch.bfloat16, "cpu")
    sparse = _v(block_sparse=True)
    with pytest.raises(ValueError, match="carries masks"):
        HopperBwdPlan(q, k, v, False, None, _v(), Masks(None, None, _bm()))
    with pytest.raises(ValueError, match="carries masks"):
        HopperBwdPlan(q, k, v, False, None, sparse)
    with pytest.raises(ValueError, match=r"at least 64 x 64 .* 32 x 128"):
        HopperBwdPlan(q, k, v, False, None, sparse, Masks(None, None, _bm((32, 128))))
    with pytest.raises(ValueError, match=r"block_size \(128, 64\) \(as \{'block_n': 64, 'num_"):
        HopperBwdPlan(q, k, v, False, None, sparse, Masks(None, None, _bm((128, 64))))
    big = _v(BIG, block_sparse=True)  # tiles within the blocks, but not the fitted ones
    with pytest.raises(ValueError, match=r"must fit the block mask's block_size \(128, 128\)"):
        HopperBwdPlan(q, k, v, False, None, big, Masks(None, None, _bm(elem=True)))


def test_forced_backward_runs_the_fitted_twin_and_explain_says_so():
    q, k, v = qkv(1, 2, 2, 256, 256, 64, torch.bfloat16, "cpu")
    with flashtune.force(DEFAULT):
        masks = Masks(check_window((64, 0), True), check_softcap(20.0), _bm((64, 64)))
        got = ops.select_bwd(q, k, True, False, masks)
        ex = flashtune.explain(q, k, v, causal=True, family="bwd", window=(64, 0), softcap=20.0,
                               block_mask=_bm((64, 64)))
    assert got == _v(SMALL, window=True, softcap=True, block_sparse=True)
    assert ex.level == "forced" and ex.variant == got and ex.problem.block_density
    assert any("with the call's masks rendered in" in n for n in ex.notes), ex.notes


def test_search_pins_block_sparse_in_hopper_bwd_spaces():
    from flashtune.problem import Problem
    from flashtune.search_space import Space
    from flashtune.targets import get as get_target
    p = Problem("hopper_bwd", "bfloat16", 128, True, 1, 1, 16, 4096, 4096, block_density=0.25)
    space = Space.build("hopper_bwd", get_target("H100"), p)
    assert ("block_sparse", True) in space.pinned
    assert space.feasible and all(v.masks == ("block_sparse",) for v in space.feasible)


# -- the sm_90 compile of the block_sparse defaults, with this Triton (3.9 in CI), no GPU --------

@pytest.mark.slow
def test_block_sparse_defaults_compile_for_sm90():
    """Each D's default with block_sparse (an element mask, 128-blocks) fits the H100; D=64
    spills nothing, D=128 and 256 sit at the register cap as the window renders do (the
    template header quotes it)."""
    from test_compile_sm90 import kernels_check
    names = sorted({_v(FAM.default(d, "bfloat16").name, block_sparse=True).name
                    for d in (64, 128, 256)})
    r = kernels_check("--gpu", "H100", "--dtype", "bf16", "--head-dim", "64,128,256",
                      "--format", "json", *names)
    rows = json.loads(r.stdout) if r.stdout.startswith("[") else []
    assert rows, r.stdout[-2000:] + r.stderr[-2000:]
    for d in (64, 128, 256):
        want = _v(FAM.default(d, "bfloat16").name, block_sparse=True).name
        x = next(x for x in rows if x["head_dim"] == d and x["variant"] == want)
        assert x["smem"] <= 232448 and x["regs"] <= 255, x
        if d == 64:
            assert x["fits"] and not x["why"] and not x["spill_bytes"], x


# -- GPU: dQ, dK, dV against the float64 reference, the family forced -----------------------------

# (variant, D, dtype, (B, H, Hk, Nq, Nk), block size, pattern, element mask, causal, mask dims,
# extra masks). patterns: d10 / d60 random blocks at ~10% / ~60%, full: every block, empty: ~60%
# with one query block's row empty; mask dims: "bh" one pattern per (batch, head), "h" shared
# by the batch, "b" shared by the heads
GPU_CASES = [
    (DEFAULT, 64, torch.bfloat16, (1, 4, 2, 300, 517), (128, 128), "d10", False, False, "bh", {}),
    (DEFAULT, 64, torch.float16, (2, 2, 2, 257, 257), (128, 128), "d60", True, True, "bh", {}),
    (DEFAULT, 64, torch.bfloat16, (1, 2, 2, 700, 450), (256, 128), "empty", False, True, "h", {}),
    (DEFAULT, 64, torch.bfloat16, (1, 2, 2, 600, 600), (128, 128), "d60", True, False, "bh",
     dict(softcap=5.0)),
    (DEFAULT, 128, torch.bfloat16, (1, 4, 4, 1000, 1000), (128, 128), "d60", False, False, "bh",
     {}),
    (DEFAULT, 128, torch.bfloat16, (1, 8, 2, 515, 2051), (128, 128), "d10", True, True, "bh", {}),
    (DEFAULT, 128, torch.float16, (2, 3, 3, 384, 384), (128, 128), "full", False, True, "b", {}),
    (DEFAULT, 128, torch.bfloat16, (1, 2, 2, 640, 300), (128, 128), "empty", True, False, "bh",
     {}),
    (DEFAULT, 128, torch.float16, (1, 4, 2, 333, 1100), (128, 256), "d60", True, False, "h", {}),
    (DEFAULT, 128, torch.bfloat16, (1, 4, 4, 1024, 1024), (128, 128), "d60", True, True, "bh",
     dict(window=(200, 0), softcap=10.0)),
    (DEFAULT, 128, torch.bfloat16, (1, 4, 2, 1024, 1024), (64, 64), "d60", True, True, "bh", {}),
    (SMALL, 128, torch.float16, (1, 2, 2, 500, 900), (128, 64), "d10", False, False, "bh", {}),
    (BIG, 64, torch.bfloat16, (1, 4, 4, 512, 512), (128, 128), "d60", False, True, "bh", {}),
    (D256, 256, torch.bfloat16, (1, 4, 2, 513, 700), (128, 128), "d60", True, False, "bh", {}),
    (D256, 256, torch.float16, (1, 2, 2, 400, 400), (128, 128), "empty", False, True, "bh",
     dict(window=(70, 20))),
]
_DENSITY = {"d10": 0.1, "d60": 0.6, "full": 1.0, "empty": 0.6}


def _gpu_mask(shape, bs, pattern, elem, dims, seed):
    b, h, _, nq, nk = shape
    bm = _random_mask(nq, nk, bs, _DENSITY[pattern], b if "b" in dims else 1,
                      h if "h" in dims else 1, elem, 1 if pattern == "empty" else None, seed)
    return BlockMask(bm.state.cuda(), (nq, nk), bs, None if bm.mask is None else bm.mask.cuda())


def test_gpu_grid_compiles_stay_few():
    """One compile per case at most (the GPU step's time budget), every variant kind."""
    assert len(GPU_CASES) <= 16 and {c[0] for c in GPU_CASES} == {DEFAULT, SMALL, BIG, D256}
    assert {c[8] for c in GPU_CASES} == {"bh", "h", "b"}


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[
    f"{c[0][11:]}-d{c[1]}-{str(c[2])[6:]}-{c[3][3]}x{c[3][4]}g{c[3][1] // c[3][2]}"
    f"-bs{c[4][0]}x{c[4][1]}-{c[5]}{'-elem' if c[6] else ''}{'-causal' if c[7] else ''}-{c[8]}"
    f"{''.join('-' + k for k in c[9])}" for c in GPU_CASES])
def test_grads_match_reference(case, monkeypatch):
    """The backward alone (ops.run_backward, as autograd calls it) on the float64 reference's O
    and LSE: the Gluon kernel must run (no generic fallback)."""
    name, d, dtype, shape, bs, pattern, elem, causal, dims, extra = case
    b, h, hk, nq, nk = shape
    q, k, v = qkv(b, h, hk, nq, nk, d, dtype, "cuda")
    bm = _gpu_mask(shape, bs, pattern, elem, dims, seed=nq * 7 + nk)
    dm = bm.to_dense_mask()
    masks = Masks(check_window(extra.get("window"), causal), check_softcap(extra.get("softcap")),
                  bm)
    chosen, dq, dk, dv = backward_alone(name, q, k, v, masks, dict(causal=causal, mask=dm,
                                                                   **extra), monkeypatch)
    assert chosen.family == "hopper_bwd" and chosen.block_sparse, chosen.name
    seen = (dm & dense_mask(nq, nk, causal, extra.get("window"), device="cuda")).expand(
        b, h, nq, nk)
    assert torch.all(dq[~seen.any(-1)] == 0)  # rows that see no key: nothing, no NaN
    kv_seen = seen.reshape(b, hk, h // hk, nq, nk).any(2).any(2)
    assert torch.all(dk[~kv_seen] == 0) and torch.all(dv[~kv_seen] == 0)


@pytest.mark.gpu
@hopper_gpu
def test_autograd_through_attention_runs_the_block_sparse_twin(monkeypatch):
    """flashtune.attention(..., block_mask) with gradients, hopper_bwd forced: its block_sparse
    twin runs the backward (no generic fallback) and matches the reference."""
    shape = (2, 4, 2, 1024, 1024)
    bm = _gpu_mask(shape, (128, 128), "d60", True, "bh", seed=5)
    forced_autograd(monkeypatch, shape, causal=True, block_mask=bm)
