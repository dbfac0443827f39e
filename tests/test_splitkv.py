"""Split-KV (Flash-Decoding) kernels and flashtune.attention_with_kvcache, against the float64
reference on the equivalent dense problem of each sequence. Tiny shapes: the interpreter is slow."""
import dataclasses

import pytest
import torch

import flashtune
from flashtune.accuracy import compare
from flashtune.codegen import Variant, render
from flashtune.launch_splitkv import MAX_SPLITS, auto_num_splits, clamp_num_splits
from flashtune.reference import reference, same_dtype_math

DTYPES = [torch.float16, torch.float32, torch.bfloat16]
SMALL = "splitkv-m16-n16-w4-s1"  # BLOCK_N 16: several key blocks in a tiny cache


def variant(num_splits=0, extra=""):
    return SMALL + (f"-sp{num_splits}" if num_splits else "") + extra


def make(b, nq, hq, hk, d, cap, dtype, device):
    q = torch.randn(b, nq, hq, d, dtype=dtype, device=device)
    kc = torch.randn(b, cap, hk, d, dtype=dtype, device=device)
    vc = torch.randn(b, cap, hk, d, dtype=dtype, device=device)
    return q, kc, vc


def check(q, kc, vc, lengths, out, causal=False, lse=None, scale=None):
    """out (B, Nq, Hq, D) against the reference of each sequence over its first lengths[b] keys
    of the contiguous caches kc, vc (B, N, Hk, D)."""
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    for b, n in enumerate(lengths):
        qb = q[b:b + 1].transpose(1, 2)
        kb, vb = (t[b:b + 1, :n].transpose(1, 2) for t in (kc, vc))
        ob = out[b:b + 1].transpose(1, 2)
        if n == 0:
            assert (ob == 0).all(), f"sequence {b} has no keys: expected zeros"
            if lse is not None:
                assert (lse[b] == float("-inf")).all()
            continue
        ref, ref_lse = reference(qb, kb, vb, causal=causal, scale=scale, return_lse=True)
        rep = compare(ob, ref, same_dtype_math(qb, kb, vb, causal=causal, scale=scale))
        assert rep.ok, f"sequence {b} (L={n}): {rep}"
        if lse is not None:
            assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
            ok = torch.isfinite(ref_lse).cpu()
            assert torch.equal(torch.isfinite(lse[b:b + 1].double().cpu()), ok.cpu())
            torch.testing.assert_close(lse[b:b + 1].double().cpu()[ok], ref_lse.cpu()[ok],
                                       atol=1e-4, rtol=1e-4)


def run(q, kc, vc, seqlens, var=variant(), **kw):
    with flashtune.force(var):
        return flashtune.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, **kw)


# -- numerics ------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_splits_match_reference(num_splits, dtype, device):
    # 7 splits of 100 keys in blocks of 16: splits 4..6 of the first sequence and 3..6 of the
    # second have no keys (and must add nothing, no NaN)
    q, kc, vc = make(2, 1, 4, 2, 32, 112, dtype, device)
    lengths = [100, 37]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    out, lse = run(q, kc, vc, seqlens, variant(num_splits), return_lse=True)
    check(q, kc, vc, lengths, out, lse=lse)


@pytest.mark.parametrize("hq,hk", [(2, 2), (8, 2), (4, 1)])  # groups 1, 4 and MQA
def test_gqa_groups(hq, hk, device):
    q, kc, vc = make(1, 1, hq, hk, 16, 70, torch.float16, device)
    out = run(q, kc, vc, 70, variant(3))
    check(q, kc, vc, [70], out)


@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_causal_bottom_right(nq, dtype, device):
    # lengths 2 < nq: the first query tokens of that sequence see no key (zeros)
    q, kc, vc = make(3, nq, 4, 2, 16, 64, dtype, device)
    lengths = [64, 33, 2]
    out, lse = run(q, kc, vc, torch.tensor(lengths, dtype=torch.int32, device=device),
                   variant(3), causal=True, return_lse=True)
    check(q, kc, vc, lengths, out, causal=True, lse=lse)


def test_ragged_with_empty_and_single_key(device):
    q, kc, vc = make(3, 2, 2, 1, 16, 48, torch.float16, device)
    lengths = [0, 1, 45]
    out, lse = run(q, kc, vc, torch.tensor(lengths, dtype=torch.int32, device=device),
                   variant(2), return_lse=True)
    check(q, kc, vc, lengths, out, lse=lse)


def test_auto_num_splits_runs(device):
    q, kc, vc = make(1, 1, 2, 1, 16, 80, torch.float32, device)
    out = run(q, kc, vc, 80, variant(0), scale=0.3)
    check(q, kc, vc, [80], out, scale=0.3)


def test_matches_split_q_attention(device):
    q, kc, vc = make(2, 3, 4, 2, 32, 40, torch.float16, device)
    out = run(q, kc, vc, 40, variant(3), causal=True)
    dense = flashtune.attention(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                causal=True).transpose(1, 2)
    torch.testing.assert_close(out, dense, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_append_in_place(dtype, device):
    q, kc, vc = make(2, 3, 4, 2, 16, 48, dtype, device)
    k_new, v_new = (torch.randn(2, 3, 2, 16, dtype=dtype, device=device) for _ in range(2))
    lengths = [5, 40]
    before_k, before_v = kc.clone(), vc.clone()
    out = run(q, kc, vc, torch.tensor(lengths, dtype=torch.int32, device=device), variant(2),
              k=k_new, v=v_new, causal=True)
    expect_k, expect_v = before_k.clone(), before_v.clone()
    for b, s in enumerate(lengths):
        expect_k[b, s:s + 3] = k_new[b]
        expect_v[b, s:s + 3] = v_new[b]
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)
    check(q, kc, vc, [n + 3 for n in lengths], out, causal=True)


def to_paged(kc, vc, page, generator_seed=0):
    """The contiguous caches (B, N, Hk, D) as pages in shuffled order, plus one spare page
    (NaN: a kernel that reads it fails)."""
    b, n, hk, d = kc.shape
    per = n // page
    g = torch.Generator().manual_seed(generator_seed)
    perm = torch.randperm(b * per + 1, generator=g)
    block_table = perm[:b * per].view(b, per).to(torch.int32).to(kc.device)
    kp = torch.full((b * per + 1, page, hk, d), float("nan"), dtype=kc.dtype, device=kc.device)
    vp = kp.clone()
    for i in range(b):
        for j in range(per):
            kp[block_table[i, j]] = kc[i, j * page:(j + 1) * page]
            vp[block_table[i, j]] = vc[i, j * page:(j + 1) * page]
    return kp, vp, block_table


@pytest.mark.parametrize("loads", ["pointer", "descriptor"])
def test_paged_equals_contiguous(loads, device):
    q, kc, vc = make(2, 2, 4, 2, 16, 64, torch.float16, device)
    k_new, v_new = (torch.randn(2, 2, 2, 16, dtype=torch.float16, device=device) for _ in range(2))
    lengths = torch.tensor([30, 50], dtype=torch.int32, device=device)
    # NaN past each sequence's keys (after the append): a kernel that lets them in fails
    for b, n in enumerate(lengths.tolist()):
        kc[b, n + 2:] = float("nan")
        vc[b, n + 2:] = float("nan")
    kp, vp, bt = to_paged(kc, vc, 16)
    extra = "" if loads == "pointer" else "-loads=descriptor"
    ref = run(q, kc, vc, lengths, variant(2, extra), k=k_new, v=v_new, causal=True)
    out = run(q, kp, vp, lengths, variant(2, extra), k=k_new, v=v_new, causal=True,
              block_table=bt)
    # equal up to rounding: a paged split starts where the longest sequence puts it, a
    # contiguous one where its own length does (the same keys, merged in other groups)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    # the appended keys landed in the right pages
    for b in range(2):
        for t in range(2):
            pos = int(lengths[b]) + t
            assert torch.equal(kp[bt[b, pos // 16], pos % 16], k_new[b, t])
            assert torch.equal(vp[bt[b, pos // 16], pos % 16], v_new[b, t])
    check(q, kc, vc, [32, 52], out, causal=True)


@pytest.mark.parametrize("loads", ["pointer", "descriptor"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_pages_of_several_key_blocks(loads, num_splits, device):
    # 64-key pages, 16-key blocks: a split walks several blocks of a page (whose table entry it
    # does not read again) and crosses into shuffled pages mid-split; ragged lengths end inside
    # a page, and Nq = 2 causal masks the last blocks
    q, kc, vc = make(2, 2, 4, 2, 16, 192, torch.float16, device)
    lengths = [70, 181]
    for b, n in enumerate(lengths):
        kc[b, n:] = float("nan")
        vc[b, n:] = float("nan")
    kp, vp, bt = to_paged(kc, vc, 64, generator_seed=3)
    sl = torch.tensor(lengths, dtype=torch.int32, device=device)
    extra = "" if loads == "pointer" else "-loads=descriptor"
    out = run(q, kp, vp, sl, variant(num_splits, extra), causal=True, block_table=bt)
    check(q, kc, vc, lengths, out, causal=True)


@pytest.mark.parametrize("paged", [False, True])
def test_int_cache_seqlens_append(paged, device):
    # an int cache_seqlens is one length for every sequence: no lengths tensor (UNIFORM), the
    # append lands at that position, the keys past it (NaN) are never read
    q, kc, vc = make(2, 2, 4, 2, 16, 64, torch.float16, device)
    k_new, v_new = (torch.randn(2, 2, 2, 16, dtype=torch.float16, device=device) for _ in range(2))
    kc[:, 41:] = float("nan")
    vc[:, 41:] = float("nan")
    kw = dict(k=k_new, v=v_new, causal=True)
    if paged:
        kp, vp, bt = to_paged(kc, vc, 16)
        out = run(q, kp, vp, 39, variant(3), block_table=bt, **kw)
        for b in range(2):
            for t in range(2):
                assert torch.equal(kp[bt[b, (39 + t) // 16], (39 + t) % 16], k_new[b, t])
        kc[:, 39:41], vc[:, 39:41] = k_new, v_new  # what the reference attends to
    else:
        out = run(q, kc, vc, 39, variant(3), **kw)
        assert torch.equal(kc[:, 39:41], k_new) and torch.equal(vc[:, 39:41], v_new)
    check(q, kc, vc, [41, 41], out, causal=True)


def test_descriptor_loads_contiguous(device):
    q, kc, vc = make(2, 1, 4, 2, 32, 64, torch.bfloat16, device)
    lengths = [64, 21]
    out = run(q, kc, vc, torch.tensor(lengths, dtype=torch.int32, device=device),
              variant(3, "-loads=descriptor"))
    check(q, kc, vc, lengths, out)


@pytest.mark.parametrize("num_splits,d", [(3, 16), (100, 64), (300, 40)])
def test_combine_merges_exactly(num_splits, d, device):
    """The combine alone on random partial results (some splits empty: LSE -inf, one row with
    every split empty), against the float64 merge. 100 and 300 splits take the thin-slice tiles
    (several programs per row, a head dim that is not a power of two)."""
    import triton

    from flashtune.codegen import load
    from flashtune.launch_splitkv import combine_tile
    b, h, nq = 2, 3, 1
    rows = b * h * nq
    o_part = torch.randn(rows, num_splits, d, dtype=torch.float32, device=device)
    lse_part = torch.randn(rows, num_splits, dtype=torch.float32, device=device) * 4
    lse_part[:, ::3] = float("-inf")
    lse_part[rows - 1] = float("-inf")
    o = torch.empty(b, nq, h, d, dtype=torch.float16, device=device)
    lse = torch.empty(b, h, nq, dtype=torch.float32, device=device)
    block_s, chunk_d = combine_tile(num_splits, triton.next_power_of_2(d))
    load(Variant.parse(SMALL)).attn_splitkv_combine[(rows, triton.cdiv(d, chunk_d))](
        o_part, lse_part, o, lse, h, nq, num_splits, o.stride(0), o.stride(1), o.stride(2),
        HEAD_DIM=d, BLOCK_S=block_s, CHUNK_D=chunk_d, USE_PDL=False)
    ref_lse = torch.logsumexp(lse_part.double(), 1)
    w = torch.exp(lse_part.double() - ref_lse[:, None]).nan_to_num(0.0)
    ref_o = (w[:, :, None] * o_part.double()).sum(1)
    got_o = o.transpose(1, 2).reshape(rows, d).double()  # rows are (b, head, token)
    torch.testing.assert_close(got_o[:-1].cpu(), ref_o[:-1].cpu(), atol=2e-3, rtol=2e-3)
    assert (got_o[-1] == 0).all() and lse.reshape(-1)[-1] == float("-inf")
    torch.testing.assert_close(lse.reshape(-1)[:-1].double().cpu(), ref_lse[:-1].cpu(),
                               atol=1e-5, rtol=1e-5)


# -- the num_splits rule and the renders ---------------------------------------------------------
def test_num_splits_rule():
    # H100: B=1, Hk=8, 32k keys, BLOCK_N=64 -> about one wave of 132 SMs
    assert auto_num_splits(8, 32768, 64, 132) == 16
    assert auto_num_splits(64, 32768, 64, 132) == 2
    assert auto_num_splits(256, 32768, 64, 132) == 1   # enough programs already
    assert auto_num_splits(8, 256, 64, 132) == 4       # 4 blocks: one block per split
    assert auto_num_splits(8, 64, 64, 132) == 1        # one block: one split
    assert auto_num_splits(1, 4096, 64, 132) == 64     # MQA B=1: a wave of one-block splits
    assert auto_num_splits(1, 32768, 64, 132) == 132   # 512 blocks: one wave
    assert auto_num_splits(1, 1 << 20, 64, 132) == 132
    assert auto_num_splits(1, 1 << 20, 64, 1000) == MAX_SPLITS  # capped
    assert auto_num_splits(8, 0, 64, 132) == 1
    assert clamp_num_splits(7, 40, 16) == 3 and clamp_num_splits(7, 0, 16) == 1


def test_renders():
    for name in (SMALL, SMALL + "-loads=descriptor", SMALL + "-paged=true",
                 SMALL + "-loads=descriptor-paged=true"):
        v = Variant.parse(name)
        gpu, cpu = render(v), render(v, interpret=True)
        assert "_interp_tile" not in gpu and "_interp_tile" in cpu
        assert len(gpu.splitlines()) == len(cpu.splitlines())
        assert ("block_table" in gpu.lower()) and (("page * stride_kp" in gpu)
                                                  == (v.paged and v.loads == "pointer"))
    assert Variant.parse(SMALL + "-sp3-paged=true").name == SMALL + "-sp3-paged=true"
    with pytest.raises(ValueError, match="paged"):
        Variant("fwd", 64, 64, 4, 2, paged=True)
    # the default (contiguous) variants keep their names and keys
    assert "paged" not in Variant.parse(SMALL).to_dict()


# -- bad input: a clear error naming the argument, before anything is written or launched -------
def _bad_cases(device):
    f16 = torch.float16
    b, cap, hk, d = 2, 32, 2, 16
    q = torch.randn(b, 1, 4, d, dtype=f16, device=device)
    kc = torch.randn(b, cap, hk, d, dtype=f16, device=device)
    vc = torch.randn_like(kc)
    kn = torch.randn(b, 2, hk, d, dtype=f16, device=device)
    vn = torch.randn_like(kn)
    sl = torch.tensor([3, 10], dtype=torch.int32, device=device)
    kp = torch.randn(5, 16, hk, d, dtype=f16, device=device)
    vp = torch.randn_like(kp)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    base = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=sl, k=kn, v=vn)
    paged = dict(base, k_cache=kp, v_cache=vp, block_table=bt)
    return [
        ("cache_seqlens", dict(base, cache_seqlens=torch.tensor([3, 33], **i32))),
        ("cache_seqlens", dict(base, cache_seqlens=torch.tensor([-1, 3], **i32))),
        ("cache_seqlens", dict(base, cache_seqlens=-2)),
        ("cache_seqlens", dict(base, cache_seqlens=sl.long())),
        ("cache_seqlens", dict(base, cache_seqlens=torch.tensor([3, 4, 5], **i32))),
        ("cache_seqlens", dict(base, cache_seqlens=3.0)),
        ("cache_seqlens", dict(paged, cache_seqlens=torch.tensor([3, 33], **i32))),
        ("appending k/v", dict(base, cache_seqlens=torch.tensor([3, 31], **i32))),  # past cap
        ("appending k/v", dict(paged, cache_seqlens=torch.tensor([31, 3], **i32))),  # pages
        ("block_table", dict(paged, block_table=torch.tensor([[5, 1], [2, 3]], **i32))),
        ("block_table", dict(paged, block_table=torch.tensor([[0, 1], [-1, 3]], **i32))),
        ("block_table", dict(paged, block_table=bt.long())),
        ("block_table", dict(paged, block_table=bt[:1])),
        ("page size", dict(paged, k_cache=kp[:, :8], v_cache=vp[:, :8])),
        ("v_cache", dict(base, v_cache=vc[:, :16])),
        ("k_cache", dict(base, k_cache=kc.float(), v_cache=vc.float())),
        ("v_cache", dict(base, v_cache=vc.bfloat16())),
        ("k_cache", dict(base, k_cache=kc[:1], v_cache=vc[:1])),
        ("head_dim", dict(base, q=torch.randn(b, 1, 4, 32, dtype=f16, device=device))),
        ("q.dtype", dict(base, q=q.to(torch.int8))),
        ("k.dtype", dict(base, k=kn.float())),
        ("k and v", dict(base, v=None)),
        ("k and v", dict(base, v=vn[:, :1])),
        ("k and v", dict(base, k=kn[:, :, :1], v=vn[:, :, :1])),
        ("heads", dict(base, q=torch.randn(b, 1, 3, d, dtype=f16, device=device))),
        ("causal", dict(base, causal=1)),
        ("scale", dict(base, scale=-1.0)),
    ]


def test_bad_inputs_name_the_argument_and_write_nothing(device):
    for i, (name, kwargs) in enumerate(_bad_cases(device)):
        caches = [kwargs["k_cache"], kwargs["v_cache"]]
        before = [c.clone() for c in caches]
        args = [kwargs.pop(n) for n in ("q", "k_cache", "v_cache")]
        with pytest.raises((ValueError, TypeError), match=name) as info:
            flashtune.attention_with_kvcache(*args, **kwargs)
        for c, c0 in zip(caches, before):
            assert torch.equal(c, c0), f"case {i} ({name}: {info.value}) wrote to the cache"


def test_search_space_builds():
    from flashtune.problem import Problem
    from flashtune.search_space import Space
    from flashtune.targets import get
    p = Problem("splitkv", "bfloat16", 128, False, 4, 1, 32, 1, 32768)
    space = Space.build("splitkv", get("H100"), p)
    names = {v.name for v in space.feasible}
    assert "splitkv-m16-n64-w4-s3" in names and "splitkv-m16-n64-w4-s3-sp16" in names
    assert all(v.family == "splitkv" and not v.paged for v in space.feasible)
    assert ("loads", "descriptor", "tma") in Space.build("splitkv", get("A100"), p).dropped



def test_measure_runs_keep_their_plan(device):
    """The search's timed runs reuse the plan of the first run (kept_plan): same output,
    no second plan for the same variant, problem and inputs."""
    from flashtune.codegen import Variant
    from flashtune.measure_splitkv import SplitKVOps
    from flashtune.problem import Problem
    ops = SplitKVOps(device=device)
    p = Problem("splitkv", "float16", 32, False, 2, 2, 4, 1, 70)
    gp = ops.gate_problem(p)
    inputs = ops.inputs(gp, seed=0)
    ref = ops.reference(gp, inputs)
    v = Variant.parse("splitkv-m16-n32-w4-s1-sp2")
    out = ops.run(v, gp, inputs)
    assert ops.check(out, gp, ref).ok
    key = (v, gp, inputs[0].data_ptr(), device)
    plan = ops._plans[key]
    again = ops.run(v, gp, inputs)
    assert ops._plans[key] is plan and len(ops._plans) == 1
    assert ops.check(again, gp, ref).ok
    assert not ops.check(out * 1.1, gp, ref).ok


def test_the_search_times_a_step_of_layers_each_with_its_own_cache(device, monkeypatch):
    """A decode bucket is timed as a server replays a step (and as `flashtune bench` times every
    peer): several layers, each reading its own cache, the time per layer -- one call alone
    timed its launch and the L2 flush's write-back beside its reads (session 31)."""
    from flashtune.codegen import Variant
    from flashtune.measure_splitkv import SplitKVOps
    from flashtune.problem import Problem
    gpu = SplitKVOps(device="cuda")  # its layer count is arithmetic: nothing runs here
    mqa_b1_2k = Problem("splitkv", "bfloat16", 128, False, 8, 1, 8, 1, 2048)
    gqa_b8_32k = Problem("splitkv", "bfloat16", 128, False, 4, 8, 32, 1, 32768)
    gqa_b64_128k = Problem("splitkv", "bfloat16", 128, False, 4, 64, 32, 1, 131072)
    assert gpu.layers(mqa_b1_2k) == 16          # 1 MiB a layer
    assert gpu.layers(gqa_b8_32k) == 8          # 1 GiB a layer, 8 GiB a step at most
    assert gpu.layers(gqa_b64_128k) == 1        # 32 GiB a layer
    ops = SplitKVOps(device=device)
    p = Problem("splitkv", "float16", 32, False, 2, 2, 4, 1, 70)
    assert ops.layers(p) == (16 if device == "cuda" else 1)
    monkeypatch.setattr(ops, "layers", lambda p: 3)
    q, ks, vs, seqlens = ops.step_inputs(p, seed=1)
    assert len(ks) == len(vs) == 3 and all(k.shape == ks[0].shape for k in ks + vs)
    assert not any(torch.equal(a, b) for i, a in enumerate(ks + vs) for b in (ks + vs)[i + 1:])
    v = Variant.parse("splitkv-m16-n32-w4-s1-sp2")
    out = ops.step(v, p, (q, ks, vs, seqlens))
    ref = ops.reference(p, (q, ks[2], vs[2], seqlens))  # the last layer's
    assert ops.check(out, p, ref).ok
    assert not ops.check(out, p, ops.reference(p, (q, ks[0], vs[0], seqlens))).ok


def test_the_gpu_backend_times_the_step_and_reports_it_per_layer(monkeypatch):
    """measure() and retime() time ops.step on ops.step_inputs where a family has them, and
    divide by ops.layers; the gate still runs one call on the gate's inputs."""
    from types import SimpleNamespace

    from flashtune import measure_gpu, timing
    from flashtune.codegen import Variant
    from flashtune.problem import Problem
    seen = []

    class Ops:
        graphed = False
        gate_problem = staticmethod(lambda p: p)
        inputs = staticmethod(lambda p, seed: ("one", seed))
        reference = staticmethod(lambda p, i: None)
        check = staticmethod(lambda out, p, ref: SimpleNamespace(ok=True, max_err=0.0))
        layers = staticmethod(lambda p: 4)
        step_inputs = staticmethod(lambda p, seed: ("step", seed))

        @staticmethod
        def run(variant, p, inputs):
            seen.append(("run", inputs[0]))

        @staticmethod
        def step(variant, p, inputs):
            seen.append(("step", inputs[0]))

    def bench(fn, **kw):
        fn()
        return 8.0, 0.01

    def interleaved(fns, rounds, reps, flush, seed):
        for f in fns:
            f()
        return [(12.0, 0.02) for _ in fns]
    monkeypatch.setattr(measure_gpu.GpuBackend, "_ops", lambda self, family: Ops)
    monkeypatch.setattr(timing, "bench", bench)
    monkeypatch.setattr(timing, "interleaved", interleaved)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    b = measure_gpu.GpuBackend(smem_limit=1 << 20)
    p = Problem("splitkv", "float16", 32, False, 2, 2, 4, 1, 70)
    got = b.measure(Variant.parse("splitkv-m16-n32-w4-s1"), p)
    assert got.ok and got.ms == 2.0, got
    assert seen == [("run", "one"), ("step", "step")]
    assert b.retime([Variant.parse("splitkv-m16-n32-w4-s1")], p, 1) == [(3.0, 0.02)]

# -- splitkv serving dense forwards (families compete in the dispatcher) -------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,h,hk", [(1, 8, 2), (3, 4, 4), (2, 6, 1)])
def test_dense_attention_routes_decode_shapes_to_splitkv(nq, h, hk, causal, device):
    import flashtune
    from flashtune.accuracy import compare
    from flashtune.reference import reference, same_dtype_math
    q = torch.randn(2, h, nq, 64, dtype=torch.float16, device=device)
    k = torch.randn(2, hk, 150, 64, dtype=torch.float16, device=device)
    v = torch.randn_like(k)
    ex = flashtune.explain(q, k, v, causal=causal)
    assert ex.variant.family == "splitkv" and any("competed" in n for n in ex.notes), str(ex)
    o, lse = flashtune.attention(q, k, v, causal=causal, return_lse=True)
    assert o.shape == q.shape and o.stride() == q.stride() and lse.shape == q.shape[:3]
    report = compare(o, reference(q, k, v, causal=causal), same_dtype_math(q, k, v, causal=causal))
    assert report.ok, str(report)
    # a training-shaped call stays with the split-Q family
    assert flashtune.explain(torch.randn(2, h, 128, 64), k, v).variant.family == "fwd"


def test_a_growing_cache_builds_one_plan_per_bucket(device, monkeypatch):
    """transformers' DynamicCache: each decoding step attends to a cache one key longer (new
    shape, new strides). The dense forward builds and dispatches the splitkv plan once per key
    count bucket, not once per step, and every step matches the float64 reference."""
    from flashtune import dispatch, ops
    from flashtune.launch_splitkv import DensePlan
    ops._plans.clear()
    ops._bucket_plans.clear()
    built = []
    real = DensePlan.__init__

    def counting(self, *a, **kw):
        built.append(a[1].shape[2])
        real(self, *a, **kw)
    monkeypatch.setattr(DensePlan, "__init__", counting)
    selects = []
    real_select = dispatch.select_for_call
    monkeypatch.setattr(dispatch, "select_for_call",
                        lambda *a, **kw: (selects.append(1), real_select(*a, **kw))[1])
    b, h, hk, d = 2, 4, 2, 32
    q = torch.randn(b, 1, h, d, dtype=torch.float16, device=device).transpose(1, 2)
    k_all = torch.randn(b, hk, 100, d, dtype=torch.float16, device=device)
    v_all = torch.randn_like(k_all)
    for n in range(91, 100):  # one bucket: log2_bucket gives 128 for 91..181
        k = k_all[:, :, :n].contiguous()  # as torch.cat makes it: strides follow n
        v = v_all[:, :, :n].contiguous()
        o = flashtune.attention(q, k, v)
        rep = compare(o, reference(q, k, v), same_dtype_math(q, k, v))
        assert rep.ok, f"{n} keys: {rep}"
    assert len(built) == 1 and len(selects) == 1, (built, selects)
    # the next bucket gets its own plan; a forced variant its own too
    k = k_all[:, :, :40].contiguous()
    flashtune.attention(q, k, k)
    with flashtune.force("splitkv-m16-n16-w4-s1-sp2"):
        o = flashtune.attention(q, k, k)
    assert compare(o, reference(q, k, k), same_dtype_math(q, k, k)).ok
    assert built == [91, 40, 40]


def test_forced_splitkv_serves_dense_forward_and_backward_matches_reference(device):
    import flashtune
    from test_backward import assert_grads_match
    q = torch.randn(1, 4, 2, 32, dtype=torch.float16, device=device)
    k = torch.randn(1, 2, 70, 32, dtype=torch.float16, device=device)
    v = torch.randn_like(k)
    with flashtune.force("splitkv-m16-n32-w4-s1-sp3"):
        assert flashtune.explain(q, k, v, causal=True).variant.family == "splitkv"
        # the bwd family consumes splitkv's O and LSE: gradients against the float64 reference
        assert_grads_match(q, k, v, causal=True)


# -- checked values are remembered per tensor version; kernels clamp to the cache ----------------
def test_values_rechecked_after_an_in_place_change(device):
    import flashtune
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=device)
    kc = torch.randn(2, 64, 2, 32, dtype=torch.float16, device=device)
    vc = torch.randn_like(kc)
    sl = torch.tensor([10, 64], dtype=torch.int32, device=device)
    flashtune.attention_with_kvcache(q, kc, vc, cache_seqlens=sl)
    flashtune.attention_with_kvcache(q, kc, vc, cache_seqlens=sl)  # remembered: no new copy
    sl[1] = 65  # in place: the version counter moves, the values are checked again
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 65 is beyond"):
        flashtune.attention_with_kvcache(q, kc, vc, cache_seqlens=sl)


@pytest.mark.parametrize("paged", [False, True])
def test_kernels_clamp_values_changed_behind_the_checks_back(paged, device):
    # a write PyTorch's version counter cannot see (here through .data) must not make a kernel
    # read outside the cache: the kernels clamp seqlens and page indices to it
    import flashtune
    q = torch.randn(1, 1, 2, 32, dtype=torch.float16, device=device)
    kc = torch.randn(4 if paged else 1, 16 if paged else 64, 1, 32, dtype=torch.float16,
                     device=device)
    vc = torch.randn_like(kc)
    bt = torch.tensor([[3, 1, 0, 2]], dtype=torch.int32, device=device) if paged else None
    sl = torch.tensor([40], dtype=torch.int32, device=device)
    ok = flashtune.attention_with_kvcache(q, kc, vc, cache_seqlens=sl, block_table=bt)
    sl.data.fill_(1 << 20)
    if paged:
        bt.data.fill_(1 << 20)
    out = flashtune.attention_with_kvcache(q, kc, vc, cache_seqlens=sl, block_table=bt)
    assert out.shape == ok.shape and torch.isfinite(out).all()


def test_paged_fit_keeps_bytes_in_flight():
    # a key block lies in one page; a shorter step pipelines deeper by the same factor
    from flashtune.kvcache import fit_pages
    v = Variant.parse("splitkv-m16-n128-w4-s1")
    assert fit_pages(v, 64).name == "splitkv-m16-n64-w4-s2-paged=true"
    assert fit_pages(v, 48).name == "splitkv-m16-n16-w4-s8-paged=true"  # 8x deeper, capped at 8
    assert fit_pages(v, 256).name == "splitkv-m16-n128-w4-s1-paged=true"
    assert fit_pages(fit_pages(v, 256), None) == v


@pytest.mark.parametrize("paged", [False, True])
def test_split_start_from_a_stale_longest_length(paged, device):
    # the kernels place each split by the host's longest sequence (split_keys) so a paged split
    # can read its first pages before its length; a CUDA graph replayed after the caches grew
    # passes a stale one: a sequence longer than it is split by its own length, no key is lost
    from flashtune.launch_splitkv import SplitKVPlan
    q, kc, vc = make(3, 1, 4, 2, 16, 64, torch.float16, device)
    lengths = [9, 40, 64]
    sl = torch.tensor(lengths, dtype=torch.int32, device=device)
    kk, vv, bt = to_paged(kc, vc, 16) if paged else (kc, vc, None)
    var = Variant.parse(variant(3, "-paged=true" if paged else ""))
    plan = SplitKVPlan(q, kk, False, None, var)
    for host_max in (64, 24, 1):  # exact, stale (shorter than two sequences), nearly nothing
        out, lse = plan.run(q, kk, vv, sl, bt, host_max)
        check(q, kc, vc, lengths, out, lse=lse)


def test_a_far_record_does_not_outbid_an_exact_one(monkeypatch):
    """A decode step through the dense API on the H100: its fwd record is the nearest one, 11.5
    octaves away (Nq~512), whose TFLOP/s scaled to one query row said ~1.5 us against the exact
    splitkv record's 39 us, and the split-Q kernel ran the decode. Records compete only when
    both are of the problem's own bucket; otherwise the families' heuristic decides."""
    from flashtune import dispatch
    from flashtune.problem import Problem
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on the GPU machine (nothing runs here)
    dispatch.configure(gpu="H100")  # the shipped H100 table, no user DB in the way
    try:
        p = Problem("fwd", "bfloat16", 128, False, 8, 64, 8, 1, 2048)
        ex = dispatch.explain(p)
        assert ex.variant.family == "splitkv", str(ex)
        assert not any("tuned records" in n for n in ex.notes), ex.notes
        # a training shape keeps its exact record (fwd's or hopper_fwd's, by their records)
        t = Problem("fwd", "bfloat16", 128, False, 1, 8, 16, 2048, 2048)
        ex = dispatch.explain(t)
        assert ex.variant.family != "splitkv" and ex.distance == 0, str(ex)
    finally:
        dispatch.configure()


@pytest.mark.parametrize("window,softcap,causal,nq", [(64, False, False, 1), (50, True, True, 3),
                                                      (0, True, False, 1)])
def test_measure_runs_masked_problems_with_their_masks(device, window, softcap, causal, nq):
    """A masked splitkv bucket of the search (--mask window=... / softcap) runs and is gated with
    its representative masks: its variants carry the mask code, the plan gets the masks."""
    from flashtune.codegen import Variant
    from flashtune.measure_splitkv import SplitKVOps
    from flashtune.problem import Problem
    ops = SplitKVOps(device=device)
    p = Problem("splitkv", "float16", 64, causal, 2, 2, 4, nq, 300, window=window,
                softcap=softcap)
    gp = ops.gate_problem(p)
    inputs = ops.inputs(gp, seed=1)
    # scores of a few tens reach the search's softcap (50): with unit ones it changes them by
    # ~1e-4 and the unmasked answer passed the gate by chance (on the H100, session 28)
    inputs = (inputs[0] * 20, *inputs[1:])
    ref = ops.reference(gp, inputs)
    masks = "-".join(m for m, on in (("softcap=true", softcap), ("window=true", bool(window)))
                     if on)
    out = ops.run(Variant.parse(f"splitkv-m16-n32-w4-s1-sp3-{masks}"), gp, inputs)
    assert ops.check(out, gp, ref).ok
    assert not ops.check(out * 1.05, gp, ref).ok
    # the gate's reference applies the masks: the unmasked answer fails it
    plain = ops.run(Variant.parse("splitkv-m16-n32-w4-s1-sp3"),
                    dataclasses.replace(gp, window=0, softcap=False), inputs)
    assert not ops.check(plain, gp, ref).ok
