"""The search of the backward family on the CPU: its space (both dQ schemes, the dQ kernel's
tiles only where they exist), the dry run, a replayed study whose winner reaches the tuned DB and
the dispatcher, and the real measuring operations run once in Triton's interpreter."""
import dataclasses
import importlib.util
import json
from pathlib import Path

import optuna
import pytest
import torch
from click.testing import CliRunner

from flashtune import dispatch, ops, targets
from flashtune.cli import main as cli
from flashtune.codegen import Variant
from flashtune.defaults import default_variant
from flashtune.measure import Outcome
from flashtune.problem import Bucket
from flashtune.replay import write_recording
from flashtune.search import SearchConfig, plan_of, run_search
from flashtune.search_plan import standard_problem
from flashtune.search_progress import NoProgress
from flashtune.search_space import Space
from flashtune.search_study import make_storage, study_name

H100, A100 = targets.get("H100"), targets.get("A100")
_DQ_TILES = ("block_m2", "block_n2", "num_warps2", "num_stages2")


def _p(d=128, causal=False, n=4096):
    return standard_problem("bwd", "bfloat16", d, causal, n)


def test_space_has_every_scheme_and_dq_tiles_only_where_they_exist():
    s = Space.build("bwd", H100, _p())
    vs = s.variants()
    assert len(vs) == len(set(vs))  # an atomic kernel is one point, not one per dQ tile
    atomic = [v for v in vs if v.dq == "atomic"]
    separate = [v for v in vs if v.dq == "separate"]
    fused = [v for v in vs if v.dq == "fused"]
    assert atomic and separate and fused
    assert all(getattr(v, f) == 0 for v in atomic for f in _DQ_TILES)
    assert all(getattr(v, f) > 0 for v in separate for f in _DQ_TILES)
    # fused: the dQ tiles, and the one kernel's warps and stages (num_warps2/num_stages2 unset)
    assert all(v.block_m2 and v.block_n2 and not v.num_warps2 and not v.num_stages2
               for v in fused)
    # m2 x n2 x w2 x s2 x dq_loads per dK/dV config; fused: m2 x n2 x dq_loads
    assert len(separate) == len(atomic) * 3 * 4 * 2 * 4 * 2
    assert len(fused) == len(atomic) * 3 * 4 * 2
    assert all(v.dq_loads == "pointer" for v in atomic)
    feas = s.feasible
    assert {v.dq for v in feas} == {"atomic", "separate", "fused"}
    assert all(v.block_m2 >= 8 * v.num_warps for v in feas if v.dq == "fused")
    for d in (64, 128):
        sd = Space.build("bwd", H100, _p(d))
        for dq in ("atomic", "separate"):
            assert default_variant("bwd", d, "bfloat16", dq=dq, arch="sm_90") in sd.feasible


def test_optuna_proposes_every_scheme_and_round_trips():
    s = Space.build("bwd", H100, _p(causal=True))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = []
    for _ in range(40):
        t = study.ask()
        v = s.suggest(t)
        seen.append(v)
        if v.dq == "atomic":  # the dQ kernel's params are not even asked for
            assert not any(k.startswith(_DQ_TILES) for k in t.params), t.params
        if v.dq == "fused":  # its tiles only: the one kernel's warps and stages serve both
            assert not any(k.startswith(("num_warps2", "num_stages2")) for k in t.params)
        study.tell(t, 0.0)
    assert {v.dq for v in seen} == {"atomic", "separate", "fused"}
    assert {v.causal_split for v in seen} == {True, False}
    for v in (next(x for x in seen if x.dq == "atomic"),
              next(x for x in seen if x.dq == "separate"),
              next(x for x in seen if x.dq == "fused")):
        study.enqueue_trial(s.optuna_params(v))
        assert s.suggest(study.ask()) == v


@pytest.mark.parametrize("gpu,d,name,kernel,shared", [
    # metadata.shared of the kernel compiled for the target on the CPU (see feasibility.py)
    ("H100", 128, "bwd-m64-n64-w8-s2-dq=separate-mq64-nq64-wq4-sq1", 0, 99328),
    ("H100", 128, "bwd-m32-n128-w8-s2-dq=separate-mq128-nq64-wq8-sq2", 0, 98560),
    ("H100", 128, "bwd-m32-n128-w8-s2-dq=separate-mq128-nq64-wq8-sq2", 1, 131072),
    ("H100", 128, "bwd-m32-n128-w8-s2-dq=atomic", 0, 139520),
    # dq="fused": one kernel as large as the larger half (the dQ half here; the dK/dV half)
    ("H100", 128, "bwd-m32-n128-w8-s2-dq=fused-mq128-nq64", 0, 131072),
    ("H100", 128, "bwd-m64-n128-w8-s3-dq=fused-mq128-nq64", 0, 164864),
    ("H100", 64, "bwd-m32-n128-w8-s3-dq=atomic", 0, 82432),
    ("H100", 64, "bwd-m128-n64-w8-s4-dq=separate-mq64-nq64-wq4-sq4", 0, 150528),
    ("H100", 64, "bwd-m128-n64-w8-s4-dq=separate-mq64-nq64-wq4-sq4", 1, 81920),
    ("A100", 128, "bwd-m64-n64-w8-s3-dq=separate-mq64-nq64-wq4-sq1", 0, 107520),
    ("A100", 128, "bwd-m32-n64-w8-s3-dq=atomic", 0, 82432),
])
def test_bwd_shared_memory_model_matches_triton(gpu, d, name, kernel, shared):
    from flashtune import feasibility
    r = feasibility.bwd_kernels(Variant.parse(name), _p(d), targets.get(gpu))[kernel]
    assert abs(r.smem_bytes - shared) <= max(4096, 0.08 * shared), r


def test_model_prunes_known_too_big_bwd_configs():
    s = Space.build("bwd", H100, _p())
    cases = {  # what sm_90 compiles showed
        "bwd-m128-n64-w8-s4-dq=atomic": ("shared memory", "attn_bwd_dkdv"),  # 363520 B
        "bwd-m32-n64-w8-s2-dq=separate-mq64-nq128-wq4-sq4": ("shared memory", "attn_bwd_dq"),
        "bwd-m32-n128-w4-s2-dq=separate-mq128-nq64-wq8-sq2": ("registers", "attn_bwd_dkdv"),
        "bwd-m64-n128-w4-s2-dq=atomic": ("registers", "attn_bwd_dkdv"),  # spilled 3.6 KB
    }
    for name, (resource, kernel) in cases.items():
        v = Variant.parse(name)
        assert v in s.variants()
        verdict = s.check(v)  # the model's verdict, not a constraint's
        assert not verdict.ok and resource in verdict.reason and kernel in verdict.reason, name
    a100 = Space.build("bwd", A100, _p())
    sh, sa = s.sizes(), a100.sizes()
    # descriptor loads (either kernel's) need TMA: never proposed on the A100
    assert not any("descriptor" in (v.loads, v.dq_loads) for v in a100.variants())
    assert sh["constraints"] > sh["feasible"] > sa["feasible"] > 0
    assert sh["constraints"] > sa["constraints"] > sa["feasible"]


def test_dry_run_shows_bwd_sizes_for_h100_and_a100():
    r = CliRunner().invoke(cli, ["search", "--gpu", "H100", "--family", "bwd", "--dry-run",
                                 "--head-dim", "128", "--seqlen", "4096", "--causal", "false"])
    assert r.exit_code == 0, r.output
    assert "bwd-bf16-d128-full-q4096-k4096-bh64" in r.output
    assert "block_m2       32, 64, 128  (only when dq != 'atomic')" in r.output
    assert "dq             atomic, separate, fused" in r.output
    sizes = {}
    for gpu in ("H100", "A100"):
        r = CliRunner().invoke(cli, ["search", "--gpu", gpu, "--family", "bwd", "--dry-run",
                                     "--head-dim", "128", "--seqlen", "4096", "--causal",
                                     "false", "--format", "json"])
        assert r.exit_code == 0, r.output
        (b,) = json.loads(r.output)["buckets"]
        assert b["when"]["block_m2"] == "dq != 'atomic'"
        sizes[gpu] = b["sizes"]
    assert sizes["H100"]["file"] > sizes["H100"]["target"] > sizes["H100"]["feasible"]
    assert sizes["A100"]["feasible"] < sizes["H100"]["feasible"]


def _recording(path, problem):
    """Every feasible variant of the bucket; any atomic variant is faster than any separate
    one, so the winner must be atomic (the atomic default is measured first)."""
    space = Space.build("bwd", H100, problem)
    b = Bucket.of(problem)
    rows = []
    for v in space.feasible:
        tiles = abs(v.block_m - 32) / 128 + abs(v.block_n - 128) / 256 + v.num_stages / 16
        ms = (0.5 if v.dq == "atomic" else 1.0) * (1 + tiles / 4)
        rows.append((b, v.name, Outcome(True, ms, max_err=1e-3)))
    write_recording(path, {"gpu": "H100", "gpu_name": H100.name, "synthetic": True,
                           "sm_count": H100.sm_count}, [problem], rows)


def test_bwd_study_writes_winner_to_db_and_the_dispatcher_uses_it(tmp_path):
    from flashtune.tuned_db import TunedDB

    cfg = SearchConfig(gpu="H100", families=("bwd",), head_dims=(64,), seqlens=(1024,),
                       causal=(True,), compile_workers=1, seed=0, trials=8, top_k=3,
                       storage=f"sqlite:///{tmp_path}/optuna.db", db=f"sqlite:///{tmp_path}/t.db",
                       replay=str(tmp_path / "rec.jsonl"))
    (pb,) = plan_of(cfg, H100)
    _recording(tmp_path / "rec.jsonl", pb.problem)
    res = run_search(cfg, progress=NoProgress())
    (b,) = res.buckets
    assert b.status == "done" and b.measured == 8 and res.db_written == 1
    assert Variant.parse(b.winner).dq == "atomic" and b.speedup > 1.5
    study = optuna.load_study(study_name=study_name(pb.space, pb.bucket),
                              storage=make_storage(cfg.storage))
    proposed = [Variant.parse(t.user_attrs["variant"]) for t in study.trials
                if "variant" in t.user_attrs]
    assert proposed[:2] == [default_variant("bwd", 64, "bfloat16", dq="separate", arch="sm_90"),
                            default_variant("bwd", 64, "bfloat16", dq="atomic", arch="sm_90")]
    (rec,) = TunedDB(cfg.db).records()
    assert rec.bucket.family == "bwd" and rec.variant.name == b.winner
    assert rec.unit == "TFLOP/s" and rec.provenance.source == "search"

    # the dispatcher serves it; deterministic=True swaps in the separate dQ kernel
    empty = tmp_path / "tables"
    empty.mkdir()
    dispatch.configure(gpu="H100", db=cfg.db, tables_dir=empty)
    try:
        p = pb.problem
        q = torch.empty(1, p.batch * p.heads, p.seqlen_q, p.head_dim, dtype=torch.bfloat16,
                        device="meta")
        assert ops.select_bwd(q, q, True, False) == rec.variant
        det = ops.select_bwd(q, q, True, True)
        assert det.dq == "separate" and dataclasses.replace(
            det, dq="atomic", **{f: 0 for f in _DQ_TILES}) == rec.variant
    finally:
        dispatch.configure()


def test_gpu_backend_measures_bwd():
    from flashtune.measure_gpu import GpuBackend
    assert GpuBackend(smem_limit=H100.smem_per_block).supports("bwd")


def test_compile_ahead_compiles_every_kernel_of_the_variant(monkeypatch):
    """The launcher runs on meta tensors and each kernel goes to the JIT's warmup (stood in
    for here: warmup needs a GPU driver); the largest shared memory is what is judged."""
    from _warmup import stub_load

    from flashtune import launch_bwd
    from flashtune.measure_bwd import BwdOps

    calls = stub_load(monkeypatch, launch_bwd,
                      ("attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"))
    p = _p(64, causal=True, n=1024)
    sep = default_variant("bwd", 64, "bfloat16", dq="separate")
    # the timed problem's kernels, then the gate's (one batch: the real JIT finds those in its
    # cache unless an integer argument specializes differently; this stand-in has no cache)
    assert BwdOps().compile_ahead(sep, p) == 6000
    kernels = [("attn_bwd_preprocess", 4, None), ("attn_bwd_dkdv", sep.num_warps, sep.block_m),
               ("attn_bwd_dq", sep.num_warps2, sep.block_m2)]
    assert [(c.name, c.kw["num_warps"], c.kw.get("BLOCK_M")) for c in calls] == kernels * 2
    calls.clear()
    assert BwdOps().compile_ahead(default_variant("bwd", 64, "bfloat16", dq="atomic"), p) == 4000
    assert [c.name for c in calls] == ["attn_bwd_preprocess", "attn_bwd_dkdv"] * 2


def test_bwd_measuring_ops_in_the_interpreter():
    """The timing worker's gate, on the CPU: inputs (O and LSE from the forward), the run of
    both schemes, the float64 reference gradients, and a wrong dK caught by name."""
    from flashtune.measure_bwd import BwdOps
    from flashtune.problem import Problem

    bwd = BwdOps(device="cpu")
    p = Problem("bwd", "float16", 32, True, 2, 3, 4, 48, 40)   # GQA, Nq != Nk, tails
    gp = bwd.gate_problem(p)
    assert gp.batch == 1 and gp.seqlen_q == p.seqlen_q
    inputs = bwd.inputs(gp, seed=0)
    assert all(t.abs().sum() > 0 for t in inputs)
    ref = bwd.reference(gp, inputs)
    for name in ("bwd-m16-n32-w4-s1-dq=atomic", "bwd-m16-n32-w4-s1-dq=separate-mq32-nq16-wq4-sq1"):
        out = bwd.run(Variant.parse(name), gp, inputs)
        report = bwd.check(out, gp, ref)
        assert report.ok and report.max_err > 0, f"{name}: {report}"
    dq, dk, dv = out
    bad = bwd.check((dq, dk * 1.1, dv), gp, ref)
    assert not bad.ok and str(bad).startswith("dk FAIL")
    # the timed runs reuse the plan built by the first (as the dispatcher's memo): same
    # gradients, no second plan for the same variant, problem and inputs
    v = Variant.parse("bwd-m16-n32-w4-s1-dq=atomic")
    plan = bwd._plans[(v, gp, inputs[0].data_ptr(), "cpu")]
    again = bwd.run(v, gp, inputs)
    assert bwd._plans[(v, gp, inputs[0].data_ptr(), "cpu")] is plan
    assert bwd.check(again, gp, ref).ok


def test_sweep_reads_bwd_buckets():
    path = Path(__file__).resolve().parents[1] / "bench" / "sweep.py"
    spec = importlib.util.spec_from_file_location("_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    assert sweep.parse_bucket("bwd:128:4096:causal") == ("bwd", 128, 4096, True)
    assert sweep.parse_bucket("64:1024:full") == ("fwd", 64, 1024, False)
    with pytest.raises(ValueError, match="bwd:128:x"):
        sweep.parse_bucket("bwd:128:x:full")


@pytest.mark.gpu
def test_tiny_real_bwd_search(tmp_path):
    """On the GPU present: both schemes compile ahead, pass the gate and are timed; the winner
    reaches the DB and the timing worker never recompiled."""
    target = targets.detect()
    cfg = SearchConfig(gpu="auto", families=("bwd",), head_dims=(64,), seqlens=(512,),
                       causal=(True,), trials=4, seed=0, compile_workers=2, top_k=2,
                       retime_rounds=2, storage=f"sqlite:///{tmp_path}/o.db",
                       db=f"sqlite:///{tmp_path}/t.db")
    res = run_search(cfg, progress=NoProgress())
    (b,) = res.buckets
    assert b.winner and b.tflops > 0 and res.db_written == 1, b
    (pb,) = plan_of(cfg, target)
    study = optuna.load_study(study_name=study_name(pb.space, pb.bucket),
                              storage=make_storage(cfg.storage))
    done = {t.user_attrs["variant"]: t.user_attrs["result"] for t in study.trials
            if "result" in t.user_attrs and "variant" in t.user_attrs}
    ok = {n: r for n, r in done.items() if r.get("ms")}
    assert {Variant.parse(n).dq for n in ok} == {"atomic", "separate"}, done  # both defaults
    assert all(r["max_err"] > 0 for r in ok.values())
    assert not any("recompiled" in r.get("notes", "") for r in ok.values()), done


def test_seeds_carry_the_fused_default_with_descriptor_kv_on_sm90_only():
    from flashtune.defaults import bwd_default, bwd_seeds
    fused = bwd_default(128, "bfloat16", arch="sm_90", dq="fused")
    seeds = bwd_seeds(128, "bfloat16", arch="sm_90")
    assert dataclasses.replace(fused, dq_loads="descriptor") in seeds and fused in seeds
    assert all(v.dq_loads == "pointer" for v in bwd_seeds(128, "bfloat16", arch="sm_80"))
    assert all(v.dq_loads == "pointer" for v in bwd_seeds(128, "float32", arch="sm_90"))
