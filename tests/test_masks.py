"""Masks beyond causal: sliding window, softcap and block-sparse attention (issue 11), forward and
gradients against the float64 reference, alone and with causal, GQA, odd lengths and Nq != Nk;
the window arithmetic the kernels share with flashtune/masks.py; that a variant without masks
renders no mask code (dense kernels unchanged); Bucket keys; bad input."""
import contextlib
import dataclasses
import math
import os

import pytest
import torch

import flashtune
from flashtune import BlockMask
from flashtune.accuracy import compare
from flashtune.codegen import Variant, kernel_hash, render
from flashtune.masks import UNBOUNDED, check_window, dense_mask, window_range
from flashtune.problem import Bucket, Problem
from flashtune.reference import reference, same_dtype_math

from _check import assert_matches_reference, qkv

FWD = "fwd-m16-n16-w4-s1"  # small tiles: several blocks in every loop at these sizes
BWD = {"atomic": "bwd-m16-n32-w4-s1-dq=atomic",
       "separate": "bwd-m16-n32-w4-s1-dq=separate-mq32-nq16-wq4-sq1",
       "fused": "bwd-m16-n32-w4-s1-dq=fused-mq32-nq16",
       # Q/dO through tensor descriptors (dQ by a reduce-add): the block-sparse test only
       "atomic_desc": "bwd-m16-n32-w4-s1-loads=descriptor-dq=atomic",
       "fused_desc": "bwd-m16-n32-w4-s1-loads=descriptor-dq=fused-mq32-nq16",
       # and K/V of the dQ programs too (dq_loads)
       "fused_kvdesc": "bwd-m16-n32-w4-s1-loads=descriptor-dq=fused-mq32-nq16-dq_loads=descriptor"}
WINDOW_BWD = ("atomic", "fused", "separate")


@contextlib.contextmanager
def forced_on_every_thread(name):
    """force() is thread-local and autograd runs CUDA backwards on a thread of its own: the
    environment variable reaches that one too (ops.call_forced lets it win over the variant the
    forward was forced to)."""
    old = os.environ.get("FLASHTUNE_FORCE_VARIANT")
    os.environ["FLASHTUNE_FORCE_VARIANT"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["FLASHTUNE_FORCE_VARIANT"]
        else:
            os.environ["FLASHTUNE_FORCE_VARIANT"] = old


def check(q, k, v, *, grads=True, bwd="atomic", block_mask=None, **kw):
    """flashtune's O (and dQ, dK, dV) against the float64 reference with the same masks."""
    dm = None if block_mask is None else block_mask.to_dense_mask()
    xs = [t.detach().clone().requires_grad_(grads) for t in (q, k, v)]
    with flashtune.force(FWD):
        out = flashtune.attention(*xs, block_mask=block_mask, **kw)
    rep = compare(out, reference(q, k, v, mask=dm, **kw), same_dtype_math(q, k, v, mask=dm, **kw))
    assert rep.ok, f"out: {rep}"
    if not grads:
        return
    do = torch.randn_like(out)
    with flashtune.force(BWD[bwd]), forced_on_every_thread(BWD[bwd]):
        got = torch.autograd.grad(out, xs, do)

    def ref_grads(dtype, fn):
        ys = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*ys, mask=dm, **kw), ys, do.to(dtype))

    for name, g, r, b in zip(("dq", "dk", "dv"), got, ref_grads(torch.float64, reference),
                             ref_grads(q.dtype, same_dtype_math)):
        rep = compare(g, r, b)
        assert rep.ok, f"{name}: {rep}"


# -- window ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("window,causal", [((8, 5), False), ((0, 0), False), ((9, -1), False),
                                           ((-1, 6), False), ((12, 7), True), ((3, -1), True)])
@pytest.mark.parametrize("nq,nk", [(37, 53), (53, 37)])
def test_window_forward(window, causal, nq, nk, device):
    check(*qkv(1, 2, 1, nq, nk, 32, torch.float16, device), grads=False, window=window,
          causal=causal)


@pytest.mark.parametrize("bwd", WINDOW_BWD)
@pytest.mark.parametrize("window,causal,dtype", [((10, 3), False, torch.float16),
                                                 ((12, -1), True, torch.float32),
                                                 ((0, 20), False, torch.float32)])
def test_window_grads(window, causal, dtype, bwd, device):
    check(*qkv(1, 2, 1, 45, 70, 32, dtype, device), window=window, causal=causal, bwd=bwd)


def test_window_is_bottom_right_aligned_like_causal(device):
    # window (-1, 0) is the causal mask: same output as causal=True
    q, k, v = qkv(1, 1, 1, 30, 50, 32, torch.float32, device)
    with flashtune.force(FWD):
        a = flashtune.attention(q, k, v, window=(-1, 0))
        b = flashtune.attention(q, k, v, causal=True)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("nq,nk,left,right", [(64, 64, 16, 0), (50, 90, 7, 33), (90, 50, 70, 2),
                                              (17, 200, -1, 5), (33, 33, 0, 0)])
@pytest.mark.parametrize("block,block_o", [(16, 16), (32, 16), (16, 64)])
def test_window_range_covers_exactly_the_window(nq, nk, left, right, block, block_o):
    # the arithmetic the templates' _window_range shares: every visible key lies in [lo, hi),
    # blocks in [full_lo, full_hi) are fully visible to every row (so they may skip the mask)
    keep = dense_mask(nq, nk, window=(left, right))
    wl, wr = (UNBOUNDED if w < 0 else w for w in (left, right))
    for start in range(0, nq, block):
        lo, flo, fhi, hi = window_range(start, block, block_o, nk - nq, wl, wr, nk,
                                        nk // block_o * block_o)
        rows = keep[start:start + block]
        seen = rows.any(0).nonzero().flatten()
        if len(seen):
            assert lo <= int(seen[0]) and int(seen[-1]) < hi
        # loops start block-aligned (an end clamped to hi leaves the loops after it empty)
        assert lo % block_o == 0 and lo <= flo <= fhi <= hi
        assert flo % block_o == 0 or flo == hi
        if fhi > flo:
            assert fhi % block_o == 0 and bool(rows[:, flo:fhi].all())
    # dK/dV's transposed call: key block rows, query columns
    for start in range(0, nk, block):
        lo, flo, fhi, hi = window_range(start, block, block_o, nq - nk, wr, wl, nq, nq)
        cols = keep[:, start:start + block]
        seen = cols.any(1).nonzero().flatten()
        if len(seen):
            assert lo <= int(seen[0]) and int(seen[-1]) < hi


# -- softcap ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal,dtype", [(False, torch.float32), (True, torch.float16)])
def test_softcap(causal, dtype, device):
    q, k, v = qkv(1, 2, 2, 40, 33, 32, dtype, device)
    check(q * 3, k * 3, v, softcap=2.0, causal=causal)  # scores well into tanh's bend


def test_softcap_with_window_gqa(device):
    check(*qkv(2, 4, 2, 33, 70, 32, torch.float32, device), softcap=1.5, window=(-1, 5),
          causal=True, bwd="separate")


# -- block-sparse ----------------------------------------------------------------------------------
def test_block_mask_from_dense_lists(device):
    blocks = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 1]], dtype=torch.bool, device=device)
    bm = BlockMask.from_dense(blocks, (70, 90), block_size=32)
    assert bm.full_kv_num_blocks.flatten().tolist() == [2, 0, 3]
    assert bm.full_kv_indices[0, 0, 0, :2].tolist() == [0, 2]
    assert bm.full_q_num_blocks.flatten().tolist() == [2, 1, 2]
    assert bm.full_q_indices[0, 0, 1, :1].tolist() == [2]
    assert bm.kv_num_blocks.sum() == 0 and bm.density() == pytest.approx(5 / 9)
    assert bm.to_dense_mask().shape == (1, 1, 70, 90)


@pytest.mark.parametrize("bwd", sorted(BWD))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_block_sparse_element_mask(dtype, bwd, device):
    q, k, v = qkv(1, 2, 1, 45, 70, 32, dtype, device)
    m = torch.rand(1, 2, 45, 70, device=device) < 0.6
    m[..., 32:64] = False  # a dropped key block
    m[..., :32, 64:] = True  # a full block
    bm = BlockMask.from_mask(m, block_size=32)
    assert bm.kv_num_blocks.sum() > 0 and bm.full_kv_num_blocks.sum() > 0
    check(q, k, v, block_mask=bm, bwd=bwd)


@pytest.mark.parametrize("kw", [dict(causal=True, softcap=2.0), dict(window=(20, 20))])
def test_block_sparse_composes(kw, device):
    q, k, v = qkv(2, 2, 2, 45, 70, 32, torch.float32, device)
    blocks = torch.rand(2, 1, 2, 2, device=device) < 0.7
    blocks[..., 0, 0] = True
    bm = BlockMask.from_dense(blocks, (45, 70), block_size=(32, 64))
    check(q, k, v, block_mask=bm, **kw)


def test_block_sparse_tiles_are_clamped_to_the_block_size(device):
    # a tuned tile larger than the block size runs at the block size
    q, k, v = qkv(1, 1, 1, 40, 40, 32, torch.float16, device)
    bm = BlockMask.from_dense(torch.ones(3, 3, dtype=torch.bool, device=device), (40, 40),
                              block_size=16)
    with flashtune.force("fwd-m32-n32-w4-s1"):
        out = flashtune.attention(q, k, v, block_mask=bm)
    rep = compare(out, reference(q, k, v), same_dtype_math(q, k, v))
    assert rep.ok, str(rep)


def test_from_flex_block_mask(device):
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    nq = nk = 256

    def local(b, h, qi, ki):
        return (qi - ki).abs() <= 40

    try:
        fbm = fa.create_block_mask(local, 1, 1, nq, nk, device=device, BLOCK_SIZE=64)
    except Exception as e:  # noqa: BLE001 -- Flex's CPU support varies by torch build
        pytest.skip(f"create_block_mask unavailable here: {e}")
    bm = BlockMask.from_flex(fbm)
    assert bm.block_size == (64, 64) and bm.mask is not None
    want = dense_mask(nq, nk, window=(40, 40), device=device)
    assert torch.equal(bm.to_dense_mask()[0, 0], want)
    q, k, v = qkv(1, 2, 1, nq, nk, 32, torch.float16, device)
    check(q, k, v, block_mask=bm, grads=False)


# -- structure: dense kernels unchanged, keys, dispatch ------------------------------------------
MASK_WORDS = ("win_left", "_tanh", "softcap", "BM_IDX", "BM_STATE", "_window_range", "ELEM")


@pytest.mark.parametrize("name", ["fwd-m64-n32-w4-s2", "fwd-m64-n32-w4-s2-varlen=true",
                                  "fwd-m128-n64-w8-s3-loads=descriptor",
                                  "bwd-m16-n32-w4-s1-dq=separate-mq32-nq16-wq4-sq1",
                                  "bwd-m16-n32-w4-s1-dq=atomic-varlen=true"])
def test_variant_without_masks_renders_no_mask_code(name):
    v = Variant.parse(name)
    for interpret in (False, True):
        src = "\n".join(line for line in render(v, interpret).splitlines()[1:]
                        if not line.lstrip().startswith("#"))
        assert not any(w in src for w in MASK_WORDS), name
    for m in ("window", "softcap", "block_sparse"):
        masked = render(dataclasses.replace(v, **{m: True}))
        assert "win_left" in masked and kernel_hash(dataclasses.replace(v, **{m: True})) != \
            kernel_hash(v)


# kernel hashes of dense variants before the masks were added (the shipped table stays fresh);
# the varlen and splitkv entries are those of the same renders after their own performance work
# (varlen clamps, split-KV combine and page prefetch; the paged one since its table is read only
# where a key block starts a new page, session 29), checked equal before and after the merge
DENSE_HASHES = {
    "fwd-m64-n32-w4-s2": "4d63270b660b9851",
    "fwd-m128-n64-w8-s3-loads=descriptor": "6bb41587c690a4a8",
    "fwd-m64-n32-w4-s2-causal_split=false": "3dfd85c6e392328d",
    "fwd-m64-n32-w4-s2-varlen=true": "3bcfccb673286998",
    "bwd-m16-n32-w4-s1-dq=atomic": "881be2433973ea1a",
    "bwd-m16-n32-w4-s1-dq=separate-mq32-nq16-wq4-sq1": "faa4b749d26d519a",
    "splitkv-m64-n64-w4-s3": "060e2cceee32ce17",
    "splitkv-m64-n64-w4-s3-loads=descriptor-paged=true": "efd4d087693419f6",
}


@pytest.mark.parametrize("name", sorted(DENSE_HASHES))
def test_dense_kernel_hashes_unchanged(name):
    assert kernel_hash(Variant.parse(name)) == DENSE_HASHES[name]


def test_buckets_key_on_masks():
    p = Problem("fwd", "bfloat16", 128, False, 1, 1, 16, 16384, 16384)
    assert Bucket.of(p).mask == "" and "mask" not in Bucket.of(p).__dict__.get("_", {})
    win = dataclasses.replace(p, window=1024)
    sparse = dataclasses.replace(p, block_density=0.1)
    bw, bs = Bucket.of(win), Bucket.of(sparse)
    assert bw.mask == "window1024" and bs.mask.startswith("block")
    assert len({Bucket.of(p).key, bw.key, bs.key}) == 3
    # another window size serves it, octaves away; so does the dense record, as a window of
    # every key (16k keys a query here: 4 octaves from 1024), never the reverse
    other = Bucket.of(dataclasses.replace(p, window=4096))
    assert bw.log_distance(other) == pytest.approx(2.0)
    assert bw.log_distance(Bucket.of(p)) == pytest.approx(4.0)
    assert Bucket.of(p).log_distance(bw) == float("inf")
    # a block mask: the dense record counts as every block kept (64/64)
    assert bs.log_distance(Bucket.of(p)) == pytest.approx(math.log2(64 / int(bs.mask[5:])))
    # softcap changes the kernel: a record without it never serves a softcapped bucket
    capped = Bucket.of(dataclasses.replace(p, window=1024, softcap=True))
    assert capped.log_distance(bw) == float("inf")
    assert capped.log_distance(Bucket.of(dataclasses.replace(p, softcap=True))) == 4.0
    # the dense key is what it was before masks existed (the mask field is left out at "")
    from flashtune._keys import as_dict
    assert "mask" not in as_dict(Bucket.of(p)) and "window" not in as_dict(p)
    assert win.flops() < p.flops() and sparse.flops() == pytest.approx(0.1 * p.flops())



def test_a_window_wider_than_the_keys_is_no_window():
    """A side reaching past every key a query has cuts nothing: unbounded, and a window
    unbounded on both sides (causal: on the left) is dropped, so the dense kernels run."""
    assert check_window((4096, 0), True, 4096, 4096) is None
    assert check_window((4095, 0), True, 4096, 4096) is None
    assert check_window((4094, 0), True, 4096, 4096) == (4094, 0)
    assert check_window((7, 99), False, 100, 300) == (7, -1)      # right >= Nq - 1
    assert check_window((299, 98), False, 100, 300) == (-1, 98)   # left >= Nk - 1
    assert check_window((299, 99), False, 100, 300) is None
    assert check_window((7, 99), False) == (7, 99)                # no lengths: as given


@pytest.mark.parametrize("causal", [False, True])
def test_trimmed_window_runs_the_unmasked_kernel(causal, device):
    q, k, v = qkv(1, 2, 1, 40, 70, 32, torch.float16, device)
    wide = flashtune.attention(q, k, v, causal=causal, window=(69, 39))
    assert torch.equal(wide, flashtune.attention(q, k, v, causal=causal))
    check(q, k, v, grads=False, window=(69, 39), causal=causal)
    check(q, k, v, grads=False, window=(68, 38), causal=causal)  # one key short: masked

# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,exc,words", [
    (dict(window=(-2, 3)), ValueError, "window"),
    (dict(window=(3,)), TypeError, "window"),
    (dict(window=(1.5, 2)), TypeError, "window"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap="3"), TypeError, "softcap"),
    (dict(block_mask=torch.ones(2, 2, dtype=torch.bool)), TypeError, "block_mask"),
])
def test_bad_mask_arguments(kw, exc, words, device):
    q, k, v = qkv(1, 1, 1, 16, 16, 32, torch.float16, device)
    with pytest.raises(exc, match=words):
        flashtune.attention(q, k, v, **kw)


def test_bad_block_mask(device):
    q, k, v = qkv(2, 2, 2, 40, 40, 32, torch.float16, device)
    wrong_len = BlockMask.from_dense(torch.ones(2, 2, dtype=torch.bool), (64, 64), block_size=32)
    with pytest.raises(ValueError, match="block_mask was built for seq_lengths"):
        flashtune.attention(q, k, v, block_mask=wrong_len)
    wrong_heads = BlockMask.from_dense(torch.ones(1, 3, 2, 2, dtype=torch.bool), (40, 40),
                                       block_size=32)
    with pytest.raises(ValueError, match="block_mask has"):
        flashtune.attention(q, k, v, block_mask=wrong_heads)
    with pytest.raises(ValueError, match="block_size"):
        BlockMask.from_dense(torch.ones(2, 2, dtype=torch.bool), (40, 40), block_size=24)
    with pytest.raises(ValueError, match="blocks"):
        BlockMask.from_dense(torch.ones(3, 2, dtype=torch.bool), (40, 40), block_size=32)
    other = "meta" if device == "cpu" else "cpu"  # a mask on another device than q
    elsewhere = BlockMask.from_dense(torch.ones(2, 2, dtype=torch.bool, device=other), (40, 40),
                                     block_size=32)
    with pytest.raises(ValueError, match=f"block_mask is on {other}"):
        flashtune.attention(q, k, v, block_mask=elsewhere)


# -- varlen ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(window=(6, 2)), dict(causal=True, window=(9, -1), softcap=2.0)])
def test_varlen_window_softcap(kw, device):
    # each sequence against the dense reference of its own lengths (window bottom-right per sequence)
    lens_q, lens_k = [5, 0, 23, 17], [9, 4, 30, 17]
    h, hk, d = 2, 1, 32
    q = torch.randn(sum(lens_q), h, d, device=device)
    k = torch.randn(sum(lens_k), hk, d, device=device)
    v = torch.randn_like(k)
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
          for n in (lens_q, lens_k)]
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    with flashtune.force("fwd-m16-n16-w4-s1"):
        out = flashtune.attention_varlen(*xs, *cu, max(lens_q), max(lens_k), **kw)
    do = torch.randn_like(out)
    with flashtune.force(BWD["separate"]):
        got = torch.autograd.grad(out, xs, do)
    for b in range(len(lens_q)):
        sq = slice(int(cu[0][b]), int(cu[0][b + 1]))
        sk = slice(int(cu[1][b]), int(cu[1][b + 1]))
        if sq.start == sq.stop:
            continue
        ys = [t[s].transpose(0, 1)[None].detach().to(torch.float64).requires_grad_()
              for t, s in ((q, sq), (k, sk), (v, sk))]
        ref = reference(*ys, **kw)
        rg = torch.autograd.grad(ref, ys, do[sq].transpose(0, 1)[None].to(torch.float64))
        torch.testing.assert_close(out[sq].transpose(0, 1)[None].double(), ref, atol=2e-5, rtol=1e-4)
        for g, r, s in zip(got, rg, (sq, sk, sk)):
            torch.testing.assert_close(g[s].transpose(0, 1)[None].double(), r, atol=5e-5, rtol=1e-4)


# -- split-KV (attention_with_kvcache) -----------------------------------------------------------
@pytest.mark.parametrize("kw,splits", [(dict(window=(20, -1)), 3), (dict(window=(5, 2)), 1),
                                       (dict(causal=True, window=(30, 0), softcap=2.0), 4),
                                       (dict(softcap=1.5), 2)])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_window_softcap(kw, splits, paged, device):
    b, nq, hq, hk, d, cap = 3, 3, 4, 2, 32, 96
    q = torch.randn(b, nq, hq, d, device=device)
    kc = torch.randn(b, cap, hk, d, device=device)
    vc = torch.randn_like(kc)
    lengths = [96, 41, 2]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    extra = {}
    kcx, vcx = kc, vc
    if paged:  # pages of 16 rows, shuffled
        pages = b * cap // 16
        perm = torch.randperm(pages, device=device)
        kcx = torch.empty(pages, 16, hk, d, device=device)
        vcx = torch.empty_like(kcx)
        kcx[perm] = kc.reshape(pages, 16, hk, d)
        vcx[perm] = vc.reshape(pages, 16, hk, d)
        extra["block_table"] = perm.reshape(b, cap // 16).to(torch.int32)
    with flashtune.force(f"splitkv-m16-n16-w4-s1-sp{splits}"):
        out = flashtune.attention_with_kvcache(q, kcx, vcx, cache_seqlens=seqlens, **kw, **extra)
    for i, n in enumerate(lengths):
        qb = q[i:i + 1].transpose(1, 2)
        kb, vb = (t[i:i + 1, :n].transpose(1, 2) for t in (kc, vc))
        rep = compare(out[i:i + 1].transpose(1, 2), reference(qb, kb, vb, **kw),
                      same_dtype_math(qb, kb, vb, **kw))
        assert rep.ok, f"sequence {i} (L={n}): {rep}"


# -- the search: masked buckets are measured with representative masks -------------------------
@pytest.mark.parametrize("fields", [dict(window=24), dict(softcap=True, block_density=0.5)])
def test_search_measures_masked_problems(fields, device):
    from flashtune.measure_bwd import BwdOps
    from flashtune.measure_fwd import OPS as FWD_OPS
    p = Problem("bwd", "float16", 32, True, 2, 1, 4, 150, 150, **fields)
    ops = BwdOps(device=device)
    inputs = ops.inputs(p)
    v = Variant.parse("bwd-m16-n32-w4-s1-dq=atomic")
    v = dataclasses.replace(v, **{m: True for m in p.mask_kinds})
    assert ops.check(ops.run(v, p, inputs), p, ops.reference(p, inputs)).ok
    pf = dataclasses.replace(p, family="fwd")
    q, k, vv = inputs[:3]
    out = FWD_OPS.run(dataclasses.replace(Variant.parse(FWD), **{m: True for m in p.mask_kinds}),
                      pf, (q, k, vv))
    assert FWD_OPS.check(out, pf, FWD_OPS.reference(pf, (q, k, vv))).ok


def test_search_plans_masked_buckets():
    from flashtune.masks import parse_spec
    from flashtune.search_plan import plan
    from flashtune.targets import get as get_target
    specs = ((),) + tuple(tuple(sorted(parse_spec(s).items()))
                          for s in ("window=1024", "density=0.1+softcap"))
    planned = plan(get_target("H100"), ("fwd", "splitkv"), ("bfloat16",), (128,), (True,),
                   (4096,), (), specs)
    masks = sorted({(pb.bucket.family, pb.bucket.mask) for pb in planned})
    assert ("fwd", "window1024") in masks and ("fwd", "softcap+block8") in masks
    assert not any(f == "splitkv" and "block" in m for f, m in masks)  # no block-sparse split-KV
    for pb in planned:
        v = pb.space.variants()[0] if hasattr(pb.space, "variants") else None
        assert v is None or set(v.masks) == set(pb.problem.mask_kinds)
    with pytest.raises(ValueError, match="mask spec"):
        parse_spec("window=-3")


def test_tuned_db_stores_masked_records(tmp_path):
    from test_db import make_record

    from flashtune.tuned_db import TunedDB
    db = TunedDB(f"sqlite:///{tmp_path / 'tuned.db'}")
    dense = make_record()
    masked = dataclasses.replace(dense, bucket=dataclasses.replace(dense.bucket,
                                                                   mask="window1024"))
    db.put(dense)
    db.put(masked)
    got = {r.bucket.mask: r for r in db.records()}
    assert set(got) == {"", "window1024"} and got["window1024"].bucket == masked.bucket


def test_block_mask_under_torch_compile(device):
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 1, 40, 70, 32, torch.float32, device))
    bm = BlockMask.from_mask(torch.rand(40, 70, device=device) < 0.7, block_size=32)

    def f(q, k, v):
        return flashtune.attention(q, k, v, block_mask=bm, window=(30, 10), softcap=2.0)

    with flashtune.force(FWD):
        want = f(q, k, v)
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    g1 = torch.autograd.grad(got.sum(), (q, k, v))
    g2 = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_the_search_times_a_kept_plan_not_its_construction(monkeypatch):
    """FwdOps.run builds a variant's launch plan once per (variant, problem, inputs), as the
    dispatcher memoizes a call's: the timed runs are the launches."""
    from flashtune import launch
    from flashtune.measure_fwd import OPS as FWD_OPS
    built = []
    real = launch.FwdPlan

    class Counting(real):
        __slots__ = ()

        def __init__(self, *a, **kw):
            built.append(1)
            super().__init__(*a, **kw)
    monkeypatch.setattr(launch, "FwdPlan", Counting)
    monkeypatch.setattr(FWD_OPS, "_plans", {}, raising=False)
    p = Problem("fwd", "float32", 16, True, 1, 2, 2, 40, 40)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    var = Variant.parse("fwd-m16-n16-w4-s1")
    outs = [FWD_OPS.run(var, p, (q, k, v)) for _ in range(3)]
    assert len(built) == 1 and all(torch.equal(o, outs[0]) for o in outs)
    assert_matches_reference(q, k, v, causal=True, out=outs[0])
    q2 = torch.randn_like(q)  # other inputs: another plan
    FWD_OPS.run(var, p, (q2, k, v))
    assert len(built) == 2
