"""The splitkv family's gluon render (Variant.gluon: the partial kernel in Gluon, sm_90): its
variant rules, where the launch runs the Triton render instead (off sm_90, pages narrower than
its tile, masks, strided caches, too many rows), its sm_90 compile, and on the GPU its outputs
against float64 through flashtune.attention_with_kvcache, contiguous and paged."""
import os
import subprocess
import sys

import pytest
import torch

import flashtune
from flashtune.codegen import Variant
from flashtune.launch_splitkv import SplitKVPlan, gluon_blocker

from test_splitkv import check, make

GLUON = "splitkv-m64-n64-w4-s2-gluon=true"
GLUON_T = "splitkv-m16-n64-w4-s2-gluon=true"  # swap_ab: the rows in wgmma's N


@pytest.mark.parametrize("name,field", [
    ("splitkv-m64-n64-w8-s2-gluon=true", "num_warps"),
    ("splitkv-m128-n64-w4-s2-gluon=true", "block_m"),
    ("splitkv-m16-n32-w4-s2-gluon=true", "block_n"),   # swap_ab: keys in wgmma's 64-row M
    ("splitkv-m64-n64-w4-s2-gluon=true-window=true", "masks"),
    ("splitkv-m64-n64-w4-s2-gluon=true-loads=descriptor", "loads"),
    ("splitkv-m64-n16-w4-s2-gluon=true", "block_n"),
    ("splitkv-m64-n64-w4-s6-gluon=true", "stages"),
])
def test_gluon_variant_rules(name, field):
    with pytest.raises(ValueError, match=field):
        Variant.parse(name)
    assert Variant.parse(GLUON).gluon and Variant.parse(GLUON).name == GLUON
    assert Variant.parse(GLUON + "-paged=true").paged  # a paged cache: the same render
    assert Variant.parse(GLUON_T).structure()["swap_ab"]
    assert not Variant.parse(GLUON).structure()["swap_ab"]


def _meta(b, nq, hq, hk, d, cap, dtype=torch.bfloat16):
    return (torch.empty(b, nq, hq, d, dtype=dtype, device="meta"),
            torch.empty(b, cap, hk, d, dtype=dtype, device="meta"))


@pytest.mark.parametrize("shape,why", [
    ((2, 1, 32, 8, 128, 4096, torch.bfloat16), ""),
    ((2, 4, 16, 4, 64, 512, torch.float16), ""),
    ((1, 16, 32, 4, 128, 512, torch.bfloat16), "rows"),          # 8 x 16 = 128 rows
    ((1, 1, 8, 1, 128, 512, torch.float32), "bf16/fp16"),
    ((1, 1, 8, 1, 256, 512, torch.bfloat16), "head dim"),
])
def test_gluon_blocker(shape, why):
    q, k = _meta(*shape)
    got = gluon_blocker(q, k, Variant.parse(GLUON))
    assert (got == "") if not why else (why in got), got


def test_gluon_blocker_swapped_tile_rows():
    # block_m 16: a step's GROUP x Nq rows within 16 (GQA 4 x 4 tokens), not 32 (8 x 4)
    assert gluon_blocker(*_meta(2, 4, 16, 4, 128, 512), Variant.parse(GLUON_T)) == ""
    assert "32 rows" in gluon_blocker(*_meta(2, 4, 32, 4, 128, 512), Variant.parse(GLUON_T))


def test_gluon_blocker_strided_cache_and_cpu():
    q, k = _meta(1, 1, 8, 2, 64, 256)
    wide = torch.empty(1, 256, 4, 64, dtype=torch.bfloat16, device="meta")[:, :, :2]
    assert "contiguous" in gluon_blocker(q, wide, Variant.parse(GLUON))
    assert "GPU" in gluon_blocker(torch.empty(1, 1, 8, 64), torch.empty(1, 256, 2, 64),
                                  Variant.parse(GLUON))


def test_pages_the_tile_fits_keep_the_gluon_render_and_masks_drop_it():
    from flashtune.dispatch import mask_twin
    from flashtune.kvcache import fit_pages
    from flashtune.masks import Masks
    v = Variant.parse(GLUON)
    for page in (64, 256):  # a 64-key tile lies in one page
        paged = fit_pages(v, page)
        assert paged.paged and paged.gluon and paged.block_n == 64
    # 16- and 32-key pages: the Triton render at the page's width, as deep in bytes
    assert fit_pages(v, 32) == Variant.parse("splitkv-m64-n32-w4-s4-paged=true")
    assert fit_pages(v, 16) == Variant.parse("splitkv-m64-n16-w4-s8-paged=true")
    assert fit_pages(v, None) == v
    # a paged cache's pages are the TMA view's rows: its shape passes the blocker
    pages = torch.empty(20, 64, 2, 64, dtype=torch.bfloat16, device="meta")
    q, _ = _meta(2, 1, 8, 2, 64, 256)
    assert gluon_blocker(q, pages, fit_pages(v, 64)) == ""
    twin = mask_twin(v, Masks((32, 0), None), 128, torch.bfloat16)
    assert twin.window and not twin.gluon


@pytest.mark.parametrize("nq,causal", [(1, False), (2, True)])
def test_off_sm90_the_plan_runs_the_triton_render(nq, causal, device):
    # here (the interpreter, or a GPU other than sm_90) the same tiles without gluon, exact
    q, kc, vc = make(2, nq, 8, 2, 64, 200, torch.float16, device)
    plan = SplitKVPlan(q, kc, causal, None, Variant.parse(GLUON))
    on_sm90 = device == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    assert plan.variant.gluon == on_sm90 and bool(plan.gluon_why) != on_sm90
    lengths = [200, 61]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    with flashtune.force(GLUON):
        out, lse = flashtune.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                                    causal=causal, return_lse=True)
    check(q, kc, vc, lengths, out, causal=causal, lse=lse)


def test_gluon_render_compiles_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-m", "flashtune.cli", "kernels", "check", "--gpu",
                        "H100", "--head-dim", "64,128", GLUON,
                        "splitkv-m64-n32-w4-s4-gluon=true-early_start=true",
                        "splitkv-m16-n128-w4-s2-gluon=true-early_start=true"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [ln for ln in r.stdout.splitlines() if " partial " in ln]
    assert len(rows) == 6 and all(" ok " in ln and "spills 0 B" in ln for ln in rows), r.stdout


# (B, Hq, Hk, Nq, D, capacity, lengths (None: every sequence the capacity, an int), causal);
# bench/gluon_splitkv.py's cases, which passed on the H100 (session 36, call 16)
GPU_CASES = [
    (1, 8, 1, 1, 128, 4096, None, False),
    (3, 32, 8, 1, 128, 2000, [1999, 5, 1500], False),   # a 5-key sequence: splits without keys
    (2, 16, 4, 4, 128, 1024, [700, 1024], True),        # speculative tokens, bottom-right causal
    (2, 8, 8, 2, 128, 512, [512, 100], True),
    (2, 8, 2, 1, 64, 3000, [3000, 2047], False),
    (1, 8, 1, 1, 128, 131072 + 64, [131072], False),    # one wave: the early start
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "B{}-{}/{}-Nq{}-D{}-cap{}".format(
    *c[:6]) + ("-ragged" if c[6] else "-uniform") + ("-causal" if c[7] else ""))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", [GLUON, GLUON_T])
def test_gluon_matches_float64(case, dtype, name):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the gluon render is sm_90's")
    b, hq, hk, nq, d, cap, lengths, causal = case
    q, kc, vc = make(b, nq, hq, hk, d, cap, dtype, "cuda")
    seqlens = cap if lengths is None else torch.tensor(lengths, dtype=torch.int32,
                                                       device="cuda")
    assert SplitKVPlan(q, kc, causal, None, Variant.parse(name)).variant.gluon
    with flashtune.force(name):
        out, lse = flashtune.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                                    causal=causal, return_lse=True)
    check(q, kc, vc, lengths or [cap] * b, out, causal=causal, lse=lse)


def _paged(kc, vc, page, seed=0):
    """kc, vc (B, N, Hk, D) as a paged cache of `page`-key pages in shuffled order, with spare
    pages no sequence owns: (k_pages, v_pages, block_table)."""
    b, n, hk, d = kc.shape
    per = -(-n // page)
    g = torch.Generator(device="cpu").manual_seed(seed)
    order = torch.randperm(b * per + 3, generator=g)[:b * per].to(kc.device)
    kp, vp = (torch.randn(b * per + 3, page, hk, d, dtype=kc.dtype, device=kc.device)
              for _ in range(2))
    for t, src in ((kp, kc), (vp, vc)):
        padded = torch.zeros(b, per * page, hk, d, dtype=kc.dtype, device=kc.device)
        padded[:, :n] = src
        t[order] = padded.reshape(b * per, page, hk, d)
    return kp, vp, order.reshape(b, per).to(torch.int32)


# (B, Hq, Hk, Nq, D, capacity, page, lengths, causal)
PAGED_CASES = [
    (1, 8, 1, 1, 128, 131072, 256, None, False),      # one wave: the early start, paged
    (3, 32, 8, 1, 128, 2000, 64, [1999, 5, 1500], False),
    (2, 16, 4, 4, 128, 1024, 128, [700, 1024], True),
    (2, 8, 2, 1, 64, 3000, 256, [3000, 2047], False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PAGED_CASES,
                         ids=lambda c: "B{}-{}/{}-Nq{}-D{}-cap{}-page{}".format(*c[:7]))
@pytest.mark.parametrize("name", [GLUON, GLUON_T])
def test_gluon_paged_matches_float64(case, name):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the gluon render is sm_90's")
    b, hq, hk, nq, d, cap, page, lengths, causal = case
    q, kc, vc = make(b, nq, hq, hk, d, cap, torch.bfloat16, "cuda")
    kp, vp, bt = _paged(kc, vc, page)
    lengths = lengths or [cap] * b
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    from flashtune.kvcache import fit_pages
    assert SplitKVPlan(q, kp, causal, None, fit_pages(Variant.parse(name), page)).variant.gluon
    with flashtune.force(name):
        out, lse = flashtune.attention_with_kvcache(q, kp, vp, cache_seqlens=seqlens,
                                                    block_table=bt, causal=causal,
                                                    return_lse=True)
    check(q, kc, vc, lengths, out, causal=causal, lse=lse)


@pytest.mark.parametrize("name,d,alone", [
    (GLUON, 128, False),
    ("splitkv-m64-n64-w4-s3-gluon=true", 128, False),   # 112 KiB: two share an SM
    ("splitkv-m64-n128-w4-s2-gluon=true", 128, True),   # 144 KiB
    ("splitkv-m64-n64-w4-s4-gluon=true", 128, True),
    ("splitkv-m64-n128-w4-s2-gluon=true", 64, False),
    ("splitkv-m64-n128-w4-s2", 128, False),             # the Triton render: no ring to preload
])
def test_a_ring_that_holds_its_sm_alone_preloads_and_lets_the_next_layer_in(name, d, alone):
    q, k = _meta(1, 1, 8, 1, d, 32768)
    plan = SplitKVPlan(q, k, False, None, Variant.parse(name))
    assert plan.ring_alone == alone
    stages, bn = plan.variant.num_stages, plan.variant.block_n
    # a split's share no longer than its ring: one tile; longer: the whole ring (both paced)
    ring = 132 * stages * bn  # 132 splits, each as many keys as its ring holds
    for splits, keys, longer in ((132, ring, False), (132, ring + 1, True),
                                 (4, 8 * stages * bn, True), (1, 1, False), (132, 32768, False)):
        want = 0 if not alone else (stages if longer else 1)
        assert plan.preload_tiles(keys, splits) == want, (splits, keys)
    assert plan.preload_pace() == 1  # one K or V half in flight
    assert plan.first_trigger(32768) == alone  # (meta tensors: no L2, so no L2 rule says yes)
    plan.preload, plan.pace = 7, 0  # the probe's: at most the ring; all at once
    assert plan.preload_tiles(32768, 132) == stages and plan.preload_pace() == 0


@pytest.mark.parametrize("name,paged,steals", [
    ("splitkv-m64-n128-w4-s2-gluon=true", False, True),   # a ring alone on its SM
    ("splitkv-m64-n128-w4-s2-gluon=true", True, True),    # paged too
    (GLUON, False, False),                                # two share an SM
    ("splitkv-m64-n128-w4-s2", False, False),             # the Triton render
])
def test_a_ring_alone_on_its_sm_shares_its_splits_tiles(name, paged, steals):
    q, k = _meta(1, 1, 8, 1, 128, 131072)
    if paged:
        k = torch.empty(256, 512, 1, 128, dtype=torch.bfloat16, device="meta")
    plan = SplitKVPlan(q, k, False, None, Variant.parse(name + ("-paged=true" if paged else "")))
    # where a split's share is at least STEAL_MIN_TILES (6) tiles of 128 keys
    assert plan.steals(131072, 132) == steals          # 7.8 tiles a split
    assert plan.steals(132 * 6 * 128, 132) == steals   # 6
    assert not plan.steals(132 * 6 * 128 - 128, 132)   # 5.99
    assert not plan.steals(65536, 132)                  # 3.9
    assert not plan.steals(131072, 1)                   # one split: nothing to share
    plan.steal = True  # the probe's: gluon renders only, any length
    assert plan.steals(1000, 132) == plan.variant.gluon
    # a split owns 4 tiles (at least its ring's; paged, two more: its first two refills' pages
    # are read beside its length) before it takes tickets
    extra = 2 if paged else 0
    assert plan.steal_rounds() == max(4, plan.variant.num_stages + extra)
    plan.steal_own = 1
    assert plan.steal_rounds() == plan.variant.num_stages + extra


# (B, Hq, Hk, Nq, capacity, lengths, causal): tiles of 128 keys shared past the ring's first
# fill by 132 (MQA B=1) .. 4 splits; lengths with no shared tile, splits with no tile, a 5-key
# sequence, speculative tokens under bottom-right causal
STEAL_CASES = [
    (1, 8, 1, 1, 131072 + 64, [131072 - 77], False),
    (1, 8, 1, 1, 32768, [32768], False),
    (3, 16, 4, 1, 6000, [5999, 5, 3000], False),
    (2, 16, 4, 4, 4096, [4096, 1500], True),
    (2, 8, 1, 2, 2048, [300, 2048], True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", STEAL_CASES, ids=lambda c: "B{}-{}/{}-Nq{}-cap{}".format(
    *c[:5]) + ("-causal" if c[6] else ""))
@pytest.mark.parametrize("name,own,page", [("splitkv-m64-n128-w4-s2-gluon=true", 0, 0),
                                           (GLUON, 0, 0),
                                           ("splitkv-m64-n128-w4-s2-gluon=true", 2, 0),
                                           ("splitkv-m64-n128-w4-s2-gluon=true", 0, 256),
                                           (GLUON, 0, 128),
                                           ("splitkv-m64-n128-w4-s2-gluon=true", 5, 256),
                                           ("splitkv-m16-n128-w4-s2-gluon=true", 0, 0),
                                           ("splitkv-m16-n128-w4-s2-gluon=true", 0, 256)])
def test_gluon_shared_tiles_match_float64(case, name, own, page):
    """STEAL (the early start's splits take the tiles past their own from a
    counter): against float64, launch after launch and in graph replays at other lengths, the
    counters back at 0 after each; forced on a ring two programs share an SM with too, with
    each split owning only its ring's 2 tiles before the shared ones (steal_own; the rule: 4),
    and over shuffled pages (a split owning the rule's 4, or 5: its first ticket asked in its
    loop, not before it)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the gluon render is sm_90's")
    b, hq, hk, nq, cap, lengths, causal = case
    q, kc, vc = make(b, nq, hq, hk, 128, cap, torch.bfloat16, "cuda")
    kp, vp, bt = _paged(kc, vc, page) if page else (kc, vc, None)
    plan = SplitKVPlan(q, kp, causal, None,
                       Variant.parse(name + ("-paged=true" if page else "")))
    plan.steal, plan.steal_own = True, own or None
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    top = max(lengths)
    assert plan.early(plan.num_splits(top)) and plan.steals(top, plan.num_splits(top))
    for _ in range(3):
        out, lse = plan.run(q, kp, vp, seqlens, bt, top)
        check(q, kc, vc, lengths, out, causal=causal, lse=lse)
        assert not plan.counters(q.device).any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = plan.run(q, kp, vp, seqlens, bt, top)
    for again in ([min(cap, n + 700) for n in lengths], [max(0, n - 900) for n in lengths]):
        seqlens.copy_(torch.tensor(again, dtype=torch.int32))
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            check(q, kc, vc, again, out, causal=causal, lse=lse)
        assert all(not c.any() for c in plan._counters.values())


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("early", [False, True, "preload", "paced", "alone"])
def test_gluon_graph_replay_with_longer_sequences(paged, early):
    """A step captured at one length and replayed at others (a serving loop's graph), with and
    without the early start (and its tiles loaded before the wait, placed by the captured
    length: a replay at another length moves them): contiguous, each sequence is split by its own
    length; paged, by the captured one (split_keys), a longer sequence by its own; an empty one
    writes zeros."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the gluon render is sm_90's")
    q, kc, vc = make(2, 1, 8, 1, 128, 4096, torch.bfloat16, "cuda")
    kp, vp, bt = _paged(kc, vc, 256) if paged else (kc, vc, None)
    seqlens = torch.tensor([1000, 300], dtype=torch.int32, device="cuda")
    # "alone": a 128-key ring (holds its SM alone) whose launch preloads one tile by its rule
    name = GLUON.replace("-n64-", "-n128-") if early == "alone" else GLUON
    plan = SplitKVPlan(q, kp, False, None, Variant.parse(name + ("-paged=true" if paged else "")))
    if early != "alone":
        plan.preload = 2 if early in ("preload", "paced") else 0
    # "preload": both tiles before the wait at once; "paced": one K / V half in flight (PACE)
    plan.pace = {"preload": 0, "paced": 1}.get(early)
    assert plan.preload_tiles(1000, plan.num_splits(1000)) == {
        False: 0, True: 0, "preload": 2, "paced": 2, "alone": 1}[early]
    early = bool(early)
    plan.allow_early = early  # a one-wave grid: the launch takes the early start unless told
    assert plan.variant.gluon and plan.early(plan.num_splits(1000)) == early
    plan.run(q, kp, vp, seqlens, bt, 1000)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = plan.run(q, kp, vp, seqlens, bt, 1000)
    for lengths in ([1000, 300], [4096, 2500], [3000, 4000], [999, 0], [1, 1000]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        check(q, kc, vc, lengths, out, lse=lse)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("nq,n_new,causal", [(1, 1, False), (1, 3, False), (2, 2, True)])
@pytest.mark.parametrize("splits", [0, 3])
def test_gluon_preloaded_tiles_never_hold_the_appended_keys(paged, nq, n_new, causal, splits):
    """A ring that holds its SM alone loads its first tile before its wait (its whole ring,
    paced, where a split's share is longer: 3 splits of up to 3 tiles); a tile holding keys the
    call appends just before (an index_put a kernel ahead) is loaded again after the wait: the
    new keys are attended to. One wave (8 and 4 splits of 128 keys, or 3), the last split's first
    or second tile holding them; paged over shuffled pages."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the gluon render is sm_90's")
    name = GLUON.replace("-n64-", "-n128-") + (f"-sp{splits}" if splits else "")
    q, kc, vc = make(2, nq, 8, 1, 128, 2048, torch.bfloat16, "cuda")
    lengths = [1000 - n_new, 500 - n_new]
    kn, vn = (torch.randn(2, n_new, 1, 128, dtype=torch.bfloat16, device="cuda")
              for _ in range(2))
    kp, vp, bt = _paged(kc, vc, 256) if paged else (kc, vc, None)
    from flashtune.kvcache import fit_pages
    plan = SplitKVPlan(q, kp, causal, None, fit_pages(Variant.parse(name), 256 if paged else None))
    s = plan.num_splits(1000)
    assert plan.ring_alone and plan.preload_tiles(1000, s) == (2 if splits else 1)
    assert plan.early(s) and plan.preload_pace() == 1
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    with flashtune.force(name):
        out, lse = flashtune.attention_with_kvcache(q, kp, vp, cache_seqlens=seqlens, k=kn, v=vn,
                                                    block_table=bt, causal=causal,
                                                    return_lse=True)
    if paged:  # the appended keys, read back through the table
        kc, vc = (torch.stack([t[bt[i]].reshape(-1, 1, 128) for i in range(2)]) for t in (kp, vp))
    for i, n in enumerate(lengths):
        assert torch.equal(kc[i, n:n + n_new], kn[i]) and torch.equal(vc[i, n:n + n_new], vn[i])
    check(q, kc, vc, [n + n_new for n in lengths], out, causal=causal, lse=lse)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("pre,pace", [(1, 1), (2, 1), (2, 0)])
def test_gluon_tiles_loaded_before_the_wait_with_keys_written_just_before(paged, pre, pace):
    """The early start's loads before its wait: `pre` tiles, `pace` K / V halves in flight (0:
    all). Keys written just before the launch (appended=2) sit in the last split's second tile,
    which is loaded again after the wait; then a graph replayed at other lengths moves every
    split (the tiles the hint placed are all loaded again)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the gluon render is sm_90's")
    name = "splitkv-m64-n128-w4-s2-sp3-gluon=true"
    q, kc, vc = make(2, 1, 8, 1, 128, 2048, torch.bfloat16, "cuda")
    kp, vp, bt = _paged(kc, vc, 256) if paged else (kc, vc, None)
    from flashtune.kvcache import fit_pages
    plan = SplitKVPlan(q, kp, False, None, fit_pages(Variant.parse(name), 256 if paged else None))
    plan.preload, plan.pace = pre, pace
    lengths = [1000, 500]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    assert plan.early(plan.num_splits(1000))
    plan.run(q, kp, vp, seqlens, bt, 1000, appended=2)  # compiled, its tiles' barriers used
    torch.cuda.synchronize()
    new_k, new_v = (torch.randn(2, 2, 1, 128, dtype=torch.bfloat16, device="cuda")
                    for _ in range(2))
    for i, n in enumerate(lengths):  # the last two keys of each sequence, written just before
        kc[i, n - 2:n], vc[i, n - 2:n] = new_k[i], new_v[i]
    if paged:
        for t, src in ((kp, kc), (vp, vc)):  # as _paged lays them out (2048 keys: 8 pages)
            t[bt.flatten().long()] = src.reshape(-1, 256, 1, 128)
    out, lse = plan.run(q, kp, vp, seqlens, bt, 1000, appended=2)
    torch.cuda.synchronize()
    check(q, kc, vc, lengths, out, lse=lse)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = plan.run(q, kp, vp, seqlens, bt, 1000, appended=2)
    for lengths in ([1500, 1000], [700, 2048], [1000, 1]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        check(q, kc, vc, lengths, out, lse=lse)


@pytest.mark.gpu
def test_gluon_strided_caches_and_narrow_pages_fall_back():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the gluon render is sm_90's")
    q, kc, vc = make(2, 1, 8, 2, 128, 300, torch.bfloat16, "cuda")
    wide_k, wide_v = (torch.randn(2, 300, 4, 128, dtype=torch.bfloat16, device="cuda")
                      for _ in range(2))
    k2, v2 = wide_k[:, :, 1:3], wide_v[:, :, 1:3]  # heads 1-2 of 4: not contiguous
    with flashtune.force(GLUON):
        out = flashtune.attention_with_kvcache(q, k2, v2, cache_seqlens=300)
        check(q, k2, v2, [300, 300], out)
        # a paged cache of 32-key pages (narrower than the 64-key tile: the Triton render),
        # the pages shuffled
        pages, vpages = (torch.randn(20, 32, 2, 128, dtype=torch.bfloat16, device="cuda")
                         for _ in range(2))
        bt = torch.randperm(20, device="cuda").reshape(2, 10).to(torch.int32)
        out = flashtune.attention_with_kvcache(q, pages, vpages, cache_seqlens=300,
                                               block_table=bt)
    kk, vv = (torch.stack([t[bt[i]].reshape(-1, 2, 128) for i in range(2)])
              for t in (pages, vpages))
    check(q, kk, vv, [300, 300], out)


def _problem(dtype="bfloat16", d=128, group=8, nq=1, nk=32768, **kw):
    from flashtune.problem import Problem
    return Problem("splitkv", dtype, d, False, group, 1, 8 * group, nq, nk, **kw)


@pytest.mark.parametrize("target,problem,searched", [
    ("H100", _problem(), True),                      # MQA 8/1, one token
    ("H100", _problem(group=4, d=64), True),
    ("H100", _problem(group=8, nq=16), False),       # 128 rows: more than one 64-row tile
    ("H100", _problem(dtype="float32"), False),
    ("H100", _problem(d=256), False),
    ("H100", _problem(window=512), False),           # masks beyond causal: the Triton render
    ("A100", _problem(), False),                     # no wgmma
])
def test_the_search_space_has_gluon_where_it_can_run(target, problem, searched):
    from flashtune.search_space import Space
    from flashtune.targets import get
    space = Space.build("splitkv", get(target), problem)
    gluon = [v for v in space.feasible if v.gluon]
    assert bool(gluon) == searched
    # every gluon point is one the family takes (Variant refuses the others) and fits sm_90: its
    # 64-row tile, or a 16-row one (swap_ab; 32 would run as 16 for these <= 16 rows) of 64- or
    # 128-key steps
    rows = problem.group * problem.seqlen_q
    assert all(v.num_warps == 4 and v.loads == "pointer" for v in gluon)
    assert all(v.block_m == 64 or (v.block_m == 16 and v.block_n >= 64) for v in gluon)
    if searched:  # both tile widths the H100 ran, 2 stages; 4 x 128 keys only under D=128
        shapes = {(v.block_n, v.num_stages) for v in gluon if v.block_m == 64}
        assert {(64, 2), (128, 2), (32, 4)} <= shapes
        assert ((128, 4) in shapes) == (problem.head_dim == 64)
        swapped = {(v.block_n, v.num_stages) for v in gluon if v.block_m == 16}
        assert {(64, 2), (128, 2)} <= swapped and rows <= 16
        # a gluon tile of 64 rows is allowed though the Triton render's is capped near the rows
        assert not any(v.block_m == 64 and not v.gluon for v in space.feasible)


def test_sm90_seeds_start_the_search_at_the_gluon_render():
    from flashtune.families import get
    from flashtune.search_space import Space
    from flashtune.targets import get as target
    fam = get("splitkv")
    names = {v.name for v in fam.seed_variants(128, "bfloat16", arch="sm_90")}
    assert {"splitkv-m64-n64-w4-s2-gluon=true", "splitkv-m64-n128-w4-s2-gluon=true",
            "splitkv-m16-n128-w4-s2-gluon=true"} <= names
    for arch, dtype, d in (("sm_80", "bfloat16", 128), ("sm_90", "float32", 128),
                           ("sm_90", "bfloat16", 256)):
        assert not any(v.gluon for v in fam.seed_variants(d, dtype, arch=arch))
    # projected into a bucket the render cannot serve, a gluon seed is no gluon point
    space = Space.build("splitkv", target("H100"), _problem(nq=16))
    assert all(not p.gluon for p in (space.project(v) for v in fam.seed_variants(
        128, "bfloat16", arch="sm_90")) if p is not None)


def test_compile_ahead_warms_the_gluon_kernel_with_descriptors(monkeypatch):
    """The search's compile-ahead (meta tensors, kernel[grid] to the JIT's warm-up): the gluon
    partial kernel gets its K/V TMA descriptors over the (B * Ncache, Hk * D) view."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from _warmup import stub_load
    from flashtune import launch_splitkv
    from flashtune.measure_splitkv import SplitKVOps
    calls = stub_load(monkeypatch, launch_splitkv, ("attn_splitkv_partial",
                                                    "attn_splitkv_combine"))
    p = _problem(nk=4096)  # 8 kv heads: the view is (1 * 4096, 8 * 128)
    assert SplitKVOps("cuda").compile_ahead(Variant.parse(GLUON), p) == 1000 * len(calls)
    partial = [c for c in calls if c.name == "attn_splitkv_partial"]
    assert partial and all(c.kw["STAGES"] == 2 and c.kw["GROUP"] == 8 for c in partial)
    for c in partial:
        descs = [a for a in c.args if isinstance(a, TensorDescriptor)]
        assert len(descs) == 2 and all(d.base.device.type == "meta" for d in descs)
        shapes = [(list(d.shape), list(d.block_shape)) for d in descs]
        assert shapes == [([4096, 8 * 128], [64, 128])] * 2

