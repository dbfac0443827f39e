"""Search spaces and the feasibility model: pruning before anything compiles."""
import dataclasses

import pytest

from flashtune import feasibility, targets
from flashtune.codegen import Variant
from flashtune.search_plan import standard_problem
from flashtune.search_space import Space

H100, A100 = targets.get("H100"), targets.get("A100")


def _p(d=128, causal=False, n=4096, dtype="bfloat16"):
    return standard_problem("fwd", dtype, d, causal, n)


@pytest.mark.parametrize("gpu,name,shared", [
    # metadata.shared of the kernel compiled through the JIT's warmup, Triton 3.6 and 3.9
    ("H100", "fwd-m128-n64-w8-s3-loads=descriptor", 132096),
    ("H100", "fwd-m128-n128-w8-s4-loads=descriptor", 295936),
    ("H100", "fwd-m64-n64-w4-s5-loads=descriptor", 181248),
    ("H100", "fwd-m128-n64-w8-s2", 98304),
    ("H100", "fwd-m128-n128-w8-s3", 229376),
    ("H100", "fwd-m64-n32-w4-s5", 98304),
    ("A100", "fwd-m128-n64-w8-s1", 49152),
    ("A100", "fwd-m128-n64-w4-s4", 131072),
    ("A100", "fwd-m64-n32-w4-s5", 86016),
])
def test_shared_memory_model_matches_triton(gpu, name, shared):
    r = feasibility.resources(Variant.parse(name), _p(), targets.get(gpu))
    assert abs(r.smem_bytes - shared) <= 4096


@pytest.mark.parametrize("name,shared", [
    # the dK/dV kernel, `flashtune kernels check --head-dim 128 --causal`, sm_90, triton 3.9:
    # the descriptor atomic stages the float32 dQ tile and dS^T besides the pointer one's buffers
    ("bwd-m64-n128-w8-s2-loads=descriptor-dq=atomic", 180752),
    ("bwd-m32-n128-w8-s2-loads=descriptor-dq=atomic", 155920),
    ("bwd-m64-n64-w4-s3-loads=descriptor-dq=atomic", 173080),
    ("bwd-m128-n128-w8-s2-loads=descriptor-dq=atomic", 295952),
    ("bwd-m64-n128-w8-s2-dq=atomic", 164352),
    ("bwd-m64-n128-w8-s3-loads=descriptor-dq=fused-mq128-nq64", 165888),
])
def test_bwd_shared_memory_model_matches_triton(name, shared):
    p = standard_problem("bwd", "bfloat16", 128, True, 4096)
    dkdv = dict(feasibility.kernels(Variant.parse(name), p, H100))["attn_bwd_dkdv"]
    assert abs(dkdv.smem_bytes - shared) <= 4096


def test_model_prunes_what_cannot_fit():
    big = Variant.parse("fwd-m128-n128-w8-s4-loads=descriptor")  # 289 KiB > 227 KiB
    v = feasibility.check(big, _p(), H100)
    assert not v.ok and "shared memory" in v.reason and "232448" in v.reason
    spill = Variant.parse("fwd-m256-n128-w2-s1")
    assert "registers" in feasibility.check(spill, _p(), H100).reason
    assert feasibility.check(Variant.parse("fwd-m128-n64-w8-s3"), _p(), H100).ok
    # float32 tiles are twice the bytes
    assert feasibility.resources(big, _p(dtype="float32"), H100).smem_bytes > \
        feasibility.resources(big, _p(), H100).smem_bytes


def test_a100_space_never_proposes_tma_and_differs_from_h100():
    a, h = Space.build("fwd", A100, _p()), Space.build("fwd", H100, _p())
    assert all(v.loads == "pointer" for v in a.variants())
    assert any(v.loads == "descriptor" for v in h.feasible)
    assert ("loads", "descriptor", "tma") in a.dropped and not h.dropped
    assert a.hash != h.hash and len(a.feasible) < len(h.feasible)
    sa, sh = a.sizes(), h.sizes()
    assert sa["file"] == sh["file"] and sa["target"] < sh["target"]
    assert sh["file"] >= sh["target"] >= sh["constraints"] >= sh["feasible"] > 0


def test_causal_split_is_searched_only_for_causal_problems():
    full, causal = Space.build("fwd", H100, _p()), Space.build("fwd", H100, _p(causal=True))
    assert "causal_split" not in {p.name for p in full.params}
    assert ("causal_split", True) in full.pinned
    assert "causal_split" in {p.name for p in causal.params}
    assert len(causal.variants()) == 2 * len(full.variants())


def test_constraints_and_optuna_params_round_trip():
    s = Space.build("fwd", H100, _p(causal=True))
    v = Variant.parse("fwd-m64-n32-w8-s2")  # 8 warps need 128 query rows
    assert not s.check(v).ok and "constraint" in s.check(v).reason
    good = s.feasible[0]
    params = s.optuna_params(good)
    assert params["block_m_log2"] == good.block_m.bit_length() - 1
    grid = s.grid()
    assert set(grid) == set(params) and all(params[k] in grid[k] for k in params)
    assert s.hash == Space.build("fwd", H100, _p(causal=True)).hash  # stable


def test_bad_constraint_names_the_file_and_the_names(monkeypatch):
    from flashtune import search_spaces
    raw = dict(search_spaces.load_space("fwd"), constraints=["block_q > 1"])
    monkeypatch.setattr("flashtune.search_space.load_space", lambda f: raw)
    s = Space.build("fwd", H100, _p())
    with pytest.raises(ValueError, match="fwd.json constraints.*block_q.*known names"):
        s.check(s.variants()[0])


def test_kernels_list_still_describes_the_family():
    from flashtune.search_spaces import describe_family
    d = describe_family("fwd")
    assert d["choices"]["loads"] == ["pointer", "descriptor"]
    Variant.parse(d["example"])


def test_space_file_errors_are_clear(tmp_path, monkeypatch):
    from flashtune import search_spaces
    bad = tmp_path / "zz.json"
    bad.write_text('{"format": 1, "family": "zz", "params": {"block_m": []}}')
    monkeypatch.setattr(search_spaces, "_DIR", tmp_path)
    search_spaces.load_space.cache_clear()
    try:
        with pytest.raises(ValueError, match="params.block_m must be a non-empty list"):
            search_spaces.load_space("zz")
    finally:
        search_spaces.load_space.cache_clear()


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Space.build("fwd", H100, _p()).family = "bwd"


def _decode(d=128, group=4, nq=1, nk=32768, batch=1):
    from flashtune.problem import Problem
    return Problem("splitkv", "bfloat16", d, False, group, batch, 8 * group, nq, nk)


@pytest.mark.parametrize("name,d,shared", [
    # metadata.shared of attn_splitkv_partial compiled for sm_90 (families.splitkv.compile_check,
    # Triton 3.9, 2026-11-23); the H100 sweep hit the last one as "out of resource: 237624"
    ("splitkv-m64-n64-w4-s3", 128, 71680),
    ("splitkv-m64-n16-w4-s1", 128, 8704),
    ("splitkv-m64-n32-w4-s5", 128, 70656),
    ("splitkv-m64-n64-w4-s2-loads=descriptor", 128, 55320),
    ("splitkv-m64-n128-w4-s4-loads=descriptor", 128, 237624),
    # the gluon render (flashtune kernels check --gpu H100, Triton 3.9, 2026-11-27)
    ("splitkv-m64-n64-w4-s2-gluon=true", 128, 81952),
    ("splitkv-m64-n128-w4-s3-gluon=true", 128, 213048),
    ("splitkv-m64-n32-w4-s4-gluon=true", 128, 81984),
    ("splitkv-m64-n128-w4-s2-gluon=true", 128, 147488),
    # its 16-row tile (swap_ab: P^T in shared memory; kernels check, Triton 3.9, 2026-11-28)
    ("splitkv-m16-n128-w4-s2-gluon=true", 128, 139552),
    ("splitkv-m16-n64-w4-s2-gluon=true", 128, 71968),
    ("splitkv-m16-n128-w4-s2-gluon=true", 64, 71968),
])
def test_splitkv_shared_memory_model_matches_triton(name, d, shared):
    r = feasibility.resources(Variant.parse(name), _decode(d), H100)
    assert abs(r.smem_bytes - shared) <= 0.02 * shared


def test_splitkv_model_prunes_what_the_h100_refused():
    assert not feasibility.check(Variant.parse("splitkv-m64-n128-w4-s4-loads=descriptor"),
                                 _decode(), H100).ok
    assert feasibility.check(Variant.parse("splitkv-m64-n128-w4-s3-loads=descriptor"),
                             _decode(), H100).ok
    # more rows per tile (GQA 8 x 8 speculative tokens: BLOCK_M 64) need more shared memory
    small, big = (feasibility.resources(Variant.parse("splitkv-m64-n64-w4-s3"),
                                        _decode(group=8, nq=nq), H100) for nq in (1, 8))
    assert big.smem_bytes > small.smem_bytes
    # the gluon ring at 4 x 128 keys (D=128) is over sm_90's 227 KiB; at D=64 it fits
    g = Variant.parse("splitkv-m64-n128-w4-s4-gluon=true")
    assert not feasibility.check(g, _decode(), H100).ok
    assert feasibility.check(g, _decode(d=64), H100).ok


@pytest.mark.parametrize("family,d,fits,too_big", [
    ("hopper_fwd", 256, "hopper_fwd-m128-n64-w8-s2-lr24", "hopper_fwd-m128-n128-w8-s4-lr24"),
    ("hopper_bwd", 128, "hopper_bwd-m64-n128-w8-s2", "hopper_bwd-m128-n128-w8-s4"),
])
def test_hopper_resource_models_prune_what_cannot_fit(family, d, fits, too_big):
    h100 = targets.get("H100")
    p = dataclasses.replace(_p(d=d), family=family)
    assert feasibility.check(Variant.parse(fits), p, h100).ok
    bad = feasibility.check(Variant.parse(too_big), p, h100)
    assert not bad.ok and "shared memory" in bad.reason
