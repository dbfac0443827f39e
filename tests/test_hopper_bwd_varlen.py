"""hopper_bwd's varlen render (packed sequences, Gluon, sm_90): GPU tests force it and compare
attention_varlen's dQ, dK, dV with the float64 reference run per sequence (empty and one-token
sequences, Nq != Nk, causal rows that see nothing, GQA, every dQ scheme, D 64/128/256, tails
cut at every sequence's end); CPU tests cover the dispatcher (the rival family competes for
varlen calls by the dense records, masked ones stay generic), the render (the dense kernels'
code is untouched) and the sm_90 compile."""
import dataclasses

import pytest
import torch

import flashtune
from flashtune import dispatch, gluon_compat, ops_varlen
from flashtune.codegen import Variant, kernel_hash, render
from flashtune.masks import Masks
from flashtune.problem import Problem

from test_varlen import assert_varlen_matches, packed

from _check import ON_H100, hopper_gpu

gluon_compat.missing()  # imported under the session's interpreter setting (test_hopper_bwd)
pytestmark = pytest.mark.usefixtures("reset_dispatch")  # nothing forced or configured after a test


# -- CPU: render, variant rules, dispatch -----------------------------------------------------

DENSE = ["hopper_bwd-m64-n64-w4-s2-dq=gluon", "hopper_bwd-m64-n128-w8-s1",
         "hopper_bwd-m64-n128-w8-s2-dq=separate",
         "hopper_bwd-m64-n64-w4-s2-dq=gluon-mq64-nq128-wq4-sq1"]


@pytest.mark.parametrize("name", DENSE)
def test_varlen_code_only_in_varlen_renders(name):
    v = Variant.parse(name)
    vl = dataclasses.replace(v, varlen=True)
    assert kernel_hash(v) != kernel_hash(vl)
    dense, packed_src = render(v), render(vl)
    code = [ln for ln in dense.splitlines()[1:] if ln.strip() and not ln.strip().startswith("#")]
    for word in ("cu_seqlens", "varlen", "max_seqlen", "total_q", "q_row0", "k_row0"):
        assert not any(word in ln.lower() for ln in code), word
    assert "CU_SEQLENS_Q" in packed_src and "_store_rows" in packed_src
    assert len(dense.splitlines()) == len(packed_src.splitlines())  # line numbers match


@pytest.mark.parametrize("extra", ["window=true", "softcap=true", "dq_overlap=true"])
def test_varlen_render_refuses_what_it_lacks(extra):
    with pytest.raises(ValueError, match="varlen"):
        Variant.parse(f"hopper_bwd-m64-n64-w8-s2-{extra}-varlen=true")


def _ship(tables, hopper_ms: float, generic_ms: float) -> None:
    """An H100 table with a hopper_bwd and a generic bwd record for the bucket of the varlen
    call below (D=128, bf16, causal, 7 sequences, 16 heads, longest 3000; tests only)."""
    from flashtune.problem import Bucket, Problem
    from flashtune.tuned_db.io import table_path, write_table
    from test_db import make_record
    p = Problem("bwd", "bfloat16", 128, True, 1, 7, 16, 3000, 3000)
    recs = []
    for fam, name, ms in (("hopper_bwd", "hopper_bwd-m64-n64-w4-s2-dq=gluon", hopper_ms),
                          ("bwd", "bwd-m64-n128-w8-s3-causal_split=false-dq=fused-mq128-nq64",
                           generic_ms)):
        r = make_record(variant=name, ms=ms, family=fam)
        recs.append(dataclasses.replace(r, gpu=table_path("H100").stem,
                                        bucket=Bucket.of(dataclasses.replace(p, family=fam))))
    write_table(table_path("H100", tables), "H100", recs)


@pytest.mark.parametrize("faster", ["hopper_bwd", "bwd"])
def test_dispatcher_gives_varlen_backwards_to_the_faster_family(faster, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a GPU machine (no kernel runs here)
    _ship(tmp_path, *((2.6, 2.95) if faster == "hopper_bwd" else (3.0, 2.95)))
    dispatch.configure(gpu="H100", db=f"sqlite:///{tmp_path}/none.db", tables_dir=tmp_path)
    q = torch.empty(9000, 16, 128, dtype=torch.bfloat16)
    p = Problem("bwd", "bfloat16", 128, True, 1, 7, 16, 3000, 3000)
    v = dispatch.select_varlen("bwd", q, q, 7, 3000, 3000, True)
    assert (v.family, v.varlen) == (faster, True)
    assert flashtune.explain(p, varlen=True).variant == v
    # a window: the rival's varlen render takes none, so the generic bwd's own answer
    masked = dispatch.select_varlen("bwd", q, q, 7, 3000, 3000, True, Masks(window=(64, 0)))
    assert (masked.family, masked.varlen) == ("bwd", True)
    # a forced hopper_bwd variant serves varlen backwards (unless masked); forwards: never
    with flashtune.force("hopper_bwd-m64-n64-w4-s2-dq=gluon"):
        assert dispatch.select_varlen("bwd", q, q, 7, 3000, 3000, True).name == \
            "hopper_bwd-m64-n64-w4-s2-dq=gluon-varlen=true"
        assert dispatch.select_varlen("bwd", q, q, 7, 3000, 3000, True,
                                      Masks(softcap=5.0)).family == "bwd"
        assert dispatch.select_varlen("fwd", q, q, 7, 3000, 3000, True).family == "fwd"


def test_a_forced_variant_without_a_varlen_render_leaves_the_call_to_the_dispatcher():
    q = torch.empty(90, 4, 128, dtype=torch.bfloat16)
    for name in ("hopper_bwd-m64-n64-w8-s2-dq_overlap=true",
                 "hopper_bwd-m64-n128-w8-s2-softcap=true"):
        with flashtune.force(name):
            v = dispatch.select_varlen("bwd", q, q, 3, 30, 30, True)
        assert v.family == "bwd" and v.varlen, name


def test_a_batch_of_many_short_sequences_fits_the_grid(monkeypatch):
    """5,000 sequences x 16 heads: 80,000 (sequence, head) programs, past one grid axis's
    65,535, go over two (meta tensors: the plan is built as for a GPU, nothing launched)."""
    from flashtune.launch_hopper_bwd import HopperBwdVarlenPlan
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.empty(5000 * 3, 16, 128, dtype=torch.bfloat16, device="meta")
    plan = HopperBwdVarlenPlan(q, q, 5000, 3, 3, True, None,
                               Variant.parse("hopper_bwd-m64-n64-w4-s2-dq=gluon-varlen=true"))
    assert plan.why == "" and plan.grid == plan.dq_grid == (1, 65535, 2)  # 80,000 <= 2 x 65,535


def test_off_hopper_the_plan_computes_with_the_generic_bwd(device):
    """A forced hopper_bwd varlen variant where Gluon cannot run (the CPU here): the generic
    bwd's varlen default computes the gradients; deterministic calls of an atomic one run the
    generic separate dQ."""
    if ON_H100:
        pytest.skip("the H100 runs the Gluon kernel itself")
    q, k, v, cu_q, cu_k = packed([5, 0, 17, 1], [9, 3, 17, 0], 4, 2, 64, torch.float16, device)
    for name in ("hopper_bwd-m64-n64-w4-s2-dq=gluon", "hopper_bwd-m64-n128-w8-s1"):
        with flashtune.force(name):
            assert_varlen_matches(q, k, v, cu_q, cu_k, causal=True)
            assert_varlen_matches(q, k, v, cu_q, cu_k, deterministic=True)


def _spills(names, d):
    """{(dense name, head dim, kernel): spilled bytes} of `names` compiled for sm_90 (this
    Triton, no GPU), GQA 4 (--tails)."""
    import json
    from test_compile_sm90 import kernels_check
    r = kernels_check(*names, "--head-dim", d, "--tails", "--format", "json")
    assert r.returncode in (0, 1), r.stdout[-3000:] + r.stderr[-3000:]
    return {(row["variant"].removesuffix("-varlen=true"), row["head_dim"], row["kernel"]):
            row["spill_bytes"] for row in json.loads(r.stdout)}


def test_shipped_kind_of_varlen_render_compiles_for_sm90():
    """The render the D=128 records would run (dq="gluon"): both kernels, no spills (~10 s)."""
    got = _spills(["hopper_bwd-m64-n64-w4-s2-dq=gluon-varlen=true"], "128")
    assert got == {("hopper_bwd-m64-n64-w4-s2-dq=gluon", 128, k): 0 for k in ("bwd", "dq")}


@pytest.mark.slow
def test_varlen_render_compiles_for_sm90():
    """Every kernel of the varlen renders compiles for sm_90, spilling no more than its dense
    render (D=128 m64-n128-w8-s1's atomic-dQ kernel spills 28-32 B either way); D=256 its one
    tile."""
    for d, names in (("64,128", DENSE), ("256", ["hopper_bwd-m64-n64-w8-s2-dq=gluon"])):
        dense, packed_ = _spills(names, d), _spills([n + "-varlen=true" for n in names], d)
        assert set(packed_) == set(dense) and len(dense) >= len(names)
        assert all(packed_[k] <= dense[k] for k in dense), (packed_, dense)


# -- GPU: against the float64 reference ----------------------------------------------------------

# an empty sequence on each side, one-token ones, Nq != Nk, Nq > Nk (causal rows that see no
# key), lengths that end inside a 64 / 128 tile and ones that fill whole tiles
LENS_Q = [300, 0, 1, 129, 64, 517, 77]
LENS_K = [260, 6, 1, 129, 0, 700, 128]
# per head dim: the shipped tables' kind of record first (dq="gluon"), then the other dQ schemes
# and tiles
VARIANTS = {64: ["hopper_bwd-m64-n64-w4-s1-dq=gluon", "hopper_bwd-m64-n128-w8-s2",
                 "hopper_bwd-m64-n64-w4-s2-dq=gluon-mq128-nq64-wq8-sq2"],
            128: ["hopper_bwd-m64-n64-w4-s2-dq=gluon", "hopper_bwd-m64-n128-w8-s1",
                  "hopper_bwd-m64-n128-w8-s2-dq=separate",
                  "hopper_bwd-m64-n128-w8-s4-dq=gluon-mq64-nq64-wq4-sq2"],
            256: ["hopper_bwd-m64-n64-w8-s2-dq=gluon", "hopper_bwd-m64-n64-w8-s1"]}
# (variant, head dim, dtype, heads): the first of each head dim in both dtypes, with and without
# GQA; the others bf16 with GQA 4 (each case compiles its kernels: keep the device run short)
CASES = ([(ns[0], d, dt, hh) for d, ns in VARIANTS.items()
          for dt in (torch.bfloat16, torch.float16) for hh in ((4, 4), (8, 2))]
         + [(n, d, torch.bfloat16, (8, 2)) for d, ns in VARIANTS.items() for n in ns[1:]])


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("name,d,dtype,heads", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_grads_match_reference(name, d, dtype, heads, causal):
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K, *heads, d, dtype, "cuda")
    with flashtune.force(name):
        _, dq, dk, dv = assert_varlen_matches(q, k, v, cu_q, cu_k, causal=causal)
    k1 = slice(LENS_K[0], LENS_K[0] + LENS_K[1])  # keys of a sequence with no query
    assert torch.all(dk[k1] == 0) and torch.all(dv[k1] == 0)
    q4 = slice(sum(LENS_Q[:4]), sum(LENS_Q[:5]))  # queries of a sequence with no key
    assert torch.all(dq[q4] == 0)


@pytest.mark.gpu
@hopper_gpu
def test_runs_the_gluon_kernels_not_the_fallback(monkeypatch):
    from flashtune import launch_bwd, launch_hopper_bwd
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K, 8, 2, 128, torch.bfloat16, "cuda")
    generic = []
    real = launch_bwd.BwdPlan.run
    monkeypatch.setattr(launch_bwd.BwdPlan, "run",
                        lambda self, *a, **kw: generic.append(self) or real(self, *a, **kw))
    built = []
    real_init = launch_hopper_bwd.HopperBwdVarlenPlan.__init__
    monkeypatch.setattr(launch_hopper_bwd.HopperBwdVarlenPlan, "__init__",
                        lambda self, *a, **kw: built.append(self) or real_init(self, *a, **kw))
    ops_varlen._bwd_plans.clear()
    with flashtune.force("hopper_bwd-m64-n64-w4-s2-dq=gluon"):
        assert_varlen_matches(q, k, v, cu_q, cu_k, causal=True)
    assert built and all(p.why == "" for p in built) and not generic


@pytest.mark.gpu
@hopper_gpu
def test_strided_packed_qkv_and_scale():
    """q, k, v as views of one packed (total, 3, H, D) tensor: row strides of 3 * H * D."""
    lens = [300, 1, 129, 0, 64]
    qkv = torch.randn(sum(lens), 3, 4, 128, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    with flashtune.force("hopper_bwd-m64-n64-w4-s2-dq=gluon"):
        assert_varlen_matches(q, k, v, cu, cu, causal=True, scale=0.3)


@pytest.mark.gpu
@hopper_gpu
def test_misaligned_packed_call_runs_the_generic_kernel():
    lens = [100, 37]
    base = torch.randn(sum(lens) * 4 * 64 + 8, dtype=torch.float16, device="cuda")
    q = base[1:1 + sum(lens) * 4 * 64].view(sum(lens), 4, 64)  # 2-byte offset: no descriptor
    k, v = torch.randn_like(q), torch.randn_like(q)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    with flashtune.force("hopper_bwd-m64-n64-w4-s2-dq=gluon"):
        assert_varlen_matches(q, k, v, cu, cu, causal=True)


@pytest.mark.gpu
@hopper_gpu
def test_dispatched_varlen_backward_runs_hopper_bwd_on_the_h100():
    """Through the shipped H100 table: the D=128 causal varlen backward runs hopper_bwd (its
    dense records beat the generic bwd's) and matches the reference."""
    lens = [421, 3000, 1700, 64, 1]
    q, k, v, cu_q, cu_k = packed(lens, lens, 16, 16, 128, torch.bfloat16, "cuda")
    ops_varlen._bwd_plans.clear()
    assert_varlen_matches(q, k, v, cu_q, cu_k, causal=True)
    fams = {type(p).__name__ for p in ops_varlen._bwd_plans.values()}
    assert fams == {"HopperBwdVarlenPlan"}
