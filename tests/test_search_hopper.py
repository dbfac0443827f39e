"""The search's compile-ahead for the Gluon families (hopper_fwd, hopper_bwd): the launcher runs
on meta tensors and every kernel[grid](...) goes to the JIT's warm-up, with the TMA descriptors
the launch makes (over meta bases), so the timing worker finds the binaries in Triton's cache
instead of compiling each candidate again (1-4 s a trial on the H200, serial). The warm-up needs
a GPU driver: it is stood in for here and checked on the device (first calls, trial phases)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from flashtune.codegen import Variant
from flashtune.gluon_compat import missing
from flashtune.search_plan import standard_problem

from _warmup import Warmup, stub_load

pytestmark = pytest.mark.skipif(bool(missing()), reason="this Triton has no Gluon")


def _stub(monkeypatch, module, names):
    return stub_load(monkeypatch, module, names, gluon=True)


@pytest.mark.parametrize("persistent", [False, True])
def test_hopper_fwd_compile_ahead_warms_the_launch_binary(monkeypatch, persistent):
    from flashtune import launch_hopper
    from flashtune.measure_hopper import OPS
    calls = _stub(monkeypatch, launch_hopper, ["attn_fwd_hopper"])
    v = Variant("hopper_fwd", block_m=64, block_n=128, num_warps=4, num_stages=3, pingpong=True,
                persistent=persistent, loader_regs=24)
    p = standard_problem("fwd", "bfloat16", 128, True, 2048)
    assert OPS.compile_ahead(v, p) == 2000  # the larger of the two warm-ups' shared memory
    timed, gate = calls  # the timed problem, then the gate's (one batch)
    for c, b in ((timed, p.batch), (gate, 1)):
        assert c.blocks == [[1, 64, 128], [1, 128, 128], [1, 128, 128], [1, 64, 128]]  # q k v o
        n_tiles = -(-p.seqlen_q // 128) * b * p.heads  # two ping-pong consumers of 64 rows
        assert c.args[-4:] == (p.heads, p.seqlen_q, p.seqlen_k, n_tiles)
        assert c.kw["STAGES"] == 3 and c.kw["IS_CAUSAL"] and c.kw["LOADER_REGS"] == 24
        assert c.grid == (n_tiles,)  # persistent too: no SM count asked (no CUDA context)


@pytest.mark.parametrize("masked", [False, True])
def test_hopper_bwd_separate_compile_ahead_warms_the_generic_dq_kernel(monkeypatch, masked):
    """dq="separate" runs the generic bwd's dQ kernel, which its plan loads through
    launch_bwd.load: compile_only routes that one too, so a compile worker (no CUDA) compiles it
    instead of launching it (session 24: every masked dq="separate" trial of the H100 mask
    search failed with "Triton Error [CUDA]: initialization error")."""
    import dataclasses

    from flashtune import launch_bwd, launch_hopper_bwd
    from flashtune.measure_hopper_bwd import OPS
    calls = []

    def plain(name):  # a Triton (not Gluon) kernel's warm-up: no descriptors
        return Warmup(name, calls, step=0)
    monkeypatch.setattr(launch_hopper_bwd, "load", lambda v: SimpleNamespace(
        attn_bwd_hopper=Warmup("attn_bwd_hopper", calls, gluon=True),
        attn_bwd_preprocess=plain("attn_bwd_preprocess")))
    monkeypatch.setattr(launch_bwd, "load", lambda v: SimpleNamespace(
        **{n: plain(n) for n in ("attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq")}))
    v = Variant("hopper_bwd", block_m=64, block_n=128, num_warps=8, num_stages=2,
                dq="separate", window=masked, softcap=masked)
    p = standard_problem("bwd", "bfloat16", 128, True, 1024)
    if masked:
        p = dataclasses.replace(p, window=256, softcap=True)
    assert OPS.compile_ahead(v, p) > 0
    names = [c.name for c in calls]
    assert names.count("attn_bwd_dq") == 2 and names.count("attn_bwd_hopper") == 2, names
    dq = [c for c in calls if c.name == "attn_bwd_dq"]
    assert all(c.kw.get("SOFTCAP", False) == masked or "SOFTCAP" not in c.kw for c in dq)


def test_hopper_bwd_compile_ahead_warms_the_preprocess_and_the_kernel(monkeypatch):
    from flashtune import launch_hopper_bwd
    from flashtune.measure_hopper_bwd import OPS
    names = ["attn_bwd_preprocess", "attn_bwd_hopper"]  # delta = rowsum(dO * O) first
    calls = []
    real = launch_hopper_bwd.load

    def load(v):  # the Gluon kernel stood in for; the generic preprocess is a Triton kernel
        if v.family == "hopper_bwd":
            return SimpleNamespace(attn_bwd_hopper=Warmup("attn_bwd_hopper", calls, gluon=True))
        assert getattr(real(v), "attn_bwd_preprocess") is not None
        return SimpleNamespace(attn_bwd_preprocess=Warmup("attn_bwd_preprocess", calls, step=0))
    monkeypatch.setattr(launch_hopper_bwd, "load", load)
    v = Variant("hopper_bwd", block_m=64, block_n=128, num_warps=8, num_stages=2)
    p = standard_problem("bwd", "bfloat16", 64, False, 1024)
    assert OPS.compile_ahead(v, p) > 0
    assert [c.name for c in calls] == names * 2  # the timed problem's, then the gate's
    assert calls[1].blocks == [[1, 64, 64], [1, 128, 64], [1, 128, 64], [1, 64, 64],
                               [1, 128, 64], [1, 128, 64]]  # q k v dO dK dV
