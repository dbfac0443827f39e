"""The search end to end on the CPU: replayed measurements in real isolated worker processes.

Shown here: winners reach the tuned DB with provenance; infeasible, failed and faulting
candidates (compile error, wrong result, hang, crash, broken context) fail with their reason
and never win; duplicate proposals are answered from what was measured; a killed search
resumes without losing or re-measuring a completed trial; Ctrl-C stops cleanly.
"""
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
from optuna.trial import TrialState

import flashtune.defaults

from flashtune import targets
from flashtune.codegen import Variant
from flashtune.sampler_eval import synthesize
from flashtune.search import SearchConfig, plan_of, run_search
from flashtune.search_progress import NoProgress
from flashtune.search_study import make_storage, study_name

H100 = targets.get("H100")
BASE = dict(gpu="H100", families=("fwd",), head_dims=(64,), seqlens=(1024,), causal=(False,),
            compile_workers=1, enqueue_default=False, seed=0)


class MemDB:
    """The TunedDB contract (put/get/records), in memory."""

    def __init__(self):
        self.rows = {}

    def put(self, r):
        self.rows[r.natural_key] = r

    def records(self, *a, **k):
        return list(self.rows.values())


def _recording(tmp_path, faults=None, **meta):
    path = tmp_path / "rec.jsonl"
    cfg = SearchConfig(**BASE)
    synthesize(path, H100, [pb.problem for pb in plan_of(cfg, H100)], fail_rate=0.0,
               faults=faults, **meta)
    return str(path)


def _cfg(tmp_path, rec, **kw):
    return SearchConfig(**dict(BASE, replay=rec, storage=f"sqlite:///{tmp_path}/optuna.db",
                               **kw))


def _study(cfg):
    pb = plan_of(cfg, H100)[0]
    return optuna.load_study(study_name=study_name(pb.space, pb.bucket),
                             storage=make_storage(cfg.storage))


def _measured_names(study):
    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.user_attrs.get("result", {}).get("measured"):
            out.append(t.user_attrs["variant"])
    return out


def test_search_writes_winner_with_provenance(tmp_path):
    rec = _recording(tmp_path)
    db = MemDB()
    res = run_search(_cfg(tmp_path, rec, trials=12, top_k=3), db=db, progress=NoProgress())
    (b,) = res.buckets
    assert b.status == "done" and b.measured == 12 and b.winner
    (r,) = db.records()
    assert r.variant.name == b.winner and r.unit == "TFLOP/s" and r.throughput > 0
    assert r.gpu == "nvidia-h100-80gb-hbm3" and r.provenance.source == "search"
    # runner-ups: the top 3 less the winner, plus the built-in default, which this study's
    # trials left out -- the pick gates and re-times it, so a winner must beat it
    default = flashtune.defaults.default_variant("fwd", 64, "bfloat16").name
    assert r.provenance.template_hash and len(r.runner_ups) == 3
    assert default in [n for n, _ in r.runner_ups] + [r.variant.name]
    study = _study(_cfg(tmp_path, rec))
    assert study.user_attrs["winner"] == b.winner
    names = _measured_names(study)
    assert len(names) == len(set(names)) == 12


def test_faults_fail_with_their_reason_and_never_win(tmp_path):
    cfg0 = SearchConfig(**BASE)
    feas = [v for v in plan_of(cfg0, H100)[0].space.feasible]
    fast = sorted(feas, key=lambda v: (v.block_m != 128, v.block_n != 64, v.num_stages != 3))
    faults = {fast[0].name: "hang", fast[1].name: "crash", fast[2].name: "poison",
              fast[3].name: "compile", fast[4].name: "gate"}
    rec = _recording(tmp_path, faults=faults)
    cfg = _cfg(tmp_path, rec, trials=7, trial_timeout_s=4.0, top_k=7)
    pb = plan_of(cfg, H100)[0]
    study = optuna.create_study(study_name=study_name(pb.space, pb.bucket),
                                storage=make_storage(cfg.storage), direction="maximize")
    infeasible = Variant.parse("fwd-m256-n128-w2-s1-loads=descriptor")
    for v in [fast[i] for i in range(5)] + [infeasible, fast[5], fast[6]]:
        study.enqueue_trial(pb.space.optuna_params(v))
    db = MemDB()
    res = run_search(cfg, db=db, progress=NoProgress())
    (b,) = res.buckets
    why = {name: (stage, reason) for name, stage, reason in b.failures}
    assert why[fast[0].name][0] == "timeout" and "killed" in why[fast[0].name][1]
    assert why[fast[1].name][0] == "crash" and "SIGSEGV" in why[fast[1].name][1]
    assert why[fast[2].name][0] == "launch" and "illegal memory access" in why[fast[2].name][1]
    assert why[fast[3].name][0] == "compile"
    assert why[fast[4].name][0] == "gate"
    assert b.failed == 5 and b.infeasible >= 1 and b.measured == 7
    (r,) = db.records()
    assert r.variant.name not in faults and r.variant.name in (fast[5].name, fast[6].name)
    results = {t.user_attrs["variant"]: t.user_attrs["result"] for t in _study(cfg).trials}
    assert results[infeasible.name]["stage"] == "infeasible"
    assert "registers" in results[infeasible.name]["reason"]
    # failures are told to Optuna as 0 TFLOP/s with a violated constraint: samplers learn
    assert all(results[n]["violation"] == 1.0 for n in faults)


def test_a_bucket_without_winner_says_what_failed_where(tmp_path):
    import io

    from flashtune.search_progress import PlainProgress
    feas = plan_of(SearchConfig(**BASE), H100)[0].space.feasible
    faults = {v.name: ("compile" if i % 3 == 0 else "gate") for i, v in enumerate(feas)}
    rec = _recording(tmp_path, faults=faults)
    out = io.StringIO()
    db = MemDB()
    res = run_search(_cfg(tmp_path, rec, trials=4, top_k=2), db=db, progress=PlainProgress(out))
    (b,) = res.buckets
    assert b.winner is None and b.status == "no winner" and not db.records()
    stages = [stage for _, stage, _ in b.failures]
    n_compile, n_gate = stages.count("compile"), stages.count("gate")
    assert n_compile + n_gate == b.failed == b.measured == 4
    (line,) = [ln for ln in out.getvalue().splitlines() if "measured" in ln and "[1/1]" in ln
               and "so far" not in ln]
    assert "no winner: no winner" not in line, line
    assert "no candidate passed: 4 measured, 4 failed (" in line
    for stage, n in (("compile", n_compile), ("gate", n_gate)):
        assert (f"{n} at {stage}" in line) == bool(n)


def test_duplicate_proposals_are_answered_from_what_was_measured(tmp_path):
    rec = _recording(tmp_path)
    cfg = _cfg(tmp_path, rec, trials=3)
    pb = plan_of(cfg, H100)[0]
    study = optuna.create_study(study_name=study_name(pb.space, pb.bucket),
                                storage=make_storage(cfg.storage), direction="maximize")
    v = pb.space.feasible[0]
    for _ in range(3):
        study.enqueue_trial(pb.space.optuna_params(v))
    run_search(cfg, db=MemDB(), progress=NoProgress())
    trials = [t for t in _study(cfg).trials if t.user_attrs.get("variant") == v.name]
    measured = [t for t in trials if t.user_attrs["result"].get("measured")]
    dups = [t for t in trials if t.user_attrs["result"].get("duplicate")]
    assert len(measured) == 1 and len(dups) == 2
    assert {t.value for t in trials} == {measured[0].value}


def _cli(tmp_path, rec, *extra):
    env = dict(os.environ, FLASHTUNE_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    args = [sys.executable, "-m", "flashtune.cli", "search", "--gpu", "H100", "--replay", rec,
            "--family", "fwd",
            "--head-dim", "64", "--seqlen", "1024", "--causal", "false", "--compile-workers", "1",
            "--storage", f"sqlite:///{tmp_path}/optuna.db", "--db", f"sqlite:///{tmp_path}/t.db",
            "--progress", "lines", "--seed", "0", *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _wait_for_completed(cfg, n, proc, timeout=90):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if len(_measured_names(_study(cfg))) >= n:
                return
        except KeyError:
            pass  # the study does not exist yet
        time.sleep(0.2)
    raise AssertionError("the search made no progress")


def test_resume_after_kill_loses_and_repeats_nothing(tmp_path):
    rec = _recording(tmp_path, delay_s=0.15)
    cfg = _cfg(tmp_path, rec)
    proc = _cli(tmp_path, rec, "--trials", "40")
    _wait_for_completed(cfg, 6, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # driver and workers, mid-trial
    proc.wait()
    before = {t.number: t.user_attrs["variant"] for t in _study(cfg).trials
              if t.state == TrialState.COMPLETE and t.user_attrs["result"].get("measured")}
    running = [t for t in _study(cfg).trials if t.state == TrialState.RUNNING]
    assert running
    if any(not t.user_attrs.get("owner") for t in running):
        # killed between ask() and the owner's write: such a trial is reaped once older than
        # the grace a live process gets to write its owner
        from flashtune.search_claims import ORPHAN_GRACE_S
        time.sleep(ORPHAN_GRACE_S)
    proc = _cli(tmp_path, rec, "--trials", str(len(before) + 4))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    study = _study(cfg)
    after = {t.number: t for t in study.trials}
    for number, name in before.items():  # every completed trial is still there, unchanged
        assert after[number].state == TrialState.COMPLETE
        assert after[number].user_attrs["variant"] == name
    names = _measured_names(study)
    assert len(names) == len(set(names)) == len(before) + 4  # none measured twice
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]  # reaped
    assert "1 winners written" in out


def test_ctrl_c_stops_cleanly_keeps_trials_and_writes_the_best(tmp_path):
    rec = _recording(tmp_path, delay_s=0.15)
    cfg = _cfg(tmp_path, rec)
    proc = _cli(tmp_path, rec, "--trials", "200")
    _wait_for_completed(cfg, 4, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "interrupted" in out
    study = _study(cfg)
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    assert len(_measured_names(study)) >= 4
    from flashtune.tuned_db import TunedDB
    (r,) = TunedDB(f"sqlite:///{tmp_path}/t.db").records()
    assert r.variant.name in _measured_names(study)


def test_next_bucket_starts_while_the_last_trials_finish(tmp_path):
    """A bucket whose budget is all in flight hands its last trials on (search_flight.Flight):
    the next bucket's first candidates go in while they finish, and every trial is still told
    to its own study and every bucket picked from all of its trials."""
    seqlens = (1024, 2048)
    path = tmp_path / "rec.jsonl"
    synthesize(path, H100, [pb.problem for pb in plan_of(SearchConfig(**dict(BASE, seqlens=seqlens)),
                                                           H100)],
               fail_rate=0.0, delay_s=0.05, compile_delay_s=0.4)
    cfg = _cfg(tmp_path, str(path), seqlens=seqlens, trials=8, compile_workers=3)
    res = run_search(cfg, db=MemDB(), progress=NoProgress())
    assert [b.status for b in res.buckets] == ["done", "done"] and res.measured == 16
    storage = make_storage(cfg.storage)
    spans = []
    for pb in plan_of(cfg, H100):
        trials = optuna.load_study(study_name=study_name(pb.space, pb.bucket),
                                   storage=storage).get_trials(deepcopy=False)
        measured = [t for t in trials if t.state == TrialState.COMPLETE
                    and t.user_attrs["result"].get("measured")]
        assert len(measured) == 8 and not [t for t in trials if t.state == TrialState.RUNNING]
        for t in measured:  # where each trial's time went: the replay's 0.4 s compile in it
            ph = t.user_attrs["result"]["phases"]
            assert {"compile_wait", "compile", "timing_wait", "timing"} <= set(ph)
            assert ph["compile"] >= 0.4 and ph["timing"] >= 0.05 and min(ph.values()) >= 0
        # the pick saw every trial: the winner is the fastest measured (or simpler within noise)
        b = next(b for b in res.buckets if b.study == study_name(pb.space, pb.bucket))
        assert b.measured == 8 and b.tflops >= max(t.value for t in measured) / 1.02
        spans.append((min(t.datetime_start for t in measured),
                      max(t.datetime_complete for t in measured)))
    (_, end_first), (start_second, _) = sorted(spans)
    assert start_second < end_first, spans  # overlapped, not one after the other


def test_a_bucket_measures_its_searched_neighbours_winners_first(tmp_path):
    """A bucket started after others of its kernel class were searched measures their winners
    with its default, before TPE proposes anything (search.neighbour_winners): its record is no
    slower than a neighbour's config, whatever TPE's trials find."""
    seqlens = (1024, 2048, 4096)
    path = tmp_path / "rec.jsonl"
    synthesize(path, H100, [pb.problem for pb in plan_of(SearchConfig(**dict(BASE, seqlens=seqlens)),
                                                           H100)], fail_rate=0.0)
    first = run_search(_cfg(tmp_path, str(path), seqlens=(4096, 1024), trials=12),
                       db=MemDB(), progress=NoProgress())
    winners = {b.study.split(".")[0]: b.winner for b in first.buckets}
    default = flashtune.defaults.default_variant("fwd", 64, "bfloat16").name
    theirs = set(winners.values()) - {default}
    assert len(winners) == 2 and all(winners.values()) and theirs, winners
    cfg = _cfg(tmp_path, str(path), seqlens=seqlens, trials=6, enqueue_default=True,
               table_seeds=0)
    run_search(cfg, db=MemDB(), progress=NoProgress())  # 1024 and 4096 are done: 2048 is new
    pb = next(pb for pb in plan_of(cfg, H100) if pb.bucket.seqlen_q == 2048)
    trials = sorted(optuna.load_study(study_name=study_name(pb.space, pb.bucket),
                                      storage=make_storage(cfg.storage)).get_trials(deepcopy=False),
                    key=lambda t: t.number)
    firsts = [t.user_attrs.get("variant") for t in trials[:3]]
    # the default, then the neighbours' winners (both 3 octaves away: either order)
    assert firsts[0] == default and set(firsts[1:1 + len(theirs)]) == theirs, (firsts, winners)
    assert sum(t.user_attrs.get("result", {}).get("measured", False) for t in trials) == 6


def test_a_new_bucket_measures_the_same_architectures_table_winners_first(tmp_path):
    """A bucket searched for the first time measures, after its default, the winner and
    runner-ups each shipped table of its architecture recorded for it (search.table_winners):
    an H100 search starts from the H200 table's picks; an A100 table (sm_80) is not read."""
    from flashtune.tuned_db.io import table_path, write_table
    from flashtune.tuned_db.record import Provenance, Record
    rec = _recording(tmp_path)
    pb = plan_of(SearchConfig(**BASE), H100)[0]
    default = flashtune.defaults.default_variant("fwd", 64, "bfloat16").name
    others = [v.name for v in pb.space.feasible if v.name != default]
    x, y, z, w, a100 = others[3], others[7], others[11], others[15], others[19]
    prov = Provenance("NVIDIA H200", "9.0", 132, "580", "13.0", "2.11", "3.6.0", "0.1.0",
                      "0" * 16, "2026-11-24T00:00:00+00:00", "search")
    tables = tmp_path / "tables"
    tables.mkdir()
    for gpu, name, ups in (("H200", x, ((y, 1.1), (z, 1.2), (w, 1.3))), ("A100", a100, ())):
        slug = table_path(gpu).stem
        write_table(table_path(gpu, tables), gpu,
                    [Record(slug, pb.bucket, Variant.parse(name), 1.0, 100.0, "TFLOP/s", 1e-3,
                            prov, ups)])
    cfg = _cfg(tmp_path, rec, trials=5, enqueue_default=True, tables_dir=str(tables),
               neighbour_seeds=0)
    run_search(cfg, db=MemDB(), progress=NoProgress())
    trials = sorted(_study(cfg).get_trials(deepcopy=False), key=lambda t: t.number)
    firsts = [t.user_attrs.get("variant") for t in trials[:4]]
    assert firsts == [default, x, y, z], firsts  # the winner and 2 runner-ups: table_seeds=3
    assert a100 not in firsts


def test_table_winners_add_the_nearest_buckets_winners_of_the_kernel_class(tmp_path):
    """After the bucket's own records, search.table_winners offers the winners of the k nearest
    buckets of its kernel class in the shipped tables, nearest first: a re-searched bucket opens
    before its neighbour's pick (neighbour_winners reads picks), and a neighbour's tile can win
    (session 25: D=256 non-causal N=512 ran 11% faster on the N=1k record's tile, which its own
    re-search never measured). Another class's records (causal here) are not offered."""
    from flashtune.search import table_winners
    from flashtune.tuned_db.io import table_path, write_table
    from flashtune.tuned_db.record import Provenance, Record
    cfg = SearchConfig(**dict(BASE, seqlens=(512, 1024, 2048, 8192), causal=(False, True)))
    plan = plan_of(cfg, H100)
    pb = next(x for x in plan if x.bucket.seqlen_q == 1024 and not x.bucket.causal)
    names = iter(v.name for v in pb.space.feasible)
    prov = Provenance("NVIDIA H100 80GB HBM3", "9.0", 132, "580", "13.0", "2.11", "3.6.0",
                      "0.1.0", "0" * 16, "2026-11-26T00:00:00+00:00", "search")
    won = {}
    records = []
    for x in plan:
        won[x.bucket] = next(names)
        records.append(Record(table_path("H100").stem, x.bucket, Variant.parse(won[x.bucket]),
                              1.0, 100.0, "TFLOP/s", 1e-3, prov, ((next(names), 1.1),)))
    write_table(table_path("H100", tmp_path), "H100", records)

    def at(n, causal=False):
        return won[next(x.bucket for x in plan
                        if x.bucket.seqlen_q == n and x.bucket.causal == causal)]
    own = [at(1024), records[[x.bucket for x in plan].index(pb.bucket)].runner_ups[0][0]]
    got = [v.name for v in table_winners(pb, 2, tmp_path)]
    # its own winner and runner-up, then the two nearest: 512 and 2048, one octave each way
    assert got[:2] == own and set(got[2:]) == {at(512), at(2048)}, got
    assert at(8192) not in got and not {at(n, True) for n in (512, 1024, 2048)} & set(got)
    far = next(x for x in plan if x.bucket.seqlen_q == 8192 and not x.bucket.causal)
    assert [v.name for v in table_winners(far, 1, tmp_path)] == [at(8192), at(2048)]


def test_a_trial_killed_before_its_owner_was_written_is_reaped_after_the_grace(monkeypatch):
    import optuna
    from flashtune import search_study
    from flashtune.problem import Problem
    from flashtune.search_space import Space
    from flashtune.targets import get as get_target
    p = Problem("fwd", "bfloat16", 64, False, 1, 4, 16, 1024, 1024)
    study = optuna.create_study(direction="maximize")
    bs = search_study.BucketStudy(study, Space.build("fwd", get_target("H100"), p), p)
    study.ask()  # what a process killed between ask() and its owner write leaves: no owner
    assert bs.reap_abandoned() == 0  # young: a live process may be about to write its owner
    assert study.trials[0].state == TrialState.RUNNING
    monkeypatch.setattr(search_study, "ORPHAN_GRACE_S", 0.0)
    assert bs.reap_abandoned() == 1
    assert study.trials[0].state == TrialState.FAIL
    assert "abandoned" in study.trials[0].user_attrs["result"]["reason"]


def test_the_final_retiming_times_the_other_families_records_as_runner_ups(tmp_path):
    """A fwd bucket's final re-timing also times the hopper_fwd record the shipped tables hold
    for its problem (search.rival_variants: the dispatcher picks between the two families), and
    keeps its time among the record's runner-ups, never as the winner: same-run evidence for
    dispatch.same_run. A rival whose time the run did not get adds nothing."""
    import dataclasses
    import json
    from flashtune.problem import Bucket
    from flashtune.search import rival_variants
    from flashtune.tuned_db.io import table_path, write_table
    from flashtune.tuned_db.record import Provenance, Record
    rec = _recording(tmp_path)
    pb = plan_of(SearchConfig(**BASE), H100)[0]
    hb = Bucket.of(dataclasses.replace(pb.problem, family="hopper_fwd"))
    hop = Variant.parse("hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24")
    prov = Provenance("NVIDIA H100 80GB HBM3", "9.0", 132, "580", "13.0", "2.11", "3.6.0",
                      "0.1.0", "0" * 16, "2026-11-26T00:00:00+00:00", "search")
    tables = tmp_path / "tables"
    tables.mkdir()
    write_table(table_path("H100", tables), "H100",
                [Record(table_path("H100").stem, hb, hop, 0.5, 100.0, "TFLOP/s", 1e-3, prov, ())])
    assert rival_variants(pb, str(tables)) == [hop]
    cfg = _cfg(tmp_path, rec, trials=5, tables_dir=str(tables))
    db = MemDB()
    run_search(cfg, db=db, progress=NoProgress())
    (first,) = db.records()
    assert first.variant.family == "fwd" and hop.name not in dict(first.runner_ups)
    # the recording times the rival on the fwd bucket's problem (as a timing worker would)
    with open(rec, "a") as f:
        f.write(json.dumps({"kind": "trial", "bucket": dataclasses.asdict(pb.bucket),
                            "variant": hop.name, "ms": 0.0123, "max_err": 1e-3}) + "\n")
    from flashtune import replay
    replay._cache.clear()
    cfg = _cfg(tmp_path / "again", rec, trials=5, tables_dir=str(tables))
    (tmp_path / "again").mkdir()
    db = MemDB()
    run_search(cfg, db=db, progress=NoProgress())
    (r,) = db.records()
    assert r.variant.family == "fwd"  # faster, but not this family's to win
    assert dict(r.runner_ups)[hop.name] == pytest.approx(0.0123)
    assert r.ms_of(hop.name) == pytest.approx(0.0123)
