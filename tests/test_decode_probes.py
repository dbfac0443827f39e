"""Session 36's decode probes (bench/): their kernels give the right answer before their times
are read. The overlap reader's sums against float64 (plain order in the interpreter, every
order on the GPU); the Gluon TMA reader and the Gluon split-KV partial kernel compiled for sm_90
here, and against float64 on the GPU (ragged split ends, splits without keys, a cache longer
than the sequence)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import overlap_ceiling as oc  # noqa: E402


def _sums_match(got, x, y):
    want = x.double().sum() + y.double().sum()
    assert abs(got.double().sum().item() - want.item()) < 1e-3 * (abs(want.item()) + x.numel())


def test_overlap_reader_plain_matches_float64(device):
    if device == "cuda":
        pytest.skip("the GPU test below runs every order")
    x = torch.randn(300, 64, dtype=torch.float16)
    y = torch.randn_like(x)
    for programs, shape in ((4, (4, 256, 1)), (3, (2, 128, 2))):
        _sums_match(oc.reader(x, y, programs, "plain", False, shape)(), x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["plain", "wait", "l2", "early", "l2w", "l2w/4"])
def test_overlap_reader_every_order_matches_float64(mode):
    x = torch.randn(4096 + 37, 128, dtype=torch.bfloat16, device="cuda")
    y = torch.randn_like(x)
    for per_sm, shape in ((1, (8, 2048, 3)), (4, (4, 8192, 3))):
        _sums_match(oc.reader(x, y, 132 * per_sm, mode, True, shape)(), x, y)


@pytest.mark.parametrize("script,configs,per_config", [
    ("tma_read_probe.py",
     "64/2/1,64/4/1,64/4/1/noread,64/4/1/pre,64/2/2/pretf,64/4/1/early,64/2/2/pretf/comb", 1),
    ("gluon_decode_probe.py", "64/2/1,64/3/1/kv,32/4/1/kv,128/2/1/kv,64/2/1/e", 1),
])
def test_gluon_probes_compile_for_sm90(script, configs, per_config):
    # in a process of its own: Gluon compiles nothing under the interpreter this one runs
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, str(BENCH / script), "--compile", "--configs", configs],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [ln for ln in r.stdout.splitlines() if " smem " in ln]
    assert len(rows) == per_config * len(configs.split(",")), r.stdout
    for ln in rows:  # fits the H100's 227 KB, no spills
        smem = int(ln.split(" smem ")[1].split()[0])
        assert 0 < smem <= 232448 and " spill 0" in ln, ln


@pytest.mark.gpu
def test_tma_reader_matches_float64():
    import tma_read_probe as tr
    for n in (4096, 8192 + 37):
        x = torch.randn(n, 128, dtype=torch.bfloat16, device="cuda")
        y = torch.randn_like(x)
        prev = torch.randn(4, dtype=torch.float32, device="cuda")  # the layer before's sums
        for block_r, stages in ((64, 2), (64, 4)):
            for mode in tr.MODES:  # a dependent order reads prev and scales by 1
                got = tr.tma_reader(x, y, 132, block_r, stages, mode=mode, prev=prev)()
                _sums_match(got, x, y)


@pytest.mark.gpu
def test_tma_reader_partials_through_the_shipped_combine():
    # each program stores its rows' column sums as a split's partial (LSE 0: equal weights), so
    # the combine's output is the mean of those: the column sums of x + y over the programs
    import tma_read_probe as tr
    n = 8192 + 37
    x = torch.randn(n, 128, dtype=torch.bfloat16, device="cuda")
    y = torch.randn_like(x)
    for programs, mode in ((132, "plain"), (264, "pretf")):
        comb = tr.combine_parts(tr.combine_launcher(n), programs)
        got = tr.tma_reader(x, y, programs, 64, 2, mode=mode, prev=comb[3], combine=comb)()
        _sums_match(got, x, y)
        per = -(-(-(-n // programs)) // 64) * 64
        progs = -(-n // per)
        want = (x.double() + y.double()).sum(0) / progs
        o = comb[3][0, 0].double()  # (8 heads, 128)
        assert torch.allclose(o, want.expand(8, -1), rtol=2e-2, atol=2e-2), (o - want).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("n,splits", [(1000, 132), (4096, 7), (131072 - 37, 132)])
@pytest.mark.parametrize("config", [(64, 2, False, False), (64, 3, True, False),
                                    (32, 4, True, False), (64, 2, False, True)])
def test_gluon_partial_matches_float64(n, splits, config):
    # 1000 keys over 132 splits of 64: 116 splits without keys; 7 splits: ragged ends; the last
    # config the early start (a dependent launch, its first rows prefetched before its wait)
    import gluon_decode_probe as gd
    from flashtune.reference import reference
    g, d = 8, 128
    q = torch.randn(1, 1, g, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, n + 200, 1, d, dtype=torch.bfloat16, device="cuda")  # past the length
    v = torch.randn_like(k)
    block_n, stages, kv, early = config
    o, lse = gd.GluonSplit(q, block_n, stages, splits, pdl=early, split_kv=kv,
                           early=early).run(q, k, v, n)
    kk, vv = (t[0, :n, 0].double().expand(1, g, n, d) for t in (k, v))
    ref, ref_lse = reference(q.transpose(1, 2).double(), kk, vv, return_lse=True)
    assert (o.double().reshape(g, d) - ref.reshape(g, d)).abs().max().item() < 2e-2
    assert (lse.reshape(g).double() - ref_lse.reshape(g)).abs().max().item() < 1e-3



def test_gluon_splitkv_configs_positional_and_by_name():
    import gluon_splitkv as gs
    base = gs.parse_configs("128/2")[0]
    bm, nc = gs.FIELDS.index("bm"), gs.FIELDS.index("nc")
    assert base == (128, 2) + gs.UNSET[2:] and base[bm] == 64
    # session 45's positional spelling and its named one are the same config
    pos = "64/2/256/2/0/1/0/2/-1/0/1/1/0/0/16"
    named = "64/2:splits=256:per_sm=2:pf_mib=0:tf=1:pre=2:pace=1:ts=1:bm=16"
    assert gs.parse_configs(pos) == gs.parse_configs(named)
    assert [(c[nc], c[bm]) for c in gs.parse_configs("128/2:nc=1,128/2/0/1:bm=16")] == [
        (1, 64), (0, 16)]
    assert gs.parse_configs("128/2:nw=1")[0][gs.FIELDS.index("nw")] == 1  # by name only
    for bad in ("128", "128/2:bn=4", "128/2:bm", "128/2/" + "/".join(["0"] * 15)):
        with pytest.raises(ValueError, match="config"):
            gs.parse_configs(bad)


def test_gluon_splitkv_no_wait_combine_renders_without_its_wait():
    # NW's module: the early render whose combine no longer waits for the partial grid (the
    # partial kernel's own wait kept)
    import inspect

    import gluon_splitkv as gs
    from flashtune.codegen import Variant
    mod = gs.no_wait_module(Variant.parse("splitkv-m16-n128-w4-s2-gluon=true"))
    combine = inspect.getsource(mod.attn_splitkv_combine.fn)
    assert "gdc_wait" not in combine and "gdc_launch_dependents" in combine
    assert "gdc_wait()" in inspect.getsource(mod.attn_splitkv_partial.fn)


def test_paged_timing_probe_tables_and_steps_match_contiguous():
    """bench/paged_timing_probe.py: every table maps each sequence to its own pages, once each,
    and every paged step (shared tables and one a layer) computes the contiguous step's output
    (float16 in the interpreter against a float64 reference): full caches, so a shuffled table
    reorders the keys one query token sees, all of them, as the probe times it."""
    import paged_timing_probe as pt

    from flashtune.reference import reference
    b, per, page, d = 2, 4, 16, 64
    for name, t in pt.tables(b, per, "cpu").items():
        assert t.dtype == torch.int32 and t.shape == (b, per), name
        for i in range(b):
            assert sorted(t[i].tolist()) == list(range(i * per, (i + 1) * per)), name
    if not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("the kernels need TRITON_INTERPRET=1 on the CPU")
    nk = per * page
    q = torch.randn(b, 1, 8, d, dtype=torch.float16)
    kcs = [torch.randn(b, nk, 1, d, dtype=torch.float16) for _ in range(2)]
    vcs = [torch.randn_like(k) for k in kcs]
    sl = torch.full((b,), nk, dtype=torch.int32)
    makes = pt.steps([q, q], kcs, vcs, [sl, sl], page, b, nk)
    assert set(makes) == {"contiguous", "paged16 bench", "paged16 probes", "paged16 sequential",
                          "paged16 bench per layer"}
    for i in range(2):
        want = reference(q.transpose(1, 2).double(), kcs[i].transpose(1, 2).double(),
                         vcs[i].transpose(1, 2).double()).transpose(1, 2)
        for label, make in makes.items():
            got = make(i)().double()
            assert (got - want).abs().max().item() < 2e-3, (label, i)
