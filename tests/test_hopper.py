"""hopper_fwd (Gluon, sm_90): GPU tests force the family and compare against the float64
reference; CPU tests cover what runs without one -- rendering, the version shim, the fallback and
explain() logic, the launcher's register split, and the sm_90 compile of the defaults (no Gluon
code runs in Triton's interpreter)."""
import json

import pytest
import torch

import flashtune
from flashtune import dispatch
from flashtune.codegen import Variant, render
from flashtune.families import get
from flashtune.problem import Bucket, Problem

from _check import ON_H100, assert_matches_reference, hopper_gpu, qkv

FAM = get("hopper_fwd")
pytestmark = pytest.mark.usefixtures("reset_dispatch")  # nothing forced or configured after a test


def _problem(d=128, dtype="bfloat16", causal=False, nq=4096):
    return Problem("fwd", dtype, d, causal, 1, 4, 16, nq, nq)


# -- CPU: rendering, shim, fallback, explain ------------------------------------------------------

def test_gpu_tests_cover_each_default():
    assert all(FAM.default(d, "bfloat16").name in VARIANTS[d] for d in (64, 128, 256))


def test_registered_as_a_gluon_family_serving_dense_forwards():
    assert FAM.serves == ("fwd",) and not FAM.interpreter
    assert FAM.min_capability == FAM.max_capability == 90
    for d in (64, 128, 256):
        for dt in ("bfloat16", "float16"):
            v = FAM.default(d, dt)
            assert v.family == "hopper_fwd" and v.loader_regs in (24, 32, 40, 48, 56)


def test_render_pingpong_is_structural():
    one = render(Variant.parse("hopper_fwd-m128-n128-w8-s2-lr24"))
    two = render(Variant.parse("hopper_fwd-m64-n128-w4-s2-pingpong=true-lr24"))
    assert "CONSUMERS: gl.constexpr = 1" in one and "CONSUMERS: gl.constexpr = 2" in two
    assert one.count("(_consumer,") == 1 and two.count("(_consumer,") == 2
    # line numbers match the template (tracebacks point into it), no interpreter render lines
    assert len(one.splitlines()) == len(two.splitlines())
    assert "from flashtune.gluon_compat import" in one
    # persistent is a launch choice: same source
    assert render(Variant.parse("hopper_fwd-m128-n128-w8-s2-persistent=true-lr24")) \
        .splitlines()[1:] == one.splitlines()[1:]


def test_render_without_a_loader_is_structural():
    """loader_regs 0: no loader partition (the consumers load the ring); the loader schedules'
    code is untouched by the branch (their kernel hash reads code lines only)."""
    from flashtune.codegen import kernel_hash
    two = render(Variant.parse("hopper_fwd-m64-n128-w4-s3-pingpong=true"))
    one = render(Variant.parse("hopper_fwd-m128-n128-w8-s2"))
    for src in (one, two):
        assert "(_loader," not in src and "_refill(" in src
    assert two.count("(_consumer,") == 2 and "_consumer(q_bufs" in one
    with_loader = render(Variant.parse("hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24"))
    assert "_refill" not in with_loader and with_loader.count("(_loader,") == 1
    assert len(two.splitlines()) == len(with_loader.splitlines())
    assert kernel_hash(Variant.parse("hopper_fwd-m64-n128-w4-s3-pingpong=true")) != \
        kernel_hash(Variant.parse("hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24"))


def test_render_causal_split_is_structural():
    """causal_split (default on): the dense key loop as an unmasked loop and a masked one, each
    mask a compile-time constant; off: one loop testing per step. The masked renders keep their
    per-step _edge test either way (the field changes nothing there)."""
    split = render(Variant.parse("hopper_fwd-m64-n128-w4-s2-pingpong=true-lr24"))
    one = render(Variant.parse("hopper_fwd-m64-n128-w4-s2-causal_split=false-pingpong=true-lr24"))
    assert "PARTS: gl.constexpr = 2" in split and "qk_scale, part == 1," in split
    assert "j >= n_full" not in split
    assert "PARTS: gl.constexpr = 1" in one and "qk_scale, j >= n_full," in one
    assert "part == 1" not in one
    assert len(split.splitlines()) == len(one.splitlines())
    win = [render(Variant.parse(f"hopper_fwd-m64-n64-w4-s2{cs}-pingpong=true-lr24-window=true"))
           for cs in ("", "-causal_split=false")]
    assert win[0].splitlines()[1:] == win[1].splitlines()[1:] and "part == 1" not in win[0]


def test_search_tunes_causal_split_for_dense_problems_only():
    import dataclasses
    from flashtune.search_space import Space
    from flashtune.targets import get as get_target
    h100 = get_target("H100")
    for causal in (False, True):
        dense = Space.build("hopper_fwd", h100, dataclasses.replace(_problem(causal=causal),
                                                                    family="hopper_fwd"))
        assert [p.values for p in dense.params if p.name == "causal_split"] == [(True, False)]
    masked = dataclasses.replace(_problem(causal=True), family="hopper_fwd", window=256)
    assert ("causal_split", True) in Space.build("hopper_fwd", h100, masked).pinned


def test_variant_names_round_trip_and_rules():
    v = Variant.parse("hopper_fwd-m64-n128-w4-s2-pingpong=true-persistent=true-lr32")
    assert (v.pingpong, v.persistent, v.loader_regs) == (True, True, 32)
    assert Variant.parse(v.name) == v and Variant.from_dict(json.loads(v.to_json())) == v
    v0 = Variant.parse("hopper_fwd-m64-n128-w4-s3-pingpong=true")  # loader_regs 0: no loader
    assert v0.loader_regs == 0 and Variant.parse(v0.name) == v0 and "-lr" not in v0.name
    with pytest.raises(ValueError, match="num_warps"):
        Variant.parse("hopper_fwd-m64-n128-w2-s2-lr24")
    with pytest.raises(ValueError, match="loader_regs"):
        Variant.parse("hopper_fwd-m64-n128-w4-s2-lr20")
    with pytest.raises(ValueError, match="pingpong"):  # another family's field
        Variant.parse("fwd-m64-n64-w4-s2-pingpong=true")


def test_q_buffers_is_a_field_with_its_shared_memory():
    from flashtune.families.hopper_fwd import smem_bytes
    v = Variant.parse("hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24-qb2")
    assert v.q_buffers == 2 and v.name.endswith("-qb2") and Variant.parse(v.name) == v
    assert Variant.from_dict(json.loads(v.to_json())) == v
    v1 = Variant.parse("hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24")
    assert v1.q_buffers == 1 and "qb" not in v1.name and "q_buffers" not in v1.to_json()
    # two more 64 x D tiles, one per ping-pong consumer
    assert smem_bytes(v, 128) - smem_bytes(v1, 128) == 2 * 2 * 64 * 128
    with pytest.raises(ValueError, match="q_buffers"):
        Variant.parse("hopper_fwd-m64-n64-w4-s3-pingpong=true-lr24-qb3")
    with pytest.raises(ValueError, match="q_buffers"):  # another family's field
        Variant.parse("fwd-m64-n64-w4-s2-qb2")
    # one text for both: Q_BUFS is a constexpr the launcher passes
    assert render(v).splitlines()[1:] == render(v1).splitlines()[1:]


def test_l2_order_is_structural_and_searched_for_causal_problems_only():
    import dataclasses
    from flashtune.search_space import Space
    from flashtune.targets import get as get_target
    v = Variant.parse("hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24-l2_order=true")
    off = dataclasses.replace(v, l2_order=False)
    assert v.l2_order and Variant.parse(v.name) == v and "l2_order" not in off.name
    # the sections' code only in its renders: every other variant's text (and record) unchanged
    assert "sec * num_m" in render(v) and "sec * num_m" not in render(off)
    with pytest.raises(ValueError, match="l2_order"):  # another family's field
        Variant.parse("fwd-m64-n64-w4-s2-l2_order=true")
    h100 = get_target("H100")
    for causal, offered in ((True, (False, True)), (False, None)):
        space = Space.build("hopper_fwd", h100, dataclasses.replace(
            _problem(causal=causal, nq=1024), family="hopper_fwd"))
        got = [p.values for p in space.params if p.name == "l2_order"]
        assert got == ([offered] if offered else [])
        assert any(v.l2_order for v in space.feasible) == bool(offered)


def test_head_order_is_structural_searched_for_causal_problems_and_not_with_l2_order():
    """head_order (session 24): causal tiles head by head, each head's query blocks rotated by
    its index. Its own _tile_coords in its renders only; one causal order per kernel."""
    import dataclasses
    from flashtune.search_space import Space
    from flashtune.targets import get as get_target
    v = Variant.parse("hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24-qb2"
                      "-head_order=true")
    off = dataclasses.replace(v, head_order=False)
    assert Variant.parse(v.name) == v and "head_order" not in off.name
    assert "rotated by its index" in render(v) and "rotated by its index" not in render(off)
    assert render(off) == render(Variant.parse(off.name))
    with pytest.raises(ValueError, match="two causal tile orders"):
        dataclasses.replace(v, l2_order=True)
    with pytest.raises(ValueError, match="head_order"):  # another family's field
        Variant.parse("fwd-m64-n64-w4-s2-head_order=true")
    h100 = get_target("H100")
    for causal in (True, False):
        space = Space.build("hopper_fwd", h100, dataclasses.replace(
            _problem(causal=causal, nq=1024), family="hopper_fwd"))
        assert any(x.head_order for x in space.feasible) == causal
        assert not any(x.head_order and x.l2_order for x in space.feasible)


def test_three_consumers_is_structural_and_searched_at_d64_dense_only():
    """three_consumers (session 30): a third 64-row consumer warpgroup, the ping-pong turns going
    round three; its code only in its renders, its tiles' rows in the shared memory model, and
    offered by the search for D=64 problems without masks, with 64-key steps and a loader of at
    least 32 registers (24 spills with head_order, sm_90 compile)."""
    import dataclasses
    from flashtune.families.hopper_fwd import consumers, smem_bytes
    from flashtune.search_space import Space
    from flashtune.targets import get as get_target
    v = Variant.parse("hopper_fwd-m64-n64-w4-s3-causal_split=false-pingpong=true"
                      "-three_consumers=true-persistent=true-lr32-qb2")
    off = dataclasses.replace(v, three_consumers=False)
    assert Variant.parse(v.name) == v and "three_consumers" not in off.name
    assert consumers(v) == 3 and consumers(off) == 2
    assert smem_bytes(v, 64) - smem_bytes(off, 64) == 2 * 64 * 2 * 64  # one more consumer's Q
    on_src, off_src = render(v), render(off)
    assert "turns.index((WHICH + 1) % 3)" in on_src and "def _tile_start" in on_src
    assert "turns.index((WHICH + 1) % 3)" not in off_src and "def _tile_start" not in off_src
    assert on_src.count("(_consumer, (") == 3 and off_src.count("(_consumer, (") == 2
    for bad, why in (("pingpong=false", "needs pingpong"), ("w8", "num_warps 4"),
                     ("lr0", "loader partition"), ("window=true", "dense render")):
        name = v.name.replace("pingpong=true", bad) if bad == "pingpong=false" else (
            v.name.replace("-w4-", "-w8-") if bad == "w8" else
            v.name.replace("-lr32-qb2", "") if bad == "lr0" else v.name + "-" + bad)
        with pytest.raises(ValueError, match=why):
            Variant.parse(name)
    with pytest.raises(ValueError, match="three_consumers"):  # another family's field
        Variant.parse("fwd-m64-n64-w4-s2-three_consumers=true")
    h100 = get_target("H100")
    for d, causal in ((64, True), (64, False), (128, True)):
        space = Space.build("hopper_fwd", h100, dataclasses.replace(
            _problem(d=d, causal=causal, nq=2048), family="hopper_fwd"))
        trio = [x for x in space.feasible if x.three_consumers]
        assert bool(trio) == (d == 64)
        assert all(x.pingpong and x.block_m == 64 and x.num_warps == 4 and x.loader_regs >= 32
                   for x in trio)
        # 128-key steps with async_o_store only (without it the non-causal render spills too)
        wide = [x for x in trio if x.block_n > 64]
        assert bool(wide) == (d == 64)
        assert all(x.block_n == 128 and x.async_o_store for x in wide)


def test_a_non_causal_search_starts_from_the_seeds_without_their_tile_order():
    """Seeds are per head dim; a non-causal bucket has no tile order to search, so a seed that
    carries one (the three-consumer seeds) is measured without it, not dropped (session 32:
    three consumers won every D=64 non-causal bucket from 1k on once measured there)."""
    import dataclasses
    import types
    from flashtune.problem import Bucket
    from flashtune.search import _first_points
    from flashtune.search_space import Space
    from flashtune.targets import get as get_target
    seeds = FAM.seed_variants(64, "bfloat16", arch="sm_90")
    for causal in (False, True):
        p = dataclasses.replace(_problem(d=64, causal=causal, nq=2048), family="hopper_fwd")
        space = Space.build("hopper_fwd", get_target("H100"), p)
        pb = types.SimpleNamespace(space=space, bucket=Bucket.of(p), problem=p)
        got = _first_points(pb)
        assert all(space.contains(v) for v in got) and len(set(got)) == len(got)
        if causal:
            assert got == seeds
        else:
            assert not any(v.head_order or v.l2_order for v in got)
            trio = [v for v in got if v.three_consumers]
            # the head_order and l2_order seeds are one point without their order
            assert len(trio) == 1 and trio[0] == dataclasses.replace(
                next(v for v in seeds if v.three_consumers), head_order=False)
            assert len(got) == len(seeds) - 1
    # not projected: an active param's value the space lacks, a field the space does not vary
    nc = dataclasses.replace(_problem(d=64, causal=False, nq=2048), family="hopper_fwd")
    space = Space.build("hopper_fwd", get_target("H100"), nc)
    assert space.project(dataclasses.replace(seeds[0], loader_regs=48)) is None  # not in its list
    assert space.project(dataclasses.replace(seeds[0], release_barrier=False)) is None
    assert space.project(seeds[0]) == seeds[0]


def test_a_search_measures_an_l2_order_table_winner_with_head_order_too(tmp_path):
    """search.table_winners: a shipped table's l2_order winner for the bucket is followed by its
    head_order twin (Family.winner_twins), so a re-search tries the new field on the point that
    won; runner-ups get no twin."""
    import dataclasses
    import types
    from flashtune.problem import Bucket
    from flashtune.search import table_winners
    from flashtune.search_space import Space
    from flashtune.targets import get as get_target
    from flashtune.tuned_db.io import table_path, write_table
    from flashtune.tuned_db.record import Provenance, Record
    p = dataclasses.replace(_problem(causal=True, nq=1024), family="hopper_fwd")
    space = Space.build("hopper_fwd", get_target("H100"), p)
    won = Variant.parse("hopper_fwd-m64-n64-w4-s4-pingpong=true-persistent=true-lr24-qb2"
                        "-l2_order=true")
    up = Variant.parse("hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24-qb2"
                       "-l2_order=true")
    prov = Provenance("NVIDIA H100 80GB HBM3", "9.0", 132, "580", "13.0", "2.11", "3.6.0",
                      "0.1.0", "0" * 16, "2026-11-26T00:00:00+00:00", "search")
    write_table(table_path("H100", tmp_path), "H100",
                [Record(table_path("H100").stem, Bucket.of(p), won, 1.0, 100.0, "TFLOP/s",
                        1e-3, prov, ((up.name, 1.1),))])
    pb = types.SimpleNamespace(space=space, bucket=Bucket.of(p), problem=p)
    got = table_winners(pb, 3, tmp_path)
    assert got == [won, dataclasses.replace(won, l2_order=False, head_order=True), up]
    # a winner with no tile order gets the head_order twin too (the D=64 causal 1k record);
    # one with head_order, none; a non-causal bucket's space has no head_order: no twin there
    plain = dataclasses.replace(won, l2_order=False)
    fam = get("hopper_fwd")
    trio = dataclasses.replace(plain, three_consumers=True, persistent=True, q_buffers=2,
                               async_o_store=True, loader_regs=32)
    assert fam.twins_of(plain) == [dataclasses.replace(plain, head_order=True), trio]
    assert fam.twins_of(dataclasses.replace(plain, head_order=True)) == [
        dataclasses.replace(trio, head_order=True)]
    assert fam.twins_of(dataclasses.replace(trio, head_order=True)) == []
    nc = dataclasses.replace(_problem(causal=False, nq=1024), family="hopper_fwd")
    write_table(table_path("H100", tmp_path), "H100",
                [Record(table_path("H100").stem, Bucket.of(nc), plain, 1.0, 100.0, "TFLOP/s",
                        1e-3, prov, ())])
    pb = types.SimpleNamespace(space=Space.build("hopper_fwd", get_target("H100"), nc),
                               bucket=Bucket.of(nc), problem=nc)
    assert table_winners(pb, 3, tmp_path) == [plain]  # D=128: no head_order, no third consumer
    # D=64 non-causal: the third consumer's twin, 128-key steps included (FA3's 192x128 tile)
    nc64 = dataclasses.replace(_problem(d=64, causal=False, nq=1024), family="hopper_fwd")
    wide = Variant.parse("hopper_fwd-m64-n128-w4-s2-pingpong=true-persistent=true-lr56-qb2"
                         "-early_k_release=true")
    write_table(table_path("H100", tmp_path), "H100",
                [Record(table_path("H100").stem, Bucket.of(nc64), wide, 1.0, 100.0, "TFLOP/s",
                        1e-3, prov, ())])
    pb = types.SimpleNamespace(space=Space.build("hopper_fwd", get_target("H100"), nc64),
                               bucket=Bucket.of(nc64), problem=nc64)
    assert table_winners(pb, 3, tmp_path) == [wide, dataclasses.replace(
        wide, three_consumers=True, async_o_store=True, loader_regs=32)]
    # a one-loop 128-key winner's twin takes causal_split (its causal render spills 228-352 B)
    one_loop = dataclasses.replace(wide, causal_split=False)
    assert fam.twins_of(one_loop)[-1] == dataclasses.replace(
        wide, three_consumers=True, async_o_store=True, loader_regs=32)


def test_head_order_tile_coords_cover_every_tile_once():
    """The rendered _tile_coords run in Python (gl stood in for): every (query block, head)
    exactly once, causal or not, and a persistent program of a 132-program grid draws more than
    one query block when 132 / num_m is odd (the rotation's point)."""
    import ast
    import types
    v = Variant.parse("hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24-qb2"
                      "-head_order=true")
    tree = ast.parse(render(v))
    fn = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "_tile_coords")
    fn.decorator_list = []
    for a in fn.args.args:
        a.annotation = None
    grid = [132]
    ns = {"gl": types.SimpleNamespace(num_programs=lambda axis: grid[0])}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), "<tile_coords>", "exec"), ns)
    coords = ns["_tile_coords"]
    for g in (132, 128, 7):
        grid[0] = g
        for num_m, bh_n in ((4, 512), (8, 256), (2, 1024), (3, 7), (1, 5)):
            for causal in (True, False):
                got = [coords(t, num_m, bh_n, causal) for t in range(num_m * bh_n)]
                assert sorted(got) == sorted((m, b) for b in range(bh_n) for m in range(num_m))
    # bench/tile_order_sim.py models this order: the same query blocks
    import importlib.util
    import pathlib
    spec = importlib.util.spec_from_file_location(
        "tile_order_sim", pathlib.Path(__file__).parents[1] / "bench" / "tile_order_sim.py")
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    for g in (132, 128):
        grid[0] = g
        assert all(sim.head_order(t, m, g) == coords(t, m, 64, True)[0]
                   for m in (1, 2, 4, 8, 16) for t in range(64 * m))
    # program 0 of a 132-program grid draws every query block over its rounds: num_m = 4
    # (132 / 4 odd: the head's index rotates) and 2 (132 / 2 even: the rounds rotate too)
    grid[0] = 132
    for num_m, bh_n in ((4, 512), (2, 1024)):
        assert {coords(t, num_m, bh_n, True)[0] for t in range(0, num_m * bh_n, 132)} == \
            set(range(num_m))


def test_search_offers_two_q_buffers_to_persistent_loader_schedules_only():
    import dataclasses
    from flashtune.search_space import Space
    from flashtune.targets import get as get_target
    space = Space.build("hopper_fwd", get_target("H100"),
                        dataclasses.replace(_problem(causal=True, nq=1024), family="hopper_fwd"))
    assert [p.values for p in space.params if p.name == "q_buffers"] == [(1, 2)]
    two = [v for v in space.feasible if v.q_buffers == 2]
    assert two and all(v.persistent and v.loader_regs for v in two)
    why = space.check(Variant.parse("hopper_fwd-m64-n64-w4-s3-pingpong=true-lr24-qb2")).reason
    assert "q_buffers" in why


def test_version_shim_resolves_this_triton():
    from flashtune import gluon_compat
    assert gluon_compat.missing() == ""
    import triton.experimental.gluon.language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma
    assert gluon_compat.tma_load in (getattr(tma, "async_load", None),
                                     getattr(tma, "async_copy_global_to_shared", None))
    assert gluon_compat.sync_warps in (getattr(gl, "barrier", None),
                                       getattr(gl, "thread_barrier", None))


def test_consumer_registers_fill_what_the_loader_leaves():
    from flashtune.launch_hopper import consumer_regs
    assert consumer_regs(Variant.parse("hopper_fwd-m64-n128-w4-s2-pingpong=true-lr24")) == 240
    assert consumer_regs(Variant.parse("hopper_fwd-m128-n128-w8-s2-lr24")) == 240
    assert consumer_regs(Variant.parse("hopper_fwd-m128-n128-w8-s2-pingpong=true-lr56")) == 112
    # no loader partition: the even share of all the threads, no setmaxnreg below it
    assert consumer_regs(Variant.parse("hopper_fwd-m64-n128-w4-s3-pingpong=true")) == 256
    assert consumer_regs(Variant.parse("hopper_fwd-m128-n128-w8-s2-pingpong=true")) == 128
    # three consumers: (65536 - 128 x 32) / 384 = 160 each (FA3's 3-warpgroup split)
    assert consumer_regs(Variant.parse("hopper_fwd-m64-n64-w4-s3-pingpong=true-three_consumers=true"
                                       "-lr32")) == 160


@pytest.mark.parametrize("arch,problem,why", [
    ("sm_80", _problem(), "need sm_90"),
    ("sm_100", _problem(), "need sm_90"),
    ("", _problem(), "no GPU"),
    ("sm_90", _problem(d=96), "head dim 96"),
    ("sm_90", _problem(dtype="float32"), "float32"),
])
def test_cannot_run_says_why(arch, problem, why, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert why in FAM.cannot_run(problem, arch)


def test_cannot_run_in_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in FAM.cannot_run(_problem(), "sm_90")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert FAM.cannot_run(_problem(), "sm_90") == ""


@pytest.mark.parametrize("gpu,prefer,family,note", [
    ("A100", True, "fwd", "need sm_90"),       # preferred, but the GPU cannot run it
    ("H100", True, "hopper_fwd", "heuristic"),  # preferred and runnable: it serves the call
    ("H100", False, "fwd", ""),                 # runnable, not preferred: the generic family
])
def test_dispatcher_competes_or_falls_back_with_a_reason(gpu, prefer, family, note, monkeypatch,
                                                         tmp_path):
    from flashtune.families import hopper_fwd
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a GPU machine (no kernel runs here)
    monkeypatch.setattr(hopper_fwd, "prefer_for_dense", lambda p: prefer)
    dispatch.configure(gpu=gpu, db=f"sqlite:///{tmp_path}/none.db", tables_dir=tmp_path)
    ex = flashtune.explain(_problem())
    assert ex.variant.family == family
    assert note in "\n".join(ex.notes)
    assert dispatch.select(_problem()).family == family


@pytest.mark.parametrize("fwd_ms,family", [(1.0, "fwd"), (4.0, "hopper_fwd")])
def test_masked_bucket_competes_on_same_shape_records(fwd_ms, family, monkeypatch, tmp_path):
    """A 50%-dense block mask (bucket block32) has no record of its own: each family's nearest
    is a record of the same shape one octave away (the dense one, the 25% one). They compete by
    those records, scaled to the keys computed, not by the heuristic (which ran the generic
    fwd's dense record at 0.6x the Hopper one, H100, 16k)."""
    import dataclasses
    from flashtune.families import hopper_fwd
    from flashtune.tuned_db.io import table_path, write_table
    from test_db import make_record
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a GPU machine (no kernel runs here)
    monkeypatch.setattr(hopper_fwd, "prefer_for_dense", lambda p: False)
    p = dataclasses.replace(_problem(nq=16384), block_density=0.5)
    bh = Bucket.of(p).batch_heads
    dense = make_record(gpu="nvidia-h100-80gb-hbm3", sq=16384, bh=bh, causal=False,
                        dtype="bfloat16", variant="fwd-m64-n64-w4-s3", ms=fwd_ms)
    quarter = make_record(gpu="nvidia-h100-80gb-hbm3", sq=16384, bh=bh, causal=False,
                          dtype="bfloat16", variant="hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24",
                          family="hopper_fwd", ms=1.0)
    quarter = dataclasses.replace(quarter, bucket=dataclasses.replace(quarter.bucket,
                                                                      mask="block16"))
    write_table(table_path("H100", tmp_path), "nvidia-h100-80gb-hbm3", [dense, quarter])
    dispatch.configure(gpu="H100", db=f"sqlite:///{tmp_path}/none.db", tables_dir=tmp_path)
    ex = flashtune.explain(p)
    assert ex.distance == 1 and "(tuned records)" in "\n".join(ex.notes)
    # hopper: 1 ms at 25% -> ~2 ms at 50%; fwd: fwd_ms dense -> fwd_ms / 2
    assert ex.variant.family == family


@pytest.mark.parametrize("d,causal,n,want", [
    (256, True, 4096, True), (256, False, 512, True), (128, False, 8192, True),
    (128, True, 8192, True), (128, True, 2048, False), (64, False, 8192, False),
    (128, False, 256, False), (96, False, 8192, False)])
def test_heuristic_quotes_the_h100_measurement(d, causal, n, want):
    assert FAM.prefers(_problem(d=d, causal=causal, nq=n)) is want


def test_unsupported_head_dim_falls_back_silently_on_h100(monkeypatch, tmp_path):
    from flashtune.families import hopper_fwd
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(hopper_fwd, "prefer_for_dense", lambda p: True)
    dispatch.configure(gpu="H100", db=f"sqlite:///{tmp_path}/none.db", tables_dir=tmp_path)
    ex = flashtune.explain(_problem(d=96))
    assert ex.variant.family == "fwd"
    assert any("hopper_fwd skipped: head dim 96" in n for n in ex.notes)


def test_forced_on_a_gpu_that_cannot_run_it_is_explained(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dispatch.configure(gpu="A100")
    with flashtune.force("hopper_fwd-m128-n128-w8-s2-lr24"):
        ex = flashtune.explain(_problem())
    assert ex.level == "forced" and any("cannot run here" in n for n in ex.notes)


def test_plan_falls_back_to_the_generic_default_off_hopper(device):
    """A forced hopper variant on a device that cannot run it (the CPU here, any non-sm_90 GPU)
    computes the call with the generic family's default."""
    if ON_H100:
        pytest.skip("the H100 runs the Gluon kernel itself")
    q, k, v = qkv(1, 4, 2, 37, 45, 64, torch.float16, device)
    with flashtune.force("hopper_fwd-m128-n128-w8-s3-lr24"):
        assert_matches_reference(q, k, v, causal=True)


@pytest.mark.parametrize("name", ["hopper_fwd-m64-n64-w4-s1", "hopper_fwd-m64-n64-w4-s1-lr24",
                                  "hopper_fwd-m64-n128-w4-s1-pingpong=true-lr32"])
def test_one_stage_is_refused_before_launch(device, name):
    # a consumer holds block j-1's V stage while it waits for block j's K in the next one: with
    # one stage it waits on itself (every such loader variant hung a search trial on the H200),
    # so the name is refused -- a clear error, never a hang
    q, k, v = qkv(1, 2, 2, 16, 16, 64, torch.float16, device)
    with pytest.raises(ValueError, match="num_stages=1 does not fit family 'hopper_fwd'"):
        with flashtune.force(name):
            flashtune.attention(q, k, v)


# -- the sm_90 compile of every default, with this Triton (3.9 in CI), no GPU ------------------

@pytest.mark.slow
def test_defaults_compile_for_sm90():
    from test_compile_sm90 import kernels_check
    names = {FAM.default(d, "bfloat16").name for d in (64, 128, 256)}
    r = kernels_check("--gpu", "H100", "--dtype", "bf16,fp16", "--head-dim", "64,128,256",
                      "--format", "json", *sorted(names))
    rows = json.loads(r.stdout) if r.stdout.startswith("[") else []
    assert rows, r.stdout[-2000:] + r.stderr[-2000:]
    mine = {(x["dtype"], x["head_dim"], x["variant"]): x for x in rows}
    for dt in ("bfloat16", "float16"):
        for d in (64, 128, 256):
            x = mine[(dt, d, FAM.default(d, dt).name)]  # each D's own default: fits, no spills
            assert x["fits"] and not x["why"], x


@pytest.mark.slow
def test_two_q_buffers_compile_for_sm90_without_spills():
    """The persistent ping-pong winners with a second Q buffer fit shared memory (D=256 m64-n32-s3:
    224 KB of 227) and spill nothing, causal (the costlier render)."""
    from test_compile_sm90 import kernels_check
    for d, names in QBUF.items():
        r = kernels_check("--gpu", "H100", "--dtype", "bf16", "--head-dim", str(d), "--format",
                          "json", "--causal", *names)
        rows = json.loads(r.stdout) if r.stdout.startswith("[") else []
        assert len(rows) == len(names), r.stdout[-2000:] + r.stderr[-2000:]
        for x in rows:
            assert x["fits"] and x["spill_bytes"] == 0, x


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_three_consumers_compile_for_sm90_without_spills(causal):
    """Three 64-row consumers at 160 registers each, 64-key steps, the loader at 32 (with
    head_order's tile arithmetic; 24 spills 20 B there), bf16 and fp16, GQA tails."""
    from test_compile_sm90 import kernels_check
    r = kernels_check("--gpu", "H100", "--dtype", "bf16,fp16", "--head-dim", "64", "--format",
                      "json", "--tails", "--causal" if causal else "--no-causal", *THREE[64])
    rows = json.loads(r.stdout) if r.stdout.startswith("[") else []
    assert len(rows) == 2 * len(THREE[64]), r.stdout[-2000:] + r.stderr[-2000:]
    for x in rows:
        assert x["fits"] and x["spill_bytes"] == 0, x


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_128_key_steps_compile_for_sm90_without_spills(causal):
    """D=128 ping-pong with a loader and 128-key steps: under the consumers' setmaxnreg (240)
    since P is the PV operand from the softmax on (in float32 across the back edge it spilled
    188 B) and causal_split's unmasked loop carries no mask code (one loop: 16 B causal)."""
    from test_compile_sm90 import kernels_check
    r = kernels_check("--gpu", "H100", "--dtype", "bf16", "--head-dim", "128", "--format", "json",
                      "--causal" if causal else "--no-causal",
                      "hopper_fwd-m64-n128-w4-s2-pingpong=true-lr24")
    rows = json.loads(r.stdout) if r.stdout.startswith("[") else []
    assert len(rows) == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert rows[0]["fits"] and rows[0]["spill_bytes"] == 0, rows[0]


# -- GPU: the kernel against the float64 reference, the family forced -----------------------------

SHAPES = [  # (B, H, Hk, Nq, Nk): odd lengths, one key, GQA, Nq > Nk (rows that see no key)
    (1, 2, 2, 1, 1), (2, 3, 3, 37, 37), (1, 4, 2, 113, 203), (1, 4, 1, 1000, 1000),
    (2, 2, 2, 300, 100), (1, 8, 2, 515, 2051)]
VARIANTS = {64: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24"],            # the defaults,
            128: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24",
                  "hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24",  # persistent
                  "hopper_fwd-m128-n64-w8-s3-lr24"],                         # one 8-warp consumer
            256: ["hopper_fwd-m128-n64-w8-s2-lr24-early_k_release=true",  # default since session 20
                  "hopper_fwd-m64-n32-w4-s3-pingpong=true-lr24"]}           # the one before
# no loader partition (loader_regs 0): the consumers load the ring; 128-key steps at D <= 128
NO_LOADER = {64: ["hopper_fwd-m64-n128-w4-s3-pingpong=true"],
             128: ["hopper_fwd-m64-n128-w4-s3-pingpong=true",
                   "hopper_fwd-m64-n128-w4-s2-pingpong=true-persistent=true",
                   "hopper_fwd-m128-n128-w8-s2"],
             256: ["hopper_fwd-m64-n64-w4-s2-pingpong=true"]}
for _d, _names in NO_LOADER.items():
    VARIANTS[_d] = VARIANTS[_d] + _names


# 128-key steps with a loader warp (spill-free since P is converted right after the softmax and
# causal_split keeps the mask code out of the unmasked loop), and the one-loop render beside
TILES = {64: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24"],
         128: ["hopper_fwd-m64-n128-w4-s2-pingpong=true-lr24",
               "hopper_fwd-m64-n128-w4-s2-causal_split=false-pingpong=true-lr24",
               "hopper_fwd-m128-n128-w8-s2-lr24"],
         256: ["hopper_fwd-m64-n64-w4-s2-pingpong=true-lr24"]}


# two Q buffers per consumer (persistent, with a loader): the programs must loop over several
# tiles to reuse a buffer, so these shapes have 4-16x more tiles than the 132 programs
QBUF = {64: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-persistent=true-lr24-qb2"],
        128: ["hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24-qb2",
              "hopper_fwd-m64-n128-w4-s2-pingpong=true-persistent=true-lr24-qb2",
              "hopper_fwd-m128-n64-w8-s2-persistent=true-lr24-qb2"],
        256: ["hopper_fwd-m64-n32-w4-s3-pingpong=true-persistent=true-lr24-qb2"]}
MANY_TILES = [(4, 16, 4, 1000, 1000), (2, 24, 8, 777, 1537), (16, 16, 16, 512, 512)]

# the causal tile order in L2-sized sections of heads: the shapes' long key sequences make the
# sections a few heads (32 MB / (4 B x D x Nk): D=64 4 and 6, D=128 2 and 3, D=256 1), the last
# one short (10 heads: 3 + 3 + 3 + 1 at D=128), persistent and not; a many-tile shape in one
L2ORDER = {64: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-persistent=true-lr24-qb2-l2_order=true"],
           128: ["hopper_fwd-m64-n64-w4-s4-causal_split=false-pingpong=true-persistent=true-lr32"
                 "-qb2-l2_order=true",
                 "hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24-l2_order=true"],
           256: ["hopper_fwd-m64-n32-w4-s4-causal_split=false-pingpong=true-lr40-l2_order=true"]}
SECTIONS = [(1, 6, 6, 200, 32768), (2, 5, 1, 300, 20000), (4, 16, 4, 1000, 1000)]

# the schedules a structural field's forced GPU tests run over: the defaults, a persistent
# two-Q-buffer schedule over many tiles (the ring wraps often), the no-loader ping-pong (its refill
# waits on the same K/V hand-back) and an 8-warp consumer; plus each field's D=256 schedules
FIELD_SCHEDULES = {64: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24"],
                   128: ["hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24",
                         "hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24-qb2",
                         "hopper_fwd-m64-n128-w4-s3-pingpong=true",
                         "hopper_fwd-m128-n64-w8-s3-lr24"]}
FIELD_SHAPES = [(1, 4, 1, 1000, 1000), (1, 8, 2, 515, 2051), (4, 16, 4, 1000, 1000)]


def with_field(setting: str, d256: list) -> dict:
    """FIELD_SCHEDULES and the D=256 schedules `d256`, each with `setting` (e.g. "x=true")."""
    return {d: [f"{n}-{setting}" for n in names]
            for d, names in {**FIELD_SCHEDULES, 256: d256}.items()}


# K/V stages handed back without a barrier over the consumer's warps (the 8-warp consumer keeps
# it); D=256's record
RELEASE = with_field("release_barrier=false", ["hopper_fwd-m64-n64-w4-s3-lr24"])
# O rescaled under S_j's wgmma (FA3's order); at D=256 FA3's shape (one 8-warp consumer, where the
# rescale was exposed) and the default
RESCALE = with_field("early_rescale=true", ["hopper_fwd-m128-n64-w8-s2-lr24",
                                            "hopper_fwd-m64-n32-w4-s3-pingpong=true-lr24"])
# K's half of each stage handed back after S = Q K^T, V's after P V (two barriers per stage); at
# D=256 the two-stage ping-pong whose consumers waited on K (ncu, session 18), the one-consumer
# record, and with early_rescale
K_RELEASE = with_field("early_k_release=true", [
    "hopper_fwd-m64-n64-w4-s2-pingpong=true-lr24", "hopper_fwd-m64-n64-w4-s3-lr24",
    "hopper_fwd-m64-n64-w4-s2-pingpong=true-lr24-early_rescale=true",
    # the spill-free candidate for the D=256 default (timed 0.81x cuDNN, the default 0.73x)
    "hopper_fwd-m128-n64-w8-s2-lr24",
    # the D=256 seed: no loader, causal_split off
    "hopper_fwd-m64-n64-w4-s2-causal_split=false-pingpong=true"])


def forced_grid(variants: dict, shapes: list):
    """A forced-variant GPU test's grid: each (D, variant name), bf16 and fp16, causal or not,
    each shape."""
    marks = (pytest.mark.gpu, hopper_gpu,
             pytest.mark.parametrize("d,name", [(d, n) for d, ns in variants.items() for n in ns]),
             pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"]),
             pytest.mark.parametrize("causal", [False, True]),
             pytest.mark.parametrize("shape", shapes))

    def deco(fn):
        for mark in reversed(marks):
            fn = mark(fn)
        return fn
    return deco


@forced_grid(QBUF, MANY_TILES)
def test_two_q_buffers_match_reference_over_many_tiles(d, name, dtype, causal, shape):
    _check_forced(d, name, dtype, causal, shape)


# the short-sequence records of session 25 (the H100 table): D=256's 64-key persistent ping-pong
# with one Q buffer (non-causal N=512), D=64's 64-key head-order ping-pong (causal N=512) and
# D=128's 128-key two-stage one (non-causal N=1k); many tiles per program, odd lengths, GQA
SHORT_RECORDS = {
    64: ["hopper_fwd-m64-n64-w4-s3-causal_split=false-pingpong=true-persistent=true-lr40-qb2"
         "-head_order=true-early_k_release=true-async_o_store=true"],
    128: ["hopper_fwd-m64-n128-w4-s2-pingpong=true-persistent=true-lr56-qb2-early_k_release=true"
          "-async_o_store=true"],
    256: ["hopper_fwd-m64-n64-w4-s2-pingpong=true-persistent=true-lr56-early_k_release=true"]}


@forced_grid(SHORT_RECORDS, MANY_TILES)
def test_short_sequence_records_match_reference(d, name, dtype, causal, shape):
    _check_forced(d, name, dtype, causal, shape)


# head_order (session 24): the short causal records with it in place of l2_order (persistent,
# two Q buffers, early_k_release / async_o_store), a non-persistent one and D=256's; many tiles
# per program and tile counts that do not divide the grid
HEAD_ORDER = {64: ["hopper_fwd-m128-n64-w4-s4-causal_split=false-pingpong=true-persistent=true"
                   "-lr24-qb2-head_order=true"],
              128: ["hopper_fwd-m64-n64-w4-s3-causal_split=false-pingpong=true-persistent=true"
                    "-lr56-qb2-head_order=true-early_k_release=true-async_o_store=true",
                    "hopper_fwd-m64-n64-w4-s4-pingpong=true-persistent=true-lr24-qb2"
                    "-head_order=true",
                    "hopper_fwd-m64-n64-w4-s3-causal_split=false-pingpong=true-lr56"
                    "-head_order=true-early_k_release=true"],
              256: ["hopper_fwd-m64-n64-w4-s2-pingpong=true-lr40-head_order=true"
                    "-early_k_release=true"]}


# three consumers (session 30): the persistent seeds (head_order, l2_order) and a non-persistent
# one; causal tiles end at the last row, so odd lengths leave the first tile part empty (whole
# consumers before row 0, which store nothing: a TMA store there is an illegal instruction)
THREE = {64: ["hopper_fwd-m64-n64-w4-s3-causal_split=false-pingpong=true-three_consumers=true"
              "-persistent=true-lr32-qb2-head_order=true-early_k_release=true-async_o_store=true",
              "hopper_fwd-m64-n64-w4-s3-causal_split=false-pingpong=true-three_consumers=true"
              "-persistent=true-lr32-qb2-l2_order=true-early_k_release=true-async_o_store=true",
              "hopper_fwd-m64-n64-w4-s3-pingpong=true-three_consumers=true-lr32"]}


@forced_grid(THREE, SHAPES + MANY_TILES)
def test_three_consumers_match_reference(d, name, dtype, causal, shape):
    _check_forced(d, name, dtype, causal, shape)


# FA3's 192x128 tile: three consumers on 128-key steps (session 32: the first two, bf16, and 28 of
# their fp16 cases passed on the H100; the l2_order one and the table's one-loop records have
# not run here yet)
THREE_N128 = {64: ["hopper_fwd-m64-n128-w4-s2-pingpong=true-three_consumers=true-persistent=true"
                   "-lr32-qb2-early_k_release=true-async_o_store=true",
                   "hopper_fwd-m64-n128-w4-s3-pingpong=true-three_consumers=true-persistent=true"
                   "-lr32-qb2-async_o_store=true",
                   "hopper_fwd-m64-n128-w4-s2-pingpong=true-three_consumers=true-persistent=true"
                   "-lr32-qb2-l2_order=true-early_k_release=true-async_o_store=true",
                   # the H100 table's D=64 non-causal records: the one-loop render
                   "hopper_fwd-m64-n128-w4-s2-causal_split=false-pingpong=true-three_consumers=true"
                   "-persistent=true-lr32-qb2-early_k_release=true-async_o_store=true"]}


@forced_grid(THREE_N128, SHAPES + MANY_TILES)
def test_three_consumers_on_128_key_steps_match_reference(d, name, dtype, causal, shape):
    _check_forced(d, name, dtype, causal, shape)


@forced_grid(HEAD_ORDER, MANY_TILES)
def test_head_order_matches_reference_over_many_tiles(d, name, dtype, causal, shape):
    _check_forced(d, name, dtype, causal, shape)


@forced_grid(L2ORDER, SECTIONS)
def test_l2_order_matches_reference_over_sections(d, name, dtype, causal, shape):
    _check_forced(d, name, dtype, causal, shape)


@forced_grid({d: RELEASE[d] + RESCALE[d] for d in RELEASE}, FIELD_SHAPES)
def test_release_and_rescale_settings_match_reference(d, name, dtype, causal, shape):
    """release_barrier=false and early_rescale=true (the variant name says which)."""
    _check_forced(d, name, dtype, causal, shape)


# the O store waited for under the next tile's first QK^T: the two-Q-buffer schedules (persistent,
# many tiles per program, so the deferred wait and hand-back run every tile), with the short
# causal record's fields
def on_qbuf(setting: str, record128: str) -> dict:
    """QBUF's schedules with `setting` (e.g. "x=true"), and at D=128 a short causal record's
    fields with it."""
    out = {d: [f"{n}-{setting}" for n in names] for d, names in QBUF.items()}
    out[128] = out[128] + [f"{record128}-{setting}"]
    return out


def field_pair(base: str, field: str) -> tuple:
    """(off, on, off's render, on's render) of the structural bool `field` on variant `base`;
    on's name carries it and parses back."""
    import dataclasses
    off = Variant.parse(base)
    on = dataclasses.replace(off, **{field: True})
    assert Variant.parse(on.name) == on and f"{field}=true" in on.name
    return off, on, render(off), render(on)


O_STORE = on_qbuf("async_o_store=true",
                  "hopper_fwd-m64-n64-w4-s4-causal_split=false-pingpong=true-persistent=true"
                  "-lr56-qb2-l2_order=true-early_rescale=true-early_k_release=true")


@forced_grid(O_STORE, MANY_TILES)
def test_async_o_store_matches_reference_over_many_tiles(d, name, dtype, causal, shape):
    _check_forced(d, name, dtype, causal, shape)


def test_async_o_store_is_structural_and_needs_two_q_buffers():
    import dataclasses
    off, on, off_src, on_src = field_pair(
        "hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24-qb2", "async_o_store")
    assert "def _o_stored" not in off_src and "def _o_stored" in on_src
    # the epilogue no longer waits for its store; the wait follows the next tile's first QK^T
    epi = on_src[on_src.index("tma_store(o_desc"):]
    assert epi.index("pend = qi") < epi.index("t += 1")
    assert "tma.store_wait(0)\n        sync_warps()" not in epi.split("t += 1")[0]
    first = on_src.index("sc = warpgroup_mma(q_smem, k_smem.permute((1, 0)), zero_s")
    assert first < on_src.index("pend = _o_stored(q_empty, pend)", first)
    assert 'gl.static_assert(QB == 2' in on_src
    from flashtune.search_space import Space
    from flashtune.targets import get as get_target
    space = Space.build("hopper_fwd", get_target("H100"),
                        dataclasses.replace(_problem(causal=True), family="hopper_fwd"))
    assert space.check(on).ok
    assert "async_o_store" in space.check(dataclasses.replace(on, q_buffers=1)).reason


@forced_grid(K_RELEASE, FIELD_SHAPES)
def test_early_k_release_matches_reference(d, name, dtype, causal, shape):
    _check_forced(d, name, dtype, causal, shape)


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("kw", [dict(window=(200, 0), causal=True),
                                dict(window=(300, 100), softcap=20.0)], ids=["window", "softcap"])
def test_early_rescale_with_masks(kw):
    """The masked loop (window, softcap; a row whose first blocks are all masked keeps m = -inf
    until its window starts) with the rescale moved under S_j's wgmma."""
    from flashtune.accuracy import compare
    from flashtune.reference import reference, same_dtype_math
    q, k, v = qkv(2, 8, 2, 700, 900, 128, torch.bfloat16, "cuda")
    masks = "-window=true" + ("-softcap=true" if "softcap" in kw else "")
    with flashtune.force("hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24-early_rescale=true" + masks):
        out = flashtune.attention(q, k, v, **kw)
    report = compare(out, reference(q, k, v, **kw), same_dtype_math(q, k, v, **kw))
    assert report.ok, str(report)


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("name", [
    "hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24-early_k_release=true-window=true",
    "hopper_fwd-m64-n64-w4-s2-pingpong=true-early_k_release=true-window=true"])
def test_early_k_release_with_a_window(name):
    """The masked loops hand back both halves of the stages a consumer skips (ping-pong's
    leading and trailing blocks), with a loader and without (the refill waits on both halves)."""
    from flashtune.accuracy import compare
    from flashtune.reference import reference, same_dtype_math
    q, k, v = qkv(2, 8, 2, 700, 900, 128, torch.bfloat16, "cuda")
    kw = dict(window=(200, 0), causal=True)
    with flashtune.force(name):
        out = flashtune.attention(q, k, v, **kw)
    report = compare(out, reference(q, k, v, **kw), same_dtype_math(q, k, v, **kw))
    assert report.ok, str(report)


def test_early_k_release_is_structural_and_the_default_renders_as_before():
    import dataclasses
    off = Variant.parse("hopper_fwd-m64-n64-w4-s2-pingpong=true-lr24")
    on = dataclasses.replace(off, early_k_release=True)
    assert Variant.parse(on.name) == on and "early_k_release=true" in on.name
    on_src, off_src = render(on), render(off)
    assert "STAGES + st" not in off_src and "[2 * STAGES, 1]" not in off_src
    # K's half goes back right after S_j's wait, before the softmax; V's after P V's wait
    loop = on_src[on_src.index("sc = warpgroup_mma_wait(1"):]
    assert loop.index("_release(kv_empty, st2, WARPS)") < loop.index("_softmax(") \
        < loop.index("_release(kv_empty, STAGES + st, WARPS)")
    # the loader waits for V's half before loading V
    loader = on_src[on_src.index("def _loader"):on_src.index("def _softmax")]
    assert loader.index("mbarrier.wait(kv_empty.index(STAGES + st)") \
        < loader.index("mbarrier.expect(v_ready")


def test_early_rescale_is_structural_and_the_default_renders_as_before():
    import dataclasses
    off = Variant.parse("hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24")
    on = dataclasses.replace(off, early_rescale=True)
    assert not off.early_rescale and "early_rescale" not in off.name
    assert Variant.parse(on.name) == on and "early_rescale=true" in on.name
    on_src, off_src = render(on), render(off)
    # the rescale moves: in the loop before P_{j-1} V_{j-1} is issued, and before the last P V
    mul = "acc = acc * gl.expand_dims(gl.convert_layout(alpha, rows_o), 1)"
    assert on_src.count(mul) == 2 and off_src.count(mul) == 1
    assert on_src.index(mul) < on_src.index("acc = warpgroup_mma(p_op") < off_src.index(mul)


def test_release_barrier_is_structural_and_the_default_renders_as_before():
    """release_barrier=false changes the text (no barrier before the hand-back); the default
    renders without the _release helper, so records made before the field keep their hashes."""
    import dataclasses
    on = Variant.parse("hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24")
    off = dataclasses.replace(on, release_barrier=False)
    assert on.release_barrier and "release_barrier" not in on.name
    assert Variant.parse(off.name) == off and "release_barrier=false" in off.name
    on_src, off_src = render(on), render(off)
    assert "def _release(" not in on_src and "_release(kv_empty" not in on_src
    assert off_src.count("_release(kv_empty, st, WARPS)") == 2
    with pytest.raises(ValueError, match="release_barrier"):  # another family's field
        Variant.parse("fwd-m64-n64-w4-s2-release_barrier=false")


@pytest.mark.gpu
@hopper_gpu
@pytest.mark.parametrize("kw", [dict(window=(200, 0), causal=True),
                                dict(window=(300, 100), softcap=20.0)], ids=["window", "softcap"])
def test_two_q_buffers_with_masks_over_many_tiles(kw):
    from flashtune.accuracy import compare
    from flashtune.reference import reference, same_dtype_math
    q, k, v = qkv(4, 16, 4, 1000, 1000, 128, torch.bfloat16, "cuda")
    name = "hopper_fwd-m64-n64-w4-s3-pingpong=true-persistent=true-lr24-qb2"
    with flashtune.force(name):
        assert flashtune.explain(q, k, v, **kw).variant.q_buffers == 2
        o = flashtune.attention(q, k, v, **kw)
    rep = compare(o, reference(q, k, v, **kw), same_dtype_math(q, k, v, **kw))
    assert rep.ok, str(rep)


@forced_grid(VARIANTS, SHAPES)
def test_matches_reference(d, name, dtype, causal, shape):
    _check_forced(d, name, dtype, causal, shape)


@forced_grid(TILES, SHAPES)
def test_tiles_match_reference(d, name, dtype, causal, shape):
    _check_forced(d, name, dtype, causal, shape)


def _check_forced(d, name, dtype, causal, shape):
    """O against the float64 reference with the variant forced; LSE within 1e-3, -inf exactly
    where a row sees no key."""
    from flashtune.reference import reference
    b, h, hk, nq, nk = shape
    q, k, v = qkv(b, h, hk, nq, nk, d, dtype, "cuda")
    with flashtune.force(name):
        o, lse = flashtune.attention(q, k, v, causal=causal, return_lse=True)
    assert_matches_reference(q, k, v, causal=causal, out=o)
    _, ref_lse = reference(q, k, v, causal=causal, return_lse=True)
    ref_lse, lse = ref_lse.cpu(), lse.double().cpu()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))  # -inf: rows that see no key
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max() < 1e-3


@pytest.mark.gpu
@hopper_gpu
def test_strided_layouts_and_backward_from_its_lse():
    """(B, N, H, D) views go through the descriptors' merged strides; the generic backward
    consumes the LSE this forward returns."""
    from flashtune.reference import reference
    q, k, v = (t.requires_grad_() for t in qkv(2, 4, 2, 300, 300, 128, torch.bfloat16, "cuda",
                                               layout="bnhd"))
    with flashtune.force("hopper_fwd-m64-n64-w4-s3-pingpong=true-lr24"):
        out = flashtune.attention(q, k, v, causal=True)
    assert_matches_reference(q.detach(), k.detach(), v.detach(), causal=True, out=out.detach())
    g = torch.randn_like(out)
    out.backward(g)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference(q64, k64, v64, causal=True).backward(g.double())
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < 2e-2, err


@pytest.mark.gpu
@hopper_gpu
def test_misaligned_call_runs_the_generic_kernel():
    base = torch.randn(2 * 4 * 64 * 128 + 8, dtype=torch.bfloat16, device="cuda")
    q = base[1:1 + 2 * 4 * 64 * 128].view(2, 4, 64, 128)  # 2-byte offset: no TMA descriptor
    k, v = torch.randn_like(q), torch.randn_like(q)
    with flashtune.force("hopper_fwd-m64-n64-w4-s3-pingpong=true-lr24"):
        assert_matches_reference(q, k, v)
