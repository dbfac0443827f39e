"""q, k, v in (B, N, H, D) memory -- a transformers model's projections viewed as (B, H, N, D),
or slices of one fused QKV projection -- on the Hopper families, where the dense renders' (B*H,
N, D) descriptors cannot reach and such calls ran the generic families: hopper_fwd's bnhd render
(Variant.bnhd; descriptors over (B, N, H*D)) and hopper_bwd's varlen render on equal lengths
(launch_hopper_bwd.RowsBwd). CPU tests: the views, the render (the dense kernels' code
untouched), the plans' choice and the sm_90 compile; GPU tests force the Hopper families on
these layouts (odd lengths, GQA, Nq != Nk, causal rows that see no key, dO in another layout
than q) against the float64 reference, and check that they ran the Gluon kernels."""
import dataclasses

import pytest
import torch

import flashtune
from flashtune import gluon_compat, launch_hopper
from flashtune.codegen import Variant, kernel_hash, render

from _check import assert_matches_reference, code_lines, hopper_gpu, qkv
from test_backward import assert_grads_match

gluon_compat.missing()  # imported under the session's interpreter setting (test_hopper_bwd)
pytestmark = pytest.mark.usefixtures("reset_dispatch")

FWD = {64: ["hopper_fwd-m64-n64-w4-s3-causal_split=false-pingpong=true-persistent=true-lr40-qb2"
            "-head_order=true-early_k_release=true-async_o_store=true",
            "hopper_fwd-m64-n128-w4-s2-causal_split=false-pingpong=true-persistent=true-lr40"
            "-qb2-l2_order=true-early_k_release=true-async_o_store=true"],
       128: ["hopper_fwd-m64-n128-w4-s2-pingpong=true-persistent=true-lr56-qb2"
             "-early_k_release=true-async_o_store=true",
             "hopper_fwd-m64-n128-w4-s3-pingpong=true",  # no loader: the consumers' _refill
             "hopper_fwd-m128-n64-w8-s3-lr24"],          # one consumer
       256: ["hopper_fwd-m128-n64-w8-s2-lr24-early_k_release=true",
             "hopper_fwd-m64-n64-w4-s2-pingpong=true-lr32-l2_order=true-early_k_release=true"
             "-early_rescale=true"]}
BWD = {64: ["hopper_bwd-m64-n64-w4-s1-dq=gluon-mq64-nq64-wq4-sq2", "hopper_bwd-m64-n128-w8-s2"],
       128: ["hopper_bwd-m64-n64-w4-s2-dq=gluon", "hopper_bwd-m64-n128-w8-s2-dq=separate"],
       256: ["hopper_bwd-m64-n64-w8-s2-dq=gluon-mq64-nq64-wq4-sq2"]}


def tensors(layout, b, h, hk, nq, nk, d, dtype, device):
    """q, k, v as (B, H, N, D) views: "bnhd" of (B, N, H, D) memory; "fused" slices of one
    (B, N, 3, H, D) projection (row stride 3 H D; needs h == hk, nq == nk); "mixed" q in
    (B, N, H, D) memory, k and v contiguous."""
    if layout == "fused":
        x = torch.randn(b, nq, 3, h, d, dtype=dtype, device=device)
        return tuple(t.transpose(1, 2) for t in x.unbind(2))
    if layout == "mixed":
        q = qkv(b, h, hk, nq, nk, d, dtype, device, layout="bnhd")[0]
        return (q, *qkv(b, h, hk, nq, nk, d, dtype, device)[1:])
    return qkv(b, h, hk, nq, nk, d, dtype, device, layout=layout)


# -- CPU: views, render, plans, compile -----------------------------------------------------------

def test_tile_view_takes_one_view_for_all_tensors():
    view = launch_hopper.tile_view
    q = torch.empty(2, 4, 100, 64)
    assert view(q) is launch_hopper._view3 and view(q)(q) == ([8, 100, 64], [6400, 64, 1])
    bnhd = torch.empty(2, 100, 4, 64).transpose(1, 2)
    assert view(bnhd) is launch_hopper._rows_view
    assert view(bnhd)(bnhd) == ([2, 100, 256], [25600, 256, 1])           # (B, N, H*D)
    fused = torch.empty(2, 100, 3, 4, 64).unbind(2)[1].transpose(1, 2)
    assert view(fused)(fused) == ([2, 100, 256], [76800, 768, 1])       # rows 3 H D apart
    one = torch.empty(1, 100, 4, 64).transpose(1, 2)                    # B = 1: both; the first
    assert view(one) is launch_hopper._view3 and view(one, bnhd) is launch_hopper._rows_view
    assert view(q, bnhd) is None                                          # mixed: neither
    assert view(torch.empty(2, 4, 64, 100).transpose(2, 3)) is None     # D not contiguous
    assert view(torch.empty(2, 100, 64, 4).permute(0, 3, 1, 2)) is None  # heads interleaved
    assert not launch_hopper.addressable(torch.empty(2, 100, 4, 65)[..., :64].transpose(1, 2),
                                         view=launch_hopper._rows_view)


@pytest.mark.parametrize("name", [n for ns in FWD.values() for n in ns]
                         + ["hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24-window=true",
                            "hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24-block_sparse=true"])
def test_bnhd_code_only_in_bnhd_renders(name):
    v = Variant.parse(name)
    b = dataclasses.replace(v, bnhd=True)
    assert Variant.parse(b.name) == b and kernel_hash(v) != kernel_hash(b)
    dense, rows = render(v), render(b)
    assert "tile_at" not in code_lines(dense) and "tile_at(" in code_lines(rows)
    assert len(dense.splitlines()) == len(rows.splitlines())  # line numbers match
    # only the TMA coordinates (and how the tile's batch and head are packed for them) differ
    changed = set(code_lines(rows).splitlines()) - set(code_lines(dense).splitlines())
    assert all("tile_at" in ln or "<< 16" in ln or ln.strip().startswith("q_ready.index")
               for ln in changed), changed
    with pytest.raises(ValueError, match="bnhd"):
        Variant.parse("hopper_bwd-m64-n64-w4-s2-dq=gluon-bnhd=true")  # RowsBwd: varlen's


@pytest.mark.parametrize("layout", ["bhnd", "bnhd", "fused", "mixed"])
def test_plans_take_the_bnhd_kernels_for_such_calls(layout, monkeypatch):
    """Meta tensors (the plan is built as for a GPU, nothing launched). "mixed" (q in (B, N, H, D)
    memory, k and v contiguous: a transformers model's attention after RoPE) takes the bnhd
    kernels with K and V copied into q's layout; the other way round (q contiguous) keeps the
    generic families."""
    from flashtune.launch_hopper_bwd import HopperBwdPlan
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = tensors(layout, 2, 4, 4, 256, 256, 128, torch.bfloat16, "meta")
    fwd = launch_hopper.HopperFwdPlan(q, k, v, True, None, Variant.parse(FWD[128][0]))
    bwd = HopperBwdPlan(q, k, v, True, None, Variant.parse(BWD[128][0]))
    assert fwd.why == "" and fwd.fallback is None and bwd.why == ""
    assert fwd.copy_kv == (layout == "mixed")
    assert (bwd.rows is not None and bwd.rows.copy_kv) == (layout == "mixed")
    assert fwd.variant.bnhd == (layout != "bhnd") and (bwd.rows is None) == (layout == "bhnd")
    if bwd.rows is not None:
        assert bwd.rows.plan.variant == dataclasses.replace(bwd.variant, varlen=True)
    # a window: the varlen render takes none, so the generic bwd (the forward renders it)
    win = HopperBwdPlan(q, k, v, True, None, Variant.parse(BWD[128][0] + "-window=true"),
                        flashtune.masks.Masks(window=(64, 0)))
    assert bool(win.why) == (layout != "bhnd") and win.rows is None


def test_q_contiguous_beside_kv_in_rows_memory_keeps_the_generic_families(monkeypatch):
    from flashtune.launch_hopper_bwd import HopperBwdPlan
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    k, v = qkv(2, 4, 4, 256, 256, 128, torch.bfloat16, "meta", layout="bnhd")[1:]
    q = torch.empty(2, 4, 256, 128, dtype=torch.bfloat16, device="meta")
    fwd = launch_hopper.HopperFwdPlan(q, k, v, True, None, Variant.parse(FWD[128][0]))
    bwd = HopperBwdPlan(q, k, v, True, None, Variant.parse(BWD[128][0]))
    assert fwd.fallback is not None and not fwd.copy_kv and bwd.why and bwd.rows is None


def test_shipped_kind_of_bnhd_render_compiles_for_sm90():
    """The bnhd render of a D=128 causal record: no spills, as its dense render (~10 s;
    bench/bnhd_spills.py compares every shipped record's two renders)."""
    import json
    from test_compile_sm90 import kernels_check
    names = ["hopper_fwd-m64-n64-w4-s3-causal_split=false-pingpong=true-persistent=true-lr56-qb2"
             "-head_order=true-early_k_release=true-async_o_store=true-bnhd=true"]
    r = kernels_check(*names, "--head-dim", "128", "--causal", "--format", "json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(r.stdout)
    assert len(rows) == 1 and rows[0]["spill_bytes"] == 0, rows


# -- GPU: against the float64 reference ----------------------------------------------------------

# (b, h, hk, nq, nk): tails inside a tile, GQA with Nq != Nk, causal rows that see no key (Nq > Nk)
SHAPES = [(2, 4, 4, 300, 300), (2, 8, 2, 200, 333), (3, 4, 1, 129, 64)]
FWD_CASES = [(n, d, s, torch.bfloat16) for d, ns in FWD.items() for n in ns for s in SHAPES[:2]]
FWD_CASES += [(ns[0], d, SHAPES[2], torch.float16) for d, ns in FWD.items()]
BWD_CASES = [(n, d, s, torch.bfloat16) for d, ns in BWD.items() for n in ns for s in SHAPES[:2]]
BWD_CASES += [(ns[0], d, SHAPES[2], torch.float16) for d, ns in BWD.items()]


@pytest.fixture
def no_fallback(monkeypatch):
    """A check that every Hopper plan of the test ran its own kernels: none handed its call to
    the generic family (at build or per call)."""
    from flashtune.launch_hopper_bwd import HopperBwdPlan
    plans, generic = [], []
    for cls in (launch_hopper.HopperFwdPlan, HopperBwdPlan):
        real = cls.run
        monkeypatch.setattr(cls, "run", lambda self, *a, real=real: plans.append(self)
                            or real(self, *a))
    real_generic = launch_hopper.generic_plan
    monkeypatch.setattr(launch_hopper, "generic_plan", lambda *a, **kw: generic.append(a)
                        or real_generic(*a, **kw))

    def check(*kinds):
        assert [type(p).__name__ for p in plans] == list(kinds), plans
        assert all(p.why == "" and p.fallback is None for p in plans) and not generic
        # RowsBwd's varlen plan: its own generic fallback unused
        assert all(p.rows.plan.fallback is None for p in plans if getattr(p, "rows", None))
    return check


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("which,name,d,shape,dtype", [("fwd", *c) for c in FWD_CASES]
                         + [("bwd", *c) for c in BWD_CASES])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference(which, name, d, shape, dtype, causal, no_fallback):
    """A forced hopper_fwd variant's output, or a forced hopper_bwd variant's gradients (the
    forward: the generic fwd's default), in q, k, v's layout."""
    q, k, v = tensors("bnhd", *shape, d, dtype, "cuda")
    with flashtune.force(name):
        if which == "fwd":
            outs = (assert_matches_reference(q, k, v, causal=causal),)
        else:
            outs = assert_grads_match(q, k, v, causal=causal)[1:]
    assert [o.stride() for o in outs] == [x.stride() for x in (q, k, v)[:len(outs)]]
    no_fallback("HopperFwdPlan" if which == "fwd" else "HopperBwdPlan")


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("layout", ["fused", "mixed"])
def test_fused_and_mixed_layouts(layout, no_fallback):
    """Slices of one fused QKV projection run the Hopper kernels; so does q in (B, N, H, D)
    memory beside contiguous k, v (K and V copied into q's layout: kv_rows_copy), GQA, whose
    gradients come back in each tensor's own layout."""
    h, hk = (4, 4) if layout == "fused" else (8, 2)
    q, k, v = tensors(layout, 2, h, hk, 333, 333, 128, torch.bfloat16, "cuda")
    with flashtune.force(FWD[128][0]):
        o = assert_matches_reference(q, k, v, causal=True, scale=0.3)
    with flashtune.force(BWD[128][0]):
        grads = assert_grads_match(q, k, v, causal=True, scale=0.3)[1:]
    if layout == "mixed":  # (fused: dense (B, N, H, D) gradients, not the projection's slices)
        assert o.stride() == q.stride()
        assert [g.stride() for g in grads] == [x.stride() for x in (q, k, v)]
    no_fallback("HopperFwdPlan", "HopperBwdPlan")


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("q_layout", ["bhnd", "bnhd"])
def test_do_in_another_layout_than_q(q_layout, no_fallback):
    """dO in (B, N, H, D) memory for a contiguous q, and a contiguous dO for (B, N, H, D)
    inputs: copied into q's layout, the Hopper kernels run (the generic bwd did before)."""
    q, k, v = tensors(q_layout, 2, 8, 2, 300, 300, 128, torch.bfloat16, "cuda")
    do = (torch.randn(2, 300, 8, 128, dtype=q.dtype, device="cuda").transpose(1, 2)
          if q_layout == "bhnd" else torch.randn(2, 8, 300, 128, dtype=q.dtype, device="cuda"))
    with flashtune.force(BWD[128][0]):
        assert_grads_match(q, k, v, causal=True, do=do)
    no_fallback("HopperBwdPlan")


@pytest.mark.gpu
@hopper_gpu
def test_dispatched_bnhd_calls_run_the_hopper_families(no_fallback):
    """Through the shipped table (the H100's: both Hopper families serve this bench shape, D=128
    causal 1k; the H200's gives the backward to the generic bwd): a call in (B, N, H, D) memory
    runs the family the dispatcher names, with its bnhd kernels (before: the generic families)."""
    from flashtune.problem import Problem
    q, k, v = tensors("bnhd", 16, 16, 16, 1024, 1024, 128, torch.bfloat16, "cuda")
    assert_grads_match(q, k, v, causal=True)
    plan = {"hopper_fwd": "HopperFwdPlan", "hopper_bwd": "HopperBwdPlan"}
    names = [plan.get(flashtune.explain(Problem(f, "bfloat16", 128, True, 1, 16, 16, 1024,
                                                1024)).variant.family) for f in ("fwd", "bwd")]
    assert names[0] == "HopperFwdPlan"  # every H100 / H200 table's record there
    no_fallback(*filter(None, names))
