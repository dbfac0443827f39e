"""--gpus on the CPU: one search process per replayed "GPU" (the replay backend pins its
timing worker the way the GPU backend does, from CUDA_VISIBLE_DEVICES), every measurement a
sleep of DELAY, all processes sharing one journal storage.

Shown here: two processes finish a timing-bound search in about half the time of one, with
winners as good; no variant is measured twice; a process killed mid-search loses nothing (the
other one fails its running trials and finishes its buckets); --status says what is done and
what is left, and a finished bucket is not re-timed when the search runs again.
"""
import collections
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
from click.testing import CliRunner
from optuna.trial import TrialState

from flashtune import targets
from flashtune.sampler_eval import synthesize
from flashtune.search import SearchConfig, plan_of, run_search
from flashtune.search_progress import NoProgress
from flashtune.search_study import bucket_label, make_storage, study_name

H100 = targets.get("H100")
BASE = dict(gpu="H100", families=("fwd",), head_dims=(64,), seqlens=(1024, 2048),
            causal=(False,), compile_workers=1, seed=0, top_k=3)
DELAY = 0.4


def _recording(tmp_path, delay=DELAY):
    rec = tmp_path / "rec.jsonl"
    synthesize(rec, H100, [pb.problem for pb in plan_of(SearchConfig(**BASE), H100)],
               fail_rate=0.0, delay_s=delay)
    return str(rec)


def _trials(cfg):
    """{bucket label: [FrozenTrial]} of the plan's studies."""
    storage = make_storage(cfg.storage)
    out = {}
    for pb in plan_of(cfg, H100):
        study = optuna.load_study(study_name=study_name(pb.space, pb.bucket), storage=storage)
        out[pb.bucket] = study.get_trials(deepcopy=False)
    return out


def _measured(trials):
    return [t for t in trials if t.state == TrialState.COMPLETE
            and (t.user_attrs.get("result") or {}).get("measured")]


def _span(cfg) -> float:
    """From the first trial's start to the last measured trial's end, over every bucket: the
    search's own time, without the processes' start-up (torch imports, seconds here)."""
    ts = [t for trials in _trials(cfg).values() for t in _measured(trials)]
    return (max(t.datetime_complete for t in ts)
            - min(t.datetime_start for t in ts)).total_seconds()


@pytest.mark.slow  # ~60 s here: processes import torch on a shared 2-core machine
@pytest.mark.parametrize("bound", ["timing", "compile"])
def test_two_gpu_processes_halve_the_search(tmp_path, bound):
    """Timing-bound: every trial waits on its GPU. Compile-bound (a GPU host with a warm
    Triton cache): trials wait on compile workers, and a bucket's in-flight cap (half of what
    it has left) bounds the search -- two processes sharing a bucket would split that cap and
    gain nothing, so each process takes a bucket of its own first."""
    if bound == "timing":
        rec, trials, cw = _recording(tmp_path, delay=0.5), 10, 1
    else:
        rec = str(tmp_path / "rec.jsonl")
        synthesize(rec, H100, [pb.problem for pb in plan_of(SearchConfig(**BASE), H100)],
                   fail_rate=0.0, delay_s=0.05, compile_delay_s=1.0)
        trials, cw = 16, 6
    runs = {}
    for gpus in ((0,), (0, 1)):
        cfg = SearchConfig(**dict(BASE, replay=rec, trials=trials, gpus=gpus, compile_workers=cw,
                                  storage=f"journal:///{tmp_path}/s{len(gpus)}.journal",
                                  db=f"sqlite:///{tmp_path}/t{len(gpus)}.db"))
        res = run_search(cfg, progress=NoProgress())
        runs[len(gpus)] = (cfg, res, _span(cfg))
    for n, (cfg, res, _) in runs.items():
        assert not res.interrupted and not res.notes
        assert [b.status for b in res.buckets] == ["done", "done"], res.buckets
        assert res.measured == 2 * trials and res.db_written == 2
        owners, notes = set(), set()
        for trials_ in _trials(cfg).values():
            names = [t.user_attrs["variant"] for t in _measured(trials_)]
            assert len(names) == len(set(names)) == trials  # none lost, none measured twice
            owners |= {t.user_attrs["owner"]["pid"] for t in _measured(trials_)}
            notes |= {t.user_attrs["result"]["notes"] for t in _measured(trials_)}
        assert len(owners) == n  # every process measured
        assert notes == {f"replayed on device {g}" for g in range(n)}  # each on its GPU
    one, two = runs[1][2], runs[2][2]
    if bound == "timing":  # 20 measurements of 0.5 s: one process cannot beat 10 s
        assert one >= 2 * trials * 0.5 * 0.95, one
    # two take about half (ideal 0.5; here the second process's later start and the buckets'
    # ends, on a loaded CPU, add ~0.15)
    assert two / one <= 0.75, (one, two, runs[1][1].wall_s, runs[2][1].wall_s)
    # each pick saw every process's trials: the winner is the fastest variant measured in the
    # shared study (or a simpler one within noise). Whether 1 and 2 GPUs find the same winners
    # is for the GPU run (bench/search_scaling.py): at 10 trials TPE is still sampling at
    # random (n_startup_trials), so two sample paths find different bests
    for n, (cfg, res, _) in runs.items():
        for b in res.buckets:
            trials_ = next(ts for bk, ts in _trials(cfg).items() if b.study.startswith(
                bucket_label(bk)))
            best = max(t.value for t in _measured(trials_))
            assert b.winner and b.tflops >= best / 1.02, (n, b, best)


def _cli(tmp_path, rec, *extra, **env_extra):
    env = dict(os.environ, FLASHTUNE_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1",
               **env_extra)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    args = [sys.executable, "-m", "flashtune.cli", "search", "--gpu", "H100", "--replay", rec,
            "--family", "fwd", "--head-dim", "64", "--seqlen", "1024,2048", "--causal", "false",
            "--compile-workers", "1", "--storage", f"journal:///{tmp_path}/s.journal",
            "--db", f"sqlite:///{tmp_path}/t.db", "--progress", "lines", "--seed", "0", *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _wait_until(cfg, proc, pick, timeout=90):
    """Poll the storage of a running search until pick(trials of every bucket) returns
    something (returned); the search must not end meanwhile."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
        try:
            trials = [t for ts in _trials(cfg).values() for t in ts]
        except KeyError:  # a study not created yet
            continue
        got = pick(trials)
        if got:
            return got
    return None


def _completed(cfg) -> dict:
    """{(bucket, trial number): variant} of every measured trial so far."""
    return {(b, t.number): t.user_attrs["variant"] for b, ts in _trials(cfg).items()
            for t in _measured(ts)}


def _kept(cfg, before: dict) -> dict:
    """Every trial now, after checking each of `before` is still there, unchanged."""
    after = _trials(cfg)
    by_number = {(b, t.number): t for b, ts in after.items() for t in ts}
    for key, name in before.items():
        assert by_number[key].state == TrialState.COMPLETE
        assert by_number[key].user_attrs["variant"] == name
    return after


def test_gpu_processes_start_before_the_studies_and_wait_for_them(tmp_path):
    """The children start their workers while the parent prepares the studies (their
    timelines), and none opens a bucket before the parent says the studies are ready; a second
    run of the finished search starts them and they stop without opening one."""
    import re
    rec = _recording(tmp_path, delay=0.05)
    marks = []
    for run in range(2):
        proc = _cli(tmp_path, rec, "--gpus", "0,1", "--trials", "3", FLASHTUNE_TIMELINE="1")
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        marks.append([(int(p), float(t), what) for p, t, what in re.findall(
            r"\[timeline\] pid (\d+) \+[\d.]+s at ([\d.]+): (.*)", out)])
    first, again = marks
    parent = next(p for p, _, w in first if w == "search command")
    at = {w: t for p, t, w in first if p == parent}
    assert at["2 search processes started"] <= at["studies ready"]
    opened = [t for p, t, w in first if w == "first bucket open"]
    assert len(opened) == 2 and min(opened) >= at["studies ready"], first
    assert len({p for p, _, w in first if w == "search starts"}) == 2
    assert not [w for _, _, w in again if w == "first bucket open"], again
    assert [w for _, _, w in again if w == "studies ready"]
    # what a process's first trial waits on, in its timeline: its first compile worker's start
    # and first compile, its timing worker's first measure (each GPU process starts both
    # workers; one that found no trial left to take compiles and measures nothing)
    for steps in (["compile worker 0 forked", "compile worker 0 set up",
                   "compile worker 0: first compile took"],
                  ["timing worker 0 forked", "timing worker 0: first measure took"]):
        pids = {p for p, _, w in first if w == steps[0]}
        assert len(pids) == 2, first
        worked = 0
        for pid in pids:
            seen = [w for p, _, w in first if p == pid]
            at = [i for step in steps for i, w in enumerate(seen) if w.startswith(step)]
            assert at == sorted(at) and len(at) in (len(steps) - 1, len(steps)), seen
            worked += len(at) == len(steps)  # the last step once: the first call only
        assert worked >= 1, first


def test_a_killed_gpu_process_loses_nothing(tmp_path):
    rec = _recording(tmp_path, delay=0.25)
    cfg = SearchConfig(**dict(BASE, replay=rec, storage=f"journal:///{tmp_path}/s.journal"))
    proc = _cli(tmp_path, rec, "--gpus", "0,1", "--trials", "12")

    def mid_trial(trials):  # a search process with 2 measured and one running: the victim
        done = collections.Counter(t.user_attrs["owner"]["pid"] for t in _measured(trials))
        running = {t.user_attrs.get("owner", {}).get("pid") for t in trials
                   if t.state == TrialState.RUNNING and "variant" in t.user_attrs}
        ready = [pid for pid, n in done.items() if n >= 2 and pid in running]
        return ready[0] if len(done) == 2 and ready else None
    victim = _wait_until(cfg, proc, mid_trial)
    assert victim, "both processes never measured"
    before = _completed(cfg)
    os.kill(victim, signal.SIGKILL)  # its workers exit when their pipe closes
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "killed by SIGKILL" in out and "2 winners written" in out, out
    after = _kept(cfg, before)  # every completed trial is still there, unchanged
    lost = 0
    for ts in after.values():
        names = [t.user_attrs["variant"] for t in _measured(ts)]
        assert len(names) == len(set(names)) == 12  # finished, none measured twice
        assert not [t for t in ts if t.state == TrialState.RUNNING]
        lost += sum((t.user_attrs.get("result") or {}).get("stage") == "lost" for t in ts)
    assert lost >= 1  # the victim's running trial, failed by the survivor and measured again
    from flashtune.tuned_db import TunedDB
    assert len(TunedDB(f"sqlite:///{tmp_path}/t.db").records()) == 2


def test_ctrl_c_stops_every_gpu_process_and_keeps_their_trials(tmp_path):
    """A terminal's Ctrl-C reaches the parent and both search processes: the command exits 130
    soon after (each process's last message ends the parent's wait), every completed trial is
    kept and none is left RUNNING (in flight ones are failed, to be measured again)."""
    rec = _recording(tmp_path, delay=0.25)
    cfg = SearchConfig(**dict(BASE, replay=rec, storage=f"journal:///{tmp_path}/s.journal"))
    proc = _cli(tmp_path, rec, "--gpus", "0,1", "--trials", "60")
    assert _wait_until(cfg, proc, lambda trials: len(  # both processes measuring
        {t.user_attrs["owner"]["pid"] for t in _measured(trials)}) == 2)
    before = _completed(cfg)
    os.killpg(proc.pid, signal.SIGINT)
    t_int = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert time.monotonic() - t_int < 30, out
    after = _kept(cfg, before)
    assert not [t for ts in after.values() for t in ts if t.state == TrialState.RUNNING]


def test_status_says_what_is_done_and_left_and_done_buckets_are_not_retimed(tmp_path):
    from flashtune.cli import main

    rec = _recording(tmp_path, delay=0.0)
    common = ["search", "--gpu", "H100", "--replay", rec, "--family", "fwd", "--head-dim", "64",
              "--causal", "false", "--compile-workers", "1",
              "--storage", f"journal:///{tmp_path}/s.journal", "--db", f"sqlite:///{tmp_path}/t.db",
              "--progress", "none", "--seed", "0"]
    args = common + ["--seqlen", "1024,2048"]
    runner = CliRunner()
    r = runner.invoke(main, args + ["--status", "--trials", "4"])
    assert r.exit_code == 3 and "0/2 buckets done, 2 left (8 trials to measure)" in r.output
    assert r.output.count("not started") == 2
    r = runner.invoke(main, common + ["--trials", "4", "--seqlen", "1024"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, args + ["--status", "--trials", "4"])
    assert r.exit_code == 3 and "1/2 buckets done, 1 left (4 trials to measure)" in r.output
    assert r.output.count(" done\n") == 1 and "not started" in r.output
    # the first bucket is done: the next run only searches the second, and takes the first
    # one's pick from the storage instead of re-timing it
    cfg = SearchConfig(**dict(BASE, replay=rec, trials=4,
                              storage=f"journal:///{tmp_path}/s.journal"))
    first_pick = _final(cfg, 0)
    r = runner.invoke(main, args + ["--trials", "4", "--format", "json"])
    assert r.exit_code == 0, r.output
    assert '"measured": 4,' in r.output and '"db_written": 1' in r.output  # only the second
    assert _final(cfg, 0) == first_pick
    r = runner.invoke(main, args + ["--status", "--trials", "4"])
    assert r.exit_code == 0 and "2/2 buckets done, 0 left" in r.output
    # a bigger budget: the picked buckets are left again, with what they have kept
    r = runner.invoke(main, args + ["--status", "--trials", "6", "--format", "json"])
    assert r.exit_code == 3 and '"trials_left": 4' in r.output


def _final(cfg, i):
    pb = plan_of(cfg, H100)[i]
    study = optuna.load_study(study_name=study_name(pb.space, pb.bucket),
                              storage=make_storage(cfg.storage))
    return study.user_attrs["final"]


@pytest.mark.parametrize("url", ["journal", "sqlite"])
def test_claims_are_held_once_and_freed_by_death(tmp_path, url):
    from flashtune.search_claims import claim, claims_study, me, same

    storage = make_storage(f"{url}:///{tmp_path}/s.{url}")
    study = claims_study(storage)
    # an earlier claim of a live process (the parent of this one) holds the key ...
    study.enqueue_trial({}, user_attrs={"claim": "k", "owner": {"host": me()["host"],
                                                               "pid": os.getppid()}})
    assert claim(storage, "k")["pid"] == os.getppid()
    # ... one of a dead process does not
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    study.enqueue_trial({}, user_attrs={"claim": "j", "owner": {"host": me()["host"],
                                                               "pid": dead.pid}})
    assert same(claim(storage, "j"), me())
    assert same(claim(storage, "j"), me())  # held: claiming again keeps it
    # ... nor one left by an earlier process whose pid a live process has now: the owner's
    # start time tells them apart (two CI runs' searches waited for good on such a claim)
    parent = {"host": me()["host"], "pid": os.getppid()}
    with open(f"/proc/{os.getppid()}/stat") as f:
        parent["start"] = int(f.read().rsplit(")", 1)[1].split()[19])
    study.enqueue_trial({}, user_attrs={"claim": "r", "owner": {**parent,
                                                               "start": parent["start"] + 1}})
    assert same(claim(storage, "r"), me())
    study.enqueue_trial({}, user_attrs={"claim": "p", "owner": parent})  # the live one holds
    assert claim(storage, "p")["pid"] == os.getppid()
    assert same(me(), {**me(), "start": None}) and not same(me(), {**me(), "start": -1})
    # the dead owners' claims were retired (FAIL): later claims no longer read them; every
    # live one still waits
    by_state = {t.user_attrs["claim"] + ":" + str(t.user_attrs["owner"].get("start"))
                for t in study.get_trials(states=(TrialState.FAIL,))}
    assert by_state == {"j:None", f"r:{parent['start'] + 1}"}
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert all(t.user_attrs["owner"]["pid"] in (os.getppid(), os.getpid()) for t in waiting)
    assert {t.user_attrs["claim"] for t in waiting} == {"k", "j", "r", "p"}


def test_a_pick_stored_just_before_our_claim_is_taken_not_made_again(tmp_path, monkeypatch):
    """The picker stores its pick and exits between our read of the study and our claim: its
    claim is then a dead one's and ours holds, yet the pick is there (CI saw both processes of
    test_two_processes_share_one_study pick)."""
    import flashtune.search as search
    from flashtune.search import BucketResult, _plain

    rec = _recording(tmp_path, delay=0.0)
    cfg = SearchConfig(**dict(BASE, seqlens=(1024,), replay=rec, trials=4, write_db=False,
                              storage=f"journal:///{tmp_path}/s.journal"))
    real, picked = search.claim, []

    def claim(storage, key, liveness=None):
        held = real(storage, key, liveness)
        if key.startswith("final:") and not picked:  # the other process's pick lands now
            study = optuna.load_study(study_name=key.split(":")[1], storage=storage)
            theirs = BucketResult(label="theirs", study=study.study_name, status="done",
                                measured=10 ** 6, failed=0, infeasible=0, duplicates=0,
                                winner="their-winner", ms=1.0, tflops=1.0, by="gpu9")
            study.set_user_attr("final", {"measured": 10 ** 6, "result": _plain(theirs),
                                          "record": None})
            picked.append(key)
        return held

    monkeypatch.setattr(search, "claim", claim)
    retimed = []
    monkeypatch.setattr(search, "_finish", lambda *a, **k: retimed.append(a) or 1 / 0)
    (b,) = run_search(cfg, progress=NoProgress()).buckets
    assert picked and not retimed
    assert (b.winner, b.by) == ("their-winner", "gpu9")


def test_in_order_budget_leaves_what_it_cannot_finish_untouched(tmp_path):
    from flashtune.search_status import status_rows

    rec = _recording(tmp_path, delay=0.0)
    cfg = SearchConfig(**dict(BASE, replay=rec, trials=4, time_budget_s=1e-3, in_order=True,
                              storage=f"journal:///{tmp_path}/s.journal", write_db=False))
    res = run_search(cfg, progress=NoProgress())
    # out of time before the first bucket: nothing picked from zero trials, nothing written
    assert res.buckets == () and res.db_written == 0
    assert [r["state"] for r in status_rows(cfg, H100)] == ["not started", "not started"]
    res = run_search(SearchConfig(**dict(BASE, replay=rec, trials=4, write_db=False,
                                         storage=cfg.storage)), progress=NoProgress())
    assert [b.status for b in res.buckets] == ["done", "done"]
    assert [r["state"] for r in status_rows(cfg, H100)] == ["done", "done"]


def test_scaling_report_measures_its_own_noise():
    """bench/search_scaling.py's repeat_noise: the spread of one variant's speed between runs,
    over the buckets where every run picked it (the yardstick for winners that differ)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / "search_scaling.py"
    spec = importlib.util.spec_from_file_location("search_scaling", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    winners = {"a": {"winners": ["x", "x"], "speeds": [100.0, 103.0]},
               "b": {"winners": ["y", "y"], "speeds": [200.0, 201.0]},
               "c": {"winners": ["y", "z"], "speeds": [200.0, 230.0]},  # differ: not counted
               "d": {"winners": ["x", "x"], "speeds": [100.0, None]}}   # one run missing
    got = mod.repeat_noise(winners)
    assert got["buckets"] == 2
    assert abs(got["max"] - 0.03) < 1e-9 and abs(got["median"] - 0.03) < 1e-9
    assert mod.repeat_noise({"c": winners["c"]}) == {}


def test_trial_phases_lists_the_failed_trials_not_the_duplicates(monkeypatch):
    """bench/trial_phases.py --failed: a trial whose result has a stage (compile, gate, ...) is
    a failure; a duplicate of a measured variant (measured False, no stage) is not. It listed
    only the latter until session 23 ("?" for each reason)."""
    import importlib.util
    from datetime import datetime, timedelta
    from pathlib import Path
    from types import SimpleNamespace
    bench = Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))  # trial_phases imports search_scaling
    spec = importlib.util.spec_from_file_location("trial_phases", bench / "trial_phases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t0 = datetime(2026, 11, 26)

    def trial(i, variant, result):
        return SimpleNamespace(datetime_start=t0 + timedelta(seconds=i),
                               user_attrs={"variant": variant, "result": result})
    trials = [trial(3, "v-dup", {"measured": False, "duplicate": True, "ms": 1.0}),
              trial(2, "v-spill", {"measured": True, "violation": 1.0, "stage": "compile",
                                   "reason": "spills 184 B"}),
              trial(1, "v-ok", {"measured": True, "violation": 0.0, "ms": 1.0}),
              trial(0, "v-lost", {"measured": False, "stage": "lost", "reason": "worker died"})]
    lines = mod.failed_lines(trials)
    assert [ln.split()[0] for ln in lines] == ["v-lost", "v-spill"]
    assert "compile" in lines[1] and "spills 184 B" in lines[1]
