"""splitkv's early_start render: the partial kernel as a programmatic dependent launch that sends
the first rows of its split's K/V to L2 before it waits for the kernel before it (a decode step's
previous layer). The interpreter has no dependent launches (the render runs without its early
block there); the GPU tests run a step of layers as one CUDA graph, each layer launched early."""
import pytest
import torch

import flashtune
from flashtune.codegen import Variant
from flashtune.launch_splitkv import PREFETCH_BYTES, PREFETCH_BYTES_FIRST, SplitKVPlan

from test_splitkv import check, make, run, to_paged

SMALL = "splitkv-m16-n16-w4-s1"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_early_start_render_computes_the_same(dtype, device):
    q, kc, vc = make(2, 1, 4, 2, 16, 96, dtype, device)
    lengths = [96, 41]
    kp, vp, bt = to_paged(kc, vc, 16, generator_seed=2)
    sl = torch.tensor(lengths, dtype=torch.int32, device=device)
    var = f"{SMALL}-sp3-early_start=true"
    out, lse = run(q, kc, vc, sl, var, return_lse=True)
    check(q, kc, vc, lengths, out, lse=lse)
    check(q, kc, vc, lengths, run(q, kp, vp, sl, var, block_table=bt))


def test_the_launch_picks_early_start_for_one_wave_where_pdl_works():
    q = torch.empty(1, 1, 8, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 4096, 1, 128, dtype=torch.bfloat16, device="meta")
    plan = SplitKVPlan(q, k, False, None, Variant.parse("splitkv-m64-n64-w4-s3"))
    assert not plan.early(64)  # no PDL off a GPU
    plan.pdl, plan.sms = True, 132
    assert plan.early(132) and not plan.early(133)  # one wave (1 program x splits) or not
    plan.allow_early = False
    assert not plan.early(64)
    # a variant that names the render keeps it (its block is inert without PDL)
    forced = SplitKVPlan(q, k, False, None, Variant.parse("splitkv-m64-n64-w4-s3-early_start=true"))
    assert forced.early(1000)
    # the prefetch: PREFETCH_BYTES over all programs, in rows of K and of V (2 x D x 2 bytes);
    # PREFETCH_BYTES_FIRST where the combine lets the next kernel in before its wait
    assert plan._early_args(4096, 64, False) == (4096, PREFETCH_BYTES // (64 * 2 * 128 * 2), 1)
    assert plan._early_args(4096, 64, True)[1] == PREFETCH_BYTES_FIRST // (64 * 2 * 128 * 2)
    assert plan._early_args(4096, 200, False)[2] == 0  # two waves: not let in early


def test_the_combine_lets_the_next_kernel_in_first_where_a_step_is_a_quarter_of_l2():
    q = torch.empty(1, 1, 8, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 4096, 1, 128, dtype=torch.bfloat16, device="meta")
    plan = SplitKVPlan(q, k, False, None, Variant.parse("splitkv-m64-n64-w4-s3"))
    assert plan.l2_bytes == 0 and not plan.first_trigger(1)  # no L2 known off a GPU
    plan.l2_bytes = 50 << 20  # the H100's
    per_key = 2 * 1 * 1 * 128 * 2  # K and V, one kv head, bf16
    fits = (50 << 20) // (4 * per_key)
    assert plan.first_trigger(fits) and not plan.first_trigger(fits + 1)
    # batch and kv heads count: GQA 32/8 at B=8 reads 64x the bytes of a key position
    big = SplitKVPlan(torch.empty(8, 1, 32, 128, dtype=torch.bfloat16, device="meta"),
                      torch.empty(8, 4096, 8, 128, dtype=torch.bfloat16, device="meta"), False,
                      None, Variant.parse("splitkv-m64-n64-w4-s3"))
    big.l2_bytes = 50 << 20
    assert big.first_trigger(fits // 64) and not big.first_trigger(fits // 64 + 1)
    plan.trigger_first = False  # the probe's override
    assert not plan.first_trigger(1)


def test_variant_field():
    v = Variant.parse("splitkv-m64-n64-w4-s3-early_start=true")
    assert v.early_start and v.structure()["early_start"]
    assert "early_start" not in Variant.parse("splitkv-m64-n64-w4-s3").to_dict()
    with pytest.raises(ValueError, match="early_start"):
        Variant.parse("fwd-m64-n64-w4-s3-early_start=true")


# -- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["mqa-b1", "gqa-b2", "gqa-b8-two-waves"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("first", [False, True], ids=["after-wait", "first"])
def test_gpu_early_start_layers_in_a_graph(shape, paged, first):
    # a decode step of 6 layers in one CUDA graph, each layer a dependent launch of the one
    # before: every layer's output equals its plain eager launch bit for bit, and layer 0 the
    # float64 reference; ragged lengths (the prefetch places splits by the longest), and each
    # layer appends one token to its cache before attending. first: each combine lets the next
    # layer's partial kernel launch before its own wait (first_trigger), or after it
    from flashtune.timing import capture
    b, hq, hk, lengths = {"mqa-b1": (1, 8, 1, [4000]), "gqa-b2": (2, 32, 8, [4000, 1500]),
                          "gqa-b8-two-waves": (8, 32, 8, [3000] * 7 + [100])}[shape]
    layers, nk = 6, 4096
    q = torch.randn(b, 1, hq, 128, dtype=torch.bfloat16, device="cuda")
    caches = [make(b, 1, hq, hk, 128, nk, torch.bfloat16, "cuda")[1:] for _ in range(layers)]
    new = [tuple(torch.randn(b, 1, hk, 128, dtype=torch.bfloat16, device="cuda")
                 for _ in range(2)) for _ in range(layers)]
    sl = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    pages = [to_paged(k, v, 256, generator_seed=i) for i, (k, v) in enumerate(caches)]
    # 8 x 8 programs x 4 splits: two waves of the H100's 132 SMs
    var = "splitkv-m64-n64-w4-s3" + ("-sp4" if shape == "gqa-b8-two-waves" else "")

    def layer(i):
        kw = dict(cache_seqlens=sl, k=new[i][0], v=new[i][1])
        with flashtune.force(var):
            if paged:
                kp, vp, bt = pages[i]
                return flashtune.attention_with_kvcache(q, kp, vp, block_table=bt, **kw)
            return flashtune.attention_with_kvcache(q, *caches[i], **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SplitKVPlan, "early", lambda self, s: False)
        want = [layer(i) for i in range(layers)]  # appends the new tokens (in place)
    launches = []
    orig = SplitKVPlan.early

    def spy(self, s):
        launches.append(orig(self, s))
        return launches[-1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SplitKVPlan, "early", spy)
        mp.setattr(SplitKVPlan, "first_trigger", lambda self, keys: first)
        replay = capture(lambda: [layer(i) for i in range(layers)])
    assert launches and all(launches) == (shape != "gqa-b8-two-waves"), launches
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    for i, (got, ref) in enumerate(zip(replay.outputs, want)):
        assert torch.equal(got, ref), f"layer {i}"
    k0, v0 = (t.clone() for t in caches[0])  # paged, the appends went to the pages alone
    for j, n in enumerate(lengths):
        k0[j, n], v0[j, n] = new[0][0][j, 0], new[0][1][j, 0]
    check(q, k0, v0, [n + 1 for n in lengths], replay.outputs[0])
