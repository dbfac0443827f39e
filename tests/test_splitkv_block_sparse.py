"""splitkv serving decode-shaped dense forwards with masks: a window, a softcap, and a block mask
(its block_sparse render: each split walks its share of the kept blocks' lists). Against the float64 reference with the mask's
dense form, in Triton's interpreter (float16) or on the GPU (bfloat16 too)."""
import pytest
import torch

import flashtune
from flashtune.accuracy import compare
from flashtune.codegen import Variant
from flashtune.reference import reference, same_dtype_math


def _blocks(b, hm, nqb, nkb, density, g):
    return torch.rand(b, hm, nqb, nkb, generator=g) < density


def _case(device, dtype, *, b=2, h=8, hk=2, nq=1, nk=300, d=64, bs=32, density=0.4, elem=False,
          mask_b=None, mask_h=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g).to(dtype).to(device)
    k = torch.randn(b, hk, nk, d, generator=g).to(dtype).to(device)
    v = torch.randn(b, hk, nk, d, generator=g).to(dtype).to(device)
    mb = b if mask_b is None else mask_b
    blocks = _blocks(mb, mask_h, -(-nq // bs), -(-nk // bs), density, g)
    em = (torch.rand(mb, mask_h, nq, nk, generator=g) < 0.6).to(device) if elem else None
    bm = flashtune.BlockMask.from_dense(blocks.to(device), (nq, nk), block_size=bs, mask=em)
    return q, k, v, bm


def _check(q, k, v, bm, causal=False):
    ex = flashtune.explain(q, k, v, causal=causal, block_mask=bm)
    o = flashtune.attention(q, k, v, causal=causal, block_mask=bm)
    dense = bm.to_dense_mask()
    ref = reference(q, k, v, causal=causal, mask=dense)
    base = same_dtype_math(q, k, v, causal=causal, mask=dense)
    rep = compare(o, ref, base)
    assert rep.ok, f"{ex.variant.name}: {rep}"
    return ex, o


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,h,hk", [(1, 8, 2), (3, 4, 4), (2, 8, 1)])
@pytest.mark.parametrize("elem", [False, True])
def test_decode_calls_walk_the_block_lists(device, nq, h, hk, causal, elem):
    q, k, v, bm = _case(device, torch.float16, h=h, hk=hk, nq=nq, elem=elem)
    ex, _ = _check(q, k, v, bm, causal)
    assert ex.variant.family == "splitkv" and ex.variant.block_sparse, str(ex)
    assert not any("plan runs" in n for n in ex.notes), ex.notes


@pytest.mark.parametrize("nq,h,hk,causal,window,softcap", [
    (1, 8, 2, False, (64, -1), None), (3, 4, 4, True, (50, 0), None),
    (2, 8, 1, False, None, 15.0), (2, 8, 2, True, (100, 0), 20.0)])
def test_decode_calls_with_a_window_or_softcap_run_splitkv(device, nq, h, hk, causal, window,
                                                           softcap):
    g = torch.Generator().manual_seed(nq * h)
    q = torch.randn(2, h, nq, 64, generator=g).half().to(device)
    k, v = (torch.randn(2, hk, 333, 64, generator=g).half().to(device) for _ in range(2))
    kw = dict(causal=causal, window=window, softcap=softcap)
    ex = flashtune.explain(q, k, v, **kw)
    assert ex.variant.family == "splitkv", str(ex)
    rep = compare(flashtune.attention(q, k, v, **kw), reference(q, k, v, **kw),
                  same_dtype_math(q, k, v, **kw))
    assert rep.ok, f"{ex.variant.name}: {rep}"


@pytest.mark.parametrize("splits", [1, 3, 16])
def test_every_split_count_including_splits_with_no_blocks(device, splits):
    """16 splits over a handful of kept blocks: most get none (O 0, LSE -inf in the scratch,
    nothing added by the combine); broadcast over batch, odd key count (a tail block)."""
    q, k, v, bm = _case(device, torch.float16, nk=257, density=0.15, elem=True, mask_b=1,
                        seed=splits)
    v_ = Variant.parse(f"splitkv-m16-n32-w4-s2-sp{splits}-block_sparse=true")
    with flashtune.force(v_):
        _check(q, k, v, bm)


def test_rows_that_see_no_key_are_zero(device):
    q, k, v, _ = _case(device, torch.float16)
    blocks = torch.zeros(2, 1, 1, -(-300 // 32), dtype=torch.bool)
    blocks[0, 0, 0, 3] = True  # the second sequence keeps nothing
    bm = flashtune.BlockMask.from_dense(blocks.to(device), (1, 300), block_size=32)
    _, o = _check(q, k, v, bm)
    assert torch.isfinite(o).all() and (o[1] == 0).all() and (o[0] != 0).any()


def test_block_size_64_with_a_window_and_softcap(device):
    q, k, v, bm = _case(device, torch.float16, nq=2, nk=400, bs=64, elem=True)
    ex = flashtune.explain(q, k, v, causal=True, block_mask=bm, window=(100, 0), softcap=20.0)
    o = flashtune.attention(q, k, v, causal=True, block_mask=bm, window=(100, 0), softcap=20.0)
    dense = bm.to_dense_mask()
    ref = reference(q, k, v, causal=True, mask=dense, window=(100, 0), softcap=20.0)
    base = same_dtype_math(q, k, v, causal=True, mask=dense, window=(100, 0), softcap=20.0)
    assert ex.variant.family == "splitkv" and ex.variant.masks == ("window", "softcap",
                                                                    "block_sparse"), str(ex)
    assert compare(o, ref, base).ok


def test_a_mask_per_q_head_with_gqa_runs_the_generic_forward(device):
    """A tile packs the GROUP q heads of a kv head: a mask that differs per q head cannot be
    walked there; the plan runs the fwd default with the mask, and explain says so."""
    q, k, v, bm = _case(device, torch.float16, h=8, hk=2, nq=2, elem=True, mask_h=8)
    ex, _ = _check(q, k, v, bm)
    assert any("differs per q head" in n for n in ex.notes), ex.notes
    # with one q head per kv head, the same per-head mask is walked by splitkv itself
    q, k, v, bm = _case(device, torch.float16, h=4, hk=4, nq=2, elem=True, mask_h=4)
    ex, _ = _check(q, k, v, bm)
    assert ex.variant.family == "splitkv" and not any("plan runs" in n for n in ex.notes)


def test_splitkv_plans_refuse_what_they_cannot_walk():
    from flashtune.launch_splitkv import SplitKVPlan
    from flashtune.masks import Masks
    q = torch.empty(1, 3, 8, 64, dtype=torch.float16, device="meta")  # (B, Nq, H, D)
    k = torch.empty(1, 256, 2, 64, dtype=torch.float16, device="meta")
    blocks = torch.ones(1, 1, 1, 8, dtype=torch.bool)
    bm = flashtune.BlockMask.from_dense(blocks, (3, 256), block_size=32)
    paged = Variant.parse("splitkv-m16-n32-w4-s2-paged=true-block_sparse=true")
    with pytest.raises(ValueError, match="paged renders take no block mask"):
        SplitKVPlan(q, k, False, None, paged, Masks(None, None, bm))
    q20 = torch.empty(1, 20, 8, 64, dtype=torch.float16, device="meta")  # 20 tokens, 16-blocks
    small = flashtune.BlockMask.from_dense(torch.ones(1, 1, 2, 16, dtype=torch.bool), (20, 256),
                                           block_size=16)
    v_ = Variant.parse("splitkv-m16-n16-w4-s2-block_sparse=true")
    with pytest.raises(ValueError, match="span several query blocks"):
        SplitKVPlan(q20, k, False, None, v_, Masks(None, None, small))


def test_own_calls_never_carry_block_masks():
    """block_sparse is a served-call field of splitkv: its own (kvcache) problems and the
    search's buckets of them take none, and a dense render's text is unchanged."""
    from flashtune.codegen import render
    from flashtune.families import get
    fam = get("splitkv")
    assert "block_sparse" not in fam.mask_fields("splitkv")
    assert "block_sparse" in fam.mask_fields("fwd")
    dense = render(Variant.parse("splitkv-m16-n32-w4-s2"))
    sparse = render(Variant.parse("splitkv-m16-n32-w4-s2-block_sparse=true"))
    assert "BM_FULL_IDX" in sparse and "BM_FULL_IDX" not in dense and "_mask_word" not in dense


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nk", [2048, 32768 + 77])
def test_gpu_decode_with_a_block_mask(dtype, nk):
    q, k, v, bm = _case("cuda", dtype, b=2, h=32, hk=8, nq=1, nk=nk, d=128, bs=128,
                        density=0.2, elem=True, mask_b=2)
    ex, _ = _check(q, k, v, bm)
    assert ex.variant.family == "splitkv" and ex.variant.block_sparse, str(ex)
