"""splitkv's fused combine (Variant.combine_slices): the partial kernel merges the splits itself,
the last programs of a tile to arrive at its counter doing the merge. Against the float64
reference and the combine kernel. The interpreter runs one combiner (programs run one after
another there, so none may wait on another); the GPU tests run several, which wait."""
import pytest
import torch

import flashtune
from flashtune import arrivals
from flashtune.codegen import Variant
from flashtune.launch_splitkv import SplitKVPlan

from test_splitkv import DTYPES, check, make, run, to_paged

SMALL = "splitkv-m16-n16-w4-s1"


def fused(num_splits, slices=1, extra=""):
    return f"{SMALL}-sp{num_splits}-cs{slices}{extra}"


def _areas_zero():
    return all(int(a.abs().sum()) == 0 for a in arrivals._areas.values())


# -- CPU (interpreter) and GPU: one combiner -----------------------------------------------------
@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_merge_matches_reference(num_splits, dtype, device):
    # 7 splits of 100 keys in 16-key blocks: splits past each sequence's keys merge as nothing
    q, kc, vc = make(2, 1, 4, 2, 32, 112, dtype, device)
    lengths = [100, 37]
    sl = torch.tensor(lengths, dtype=torch.int32, device=device)
    out, lse = run(q, kc, vc, sl, fused(num_splits), return_lse=True)
    check(q, kc, vc, lengths, out, lse=lse)
    assert _areas_zero(), "a launch left its counters non-zero"


def test_fused_merge_equals_the_combine_kernel(device):
    q, kc, vc = make(2, 1, 4, 1, 32, 96, torch.float16, device)
    sl = torch.tensor([96, 50], dtype=torch.int32, device=device)
    out, lse = run(q, kc, vc, sl, fused(5), return_lse=True)
    ref, ref_lse = run(q, kc, vc, sl, f"{SMALL}-sp5", return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("nq", [1, 3])
def test_fused_merge_over_several_row_tiles_causal(nq, device):
    # MQA 8 heads x 3 tokens = 24 rows: two 16-row tiles, each with its own counter; ragged
    # lengths, one shorter than Nq (its first tokens see no key: zeros, LSE -inf)
    q, kc, vc = make(3, nq, 8, 1, 16, 64, torch.float16, device)
    lengths = [64, 33, 2]
    out, lse = run(q, kc, vc, torch.tensor(lengths, dtype=torch.int32, device=device),
                   fused(3), causal=True, return_lse=True)
    check(q, kc, vc, lengths, out, causal=True, lse=lse)


def test_fused_merge_empty_and_single_key_sequences(device):
    q, kc, vc = make(3, 2, 2, 1, 16, 48, torch.float32, device)
    lengths = [0, 1, 45]
    out, lse = run(q, kc, vc, torch.tensor(lengths, dtype=torch.int32, device=device),
                   fused(4), return_lse=True)
    check(q, kc, vc, lengths, out, lse=lse)


@pytest.mark.parametrize("loads", ["pointer", "descriptor"])
def test_fused_merge_paged(loads, device):
    q, kc, vc = make(2, 2, 4, 2, 16, 192, torch.float16, device)
    lengths = [70, 181]
    for b, n in enumerate(lengths):  # NaN past the keys: a merge that lets them in fails
        kc[b, n:] = float("nan")
        vc[b, n:] = float("nan")
    kp, vp, bt = to_paged(kc, vc, 64, generator_seed=5)
    sl = torch.tensor(lengths, dtype=torch.int32, device=device)
    extra = "" if loads == "pointer" else "-loads=descriptor"
    out = run(q, kp, vp, sl, fused(3, 1, extra), causal=True, block_table=bt)
    check(q, kc, vc, lengths, out, causal=True)


def test_fused_merge_launches_no_combine_kernel(device):
    q, kc, vc = make(1, 1, 4, 2, 16, 64, torch.float16, device)
    plan = SplitKVPlan(q, kc, False, None, Variant.parse(fused(3)))
    out, lse = plan.run(q, kc, vc, None, None, 64)
    assert [k[0] for k in plan._launchers] == ["partial"]
    check(q, kc, vc, [64], out)
    # one split: the partial kernel writes the result itself (no counter touched)
    plan1 = SplitKVPlan(q, kc, False, None, Variant.parse(fused(1)))
    out1, _ = plan1.run(q, kc, vc, None, None, 64)
    check(q, kc, vc, [64], out1)
    assert _areas_zero()


def test_dense_forward_through_a_forced_fused_variant(device):
    # attention() on a decode shape, the fused render forced: the dense path's DensePlan
    q = torch.randn(2, 4, 1, 16, dtype=torch.float16, device=device)
    k = torch.randn(2, 2, 80, 16, dtype=torch.float16, device=device)
    v = torch.randn_like(k)
    with flashtune.force(fused(4)):
        out = flashtune.attention(q, k, v)
    check(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), [80, 80],
          out.transpose(1, 2))


@pytest.mark.parametrize("extra", ["-early_start=true", "-cs2-early_start=true"])
def test_early_start_renders_compute_the_same(extra, device):
    # the interpreter has no dependent launches: the render runs without its early block (the
    # GPU tests below run it)
    q, kc, vc = make(2, 1, 4, 2, 16, 96, torch.float16, device)
    lengths = [96, 41]
    kp, vp, bt = to_paged(kc, vc, 16, generator_seed=2)
    sl = torch.tensor(lengths, dtype=torch.int32, device=device)
    check(q, kc, vc, lengths, run(q, kc, vc, sl, f"{SMALL}-sp3{extra}"))
    check(q, kc, vc, lengths, run(q, kp, vp, sl, f"{SMALL}-sp3{extra}", block_table=bt))


# -- the rules (no kernels) ----------------------------------------------------------------------
def test_combiners_rule(monkeypatch):
    q = torch.empty(1, 1, 8, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 4096, 1, 128, dtype=torch.bfloat16, device="meta")
    plan = SplitKVPlan(q, k, False, None, Variant.parse("splitkv-m64-n64-w4-s3-cs16"))
    assert plan.combiners(64) == 1  # not a GPU: programs run one after another
    monkeypatch.setattr("flashtune.env.interpreting", lambda: False)
    plan.is_cuda, plan.sms = True, 132
    # 8 rows x 2 slices of D (64 splits: 64-wide slices, 4,096 elements for 4 warps) = 16 units
    assert plan.combiners(64) == 16
    assert plan.combiners(8) == 8       # never more than the splits
    assert plan.combiners(132) == 16    # 132 programs: one wave
    assert plan.combiners(133) == 1     # two waves: waiting could starve an unscheduled program
    wide = SplitKVPlan(q, k, False, None, Variant.parse("splitkv-m64-n64-w4-s3-cs64"))
    wide.is_cuda, wide.sms = True, 132
    assert wide.combiners(128) == 8 * 128 // wide._merge_tile(128)[1]  # the units cap it


def test_variant_field(device):
    v = Variant.parse("splitkv-m64-n64-w4-s3-cs8")
    assert v.combine_slices == 8 and v.name == "splitkv-m64-n64-w4-s3-cs8"
    assert v.structure()["fused_combine"]
    assert "combine_slices" not in Variant.parse("splitkv-m64-n64-w4-s3").to_dict()
    with pytest.raises(ValueError, match="combine_slices"):
        Variant.parse("splitkv-m64-n64-w4-s3-cs3")
    with pytest.raises(ValueError, match="combine_slices"):
        Variant.parse("fwd-m64-n64-w4-s3-cs2")


def test_arrival_areas_per_stream_and_growth():
    dev = torch.device("cpu")
    a = arrivals.counters(dev, 10)
    assert a.dtype == torch.int32 and a.numel() >= 10 and int(a.abs().sum()) == 0
    assert arrivals.counters(dev, 100) is a
    big = arrivals.counters(dev, a.numel() + 1)
    assert big.numel() > a.numel() and any(r is a for r in arrivals._retired)


# -- GPU: several combiners, which wait for each other -------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("slices", [1, 4, 8, 32])
@pytest.mark.parametrize("hq,hk,nk", [(8, 1, 8192), (32, 8, 4096)])
def test_gpu_combiners_match_reference(slices, hq, hk, nk):
    q, kc, vc = make(1, 1, hq, hk, 128, nk, torch.bfloat16, "cuda")
    name = f"splitkv-m64-n64-w4-s3-cs{slices}"
    plan = SplitKVPlan(q, kc, False, None, Variant.parse(name))
    s = plan.num_splits(nk)
    assert s > 1 and (plan.combiners(s) > 1) == (slices > 1)  # several wait on each other
    out, lse = plan.run(q, kc, vc, None, None, nk)
    check(q, kc, vc, [nk], out, lse=lse)
    ref, ref_lse = SplitKVPlan(q, kc, False, None, Variant.parse("splitkv-m64-n64-w4-s3")).run(
        q, kc, vc, None, None, nk)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    for _ in range(20):  # the counters come back to 0: every later launch merges right
        again, _ = plan.run(q, kc, vc, None, None, nk)
    torch.cuda.synchronize()
    assert torch.equal(again, out)
    assert _areas_zero()


@pytest.mark.gpu
def test_gpu_fused_merge_in_a_cuda_graph_over_ragged_paged_caches():
    from flashtune.timing import capture
    q, kc, vc = make(2, 1, 8, 1, 128, 8192, torch.bfloat16, "cuda")
    lengths = [8192, 3001]
    kp, vp, bt = to_paged(kc, vc, 256, generator_seed=7)
    sl = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    var = "splitkv-m64-n64-w4-s3-cs8"

    def step():
        with flashtune.force(var):
            return flashtune.attention_with_kvcache(q, kp, vp, cache_seqlens=sl, block_table=bt)
    replay = capture(step)
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    check(q, kc, vc, lengths, replay.outputs)
    assert torch.equal(replay.outputs, step())
    assert _areas_zero()


@pytest.mark.gpu
def test_gpu_two_waves_fall_back_to_one_combiner():
    # B=64 GQA: 512 programs before splitting, more than one wave: the last arrival merges
    q, kc, vc = make(64, 1, 32, 8, 128, 2048, torch.bfloat16, "cuda")
    plan = SplitKVPlan(q, kc, False, None, Variant.parse("splitkv-m64-n64-w4-s3-sp4-cs8"))
    assert plan.combiners(4) == 1
    out, _ = plan.run(q, kc, vc, None, None, 2048)
    ref, _ = SplitKVPlan(q, kc, False, None, Variant.parse("splitkv-m64-n64-w4-s3-sp4")).run(
        q, kc, vc, None, None, 2048)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    check(q[:2], kc[:2], vc[:2], [2048, 2048], out[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["splitkv-m64-n64-w4-s3-early_start=true",
                                  "splitkv-m64-n64-w4-s3-cs8-early_start=true",
                                  "splitkv-m64-n64-w4-s3-sp4-cs4-early_start=true"])
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_early_start_layers_in_a_graph(name, paged):
    # a decode step of 6 layers in one CUDA graph, each layer a dependent launch of the one
    # before (which lets it start early): every layer's output equals its own eager run by the
    # combine kernel's variant, and layer 0 the float64 reference; the caches are ragged (the
    # hint the prefetch uses is the longest length) and each layer appends one token first
    from flashtune.timing import capture
    layers, b, nk = 6, 2, 4096
    lengths = [4000, 1500]
    q, _, _ = make(b, 1, 8, 1, 128, nk, torch.bfloat16, "cuda")
    caches = [make(b, 1, 8, 1, 128, nk, torch.bfloat16, "cuda")[1:] for _ in range(layers)]
    new = [(torch.randn(b, 1, 1, 128, dtype=torch.bfloat16, device="cuda"),
            torch.randn(b, 1, 1, 128, dtype=torch.bfloat16, device="cuda"))
           for _ in range(layers)]
    sl = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    pages = [to_paged(k, v, 256, generator_seed=i) for i, (k, v) in enumerate(caches)]

    def layer(i, var):
        kw = dict(cache_seqlens=sl, k=new[i][0], v=new[i][1])
        with flashtune.force(var):
            if paged:
                kp, vp, bt = pages[i]
                return flashtune.attention_with_kvcache(q, kp, vp, block_table=bt, **kw)
            return flashtune.attention_with_kvcache(q, *caches[i], **kw)

    base = name.replace("-early_start=true", "").replace("-cs8", "").replace("-cs4", "")
    want = [layer(i, base) for i in range(layers)]  # appends the new tokens (in place)
    replay = capture(lambda: [layer(i, name) for i in range(layers)])
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    for i, (got, ref) in enumerate(zip(replay.outputs, want)):
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2, msg=f"layer {i}")
    k0, v0 = (t.clone() for t in caches[0])  # paged, the appends went to the pages alone
    for j, n in enumerate(lengths):
        k0[j, n], v0[j, n] = new[0][0][j, 0], new[0][1][j, 0]
    check(q, k0, v0, [n + 1 for n in lengths], replay.outputs[0])
    assert _areas_zero()
